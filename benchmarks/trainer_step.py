"""The trainer users run (``moe train``) against the bare training step, same shape and precision.

    python benchmarks/trainer_step.py --layers 16 --precision pure-bf16 --out trainer.json
    python benchmarks/trainer_step.py --layers 8 --precision bf16 --data kjv-gpt2 --data-dir DIR

In one run on one GPU, one after the other, each in its own process:

1. the bare step (``train_step.py``: the model compiled, forward, backward and our fused AdamW
   with the state in the precision's dtype, on random token ids), CUDA events after warm-up,
   the median;
2. ``moe train`` itself, as a child process (the product: data, gradient buckets, ZeRO-1
   optimizer, guards, metrics), OLMoE-1B-7B width at ``--layers`` layers, sequence 4096,
   ``--micro-batches`` micro-batches of ``--mbs`` sequences per step (the bare step always runs
   one), learned routing; its figure is the median of the
   TFLOP/s it prints and writes to ``metrics.jsonl`` over the steps after warm-up (both are
   checked to agree).

``--ep N --dispatcher D`` (and ``--dp M``) runs ``moe train`` under torchrun on N x M GPUs,
expert parallelism over N, M data-parallel replicas (one micro-batch per rank and step; the
printed figure is per GPU) against the one-GPU bare step: what the multi-GPU runs compare
(target: >= 0.97x). ``--cuda-graph true|false`` sets ``parallel.cuda_graph`` for ``moe train``
(default: the config's, on in one process and for rowwise EP).

Precisions: ``pure-bf16`` (bf16 weights, gradients and moments, no master), ``bf16`` (bf16
weights; fp32 gradient buffers, master weights and moments) and ``fp8`` (``pure-bf16`` with FP8
expert GEMMs; ``moe train`` only, ``--skip-bare``). ``--accumulate`` also times
moving one bf16 gradient into an fp32 bucket: zeroing then adding (the old hook) against one
copy (the hook now, for the first micro-batch of a step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from report import save, stamp
from timing import cuda_times_ms
from train_step import add_kernel_options

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STATE_DTYPE = {"pure-bf16": "bf16", "bf16": "fp32", "fp8": "bf16"}


def child(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": "200"}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def bare_step(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        cmd = [
            sys.executable,
            str(HERE / "train_step.py"),
            "--compile",
            "--optimizer=moe_core",
            f"--optimizer-dtype={STATE_DTYPE[args.precision]}",
            f"--layers={args.layers}",
            f"--mbs={args.mbs}",
            f"--warmup={args.warmup}",
            f"--iters={args.steps}",
            f"--expert-gemm={args.expert_gemm}",
            f"--attention={args.attention}",
            f"--out={out}",
        ]
        child(cmd, "the bare step")
        return json.loads(out.read_text())


def fp8_parts_override(parts: str) -> list[str]:
    """``precision.fp8_parts`` from a comma-separated ``--fp8-parts`` (none when empty)."""
    return [f"precision.fp8_parts=[{parts}]"] if parts else []


def trainer_overrides(args: argparse.Namespace, out_dir: str, data_dir: str) -> list[str]:
    data, ranks = ["data=synthetic"], args.ep * args.dp
    if args.data != "synthetic":
        data = [f"data={args.data}", f"data.dir={data_dir}"]
    return [
        f"model={args.model}",
        f"model.n_layers={args.layers}",
        f"precision={args.precision}",
        *fp8_parts_override(args.fp8_parts),
        "train=default",
        *data,
        f"train.micro_batch_size={args.mbs}",
        f"train.global_batch_size={args.mbs * args.micro_batches * ranks}",
        # held-out batches split over the data ranks: at least the default 4, a multiple of them
        f"train.eval_batches={ranks * -(-4 // ranks)}",
        f"parallel.ep={args.ep}",
        f"parallel.dp={args.dp}",
        f"parallel.dispatcher={args.dispatcher}",
        *(
            []
            if args.ep_capacity_factor is None
            else [f"parallel.ep_capacity_factor={args.ep_capacity_factor}"]
        ),
        *([] if args.cuda_graph is None else [f"parallel.cuda_graph={args.cuda_graph}"]),
        f"parallel.expert_gemm={args.expert_gemm}",
        f"parallel.attention={args.attention}",
        f"train.steps={args.warmup + args.steps}",
        "train.log_every=1",
        "train.checkpoint_at_end=false",
        "train.save_model=false",
        "train.resume=false",
        *args.set,
        f"out_dir={out_dir}",
    ]


PRINTED = re.compile(r"step\s+(\d+)\s.*?([\d.]+) TFLOP/s/gpu")


def trainer_run(args: argparse.Namespace) -> dict:
    """``moe train`` in a child process; its printed and logged figures after warm-up."""
    with tempfile.TemporaryDirectory() as out:
        overrides = trainer_overrides(args, out, str(Path(args.data_dir).resolve()))
        launch = [sys.executable, "-m", "moe_core.cli"]
        if args.ep * args.dp > 1:
            run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            launch = [*run, f"--nproc-per-node={args.ep * args.dp}", "-m", "moe_core.cli"]
        done = child([*launch, "train", *overrides], "moe train")
        shown = trainer_overrides(args, "OUT", "DIR")  # no machine paths in the record
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] >= args.warmup]
    printed = {int(s): float(v) for s, v in PRINTED.findall(done.stdout)}
    for r in timed:  # the printed figure is the logged one, rounded to one decimal
        assert abs(printed[r["step"]] - r["model_tflops_per_gpu"]) <= 0.051, (printed, r)
    tflops = [r["model_tflops_per_gpu"] for r in timed]
    return {
        "command": "moe train " + " ".join(o for o in shown if not o.startswith("out_dir")),
        "steps_timed": len(timed),
        "tflops_per_step": tflops,
        "median_tflops": statistics.median(tflops),
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_mem_gib": max(r["peak_mem_gib"] for r in timed),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "printed_tail": done.stdout.splitlines()[-4:],
    }


def accumulate(n: int = 1 << 28) -> dict:
    """One bf16 gradient of ``n`` elements into an fp32 bucket: zero + add vs one copy."""
    g = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    bucket = torch.empty(n, device="cuda", dtype=torch.float32)

    def zero_add() -> None:
        bucket.zero_()
        bucket.add_(g)

    def copy() -> None:
        bucket.copy_(g)

    out = {"elements": n}
    for name, fn in (("zero_add", zero_add), ("copy", copy)):
        out[f"{name}_ms"] = statistics.median(cuda_times_ms(fn, 3, 20))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="olmoe-1b-7b", help="a named model of conf/model (moe train)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--precision", choices=sorted(STATE_DTYPE), default="pure-bf16")
    p.add_argument("--data", choices=["synthetic", "kjv-gpt2"], default="synthetic")
    p.add_argument(
        "--data-dir",
        default="",
        help="token shards for --data kjv-gpt2 (moe tokenize model=olmoe-1b-7b data=kjv-gpt2)",
    )
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=1, help="per trainer step")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel GPUs for moe train")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas for moe train")
    p.add_argument("--dispatcher", choices=["all_to_all", "nvshmem_rowwise"], default="all_to_all")
    p.add_argument(
        "--ep-capacity-factor",
        type=float,
        default=None,
        help="nvshmem_rowwise: parallel.ep_capacity_factor (default: the config's, dropless)",
    )
    p.add_argument(
        "--cuda-graph",
        choices=["true", "false"],
        default=None,
        help="parallel.cuda_graph for moe train (default: the config's null)",
    )
    add_kernel_options(p)  # for both the bare step and moe train
    p.add_argument("--skip-bare", action="store_true", help="only the trainer")
    p.add_argument(
        "--fp8-parts", default="", help="with --precision fp8: the parts, e.g. experts,attention"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        help="another config override for moe train (e.g. model.n_experts=32), repeatable",
    )
    p.add_argument("--accumulate", action="store_true")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    return p


def run_shape(**changes: object) -> argparse.Namespace:
    """This script's arguments at their defaults with ``changes`` over them: the run another
    script builds with ``trainer_overrides`` (an option added here needs nothing there)."""
    return argparse.Namespace(**{**vars(parser().parse_args([])), **changes})


def refusal(args: argparse.Namespace) -> str | None:
    """Why these arguments cannot run (one sentence), or None."""
    if args.data != "synthetic" and not args.data_dir:
        return f"--data {args.data} needs --data-dir (the token shards)."
    if args.precision == "fp8" and not args.skip_bare:
        return (
            "--precision fp8 times moe train only (the bare step has no FP8 experts): "
            "add --skip-bare."
        )
    if args.fp8_parts and args.precision != "fp8":
        return f"--fp8-parts {args.fp8_parts} needs --precision fp8."
    if args.model != "olmoe-1b-7b" and not args.skip_bare:
        return (
            f"--model {args.model}: the bare step is OLMoE-1B-7B's shape only; add --skip-bare "
            "(benchmarks/families_step.py times moe train at other shapes)."
        )
    return None


def main() -> None:
    args = parser().parse_args()
    problem = refusal(args)
    if problem is not None:
        raise SystemExit(problem)
    result: dict = {
        "benchmark": "trainer_vs_step",
        **stamp(args.commit),
        "model": args.model,
        "layers": args.layers,
        "precision": args.precision,
        "fp8_parts": args.fp8_parts or None,
        "data": args.data,
        "mbs": args.mbs,
        "micro_batches": args.micro_batches,
        "ep": args.ep,
        "dp": args.dp,
        "dispatcher": args.dispatcher,
        "ep_capacity_factor": args.ep_capacity_factor,
        "cuda_graph": args.cuda_graph,
        "expert_gemm": args.expert_gemm,
        "attention": args.attention,
        "seq": 4096,
    }
    if args.accumulate:
        result["accumulate"] = accumulate()
    if not args.skip_bare:
        bare = bare_step(args)
        result["step"] = bare
        result["step_tflops"] = bare["model_tflops"]
    trainer = trainer_run(args)
    result["trainer"] = trainer
    result["trainer_tflops"] = trainer["median_tflops"]
    if "step_tflops" in result:
        result["ratio"] = result["trainer_tflops"] / result["step_tflops"]
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k not in ("step", "trainer")}))
    save(result, args.out)


if __name__ == "__main__":
    main()
