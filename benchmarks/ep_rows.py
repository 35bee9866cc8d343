"""All-to-all rows per token and step time with group-limited routing off and on (issue 38).

    python benchmarks/ep_rows.py --gpus 8 --groups 8 --top-k-groups 4 --out FILE -- OVERRIDES

Runs ``moe train`` twice under torchrun on ``--gpus`` GPUs with the Hydra OVERRIDES (which set
``parallel.ep`` and the all-to-all dispatcher): plain top-k, then with ``model.n_expert_groups``
and ``model.top_k_groups``. From each run's ``metrics.jsonl``, after ``--warmup`` steps: the
median ``ep_rows_per_token`` (rows a token really sent to other expert-parallel ranks per MoE
layer, summed from the dispatcher's split sizes over every rank) and the median step time;
beside them ``moe plan``'s figures for the same config: the expected rows per token under
uniform routing, the bound on ranks and nodes a token reaches and the all-to-all's bytes and
predicted time. Learned routing is not uniform, so measured rows may differ from the plan's;
the bound may not.

On one node every row travels over NVLink. On several (EP across nodes) the same two runs
would add what the node bound is for: the rows crossing the network (the plan's
``cross_node_rows``) and the all-to-all's share of the step at the NIC's rate.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from report import save, stamp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def group_overrides(groups: int, top_k_groups: int) -> list[str]:
    return [f"model.n_expert_groups={groups}", f"model.top_k_groups={top_k_groups}"]


def planned(overrides: list[str]) -> dict:
    """``moe plan``'s rows, bound and all-to-all for the run ``overrides`` compose."""
    from moe_core.compose import compose_run
    from moe_core.plan import plan, step_time

    p = plan(compose_run(overrides))
    r = p.comm.reach
    return {
        "rows_per_token": r.rows_per_token,
        "max_ranks": r.max_ranks,
        "max_nodes": r.max_nodes,
        "cross_node_rows": r.cross_node_rows,
        "all_to_all_gib_per_step": p.comm.all_to_all / 2**30,
        "all_to_all_s": step_time(p).all_to_all,
        "step_s": step_time(p).step,
    }


def measured(gpus: int, overrides: list[str], warmup: int) -> dict:
    """``moe train`` under torchrun; the medians of its logged figures after warm-up."""
    with tempfile.TemporaryDirectory() as out:
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command = [*run, f"--nproc-per-node={gpus}", "-m", "moe_core.cli", "train"]
        command += [*overrides, "train.log_every=1", f"out_dir={out}"]
        done = subprocess.run(command, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
        if done.returncode != 0:
            raise SystemExit(f"moe train {' '.join(overrides)} failed ({done.returncode})")
        rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in rows if r["step"] >= warmup]
    return {
        "steps_timed": len(timed),
        "ep_rows_per_token": [r["ep_rows_per_token"] for r in timed],
        "median_ep_rows_per_token": statistics.median(r["ep_rows_per_token"] for r in timed),
        "median_step_s": statistics.median(r["step_time_s"] for r in timed),
        "median_tflops": statistics.median(r["model_tflops_per_gpu"] for r in timed),
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="model.n_expert_groups when on")
    p.add_argument("--top-k-groups", type=int, default=4, help="model.top_k_groups when on")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the medians")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    p.add_argument("overrides", nargs="*", help="after --: the run's Hydra overrides")
    return p


def main() -> None:
    args = parser().parse_args()
    cases = {
        "top_k": args.overrides,
        "group_limited": [*args.overrides, *group_overrides(args.groups, args.top_k_groups)],
    }
    report = {**stamp(args.commit), "gpus": args.gpus, "overrides": args.overrides}
    for name, overrides in cases.items():
        report[name] = {
            "plan": planned(overrides),
            "run": measured(args.gpus, overrides, args.warmup),
        }
        print(name, json.dumps(report[name]), flush=True)
    save(report, args.out)


if __name__ == "__main__":
    main()
