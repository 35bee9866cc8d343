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

Multi-head latent attention configs (issue 38) run torchtitan's ``deepseek_v3`` family instead
(``peer_torchtitan.py`` says what it computes). ``--experts``, ``--dense-layers``,
``--mtp-depth`` and ``--set`` are model overrides both sides take; ``--recompute block`` is
``parallel.recompute=block`` for ours and full activation checkpointing for torchtitan. The
pruned DeepSeek-V3 block on one H200 (``peer_torchtitan.py``'s docstring says why this shape),
MTP on:

    python benchmarks/families_step.py --model deepseek-v3 --layers 7 --dense-layers 1 \\
        --experts 32 --mtp-depth 1 --mbs 1 --recompute block --kit KIT --out v3_mtp1.json
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


def model_overrides(args: argparse.Namespace) -> list[str]:
    """The model overrides both sides take (over ``--model`` at ``--layers``)."""
    picked = {
        "n_experts": args.experts,
        "n_dense_layers": args.dense_layers,
        "mtp_depth": args.mtp_depth,
    }
    return [f"model.{k}={v}" for k, v in picked.items() if v is not None] + args.set


def peer_run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peer.json"
        cmd = [
            sys.executable,
            str(HERE / "peer_torchtitan.py"),
            f"--kit={args.kit}",
            f"--model={args.model}",
            f"--layers={args.layers}",
            *(f"--set={o}" for o in model_overrides(args)),
            f"--compile-mtp={args.peer_compile_mtp}",
            f"--out={out}",
            "--",
            "--compile=1",
            f"--mbs={args.mbs}",
            "--dtype=bfloat16",
            "--cuda-graphs=0",
            f"--ac={'full' if args.recompute == 'block' else 'none'}",
            f"--warmup={args.warmup}",
            f"--iters={args.steps}",
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
        set=[*model_overrides(args), f"parallel.recompute={args.recompute}"],
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
    p.add_argument("--experts", type=int, default=None, help="model.n_experts (pruned)")
    p.add_argument("--dense-layers", type=int, default=None, help="model.n_dense_layers")
    p.add_argument("--mtp-depth", type=int, default=None, help="model.mtp_depth (0: MTP off)")
    p.add_argument("--set", action="append", default=[], help="another model override, both sides")
    p.add_argument(
        "--recompute",
        choices=["none", "block"],
        default="none",
        help="block: ours parallel.recompute=block, torchtitan full activation checkpointing",
    )
    p.add_argument(
        "--peer-compile-mtp", type=int, default=0, help="1: torchtitan compiles its MTP blocks too"
    )
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
        "model_overrides": model_overrides(args),
        "recompute": args.recompute,
        "peer_compile_mtp": bool(args.peer_compile_mtp),
        "runs": [],
    }
    for who in order:
        result = ours_run(args) if who == "ours" else peer_run(args)
        report["runs"].append({"who": who, **result})
        save(report, args.out)
        shown = ("median_tflops", "model_tflops", "peak_mem_gib")
        print(who, json.dumps({k: result.get(k) for k in shown}))
    figures: dict[str, list[float]] = {"ours": [], "peer": []}
    peaks: dict[str, list[float]] = {"ours": [], "peer": []}
    for r in report["runs"]:
        key = "median_tflops" if r["who"] == "ours" else "model_tflops"
        if not r.get("failed"):
            figures[r["who"]].append(r[key])
            peaks[r["who"]].append(r.get("peak_mem_gib", 0.0))
    for who, values in figures.items():
        if values:
            report[f"{who}_tflops"] = statistics.median(values)
            report[f"{who}_mfu"] = statistics.median(values) / GPUS["H200"].peak_tflops
            report[f"{who}_peak_gib"] = max(peaks[who])
    if figures["ours"] and figures["peer"]:
        report["ratio"] = report["ours_tflops"] / report["peer_tflops"]
    save(report, args.out)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))


if __name__ == "__main__":
    main()
