"""``manifest.json``: what a finished data directory holds, and the checks that it still does.

The manifest is written last and atomically, so its presence means every shard it lists was
complete when it was written. ``verify_data_dir`` is the check a pipeline stage runs before
trusting a directory: the tokenizer file, and every shard's size and (optionally) sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moe_core.data.errors import DataError
from moe_core.data.shards import SPLITS, ShardRecord, shard_problem, write_split
from moe_core.data.tokenizer import TOKEN_DTYPES, TOKENIZER_JSON
from moe_core.files import atomic_write, file_sha256, inside, json_bytes, sha256_hex

FORMAT = "moe_core.tokens/1"
MANIFEST = "manifest.json"


def build_manifest(
    spec: dict[str, Any],
    tokenizer: dict[str, Any],
    documents: int,
    splits: dict[str, tuple[int, list[ShardRecord]]],
) -> dict[str, Any]:
    """The manifest of a finished run; ``splits`` maps a split to (documents, shard records)."""
    out: dict[str, Any] = {
        **spec,
        "tokenizer": {**spec["tokenizer"], **tokenizer},
        "dtype": tokenizer["dtype"],
        "documents": documents,
        "splits": {},
    }
    for split, (docs, records) in splits.items():
        out["splits"][split] = {
            "documents": docs,
            "tokens": sum(r.tokens for r in records),
            "shards": [r.summary() for r in records],
        }
    out["total_tokens"] = sum(s["tokens"] for s in out["splits"].values())
    return out


def write_token_folder(
    path: Path,
    splits: dict[str, np.ndarray],
    *,
    dtype: str,
    shard_tokens: int,
    vocab_size: int,
    eos_id: int,
    tokenizer: bytes,
) -> Path:
    """A data folder of ``moe tokenize``'s format holding token arrays one already has (tests,
    benchmarks): each split's array is written as one document through the stage's own shard
    writer, ``tokenizer`` (a ``tokenizer.json``'s bytes) beside it, the manifest last."""
    path.mkdir(parents=True, exist_ok=True)
    atomic_write(path / TOKENIZER_JSON, tokenizer, sync=False)
    records = {
        split: write_split(
            path, split, np.asarray(splits.get(split, []), dtype=np.int64), dtype, shard_tokens
        )
        for split in SPLITS
    }
    spec = {"format": FORMAT, "tokenizer": {"name": "given"}}
    info = {
        "sha256": sha256_hex(tokenizer),
        "vocab_size": vocab_size,
        "eos_id": eos_id,
        "dtype": dtype,
    }
    atomic_write(path / MANIFEST, json_bytes(build_manifest(spec, info, 1, records)), sync=False)
    return path


@dataclass
class Manifest:
    """A data directory's manifest, read and checked."""

    data_dir: Path
    content: dict[str, Any]
    sha256: str  # of manifest.json: identifies this exact data

    @property
    def dtype(self) -> str:
        return self.content["dtype"]

    @property
    def tokenizer(self) -> dict[str, Any]:
        return self.content["tokenizer"]

    @property
    def total_tokens(self) -> int:
        return self.content["total_tokens"]

    def shards(self, split: str) -> list[dict[str, Any]]:
        return self.content["splits"][split]["shards"]

    def tokens(self, split: str) -> int:
        return self.content["splits"][split]["tokens"]


def read_manifest(data_dir: str | Path) -> Manifest:
    d = Path(data_dir)
    path = d / MANIFEST
    if not path.is_file():
        raise DataError(
            f"{d} has no {MANIFEST}, so it is not a finished moe tokenize output: run (or rerun, "
            "to finish) moe tokenize with data.dir pointing there."
        )
    raw = path.read_bytes()
    try:
        content = json.loads(raw)
    except ValueError as err:
        raise DataError(
            f"{path} is not valid JSON ({err}): rerun moe tokenize to rewrite it."
        ) from None
    if not isinstance(content, dict) or content.get("format") != FORMAT:
        found = content.get("format") if isinstance(content, dict) else None
        raise DataError(f"{path} has format {found!r}, not {FORMAT!r}: tokenize the corpus again.")
    problem = _schema_problem(content)
    if problem is not None:
        raise DataError(
            f"{path} {problem}, so it is not a manifest moe tokenize wrote: tokenize the corpus "
            "again into a new data.dir."
        )
    return Manifest(d, content, sha256_hex(raw))


# What readers of a manifest take from it: key -> the type its value must have.
_TOP = {"dtype": str, "tokenizer": dict, "splits": dict, "total_tokens": int}
_TOKENIZER = {"sha256": str, "vocab_size": int}
_SPLIT = {"documents": int, "tokens": int, "shards": list}
_SHARD = {"file": str, "tokens": int, "sha256": str}


_KINDS = {str: "a string", int: "an integer", dict: "a mapping", list: "a list"}


def _missing(content: dict[str, Any], keys: dict[str, type], where: str) -> str | None:
    for key, kind in keys.items():
        value = content.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            found = "lacks" if key not in content else f"has {value!r} at"
            return f"{found} {where}{key} ({_KINDS[kind]})"
    return None


def _schema_problem(content: dict[str, Any]) -> str | None:
    """The first key a reader needs that the manifest lacks or holds as another type, e.g.
    "lacks splits.train.shards (a list)"; None when every one is there."""
    problem = _missing(content, _TOP, "") or _missing(
        content["tokenizer"], _TOKENIZER, "tokenizer."
    )
    if problem is not None:
        return problem
    if content["dtype"] not in TOKEN_DTYPES:  # the shards are read as this numpy dtype
        return f"has {content['dtype']!r} at dtype ({' or '.join(TOKEN_DTYPES)})"
    for split in SPLITS:
        info = content["splits"].get(split)
        if not isinstance(info, dict):
            return f"lacks splits.{split} (a mapping)"
        problem = _missing(info, _SPLIT, f"splits.{split}.")
        if problem is not None:
            return problem
        for i, shard in enumerate(info["shards"]):
            if not isinstance(shard, dict):
                return f"has {shard!r} at splits.{split}.shards[{i}] (a mapping)"
            problem = _missing(shard, _SHARD, f"splits.{split}.shards[{i}].")
            if problem is not None:
                return problem
    return None


def verify_data_dir(
    data_dir: str | Path, *, checksums: bool = True, tokenizer_sha256: str | None = None
) -> Manifest:
    """The manifest of ``data_dir`` once its tokenizer and shards check out against it.

    Sizes and headers are always checked (cheap); ``checksums`` also hashes every shard.
    ``tokenizer_sha256`` refuses a directory tokenized with any other tokenizer.
    """
    manifest = read_manifest(data_dir)
    d = manifest.data_dir
    recorded = manifest.tokenizer["sha256"]
    if tokenizer_sha256 is not None and tokenizer_sha256 != recorded:
        raise DataError(
            f"{d / MANIFEST} comes from another tokenizer (sha256 {recorded[:16]}..., expected "
            f"{tokenizer_sha256[:16]}...): tokenize the corpus again into a new data.dir."
        )
    tokenizer_file = inside(d, TOKENIZER_JSON, d, DataError)
    found = file_sha256(tokenizer_file) if tokenizer_file.is_file() else "missing"
    if found != recorded:
        raise DataError(
            f"{tokenizer_file} is {'missing' if found == 'missing' else 'another tokenizer'} "
            f"(sha256 {found[:16]}..., manifest {recorded[:16]}...): the shards were written with "
            "the manifest's tokenizer, so restore its tokenizer.json or tokenize again."
        )
    for split in SPLITS:
        for shard in manifest.shards(split):
            inside(d, shard["file"], d / MANIFEST, DataError)  # nothing outside d is read
            sha = shard["sha256"] if checksums else ""
            problem = shard_problem(d, shard["file"], shard["tokens"], sha, manifest.dtype)
            if problem is not None:
                raise DataError(
                    f"{problem}: rerun moe tokenize with the same settings to rewrite it."
                )
    return manifest
