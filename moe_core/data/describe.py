"""What a data folder holds, in words (``moe data``): its format, files, documents, tokens per
split, vocabulary and the start of its token stream, decoded where a tokenizer is known."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moe_core.config import DataConfig
from moe_core.data.dataset import TokenDataset
from moe_core.data.formats import Vocabulary, open_source, run_vocabulary
from moe_core.data.tokenizer import load_tokenizer


@dataclass
class Summary:
    """Rows of (what, value) and a sample of the first tokens of the train split."""

    rows: list[tuple[str, str]] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)
    sample_text: str | None = None  # None: no tokenizer to decode with


def _files(n: int, what: str) -> str:
    return f"{n} {what} file{'s' if n != 1 else ''}"


def _count(n: object) -> str:
    """A count from a manifest, which another writer may have left out ("?")."""
    return f"{n:,}" if isinstance(n, int) else "?"


def _megabytes(paths: list[Path]) -> str:
    return f"{sum(p.stat().st_size for p in paths) / 1e6:,.1f} MB"


def summarize(
    data: DataConfig,
    model_vocab_size: int,
    sample_tokens: int = 64,
    vocab: Vocabulary | None = None,
) -> Summary:
    """``data``'s folder described; an external corpus is read with the run's vocabulary
    (``vocab``, a mixture's; else ``data.tokenizer``'s)."""
    out = Summary()
    assert data.dir is not None
    if data.format == "moe":
        train, held_out = (TokenDataset(data.dir, s, 1) for s in ("train", "validation"))
        manifest = train.manifest
        shards = [*train.paths, *held_out.paths]
        splits = manifest.content["splits"]
        tok = manifest.tokenizer
        try:
            tokenizer = load_tokenizer(data.dir)
        except Exception as err:  # tokenizers raises a bare Exception for a damaged file
            tokenizer = None  # the sample is shown as ids, and why
            out.rows.append(("tokenizer", f"tokenizer.json unreadable ({err}): ids only"))
        out.rows += [
            ("format", "moe (moe tokenize's shards and manifest)"),
            ("folder", str(manifest.data_dir)),
            ("files", f"{len(shards)} shards ({_megabytes(shards)}), dtype {manifest.dtype}"),
            (
                "documents",
                f"{_count(manifest.content.get('documents'))}: train "
                f"{splits['train']['documents']:,}, validation "
                f"{splits['validation']['documents']:,}",
            ),
            (
                "tokens",
                f"{manifest.total_tokens:,}: train {train.tokens:,}, validation "
                f"{held_out.tokens:,}",
            ),
            (
                "vocabulary",
                f"{tok['vocab_size']:,} ids (its tokenizer.json, sha256 {tok['sha256'][:16]}...)"
                + (f", end-of-text {tok['eos_id']}" if "eos_id" in tok else ""),
            ),
        ]
    else:
        vocab = vocab or run_vocabulary(data, model_vocab_size)
        train, held_out = (open_source(data, s, 1, vocab) for s in ("train", "validation"))
        tokenizer = vocab.tokenizer
        dtypes = sorted({str(d) for d in train.dtypes})
        counted = train.check_documents()
        if counted is None:
            documents = (
                "unknown (a file without metadata, and no tokenizer names the end-of-text id)"
            )
        elif data.format == "megatron":
            documents = f"{counted:,} (their indices)"
        else:
            how = f"metadata rows, or end-of-text ids {vocab.eos_id} counted where a file has none"
            documents = f"{counted:,} ({how if vocab.eos_id is not None else 'metadata rows'})"
        share = f"the last {data.validation_fraction * 100:.4g} % of the tokens"
        out.rows += [
            ("format", data.format),
            ("folder", str(train.root)),
            (
                "files",
                f"{_files(len(train.paths), 'token')} ({_megabytes(train.paths)}), dtype "
                f"{', '.join(dtypes)}"
                + (f"; {_files(len(train.sidecars), 'index/metadata')}" if train.sidecars else ""),
            ),
            ("documents", documents),
            (
                "tokens",
                f"{train.tokens + held_out.tokens:,}: train {train.tokens:,}, validation "
                f"{held_out.tokens:,} ({share})",
            ),
            (
                "vocabulary",
                f"{vocab.size:,} ids ({vocab.source})"
                + (f", end-of-text {vocab.eos_id}" if vocab.eos_id is not None else ""),
            ),
        ]
    ids = train.read(0, sample_tokens) if train.tokens else np.zeros(0, np.int64)
    out.sample_ids = [int(i) for i in ids]
    top = int(ids.max()) if len(ids) else -1
    if tokenizer is not None and top < tokenizer.get_vocab_size(with_added_tokens=True):
        out.sample_text = tokenizer.decode(out.sample_ids, skip_special_tokens=False)
    return out
