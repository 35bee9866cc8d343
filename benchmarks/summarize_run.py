"""Summarize a training run's metrics.jsonl: medians over the steps after warm-up.

python benchmarks/summarize_run.py RUN_DIR/metrics.jsonl --skip 5 --label NAME --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date

from report import save


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("metrics")
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--label", default="run")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--gpu", default="unknown")
    parser.add_argument("--config", default="", help="the overrides the run used")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f]
    timed = [r for r in rows if r["step"] >= args.skip]
    keys = ["tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu", "step_time_s", "peak_mem_gib"]
    summary = {
        "benchmark": args.label,
        "date": str(date.today()),
        "gpu": args.gpu,
        "commit": args.commit,
        "config": args.config,
        "steps": len(rows),
        "timed_steps": len(timed),
        "loss_first": rows[0]["loss"],
        "loss_last": rows[-1]["loss"],
        "skipped_steps": sum(bool(r.get("skipped")) for r in rows),
    }
    for k in keys:
        values = [r[k] for r in timed if k in r]
        if values:
            summary[f"median_{k}"] = statistics.median(values)
    print(json.dumps(summary, indent=2))
    save(summary, args.out)


if __name__ == "__main__":
    main()
