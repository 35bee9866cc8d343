"""Training loss with FP8 experts against bf16, same seed and data: ``moe train`` twice.

    python benchmarks/precision_loss.py --data-dir DIR --out fp8_loss.json [--steps 300]
    python benchmarks/precision_loss.py --data-dir DIR --set precision.fp8_fast_accum=all ...
    python benchmarks/precision_loss.py --plot fp8_loss.json --png fp8_loss.png

``model=small-64e`` (OLMoE's expert layout at d_model 1024, 12 layers) on real tokens
(``data=kjv-gpt2``, tokenized into DIR), one micro-batch of 4 x 4096 tokens per step, one GPU,
each precision in its own child process: ``precision=pure-bf16`` and ``precision=fp8`` (the
same, with the experts' forward and input-gradient GEMMs in FP8). Recorded per run: the loss of
every step, skipped steps, non-finite losses, the median TFLOP/s after warm-up and the peak
memory; compared: the mean loss over the last 20 steps (issue 17's target: within 1.5 %).
``--set`` adds a config override to the fp8 run only (an FP8 option against the same bf16 run).
``--plot`` draws both curves from a written JSON (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

from report import save, stamp
from trainer_step import child, fp8_parts_override

PRECISIONS = ("pure-bf16", "fp8")
TAIL = 20  # steps averaged for the final loss


def overrides(
    precision: str,
    steps: int,
    data_dir: str,
    out_dir: str,
    fp8_parts: str = "",
    seed: int = 0,
    fp8_set: tuple[str, ...] = (),
) -> list[str]:
    parts = [*fp8_parts_override(fp8_parts), *fp8_set] if precision == "fp8" else []
    return [
        "model=small-64e",
        f"precision={precision}",
        *parts,
        "train=default",
        "data=kjv-gpt2",
        f"data.dir={data_dir}",
        "train.micro_batch_size=4",
        "train.global_batch_size=4",
        f"train.steps={steps}",
        "train.warmup_steps=30",
        "train.log_every=1",
        "train.checkpoint_at_end=false",
        "train.save_model=false",
        "train.resume=false",
        *([f"train.seed={seed}"] if seed else []),
        f"out_dir={out_dir}",
    ]


def run(
    precision: str,
    steps: int,
    data_dir: str,
    fp8_parts: str,
    seed: int = 0,
    fp8_set: tuple[str, ...] = (),
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "moe_core.cli", "train"]
        args = overrides(precision, steps, data_dir, out, fp8_parts, seed, fp8_set)
        child([*cmd, *args], f"moe train ({precision})")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows]
    timed = [r for r in rows if r["step"] >= 5]
    return {
        "command": "moe train "
        + " ".join(overrides(precision, steps, "DIR", "OUT", fp8_parts, seed, fp8_set)[:-1]),
        "steps": len(rows),
        "loss": losses,
        "final_loss": statistics.mean(losses[-TAIL:]),
        "skipped_steps": sum(bool(r.get("skipped")) for r in rows),
        "nonfinite_losses": sum(not math.isfinite(x) for x in losses),
        "median_tflops": statistics.median(r["model_tflops_per_gpu"] for r in timed),
        "peak_mem_gib": max(r.get("peak_mem_gib") or 0.0 for r in rows),
    }


def plot(report_path: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(report_path.read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in report["runs"].items():
        ax.plot(
            range(len(r["loss"])), r["loss"], label=f"{name} (last {TAIL}: {r['final_loss']:.4f})"
        )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    diff = report["final_loss_rel_diff"]
    parts = f" [{report['fp8_parts']}]" if report.get("fp8_parts") else ""
    seed = f", seed {report['seed']}" if report.get("seed") else ""
    ax.set_title(f"small-64e, kjv-gpt2{seed}, {report['gpu']}\nfp8{parts} vs bf16 {diff:+.2%}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data-dir", default="")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--fp8-parts", default="", help="the fp8 run's parts (default: the preset's)")
    p.add_argument("--seed", type=int, default=0, help="train.seed of both runs (init, data)")
    p.add_argument(
        "--set", action="append", default=[], help="another override of the fp8 run, repeatable"
    )
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    p.add_argument("--plot", default="", help="draw a written JSON instead of running")
    p.add_argument("--png", default="precision_loss.png")
    args = p.parse_args()
    if args.plot:
        plot(Path(args.plot), Path(args.png))
        return
    if not args.data_dir:
        raise SystemExit("--data-dir: the folder `moe tokenize data=kjv-gpt2` wrote")
    data_dir = str(Path(args.data_dir).resolve())
    fp8_set = tuple(args.set)
    runs = {
        name: run(name, args.steps, data_dir, args.fp8_parts, args.seed, fp8_set)
        for name in PRECISIONS
    }
    base, fp8 = runs["pure-bf16"]["final_loss"], runs["fp8"]["final_loss"]
    report = {
        "benchmark": "precision_loss",
        **stamp(args.commit),
        "fp8_parts": args.fp8_parts or None,
        "fp8_overrides": list(fp8_set),
        "seed": args.seed,
        "final_loss_rel_diff": (fp8 - base) / base,
        "runs": runs,
    }
    for name, r in runs.items():
        print(
            f"{name:<10} final loss {r['final_loss']:.4f}  skipped {r['skipped_steps']}  "
            f"non-finite {r['nonfinite_losses']}  {r['median_tflops']:.1f} TFLOP/s  "
            f"peak {r['peak_mem_gib']:.1f} GiB"
        )
    print(f"fp8 vs bf16 final loss: {report['final_loss_rel_diff']:+.3%}")
    save(report, args.out)


if __name__ == "__main__":
    main()
