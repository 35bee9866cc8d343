"""``moe train`` at the shape of a named model beside torchtitan's step at the same shape, in one
run on one GPU (issue 37: the model families).

    python benchmarks/families_step.py --model qwen3-30b-a3b --layers 8 --kit KIT \\
        --order ours,peer,ours --expert-gemm quack --attention flash4 --out families.json

Each entry of ``--order`` runs in a process of its own, one after the other: ``ours`` is
``moe train`` (``trainer_step.trainer_run``: the product's printed model TFLOP/s, median over the
steps after warm-up, pure-bf16, synthetic tokens, learned routing, micro-batch ``--mbs`` x 4096);
``peer`` is torchtitan 0.3.0's Qwen3-MoE ``Trainer.train_step`` through
``peer_torchtitan.py`` (compiled, bf16 parameters and AdamW states, no CUDA graphs, random token
ids; its figure divides the same FLOPs per token, ``flops.count``, by the mean of its timed
steps). MFU divides by the H200's dense bf16 peak (``moe_core.hardware``). Interleaving the
order (ours, peer, ours) spreads the machine's drift over both sides.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import save, stamp
from trainer_step import run_shape, trainer_run

from moe_core.hardware import GPUS

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def peer_run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [
            sys.executable,
            str(HERE / "peer_torchtitan.py"),
            f"--kit={args.kit}",
            f"--model={args.model}",
            f"--layers={args.layers}",
            "--",
            "--compile=1",
            f"--mbs={args.mbs}",
            "--dtype=bfloat16",
            "--cuda-graphs=0",
            f"--warmup={args.warmup}",
            f"--iters={args.steps}",
            f"--out={out}",
        ]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            return {"failed": True, "tail": (done.stdout + done.stderr)[-4000:]}
        return json.loads(out.read_text())


def ours_run(args: argparse.Namespace) -> dict:
    shape = run_shape(
        model=args.model,
        layers=args.layers,
        mbs=args.mbs,
        warmup=args.warmup,
        steps=args.steps,
        expert_gemm=args.expert_gemm,
        attention=args.attention,
        skip_bare=True,
    )
    try:
        return trainer_run(shape)
    except SystemExit as err:  # trainer_step.child: the run failed, its output in the message
        return {"failed": True, "tail": str(err)[-4000:]}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kit", default="", help="the peer kit's folder (bench_torchtitan.py)")
    p.add_argument("--order", default="ours,peer,ours")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--expert-gemm", choices=["auto", "torch", "quack"], default="auto")
    p.add_argument("--attention", choices=["sdpa", "flash4"], default="sdpa")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    order = args.order.split(",")
    if any(o not in ("ours", "peer") for o in order):
        raise SystemExit(f"--order {args.order!r} is not allowed: a list of 'ours' and 'peer'.")
    if "peer" in order and not (Path(args.kit) / "bench_torchtitan.py").is_file():
        raise SystemExit(f"--kit {args.kit!r} holds no bench_torchtitan.py (the peer kit).")
    report: dict = {
        "benchmark": "families_step",
        **stamp(args.commit),
        "model": args.model,
        "layers": args.layers,
        "mbs": args.mbs,
        "seq": 4096,
        "expert_gemm": args.expert_gemm,
        "attention": args.attention,
        "runs": [],
    }
    for who in order:
        result = ours_run(args) if who == "ours" else peer_run(args)
        report["runs"].append({"who": who, **result})
        save(report, args.out)
        print(who, json.dumps({k: result.get(k) for k in ("median_tflops", "model_tflops")}))
    figures: dict[str, list[float]] = {"ours": [], "peer": []}
    for r in report["runs"]:
        key = "median_tflops" if r["who"] == "ours" else "model_tflops"
        if not r.get("failed"):
            figures[r["who"]].append(r[key])
    for who, values in figures.items():
        if values:
            report[f"{who}_tflops"] = statistics.median(values)
            report[f"{who}_mfu"] = statistics.median(values) / GPUS["H200"].peak_tflops
    if figures["ours"] and figures["peer"]:
        report["ratio"] = report["ours_tflops"] / report["peer_tflops"]
    save(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
