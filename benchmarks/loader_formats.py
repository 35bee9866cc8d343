"""Loader micro-batches per second from our shards against the same tokens in Dolma/Olmo-core
numpy files and Megatron-Core ``.idx``/``.bin`` pairs (issue 39: reading an external format
costs no more per batch than our shards).

One token stream (random ids below GPT-2's 50,257, an end-of-text id after every document) is
written three ways into a scratch folder, cut into the same number of files; each format's
``TokenLoader`` then serves the same shuffled micro-batches (the permutation depends only on
the instance count and the seed). The files are read once before timing, so every format reads
from the page cache; the formats take turns within each repeat, and the median repeat is
reported. A CPU measurement: the loader reads memory-mapped files on the host.

    python benchmarks/loader_formats.py [--tokens 33554432] [--seq 4096] [--micro-batch 8] \\
        [--batches 2000] [--repeats 7] [--commit SHA] [--out results/loader_formats_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from report import save, stamp

from moe_core.data.dataset import TokenDataset
from moe_core.data.formats import DolmaDataset, MegatronDataset
from moe_core.data.loader import TokenLoader
from moe_core.data.manifest import write_token_folder

VOCAB, EOS = 50_257, 50_256
MEGATRON_HEAD = "<9sQBQQ"


def token_stream(n: int, seed: int = 0) -> np.ndarray:
    """``n`` uint16 ids: documents of 1 to 2,000 tokens, each ending in the end-of-text id."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, EOS, n, dtype=np.uint16)
    ends = np.cumsum(rng.integers(1, 2000, n // 1000 + 1))
    tokens[ends[ends < n]] = EOS
    tokens[-1] = EOS
    return tokens


def at_document_ends(tokens: np.ndarray, files: int) -> list[np.ndarray]:
    """``tokens`` cut into ``files`` parts of about equal size, each ending a document (as
    Dolma's and Megatron's files do)."""
    ends = np.flatnonzero(tokens == EOS) + 1
    targets = np.linspace(0, len(tokens), files + 1)[1:-1]
    cuts = np.unique(ends[np.minimum(np.searchsorted(ends, targets), len(ends) - 1)])
    return np.split(tokens, cuts[cuts < len(tokens)])


def write_ours(folder: Path, tokens: np.ndarray, files: int) -> Path:
    """Our shards and manifest (a stand-in tokenizer file: nothing here decodes)."""
    folder.mkdir(parents=True)
    return write_token_folder(
        folder,
        {"train": tokens},
        dtype="uint16",
        shard_tokens=-(-len(tokens) // files),
        vocab_size=VOCAB,
        eos_id=EOS,
        tokenizer=b'{"stand-in": "tokenizer"}',
    )


def write_dolma(folder: Path, tokens: np.ndarray, files: int) -> Path:
    """Raw uint16 token files, as Olmo-core and Dolma write them (no header)."""
    folder.mkdir(parents=True)
    for k, part in enumerate(at_document_ends(tokens, files)):
        part.tofile(folder / f"part-{k:05d}.npy")
    return folder


def write_megatron(folder: Path, tokens: np.ndarray, files: int) -> Path:
    """One ``.idx``/``.bin`` pair per file, one sequence per document, Megatron-Core's layout."""
    import struct

    folder.mkdir(parents=True)
    for k, part in enumerate(at_document_ends(tokens, files)):
        prefix = folder / f"part_{k:05d}_text_document"
        part.tofile(prefix.with_name(prefix.name + ".bin"))
        lengths = np.diff(np.concatenate([[0], np.flatnonzero(part == EOS) + 1])).astype(np.int32)
        pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * 2
        docs = np.arange(len(lengths) + 1, dtype=np.int64)
        head = struct.pack(MEGATRON_HEAD, b"MMIDIDX\x00\x00", 1, 8, len(lengths), len(docs))
        body = lengths.tobytes() + pointers.tobytes() + docs.tobytes()
        prefix.with_name(prefix.name + ".idx").write_bytes(head + body)
    return folder


def batches_per_s(loader: TokenLoader, n: int) -> float:
    it = iter(loader)
    tick = time.perf_counter()
    for _ in range(n):
        next(it)
    return n / (time.perf_counter() - tick)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=1 << 25)
    p.add_argument("--files", type=int, default=16)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    tokens = token_stream(args.tokens)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folders = {
            "moe": write_ours(root / "moe", tokens, args.files),
            "dolma": write_dolma(root / "dolma", tokens, args.files),
            "megatron": write_megatron(root / "megatron", tokens, args.files),
        }
        seq = args.seq
        datasets = {
            "moe": TokenDataset(folders["moe"], "train", seq),
            "dolma": DolmaDataset(folders["dolma"], "train", seq, vocab_size=VOCAB, eos_id=EOS),
            "megatron": MegatronDataset(folders["megatron"], "train", seq, vocab_size=VOCAB),
        }
        for name, ds in datasets.items():  # the same stream, read whole once (page cache)
            assert np.array_equal(ds.read(0, ds.tokens), tokens), name
        runs: dict[str, list[float]] = {name: [] for name in datasets}
        for _ in range(args.repeats):
            for name, ds in datasets.items():
                loader = TokenLoader(ds, "train", seq, args.micro_batch, seed=1)
                runs[name].append(batches_per_s(loader, args.batches))
    results = {}
    for name, rates in runs.items():
        rate = statistics.median(rates)
        results[name] = {
            "batches_per_s": round(rate, 1),
            "tokens_per_s": round(rate * args.micro_batch * (seq + 1)),
            "runs": [round(r, 1) for r in rates],
            "vs_moe": round(rate / statistics.median(runs["moe"]), 3),
        }
        print(f"{name:9s} {rate:9.1f} micro-batches/s  ({results[name]['vs_moe']:.3f} x ours)")
    report = {
        "benchmark": "loader_formats",
        **stamp(args.commit, gpu="none (CPU)"),
        "cpu": f"{platform.machine()}, {os.cpu_count()} cores visible",
        "tokens": args.tokens,
        "files": args.files,
        "seq_len": seq,
        "micro_batch_size": args.micro_batch,
        "batches_per_repeat": args.batches,
        "results": results,
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
