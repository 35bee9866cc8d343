"""Token shard files: flat ``.npy`` arrays written atomically, each with a small JSON record.

``Cutter`` lays a split's tokens end to end (as ranges of files already written, the tokenize
stage's units) and cuts shards of exactly ``shard_tokens`` from them; ``write_shard`` copies one
shard's ranges into its file (any worker can, given the ranges).

A shard ``{split}-{k:05d}.npy`` counts only once its record ``{split}-{k:05d}.json`` exists and
its bytes match the record's size and sha256: files are written under a temporary name and
renamed into place, the shard before its record, so a crash leaves either a complete shard or
one that a rerun rewrites. The record also says where the next shard starts (document index and
tokens of that document already written) and how many documents end in the shards so far.
Shards are not fsync'ed one by one: a rerun re-hashes every shard it keeps, so one that a power
cut left incomplete is rewritten, not trusted.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_core.files import TMP_MARK, atomic_write, file_sha256, inside, json_bytes, sha256_hex

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


@dataclass(frozen=True)
class ShardJob:
    """One shard to write: its token ranges in unit files, and its record's bookkeeping."""

    split: str
    index: int
    pieces: list[tuple[str, int, int]]  # (unit file, first token, end token)
    next_doc: int
    next_offset: int
    documents: int


class Cutter:
    """Cuts one split's token stream, the units' tokens in order, into shards of exactly
    ``shard_tokens`` (the last: the rest), as ``ShardJob`` s: it sees only lengths, no tokens."""

    def __init__(self, split: str, shard_tokens: int) -> None:
        self.split, self.shard_tokens = split, shard_tokens
        self.index = 0
        self.documents = 0  # documents that end in the shards cut so far
        self._pieces: list[tuple[str, int, int]] = []
        self._docs: list[np.ndarray] = []
        self._ends: list[np.ndarray] = []
        self._pending = 0
        self._head = 0  # tokens of the first pending document already in an earlier shard

    def add(self, file: str, start: int, docs: np.ndarray, lengths: np.ndarray) -> list[ShardJob]:
        """Append the documents ``docs`` whose tokens lie in ``file`` from ``start``."""
        keep = lengths > 0
        docs, lengths = docs[keep], lengths[keep]
        tokens = int(lengths.sum())
        if tokens == 0:
            return []
        self._pieces.append((file, start, start + tokens))
        self._docs.append(docs)
        self._ends.append(self._pending + np.cumsum(lengths))
        self._pending += tokens
        jobs = []
        while self._pending >= self.shard_tokens:
            jobs.append(self._cut(self.shard_tokens))
        return jobs

    def finish(self) -> list[ShardJob]:
        return [self._cut(self._pending)] if self._pending else []

    def _cut(self, n: int) -> ShardJob:
        docs, ends = np.concatenate(self._docs), np.concatenate(self._ends)
        k = int(np.searchsorted(ends, n, side="left"))
        if ends[k] == n:
            finished, next_doc, next_offset = k + 1, int(docs[k]) + 1, 0
        else:
            start = int(ends[k - 1]) if k > 0 else 0
            head = self._head if k == 0 else 0
            finished, next_doc, next_offset = k, int(docs[k]), head + n - start
        self.documents += finished
        taken: list[tuple[str, int, int]] = []
        left = n
        while left:
            file, a, b = self._pieces[0]
            use = min(left, b - a)
            taken.append((file, a, a + use))
            left -= use
            if a + use == b:
                self._pieces.pop(0)
            else:
                self._pieces[0] = (file, a + use, b)
        self._docs, self._ends = [docs[finished:]], [ends[finished:] - n]
        self._pending -= n
        self._head = next_offset
        job = ShardJob(self.split, self.index, taken, next_doc, next_offset, self.documents)
        self.index += 1
        return job


def write_shard(data_dir: str, job: ShardJob, dtype: str) -> tuple[ShardRecord, bool]:
    """Write ``job``'s shard and then its record; ``(record, True)`` when the very same shard
    and record were already on disk and are left as they are."""
    d = Path(data_dir)
    parts = [np.load(d / file, mmap_mode="r")[a:b] for file, a, b in job.pieces]
    data = npy_bytes(np.concatenate(parts).astype(dtype, copy=False))
    record = ShardRecord(
        shard_name(job.split, job.index),
        sum(b - a for _, a, b in job.pieces),
        sha256_hex(data),
        job.next_doc,
        job.next_offset,
        job.documents,
    )
    on_disk = d / record_name(job.split, job.index)
    if _reads(on_disk) == asdict(record) and (
        shard_problem(d, record.file, record.tokens, record.sha256, dtype) is None
    ):
        return record, True
    atomic_write(d / record.file, data, sync=False)
    atomic_write(on_disk, json_bytes(asdict(record)), sync=False)
    return record, False


def _reads(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_split(
    data_dir: Path, split: str, tokens: np.ndarray, dtype: str, shard_tokens: int
) -> tuple[int, list[ShardRecord]]:
    """``tokens`` (one document) as ``split``'s shards of ``shard_tokens``: ``(documents,
    records)`` for ``manifest.build_manifest``. Tests and benchmarks make folders with it."""
    cutter = Cutter(split, shard_tokens)
    source = data_dir / f".{split}-tokens{TMP_MARK}{os.getpid()}"  # what the shards copy from
    with open(source, "wb") as f:
        np.save(f, np.asarray(tokens, dtype=dtype), allow_pickle=False)
    try:
        jobs = cutter.add(source.name, 0, np.array([0]), np.array([len(tokens)]))
        records = [write_shard(str(data_dir), job, dtype)[0] for job in jobs + cutter.finish()]
    finally:
        source.unlink()
    return cutter.documents, records
