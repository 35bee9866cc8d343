"""The token formats a mixture source (``data.sources``) may be in: each name opens one split
of a folder as an instance dataset. A new format is one entry here and its name in
``config.SOURCE_FORMATS``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

from moe_core.data.dataset import TokenDataset


class InstanceDataset(Protocol):
    """What the loaders read of a split: ``seq_len + 1``-token instances by index."""

    vocab_size: int  # token ids lie in [0, vocab_size)

    @property
    def tokens(self) -> int: ...  # tokens the split holds

    @property
    def identity(self) -> str: ...  # names this exact data in a loader state (a checksum)

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> np.ndarray: ...  # int64 [len(indices), seq_len + 1]


# (folder, split, seq_len) -> the split's instances. A dataset may also say which tokenizer
# wrote its ids (``tokenizer_id``): a mixture refuses sources whose tokenizers differ.
FORMATS: dict[str, Callable[[str | Path, str, int], InstanceDataset]] = {
    "moe": TokenDataset,
}
