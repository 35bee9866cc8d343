"""Document batches -> token ids with EOS after each document (what a tokenize worker runs).

Kept to numpy and ``tokenizers``, so that a worker imports little.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer


class Encoder:
    """Tokenizes a batch of documents into one flat array plus each document's length."""

    def __init__(self, tokenizer_json: str, eos_id: int, dtype: str) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer_json)
        self.tokenizer.encode_special_tokens = True  # only our EOS may separate documents
        self.eos_id, self.dtype = eos_id, np.dtype(dtype)

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """``(lengths, flat)``: an empty document gives no tokens, any other ends with EOS."""
        # encode_batch_fast: no character offsets, which we never read. encode_batch's char
        # offsets cost more per token the smaller the batch (units of 256 documents: about 1.3x
        # the CPU of encode_batch_fast, tokenizers 0.23, GPT-2; benchmarks/tokenize_throughput.py)
        encodings = self.tokenizer.encode_batch_fast(texts, add_special_tokens=False)
        flat: list[int] = []
        lengths = np.zeros(len(texts), dtype=np.int64)
        for i, enc in enumerate(encodings):
            ids = enc.ids
            if ids:
                flat.extend(ids)
                flat.append(self.eos_id)
                lengths[i] = len(ids) + 1
        return lengths, np.array(flat, dtype=self.dtype)
