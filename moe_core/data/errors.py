"""The error every data-stage refusal raises: one sentence naming the bad value and the way out."""

from __future__ import annotations


class DataError(ValueError):
    """A corpus, tokenizer or shard directory that cannot be used as it is."""
