"""A fault-injection run of ``moe pipeline`` (issue 21, run 7; ``multi_gpu.py pipeline-kill``,
the call x8-pipeline): the pipeline runs until training has passed ``--kill-at`` steps, then
one training rank is SIGKILLed; the train stage must relaunch training from its newest
checkpoint and the pipeline finish; a second run of the same pipeline must find it done, and
the export load in ``transformers``. On a CPU machine with ``--config-name pretrain-tiny`` (two
gloo ranks, one killed after step 60 or 62 in two tries): the stage relaunched from step 50 and
finished, the rerun skipped every stage as verified and ``transformers`` loaded the export;
2 min 40-46 s in all.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def newest_step(run_dir: Path) -> int:
    """The last step the train stage logged whole (-1 before any)."""
    metrics = run_dir / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):  # a line still being written
            continue
    return -1


def training_ranks(run_dir: Path) -> list[int]:
    """Process ids of the train stage's ranks: their command line names the stage's config
    (``moe_core.cli train --config RUN_DIR/train/config.json``); torchrun's does too, and is
    left out."""
    marker = str(run_dir / "train" / "config.json").encode()
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and b"torch.distributed.run" not in cmdline:
            ranks.append(int(pid))
    return sorted(ranks)


def loads_in_transformers(hf_dir: Path) -> dict:
    """Whether ``transformers`` loads the exported checkpoint (in a child process: 14 GB)."""
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM as M; "
        "m = M.from_pretrained(sys.argv[1], dtype=torch.bfloat16); "
        "print(sum(p.numel() for p in m.parameters()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(hf_dir)], capture_output=True, text=True, timeout=600
    )
    params = done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else None
    return {"rc": done.returncode, "parameters": params, "stderr_tail": done.stderr[-400:]}


def pipeline_kill(
    out: Path, kill_at: int, overrides: list[str], timeout_s: float, env: dict[str, str]
) -> dict:
    """``moe pipeline`` until training has logged ``kill_at`` steps, then one rank SIGKILLed:
    the train stage relaunches training from its newest checkpoint (``cluster.launch_retries``;
    with none left the run fails and the second run resumes it). Then the same pipeline again,
    which must find every stage done (or finish it), and the export loaded in ``transformers``.
    Both runs' output goes to ``pipeline_{first,second}.log`` in ``out``; the record holds the
    kill, the stage's relaunch lines, the exit codes and the load. ``env`` is added to the
    pipeline's environment."""
    run_dir = out / "pipeline"
    cmd = [sys.executable, "-m", "moe_core.cli", "pipeline", *overrides, f"run_dir={run_dir}"]
    env = {**os.environ, **env}
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / "pipeline_first.log", out / "pipeline_second.log"]
    with logs[0].open("w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        killed = None
        while first.poll() is None and time.time() - start < timeout_s:
            step = newest_step(run_dir)
            if killed is None and step >= kill_at and (ranks := training_ranks(run_dir)):
                killed = {"pid": ranks[-1], "ranks": len(ranks), "after_step": step}
                os.kill(ranks[-1], signal.SIGKILL)
            time.sleep(1)
        if first.poll() is None:
            first.kill()
    record = {"command": cmd[2:], "killed": killed, "first_rc": first.wait()}
    resumed_at = time.time()
    with logs[1].open("w") as log:
        second = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    text = logs[0].read_text() + logs[1].read_text()
    record |= {
        "relaunched": [line[-200:] for line in text.splitlines() if "launching again" in line],
        "resumed": [line[-200:] for line in text.splitlines() if "resumed from" in line],
        "second_rc": second.returncode,
        "second_seconds": time.time() - resumed_at,
        "last_step": newest_step(run_dir),
        "hf_load": loads_in_transformers(run_dir / "hf") if second.returncode == 0 else None,
        "seconds": time.time() - start,
    }
    return record


def run(
    out: Path, kill_at: int, overrides: list[str], timeout_s: float, env: dict[str, str]
) -> int:
    """``pipeline_kill``, its record written to ``out/pipeline_kill.json`` and printed; 0 when a
    rank was killed, training relaunched, the rerun finished and the export loaded."""
    record = pipeline_kill(out, kill_at, overrides, timeout_s, env)
    (out / "pipeline_kill.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    resumed = record["relaunched"] or record["first_rc"] != 0
    loaded = record["hf_load"] is not None and record["hf_load"]["rc"] == 0
    ok = record["killed"] and resumed and record["second_rc"] == 0 and loaded
    return 0 if ok else 1
