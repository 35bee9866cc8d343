"""``moe train`` at long sequences on one GPU against ``moe plan`` (issue 42, item 4).

    python benchmarks/long_context.py --out long_context_h200.json           # one GPU
    python benchmarks/long_context.py --check                                # anywhere
    python benchmarks/long_context.py --replan results/long_context_*.json   # anywhere

OLMoE-1B-7B (all 16 layers, pure-bf16, synthetic tokens) at sequence 4096 (micro-batch 4, the
reference of the other one-GPU rows) and at 16k, 32k and 64k (micro-batch 1), each ``moe train``
in its own process, one after the other, in one device call. Each length takes the lightest
activation recompute (none, selective, block) whose ``moe plan`` fits the GPU's memory with
``--margin`` GiB to spare. Recorded per length: the median model TFLOP/s per GPU over the steps
after ``--warmup`` (design.md's convention: attention's quadratic FLOPs counted, ``flops.count``
at the run's sequence length), the timed steps' peak memory (``peak_mem_gib`` of metrics.jsonl:
``torch.cuda.max_memory_allocated``, reset each step; every step's stands beside it, the first
ones' with compilation and CUDA-graph capture) and the plan's total per GPU beside it, with and
without its runtime reserve (CUDA context and workspaces, which the allocator's peak does not see).
Targets (issue 42): 32k within 15 % of 4k's TFLOP/s; plan within 10 % of measured at every
length.

``--check`` composes and plans every run without a GPU (the test suite runs it): each length's
config validates and one of the recompute choices fits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

GIB = 2**30
RECOMPUTE = ("none", "selective", "block")  # lightest first
# (sequence length, micro-batch size): 4096 at 4 is the one-GPU reference shape of RESULTS.md
LENGTHS = ((4096, 4), (16384, 1), (32768, 1), (65536, 1))


def overrides(
    seq_len: int, mbs: int, recompute: str, steps: int, extra: tuple[str, ...] = ()
) -> list[str]:
    """The ``moe train`` (and ``moe plan``) overrides of one length on one GPU (``extra``
    last: ``--layers`` and ``--set``)."""
    return [
        "model=olmoe-1b-7b",
        f"model.max_seq_len={max(seq_len, 4096)}",
        "precision=pure-bf16",
        "data=synthetic",
        f"train.seq_len={seq_len}",
        f"train.micro_batch_size={mbs}",
        f"train.global_batch_size={mbs}",
        "train.eval_batches=1",
        f"train.steps={steps}",
        "train.log_every=1",
        "train.checkpoint_at_end=false",
        "train.save_model=false",
        f"parallel.recompute={recompute}",
        "cluster=local-gpu",
        "cluster.procs_per_node=1",
        "cluster.gpus_per_node=1",
        *extra,
    ]


def choose(
    seq_len: int, mbs: int, steps: int, margin: float, extra: tuple[str, ...] = ()
) -> tuple[str, float] | None:
    """The lightest recompute whose plan fits the cluster's GPU with ``margin`` GiB to spare,
    and its planned GiB per GPU; None when none does."""
    import torch

    from moe_core.compose import compose_run
    from moe_core.plan import plan

    for recompute in RECOMPUTE:
        run = compose_run(overrides(seq_len, mbs, recompute, steps, extra))
        total = plan(run).memory.total / GIB
        gpu_gib = run.cluster.gpu_memory_gib  # the card this runs on, where there is one
        if torch.cuda.is_available():
            gpu_gib = torch.cuda.get_device_properties(0).total_memory / GIB
        if total + margin <= gpu_gib:
            return recompute, total
    return None


def measure(seq_len: int, mbs: int, recompute: str, args: argparse.Namespace) -> dict:
    """One ``moe train`` run of this length: its TFLOP/s and peak memory, and its plan."""
    from moe_core.compose import compose_run
    from moe_core.plan import plan

    args_ = overrides(seq_len, mbs, recompute, args.steps, extra(args))
    p = plan(compose_run(args_))
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "moe_core.cli", "train", *args_, f"out_dir={out}"]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            return {"seq_len": seq_len, "error": (done.stdout + done.stderr)[-3000:]}
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup :]
    # the steady steps' peak is what the plan counts; the first steps' (compilation, CUDA-graph
    # capture) stands beside it
    peak = max(r["peak_mem_gib"] for r in timed)
    planned = p.memory.total / GIB
    reserve = p.memory.reserve / GIB
    return {
        "seq_len": seq_len,
        "micro_batch_size": mbs,
        "recompute": recompute,
        "model_tflops_per_gpu": statistics.median(r["model_tflops_per_gpu"] for r in timed),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "peak_mem_gib": peak,
        "peak_per_step_gib": [r["peak_mem_gib"] for r in rows],
        "plan_gib": planned,
        "plan_without_reserve_gib": planned - reserve,
        "plan_over_measured": (planned - reserve) / peak,
        "flops_per_token": p.flops_per_token,
        "overrides": args_,
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default=",".join(str(s) for s, _ in LENGTHS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--margin", type=float, default=8.0, help="GiB the plan leaves free")
    p.add_argument("--layers", type=int, default=16, help="of OLMoE-1B-7B's 16")
    p.add_argument("--recompute", choices=RECOMPUTE, help="this one at every length")
    p.add_argument("--set", action="append", default=[], help="another override, repeatable")
    p.add_argument("--check", action="store_true", help="compose and plan only (no GPU)")
    p.add_argument(
        "--replan",
        nargs="+",
        metavar="JSON",
        help="no GPU: this code's plan beside the peaks recorded in these results",
    )
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    return p


def extra(args: argparse.Namespace) -> tuple[str, ...]:
    """The overrides ``--layers`` and ``--set`` add to every run."""
    layers = [f"model.n_layers={args.layers}"] if args.layers != 16 else []
    return (*layers, *args.set)


def replan(paths: list[str]) -> None:
    """Print this code's plan (without its runtime reserve) beside each recorded run's peak:
    the plan's accuracy after a change to it, against measurements already taken."""
    from moe_core.compose import compose_run
    from moe_core.plan import plan

    for path in paths:
        for r in json.loads(Path(path).read_text())["runs"]:
            if "error" in r:
                continue
            memory = plan(compose_run(r["overrides"])).memory
            planned = (memory.total - memory.reserve) / GIB
            print(
                f"{Path(path).name}: seq {r['seq_len']} x {r['micro_batch_size']}, recompute "
                f"{r['recompute']}: peak {r['peak_mem_gib']:.2f} GiB, plan {planned:.2f} "
                f"(recorded {r['plan_without_reserve_gib']:.2f}), plan / peak "
                f"{planned / r['peak_mem_gib']:.3f}"
            )


def main() -> None:
    from moe_core.compose import compose_run
    from moe_core.plan import plan

    args = parser().parse_args()
    if args.replan:
        return replan(args.replan)
    wanted = {int(s) for s in args.lengths.split(",")}
    runs = [(s, mbs) for s, mbs in LENGTHS if s in wanted]
    chosen = {}
    for seq_len, mbs in runs:
        found = choose(seq_len, mbs, args.steps, args.margin, extra(args))
        if args.recompute is not None:  # as asked, with its plan
            run = compose_run(overrides(seq_len, mbs, args.recompute, args.steps, extra(args)))
            found = (args.recompute, plan(run).memory.total / GIB)
        if found is None:
            sys.exit(f"seq {seq_len}: no recompute choice fits the GPU by moe plan")
        chosen[seq_len] = found
        print(f"seq {seq_len} x {mbs}: recompute {found[0]}, plan {found[1]:.1f} GiB", flush=True)
    if args.check:
        return
    from report import save, stamp

    results = []
    for seq_len, mbs in runs:
        r = measure(seq_len, mbs, chosen[seq_len][0], args)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "overrides"}), flush=True)
        save({**stamp(args.commit), "runs": results}, args.out)  # each length as it lands


if __name__ == "__main__":
    main()
