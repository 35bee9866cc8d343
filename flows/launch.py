"""How the train stage launches ``moe train``: the checks before any stage and the retried
attempts of the launcher of ``cluster.kind`` (``flows.launchers``; what a cluster runs is
rendered by ``flows.render``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flows.launchers import Attempt, Launcher
from moe_core.config import RunConfig
from moe_core.errors import RunFailedError
from moe_core.plan import (
    check_cluster,
    check_memory,
    check_resources,
    check_shrink_fits,
    host_memory_bytes,
    plan,
    plan_text,
)
from moe_core.train.metrics import CHECKPOINT_LOG
from moe_core.train.watchdog import hang_since

if TYPE_CHECKING:
    from flows.tracking import Tracker

Logger = logging.Logger | logging.LoggerAdapter


def check_launchable(run: RunConfig, launcher: type[Launcher], logger: Logger) -> None:
    """Refuse, before any stage, a layout the cluster cannot run or a launch this machine cannot
    make: one sentence, plus the plan in the log (parameters, GPUs, memory per GPU)."""
    check_cluster(run)
    report = plan(run)
    logger.info("plan for %s:\n%s", run.model.name, plan_text(report))
    c = run.cluster
    if c.kind == "local":  # this machine's GPUs
        gpus = torch.cuda.device_count()
        memory = None
        if torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory / 2**30
    else:  # the nodes the cluster config describes
        gpus, memory = c.nodes * c.gpus_per_node, c.gpu_memory_gib or None
    check_resources(run, gpus, memory)
    check_shrink_fits(run)
    if c.kind == "local" and not c.gpus_per_node:  # CPU processes: this machine's memory
        check_memory(run, host_memory_bytes(), None)
    launcher.check(run)


def preflight(run: RunConfig, logger: Logger) -> None:
    """Everything a pipeline refuses before its first stage, given its resolved config
    (``flows.layout.resolve``): the launch (``check_launchable``) and the downstream task
    files. ``moe pipeline`` calls it before Prefect starts, the flow again for a deployment
    run."""
    from flows.launchers import launcher_class

    check_launchable(run, launcher_class(run), logger)
    if run.eval.tasks:  # the task files are there and hold every configured task
        from moe_core.eval.tasks import load_tasks

        load_tasks(run.eval)


class MetricsSender:
    """While training runs, its logs (``metrics.jsonl``, ``checkpoints.jsonl``) go to MLflow
    every few seconds (and once more at the end)."""

    def __init__(
        self, tracker: Tracker, run_id: str | None, *logs: Path, every_s: float = 5.0
    ) -> None:
        self.tracker, self.run_id, self.logs, self.every_s = tracker, run_id, logs, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _send(self) -> None:
        for path in self.logs:
            self.tracker.send_metrics_file(self.run_id, path)

    def _loop(self) -> None:
        while not self.stop.wait(self.every_s):
            self._send()

    def __enter__(self) -> MetricsSender:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self._send()


def newest_checkpoint(train_dir: Path) -> str:
    """The name of the checkpoint an attempt resumes from (or "no checkpoint")."""
    from moe_core.train.checkpoint import newest_verified

    found = newest_verified(train_dir / "checkpoints")
    return found.name if found is not None else "no checkpoint"


# A run stopped to grow back onto all its nodes is relaunched without spending a retry; after
# this many such relaunches the launcher grows back no more (nodes that come and go, or idle
# nodes the job never gets, must not relaunch it forever).
MAX_GROW_BACKS = 10


def _context(attempt: Attempt) -> str:
    """What the log and the stage's error add after the relaunch (see ``Attempt.context``)."""
    return f"; {attempt.context}" if attempt.context else ""


def launch_attempts(
    launcher: Launcher, tracker: Tracker, run_id: str | None, logger: Logger
) -> list[Attempt]:
    """Launch training until an attempt finishes, at most ``1 + cluster.launch_retries`` times
    (an attempt stopped to grow back onto all ``cluster.nodes`` does not count); every attempt
    resumes from the newest valid checkpoint. Each attempt (job id, submitted script, state,
    the nodes, dp and accumulation it trained at) is added to ``train/launches.json`` and the
    stage's MLflow params."""
    run, train_dir = launcher.run, launcher.train_dir
    record = train_dir / "launches.json"
    history = json.loads(record.read_text()) if record.is_file() else []
    before = len(history)  # attempts of earlier flow runs keep their numbers
    tries = 1 + run.cluster.launch_retries
    attempts: list[Attempt] = []
    failed = grown = 0
    while failed < tries:
        number = before + len(attempts) + 1
        if attempts and attempts[-1].grow:
            logger.warning(
                "%s; launching again, asking for all %d nodes, resuming from %s",
                attempts[-1].detail,
                run.cluster.nodes,
                newest_checkpoint(train_dir),
            )
        elif attempts:
            logger.warning(
                "%s; launching again (%d of %d), resuming from %s%s",
                attempts[-1].detail,
                failed + 1,
                tries,
                newest_checkpoint(train_dir),
                _context(attempts[-1]),
            )
        began = time.time()
        logs = (train_dir / "metrics.jsonl", train_dir / CHECKPOINT_LOG)
        with MetricsSender(tracker, run_id, *logs):
            attempt = launcher.attempt(number)
        hang = None if attempt.ok else hang_since(train_dir, began)
        if hang is not None:  # the watchdog ended it: say where it hung
            attempt = dataclasses.replace(attempt, detail=f"{attempt.detail} ({hang})")
        attempts.append(attempt)
        history.append(attempt.record())
        record.write_text(json.dumps(history, indent=1))
        params = {"kind": run.cluster.kind, "job_id": attempt.job_id, "state": attempt.state}
        if attempt.script is not None:
            params["script"] = attempt.script
        if hang is not None:
            params["hang"] = hang
        if attempt.nodes is not None:
            params |= {"nodes": attempt.nodes, "dp": attempt.dp}
            params["accumulation"] = attempt.accumulation
        if attempt.grow:
            params["grow"] = True
        tracker.params(run_id, {"launch": {f"attempt_{number}": params}})
        if attempt.ok:
            return attempts
        if attempt.grow:  # stopped on purpose: never a failed attempt
            grown += 1
            if grown >= MAX_GROW_BACKS:  # nodes that come and go: stay on the ones it gets
                launcher.grow_back = False
                launcher.log(
                    f"{grown} relaunches to grow back to {run.cluster.nodes} nodes: no more "
                    "growing back in this stage run (a job that starts on fewer nodes trains "
                    "on them to the end)"
                )
        else:
            failed += 1
    last = attempts[-1]
    raise RunFailedError(
        f"{last.detail}{'' if last.context else ' (see the log above)'} on attempt {tries} of "
        f"{tries} (cluster.launch_retries={run.cluster.launch_retries}); a rerun resumes from "
        f"{newest_checkpoint(train_dir)}{_context(last)}."
    )
