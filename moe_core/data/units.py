"""The tokenize stage's work in units that any worker seeing the data folder can run.

A unit is a fixed range of ``data.unit_documents`` documents, so what it writes depends on the
corpus alone, never on how many workers there are. ``encode_unit`` tokenizes one and writes
``units/NNNNNNNN.npy`` (the unit's train tokens, then its validation tokens) and after it the
record ``units/NNNNNNNN.json`` (each document's length and the file's sha256); a rerun keeps
every unit whose record and file check out. The shards are then cut from the units' files
(``moe_core.data.shards``: ``Cutter``, ``write_shard``), and the units folder is deleted once
the manifest is written.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from moe_core.data.encode import Encoder
from moe_core.data.errors import DataError
from moe_core.data.shards import npy_bytes, shard_problem
from moe_core.data.tokenizer import TOKENIZER_JSON
from moe_core.files import atomic_write, json_bytes, sha256_hex

UNITS = "units"


def validation_mask(indices: np.ndarray, fraction: float, phase: float) -> np.ndarray:
    """Which documents are held out (``tokenize.is_validation`` for many at once)."""
    return np.floor((indices + 1) * fraction + phase) > np.floor(indices * fraction + phase)


@dataclass(frozen=True)
class Routing:
    """What a worker needs besides the documents: the tokenizer (read from the data folder,
    checked against its sha256) and the held-out documents' rule."""

    tokenizer_sha256: str
    eos_id: int
    dtype: str
    validation_fraction: float
    phase: float

    def held_out(self, first: int, count: int) -> np.ndarray:
        return validation_mask(first + np.arange(count), self.validation_fraction, self.phase)


@dataclass(frozen=True)
class UnitRecord:
    """One finished unit: documents ``first`` on, each one's tokens (EOS included; 0 for a
    document without text), how many of its tokens are train tokens, its file's sha256."""

    unit: int
    first: int
    lengths: list[int]
    train_tokens: int
    sha256: str

    @property
    def file(self) -> str:
        return f"{UNITS}/{self.unit:08d}.npy"

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


_encoders: dict[str, Encoder] = {}  # one per tokenizer in each worker process


def _encoder(data_dir: Path, routing: Routing) -> Encoder:
    encoder = _encoders.get(routing.tokenizer_sha256)
    if encoder is None:
        path = data_dir / TOKENIZER_JSON
        data = path.read_bytes() if path.is_file() else b""
        if sha256_hex(data) != routing.tokenizer_sha256:
            raise DataError(
                f"{path} is missing or another tokenizer on the worker {os.uname().nodename}: "
                "every worker must see the same data.dir as the driver (shared storage)."
            )
        encoder = _encoders[routing.tokenizer_sha256] = Encoder(
            data.decode(), routing.eos_id, routing.dtype
        )
    return encoder


def _one_thread(encoder: Encoder, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """``encoder(texts)`` on this thread alone (a worker is one core), the setting restored
    after (in the driver, with one worker, it would also slow the BPE trainer down)."""
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # read by tokenizers at each call
    try:
        return encoder(texts)
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


def encode_unit(
    data_dir: str, routing: Routing, unit: int, first: int, texts: list[str]
) -> UnitRecord:
    """Tokenize documents ``first``... of unit ``unit`` and write its file and record."""
    d = Path(data_dir)
    lengths, flat = _one_thread(_encoder(d, routing), texts)
    held = np.repeat(routing.held_out(first, len(texts)), lengths)
    data = npy_bytes(np.concatenate([flat[~held], flat[held]]))
    record = UnitRecord(
        unit, first, lengths.tolist(), int(len(flat) - held.sum()), sha256_hex(data)
    )
    atomic_write(d / record.file, data, sync=False)  # the file first: a record means it is whole
    atomic_write((d / record.file).with_suffix(".json"), json_bytes(asdict(record)), sync=False)
    return record


def finished_units(data_dir: Path, dtype: str) -> dict[int, UnitRecord]:
    """The units on disk whose record reads and whose file matches it (others are redone)."""
    found: dict[int, UnitRecord] = {}
    for path in sorted((data_dir / UNITS).glob("*.json")):
        try:
            record = UnitRecord(**json.loads(path.read_text()))
        except (ValueError, TypeError):
            continue
        if record.file != f"{UNITS}/{path.stem}.npy":
            continue
        if shard_problem(data_dir, record.file, record.tokens, record.sha256, dtype) is None:
            found[record.unit] = record
    return found
