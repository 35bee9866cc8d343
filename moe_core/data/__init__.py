"""Token data: synthetic streams, tokenized shards and the resumable loader."""
