"""Fixed-length instances read from memory-mapped token shards.

Instance ``i`` of a split is tokens ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))`` of the
split's token stream (all its shards, in order): consecutive instances do not overlap, an instance
may span a shard boundary, and the final partial instance is never served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import numpy as np

from moe_core.data.errors import DataError
from moe_core.data.manifest import Manifest, verify_data_dir
from moe_core.data.shards import SPLITS


class Instances(Protocol):
    """What the loader reads: fixed-length instances of one split (``TokenDataset``, and each
    format of ``formats.FORMATS``)."""

    split: str
    seq_len: int
    vocab_size: int
    eos_id: int | None  # the id ending each document (None: not known for this corpus)

    @property
    def root(self) -> Path: ...  # the folder named in sentences about the data

    @property
    def identity(self) -> str: ...  # a loader state saved for other data is refused by it

    @property
    def tokens(self) -> int: ...

    def __len__(self) -> int: ...

    def batch(self, indices: np.ndarray) -> np.ndarray: ...


class TokenStream:
    """Fixed-length instances over a split's token files read as one stream (``paths`` in
    order, ``starts`` the stream position of each file's first token and, last, the split's
    length): what every format shares. A subclass gives file ``k``'s tokens (``_part``) and
    the sentence for an id outside the vocabulary (``_refuse``)."""

    split: str
    instance_tokens: int
    vocab_size: int
    paths: list[Path]
    starts: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.starts[-1])

    def __len__(self) -> int:
        return self.tokens // self.instance_tokens

    def _part(self, k: int) -> np.ndarray:
        raise NotImplementedError

    def _refuse(self, token: int, path: Path) -> None:
        raise NotImplementedError

    def _fill(self, out: np.ndarray, start: int) -> None:
        k = int(np.searchsorted(self.starts, start, side="right")) - 1
        done = 0
        while done < len(out):
            offset = start + done - int(self.starts[k])
            piece = self._part(k)[offset : offset + len(out) - done]
            out[done : done + len(piece)] = piece
            done += len(piece)
            k += 1

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` of this split (int64)."""
        out = np.empty(min(n, self.tokens - start), dtype=np.int64)
        self._fill(out, start)
        return out

    def __getitem__(self, index: int) -> np.ndarray:
        return self.batch(np.array([index]))[0]

    def batch(self, indices: np.ndarray) -> np.ndarray:
        """Instances ``indices`` as one int64 array of shape ``[len(indices), seq_len + 1]``;
        a token id outside the vocabulary is refused, naming its file (``_refuse``)."""
        out_BT = np.empty((len(indices), self.instance_tokens), dtype=np.int64)
        n = len(self)
        for row, index in enumerate(indices):
            i = int(index)
            if not 0 <= i < n:
                raise IndexError(f"instance {i} is outside the {n} of the {self.split} split.")
            self._fill(out_BT[row], i * self.instance_tokens)
        if out_BT.size and not 0 <= out_BT.min() <= out_BT.max() < self.vocab_size:
            row, col = (int(x[0]) for x in np.nonzero((out_BT < 0) | (out_BT >= self.vocab_size)))
            position = int(indices[row]) * self.instance_tokens + col
            path = self.paths[int(np.searchsorted(self.starts, position, side="right")) - 1]
            self._refuse(int(out_BT[row, col]), path)
        return out_BT


class TokenDataset(TokenStream):
    """The ``seq_len + 1``-token instances of one split of a data directory."""

    def __init__(
        self, data_dir: str | Path, split: str, seq_len: int, *, checksums: bool = False
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed: one of {', '.join(SPLITS)}.")
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} is not allowed: it must be positive.")
        self.manifest: Manifest = verify_data_dir(data_dir, checksums=checksums)
        self.split, self.seq_len = split, seq_len
        self.instance_tokens = seq_len + 1
        shards = self.manifest.shards(split)
        self.paths = [self.manifest.data_dir / s["file"] for s in shards]
        self.starts = np.concatenate([[0], np.cumsum([s["tokens"] for s in shards])]).astype(
            np.int64
        )
        self._arrays: list[np.ndarray | None] = [None] * len(shards)
        self.vocab_size = int(self.manifest.tokenizer["vocab_size"])
        eos = self.manifest.tokenizer.get("eos_id")
        self.eos_id: int | None = None if eos is None else int(eos)

    @property
    def root(self) -> Path:
        return self.manifest.data_dir

    @property
    def identity(self) -> str:
        """The sha256 of the manifest, which names every shard's sha256."""
        return self.manifest.sha256

    @property
    def tokenizer_id(self) -> str:
        """The sha256 of the tokenizer that wrote the ids (a mixture's sources must share it)."""
        return self.manifest.tokenizer["sha256"]

    def _part(self, k: int) -> np.ndarray:
        array = self._arrays[k]
        if array is None:
            array = np.load(self.paths[k], mmap_mode="r")
            self._arrays[k] = array
        return array

    def _refuse(self, token: int, path: Path) -> None:
        raise DataError(
            f"token id {token} in shard {path.name} of {self.manifest.data_dir} is not allowed: "
            f"the tokenizer has ids 0 to {self.vocab_size - 1}, so the shard is corrupt; rerun "
            "moe tokenize with the same settings to rewrite it."
        )
