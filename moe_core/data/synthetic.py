"""A seeded token stream with learnable structure, for smoke runs and tests (no files needed).

Each token has ``branching`` possible successors drawn once from the vocabulary; a sequence is a
walk that picks one of them uniformly. A model that learns the successor table reaches a loss of
``ln(branching)``, far below the ``ln(vocab_size)`` it starts from.
"""

from __future__ import annotations

import numpy as np
import torch


class SyntheticTokens:
    def __init__(self, vocab_size: int, branching: int, seed: int) -> None:
        if branching > vocab_size:
            raise ValueError(
                f"data.branching={branching} must be at most the vocabulary size ({vocab_size})."
            )
        self.vocab_size, self.branching, self.seed = vocab_size, branching, seed
        g = torch.Generator().manual_seed(seed)
        self.successors_VB = torch.randint(0, vocab_size, (vocab_size, branching), generator=g)
        self._successors = self.successors_VB.numpy().reshape(-1)  # [v * branching + choice]

    def sequences(self, start: int, count: int, seq_len: int) -> torch.Tensor:
        """Walks ``start .. start + count - 1`` of ``seq_len + 1`` tokens each.

        Walk ``i`` depends only on the seed and ``i`` (its own generator draws the first token,
        then every choice), so any split of a batch across ranks and micro-batches reads exactly
        the same tokens. The walks advance together, one position per vectorized step.
        """
        first_N = np.empty(count, dtype=np.int64)
        choices_SN = np.empty((seq_len, count), dtype=np.int64)
        for row, i in enumerate(range(start, start + count)):
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 1)
            first_N[row] = torch.randint(0, self.vocab_size, (1,), generator=g).item()
            choices_SN[:, row] = torch.randint(0, self.branching, (seq_len,), generator=g).numpy()
        tokens_SN = np.empty((seq_len + 1, count), dtype=np.int64)
        tokens_SN[0] = first_N
        for t in range(seq_len):
            np.take(
                self._successors,
                tokens_SN[t] * self.branching + choices_SN[t],
                out=tokens_SN[t + 1],
            )
        return torch.from_numpy(np.ascontiguousarray(tokens_SN.T))
