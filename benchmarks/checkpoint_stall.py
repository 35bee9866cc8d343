"""What a checkpoint costs ``moe train`` on one GPU, synchronous and async (issue 43, item 4).

    python benchmarks/checkpoint_stall.py --out checkpoint_stall_h200.json   # one H200
    python benchmarks/checkpoint_stall.py --smoke                              # anywhere (CPU)

OLMoE-1B-7B (``--layers`` of its 16, pure-bf16, synthetic tokens, sequence 4096, micro-batch 4:
the one-GPU shape of the other benchmarks) trained by ``moe train`` in a child process once per
mode (``train.async_checkpoint`` false, then true), in one call: ``--checkpoints`` checkpoints
``--every`` steps apart, then ``--tail`` more steps. Each run's folder is deleted before the next
(a full checkpoint is about 41 GB; the disk must hold two only with ``--checkpoints 2``); they
go under ``--dir`` (default: this checkout, on disk; a filesystem in memory is refused).

Recorded per mode, from its ``metrics.jsonl`` and ``checkpoints.jsonl``: the median step time
over the steps before the first checkpoint (after ``--warmup``), and per checkpoint the
trainer's own figures (``checkpoint/stall_s``: the loop blocked for it; ``durable_s``; bytes;
GB/s) beside two the trainer does not compute: ``wall_blocked_s``, the time between the step
lines before and after the save, as this script saw them appear, less the later step's own time
(the save call; the trainer restarts its step clock after a save, so no step's time holds it),
and ``later_excess_s``, what the steps after it took over the median up to the next checkpoint
(an async save's collection, when it happens in the loop, and the background write's
interference). ``moe plan``'s bytes per rank and seconds at ``cluster.storage_write_gbps`` for
the same config stand beside the measured ones, and its seconds at the measured rate.

``--smoke`` runs the same harness on the CPU with the tiny model in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKPOINT_LOG = "checkpoints.jsonl"  # moe_core.train.metrics.CHECKPOINT_LOG
MODES = ("false", "true")  # train.async_checkpoint
PREFIX = ".checkpoint_stall-"  # a run's folder under --dir


def overrides(args: argparse.Namespace, mode: str) -> list[str]:
    """The ``moe train`` (and ``moe plan``) overrides of one mode's run."""
    if args.smoke:
        shape = [
            "model=tiny",
            "precision=pure-bf16",
            "train.seq_len=32",
            "train.micro_batch_size=2",
            "train.global_batch_size=8",
            "cluster=local-cpu",
        ]
    else:
        shape = [
            "model=olmoe-1b-7b",
            f"model.n_layers={args.layers}",
            "precision=pure-bf16",
            "train.seq_len=4096",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "cluster=local-gpu",
            "cluster.procs_per_node=1",
            "cluster.gpus_per_node=1",
        ]
    return [
        *shape,
        "data=synthetic",
        "train.eval_batches=1",
        f"train.steps={args.every * args.checkpoints + args.tail}",
        f"train.checkpoint_every={args.every}",
        f"train.async_checkpoint={mode}",
        "train.checkpoint_at_end=false",
        "train.keep_last=1",
        "train.log_every=1",
        "train.save_model=false",
        "train.resume=false",
        *args.set,
    ]


def planned(args: argparse.Namespace) -> dict:
    """``moe plan``'s checkpoint for the run: bytes per rank, seconds at the stated rate."""
    from moe_core.compose import compose_run
    from moe_core.plan import plan

    run = compose_run(overrides(args, "false"))
    c = plan(run).checkpoint
    return {"bytes_per_rank": c.per_rank, "seconds": c.seconds, "write_gbps": c.write_gbps}


def filesystem(path: str) -> str:
    """The type of the filesystem ``path`` is on (``/proc/mounts``), or "unknown"."""
    where, kind = "", "unknown"
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return kind
    target = str(Path(path).resolve())
    for line in mounts:
        point, fs = line.split()[1:3]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > len(where):
            where, kind = point, fs
    return kind


def refusal(args: argparse.Namespace, plan_bytes: int) -> str | None:
    """Why this cannot run here (one sentence), or None."""
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        return f"--modes {args.modes}: {unknown[0]} is not one of {', '.join(MODES)}."
    if args.tail >= args.every:
        return f"--tail {args.tail} must be below --every {args.every} (no checkpoint in it)."
    if args.warmup >= args.every - 1:
        return f"--warmup {args.warmup} leaves no timed step before the first checkpoint."
    if not args.smoke and filesystem(args.dir) in ("tmpfs", "ramfs"):
        return f"--dir {args.dir} is in memory ({filesystem(args.dir)}): pass --dir on a disk."
    held = 2 if args.checkpoints > 1 else 1  # keep_last=1: the previous one until the next is
    need = held * plan_bytes * 1.05 + 2**30
    free = shutil.disk_usage(args.dir).free
    if free < need:
        return (
            f"{args.dir} has {free / 1e9:.1f} GB free and the runs need {need / 1e9:.1f} GB "
            f"({held} checkpoint(s) of {plan_bytes / 1e9:.1f} GB): pass --dir on a larger disk "
            "or fewer --layers."
        )
    return None


def watched(cmd: list[str], out: Path) -> tuple[int, str, dict[int, float]]:
    """Run ``cmd``; its exit code, output, and when each step's line appeared in
    ``metrics.jsonl`` (this process's clock, polled every 20 ms)."""
    env = {**os.environ, "COLUMNS": "200"}
    log = out.parent / f"{out.name}.log"
    seen: dict[int, float] = {}
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
        offset, partial = 0, ""
        while True:
            finished = proc.poll() is not None
            metrics = out / "metrics.jsonl"
            if metrics.is_file():
                with metrics.open() as f:
                    f.seek(offset)
                    partial += f.read()
                    offset = f.tell()
                now = time.perf_counter()
                *lines, partial = partial.split("\n")
                for line in lines:
                    if line.strip():
                        seen.setdefault(json.loads(line)["step"], now)
            if finished:
                break
            time.sleep(0.02)
    text = log.read_text()
    log.unlink()
    return proc.returncode, text, seen


def measure(args: argparse.Namespace, mode: str, plan: dict) -> dict:
    """One mode's run and its figures (see the module's docstring)."""
    out = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{mode}-", dir=args.dir))
    try:
        cmd = [sys.executable, "-m", "moe_core.cli", "train", *overrides(args, mode)]
        code, text, seen = watched([*cmd, f"out_dir={out}"], out)
        if code != 0:
            return {"async": mode == "true", "error": text[-3000:]}
        steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        costs = [json.loads(x) for x in (out / CHECKPOINT_LOG).read_text().splitlines()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    times = {r["step"]: r["step_time_s"] for r in steps}
    median = statistics.median(times[i] for i in range(args.warmup, args.every))
    marks = [c["step"] for c in costs] + [len(steps)]
    rows = []
    for c, following in zip(costs, marks[1:], strict=True):
        n = c["step"]  # saved after step line n - 1, before step line n
        gap = seen[n] - seen[n - 1] if n in seen and n - 1 in seen else None
        excess = sum(times[i] - median for i in range(n + 1, min(following, len(steps))))
        bytes_ = c["checkpoint/bytes"]
        rows.append(
            {
                "step": n,
                "stall_s": c["checkpoint/stall_s"],
                # of it, waiting for the write (at the next save or the end): the rest is the
                # save call, gathering and copying to the host
                "wait_s": c.get("checkpoint/wait_s"),
                "durable_s": c["checkpoint/durable_s"],
                "bytes": bytes_,
                "write_gbps": c["checkpoint/write_gbps"],
                "wall_blocked_s": None if gap is None else gap - times[n],
                "next_step_over_median_s": times[n] - median if n in times else None,
                "later_excess_s": excess,
                "steps_after_s": sum(times[i] for i in range(n, len(steps))),
                "bytes_over_plan": bytes_ / plan["bytes_per_rank"],
                "plan_s_at_measured_rate": plan["bytes_per_rank"]
                / (bytes_ / c["checkpoint/durable_s"]),
            }
        )
    return {
        "async": mode == "true",
        "steps": len(steps),
        "median_step_s": median,
        "step_times_s": [times[i] for i in sorted(times)],
        "checkpoints": rows,
        "printed": [x.strip() for x in text.splitlines() if x.startswith("checkpoint step ")],
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=16, help="of OLMoE-1B-7B's 16")
    p.add_argument("--every", type=int, default=50, help="train.checkpoint_every")
    p.add_argument("--checkpoints", type=int, default=1, help="per mode")
    p.add_argument("--tail", type=int, default=49, help="steps after the last checkpoint")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    p.add_argument("--modes", default=",".join(MODES), help="train.async_checkpoint values")
    p.add_argument(
        "--dir", default=str(ROOT), help="where the runs write (a folder each, deleted after)"
    )
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few steps")
    p.add_argument("--set", action="append", default=[], help="another override, repeatable")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.smoke:
        args.every, args.tail, args.warmup = min(args.every, 4), min(args.tail, 2), 1
    plan = planned(args)
    for stale in Path(args.dir).glob(PREFIX + "*"):  # left by a run of this script cut short
        print(f"removing {stale}, left by an earlier run of this script", flush=True)
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    problem = refusal(args, plan["bytes_per_rank"])
    if problem is not None:
        raise SystemExit(problem)
    from report import save, stamp

    result = {
        "benchmark": "checkpoint_stall",
        **stamp(args.commit, gpu=None if not args.smoke else "cpu (smoke)"),
        "overrides": overrides(args, "MODE"),
        "filesystem": filesystem(args.dir),
        "plan": plan,
        "runs": {},
    }
    for mode in args.modes.split(","):
        r = measure(args, mode, plan)
        result["runs"]["async" if mode == "true" else "sync"] = r
        print(json.dumps({k: v for k, v in r.items() if k != "step_times_s"}), flush=True)
    save(result, args.out)
    if any("error" in r for r in result["runs"].values()):
        raise SystemExit("a run failed (its output is in the report above)")


if __name__ == "__main__":
    main()
