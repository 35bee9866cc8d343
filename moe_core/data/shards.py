"""Token shard files: flat ``.npy`` arrays written atomically, each with a small JSON record.

A shard ``{split}-{k:05d}.npy`` counts only once its record ``{split}-{k:05d}.json`` exists and
its bytes match the record's size and sha256: files are written under a temporary name and
renamed into place, the shard before its record, so a crash leaves either a complete shard or
one that a rerun rewrites. The record also says where the next shard starts (document index and
tokens of that document already written), which is what lets a rerun resume without retokenizing
what is already on disk. Shards are not fsync'ed one by one: a rerun re-hashes every shard it
keeps, so one that a power cut left incomplete is rewritten, not trusted.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_core.files import atomic_write, file_sha256, inside, json_bytes, sha256_hex

SPLITS = ("train", "validation")


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npy"


def record_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.json"


def npy_bytes(tokens: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, tokens, allow_pickle=False)
    return buf.getvalue()


def npy_layout(path: Path) -> tuple[np.dtype, int, int]:
    """``(dtype, tokens, data offset)`` from a flat ``.npy`` header."""
    with open(path, "rb") as f:
        major, _ = np.lib.format.read_magic(f)
        if major == 1:
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
        offset = f.tell()
    if len(shape) != 1 or fortran:
        raise ValueError(f"shape {shape} is not flat")
    return dtype, int(shape[0]), offset


@dataclass(frozen=True)
class ShardRecord:
    """One finished shard, and where the split's token stream continues after it."""

    file: str
    tokens: int
    sha256: str
    next_doc: int  # documents before this index are entirely in this or earlier shards
    next_offset: int  # tokens of document next_doc (EOS included) already written
    documents: int  # documents of this split that end in this or an earlier shard

    def summary(self) -> dict[str, Any]:
        return {"file": self.file, "tokens": self.tokens, "sha256": self.sha256}


def shard_problem(data_dir: Path, file: str, tokens: int, sha256: str, dtype: str) -> str | None:
    """Why the shard on disk is not the one described (missing, truncated, corrupted), or None."""
    try:  # a symlink leading out is never a shard of this folder (a rerun replaces it)
        path = inside(data_dir, file, data_dir)
    except ValueError:
        return f"shard {file} of {data_dir} leads outside it"
    if not path.is_file():
        return f"shard {file} is missing from {data_dir}"
    try:
        found_dtype, found_tokens, offset = npy_layout(path)
    except (ValueError, OSError) as err:
        return f"shard {file} in {data_dir} has no readable .npy header ({err})"
    size = path.stat().st_size
    expected = offset + tokens * np.dtype(dtype).itemsize
    if found_dtype != np.dtype(dtype) or found_tokens != tokens:
        return (
            f"shard {file} in {data_dir} is an array of {found_tokens} {found_dtype} tokens, not "
            f"the {tokens} {dtype} tokens recorded (replaced)"
        )
    if size != expected:
        damage = "truncated" if size < expected else "grown"
        return (
            f"shard {file} in {data_dir} holds {size} bytes, not the {expected} bytes recorded "
            f"({damage})"
        )
    found = file_sha256(path) if sha256 else sha256
    if found != sha256:
        return (
            f"shard {file} in {data_dir} has sha256 {found[:16]}..., not the recorded "
            f"{sha256[:16]}... (corrupted)"
        )
    return None


def scan_split(data_dir: Path, split: str, dtype: str) -> tuple[list[ShardRecord], set[int]]:
    """The longest run of verified shards from the first, and verified shards beyond it."""
    prefix: list[ShardRecord] = []
    later: set[int] = set()
    by_index = {
        int(p.stem.rsplit("-", 1)[1]): p
        for p in data_dir.glob(f"{split}-*.json")
        if p.stem.rsplit("-", 1)[1].isdigit()
    }
    for index in sorted(by_index):
        try:
            record = ShardRecord(**json.loads(by_index[index].read_text()))
        except (ValueError, TypeError):
            continue
        if record.file != shard_name(split, index):
            continue
        if shard_problem(data_dir, record.file, record.tokens, record.sha256, dtype) is not None:
            continue
        if index == len(prefix):
            prefix.append(record)
        else:
            later.add(index)
    return prefix, later


class SplitWriter:
    """Cuts one split's token stream into shards of exactly ``shard_tokens`` (the last: the rest).

    Created from the verified shards already on disk; the caller feeds it the documents that
    follow (``resume`` says from where) and it writes only shards that are not already there.
    """

    def __init__(self, data_dir: Path, split: str, dtype: str, shard_tokens: int) -> None:
        self.data_dir, self.split, self.dtype = data_dir, split, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.records, self._reusable = scan_split(data_dir, split, dtype)
        self.reused = len(self.records)
        last = self.records[-1] if self.records else None
        self.resume = (last.next_doc, last.next_offset) if last else (0, 0)
        self.documents = last.documents if last else 0
        self._tokens: list[np.ndarray] = []
        self._docs: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._pending = 0
        self._head_offset = self.resume[1]

    def add(self, docs: np.ndarray, lengths: np.ndarray, tokens: np.ndarray) -> None:
        """Append whole documents (or, for the resumed one, its unwritten tail) in order."""
        if len(tokens) == 0:
            return
        self._tokens.append(tokens.astype(self.dtype, copy=False))
        self._docs.append(docs)
        self._ends.append(self._pending + np.cumsum(lengths))
        self._pending += len(tokens)
        while self._pending >= self.shard_tokens:
            self._cut(self.shard_tokens)

    def finish(self) -> list[ShardRecord]:
        if self._pending:
            self._cut(self._pending)
        return self.records

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.records)

    def _cut(self, n: int) -> None:
        tokens = np.concatenate(self._tokens)
        docs = np.concatenate(self._docs)
        ends = np.concatenate(self._ends)
        k = int(np.searchsorted(ends, n, side="left"))
        if ends[k] == n:
            finished, next_doc, next_offset = k + 1, int(docs[k]) + 1, 0
        else:
            start = int(ends[k - 1]) if k > 0 else 0
            head = self._head_offset if k == 0 else 0
            finished, next_doc, next_offset = k, int(docs[k]), head + n - start
        self.documents += finished
        self._write(tokens[:n], next_doc, next_offset)
        self._tokens, self._docs = [tokens[n:]], [docs[finished:]]
        self._ends = [ends[finished:] - n]
        self._pending -= n
        self._head_offset = next_offset

    def _write(self, tokens: np.ndarray, next_doc: int, next_offset: int) -> None:
        index = len(self.records)
        data = npy_bytes(tokens)
        record = ShardRecord(
            shard_name(self.split, index),
            len(tokens),
            sha256_hex(data),
            next_doc,
            next_offset,
            self.documents,
        )
        path = self.data_dir / record.file
        on_disk = self.data_dir / record_name(self.split, index)
        if index in self._reusable and json.loads(on_disk.read_text()) == asdict(record):
            self.reused += 1
        else:
            atomic_write(path, data, sync=False)
            atomic_write(on_disk, json_bytes(asdict(record)), sync=False)
        self.records.append(record)
