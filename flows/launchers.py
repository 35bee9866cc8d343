"""How the train stage starts training and follows it: one launcher per ``cluster.kind``.

Every launcher does the same four things for one attempt: start the training of the resolved
config (``train/config.json``), stream its rank-0 log line by line, wait for its end, and stop it
when the attempt is left early (the flow run cancelled, the stage timed out, the job never
started). ``local`` runs ``torchrun`` as a child of the flow; ``slurm`` submits the batch script
``flows.launch`` renders with ``sbatch``, follows it through ``squeue``/``sacct`` and ends it with
``scancel``; ``kubernetes`` creates the Indexed Job and headless Service ``flows.launch`` builds
through the ``kubernetes`` client, follows the Job and its pods, and deletes the Job. Retries
(``cluster.launch_retries``) are the train stage's: it calls ``attempt`` again and the trainer
resumes from the newest valid checkpoint in its ``out_dir``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from flows.launch import kubernetes_objects, render_kubernetes, render_slurm
from moe_core.config import ConfigError, RunConfig
from moe_core.errors import RunFailedError

Log = Callable[[str], None]

# Slurm job states (squeue %T, sacct State): still queued, and ended.
SLURM_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}
SLURM_ENDED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "REVOKED",
    "SPECIAL_EXIT",
}
LOST_AFTER_POLLS = 10  # a job neither squeue nor sacct knows for this many polls is lost


@dataclass
class Attempt:
    """How one launch ended: its number, its id (a pid or a job id), the file that was
    submitted (None for a local child), its final state and whether training finished."""

    number: int
    job_id: str
    script: str | None
    state: str
    ok: bool
    detail: str  # one clause for the log and the stage's error, e.g. "slurm job 7 ended FAILED"

    def record(self) -> dict[str, Any]:
        return asdict(self)


class LaunchTimeoutError(RunFailedError):
    """The job did not start within ``cluster.start_timeout_s``; it was cancelled."""


class Launcher(ABC):
    """Starts one attempt of the training in ``train_dir`` and follows it to its end."""

    kind: ClassVar[str]

    def __init__(self, run: RunConfig, train_dir: Path, log: Log) -> None:
        self.run, self.train_dir, self.log = run, train_dir, log
        self.config_path = train_dir / "config.json"

    @classmethod
    @abstractmethod
    def check(cls, run: RunConfig) -> None:
        """Refuse, in one sentence, a launch this machine cannot make (before any stage)."""

    def forward(self, lines: list[str]) -> None:
        """Log the lines of the training's output worth reading (progress bars are dropped)."""
        for raw in lines:
            line = raw.rstrip()
            if line and "━" not in line:
                self.log(line)

    @abstractmethod
    def attempt(self, number: int) -> Attempt:
        """Start attempt ``number``, stream its log, return when it has ended; stop it first
        when left by an exception (cancel, timeout)."""


def _environment() -> dict[str, str]:
    """The trainer's environment: this one, unbuffered, one OpenMP thread unless set."""
    return {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


# ---- local: torchrun as a child ---------------------------------------------------------


def train_command(config_path: Path, nproc: int) -> list[str]:
    """One node's ``torchrun --standalone`` of ``moe train --config``."""
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [
        *runner,
        f"--nproc-per-node={nproc}",
        "-m",
        "moe_core.cli",
        "train",
        "--config",
        str(config_path),
    ]


def _stop_child(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to torchrun (it ends its ranks), SIGKILL after ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class LocalLauncher(Launcher):
    """``torchrun --standalone`` on this machine, its output read from a pipe."""

    kind = "local"

    @classmethod
    def check(cls, run: RunConfig) -> None:
        if run.cluster.nodes != 1:
            raise ConfigError(
                f"cluster.nodes={run.cluster.nodes} is not allowed with cluster.kind='local': "
                "1, since a local cluster is this machine (more nodes: cluster=slurm)."
            )

    def attempt(self, number: int) -> Attempt:
        cmd = train_command(self.config_path, self.run.cluster.procs_per_node)
        self.log("launching: " + " ".join(cmd))
        proc = subprocess.Popen(
            cmd,
            env=_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            assert proc.stdout is not None
            for raw in proc.stdout:
                self.forward([raw])
            proc.wait()
        finally:
            _stop_child(proc)
        code = proc.returncode
        return Attempt(
            number,
            str(proc.pid),
            None,
            f"exit {code}",
            code == 0,
            f"training exited with code {code}",
        )


# ---- slurm: sbatch, squeue/sacct, scancel --------------------------------------------------


class _Tail:
    """New complete lines of a growing file (from the start again if it was truncated)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, ""

    def lines(self, final: bool = False) -> list[str]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self.offset:  # a requeued job starts its log again
            self.offset, self.partial = 0, ""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        text = self.partial + data.decode(errors="replace")
        *complete, self.partial = text.split("\n")
        if final and self.partial:
            complete.append(self.partial)
            self.partial = ""
        return complete


def _slurm(args: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """A Slurm query or command; one that hangs (a busy controller) reads as a failed call,
    so the follow loop asks again instead of giving the job up."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(args, 124, "", f"no answer within {timeout_s:g} s")


class SlurmLauncher(Launcher):
    """``sbatch`` of ``train/slurm.sbatch`` (rendered by ``flows.launch.render_slurm``), state
    from ``squeue`` while the job is queued or running and from ``sacct`` once it has left,
    the job's log (``train/slurm-<id>.out``: the trainer prints on rank 0) streamed, and
    ``scancel`` when the attempt is left before the job ended."""

    kind = "slurm"

    @classmethod
    def check(cls, run: RunConfig) -> None:
        missing = [t for t in ("sbatch", "squeue", "sacct", "scancel") if not shutil.which(t)]
        if missing:
            raise ConfigError(
                f"cluster.kind='slurm' is not allowed on this machine: it submits with sbatch and "
                f"follows with squeue, sacct and scancel, and {' and '.join(missing)} "
                f"{'is' if len(missing) == 1 else 'are'} not on PATH (run the pipeline on a "
                "Slurm login node, infra/README.md)."
            )

    @property
    def script_path(self) -> Path:
        return self.train_dir / "slurm.sbatch"

    def submit(self) -> str:
        """Write the rendered script and ``sbatch`` it; returns the job id."""
        script = render_slurm(self.run, str(self.train_dir), str(self.config_path))
        self.script_path.write_text(script)
        done = subprocess.run(
            ["sbatch", "--parsable", str(self.script_path)],
            env=_environment(),  # sbatch hands the job this environment (--export=ALL)
            capture_output=True,
            text=True,
            timeout=120,
        )
        job_id = done.stdout.strip().split(";")[0]
        if done.returncode != 0 or not job_id.isdigit():
            why = (done.stderr or done.stdout).strip().splitlines()
            raise RunFailedError(
                f"sbatch {self.script_path} failed (exit {done.returncode}): "
                f"{why[-1] if why else 'no output'}."
            )
        return job_id

    def state(self, job_id: str) -> str | None:
        """The job's state: squeue's while it is known there, then sacct's; None if neither
        knows it (yet, or any more)."""
        queue = _slurm(["squeue", "--noheader", "--jobs", job_id, "--format=%T"])
        state = (
            queue.stdout.strip().split()[0]
            if queue.returncode == 0 and queue.stdout.strip()
            else ""
        )
        if state:
            return state
        acct = _slurm(
            [
                "sacct",
                "--noheader",
                "--allocations",
                "--parsable2",
                "--jobs",
                job_id,
                "--format=State",
            ]
        )
        words = acct.stdout.split() if acct.returncode == 0 else []
        return words[0] if words else None  # "CANCELLED by 0" -> CANCELLED

    def cancel(self, job_id: str) -> None:
        self.log(f"slurm job {job_id}: cancelling (scancel {job_id})")
        done = _slurm(["scancel", job_id])
        if done.returncode != 0:
            self.log(f"scancel {job_id} failed: {(done.stderr or done.stdout).strip()}")

    def attempt(self, number: int) -> Attempt:
        c = self.run.cluster
        job_id = self.submit()
        self.log(f"slurm job {job_id} submitted: {self.script_path}")
        tail = _Tail(self.train_dir / f"slurm-{job_id}.out")
        submitted = time.monotonic()
        started, unknown, ended = False, 0, False
        state: str | None = None
        try:
            while True:
                previous, state = state, self.state(job_id)
                self.forward(tail.lines())
                if state != previous and state is not None:
                    self.log(f"slurm job {job_id}: {state}")
                unknown = unknown + 1 if state is None else 0
                if state in SLURM_ENDED or unknown >= LOST_AFTER_POLLS:
                    ended = state in SLURM_ENDED
                    break
                if state is not None and state not in SLURM_QUEUED:
                    started = True
                waited = time.monotonic() - submitted
                if not started and c.start_timeout_s and waited > c.start_timeout_s:
                    raise LaunchTimeoutError(
                        f"slurm job {job_id} did not start within cluster.start_timeout_s="
                        f"{c.start_timeout_s:g} s (still {state or 'unknown to squeue'}), so it "
                        "was cancelled: check the partition and queue (squeue), or raise "
                        "cluster.start_timeout_s."
                    )
                time.sleep(c.poll_s)
        finally:
            if not ended:
                self.cancel(job_id)
        self.forward(tail.lines(final=True))
        final = state if ended else "LOST"
        detail = f"slurm job {job_id} ended {final}"
        if not ended:
            detail = f"slurm job {job_id} left the queue without an accounting record (sacct)"
        if final == "CANCELLED":
            raise RunFailedError(
                f"slurm job {job_id} was cancelled outside the pipeline (scancel), so it is not "
                "resubmitted: run the pipeline again to resume from the newest checkpoint."
            )
        return Attempt(number, job_id, str(self.script_path), final, final == "COMPLETED", detail)


# ---- kubernetes: an Indexed Job and a headless Service through the client -------------------


class KubernetesLauncher(Launcher):
    """A headless Service (created once) and, per attempt, an Indexed Job ``<run id>-<attempt>``
    built by ``flows.launch.kubernetes_objects`` (its YAML kept as
    ``train/kubernetes-<attempt>.yaml``), created through the ``kubernetes`` client; the Job's
    status and its pods' phases followed, pod 0's log streamed, the Job deleted when the
    attempt is left before it ended. ``apis`` (core, batch) replaces the client's APIs."""

    kind = "kubernetes"

    def __init__(self, run: RunConfig, train_dir: Path, log: Log, apis: tuple | None = None):
        super().__init__(run, train_dir, log)
        self._apis = apis

    @classmethod
    def check(cls, run: RunConfig) -> None:
        kubernetes_objects(run, run.out_dir, f"{run.out_dir}/config.json")  # paths, package
        _load_kube_config()

    @property
    def apis(self) -> tuple:
        if self._apis is None:
            from kubernetes import client

            _load_kube_config()
            self._apis = (client.CoreV1Api(), client.BatchV1Api())
        return self._apis

    def state(self, name: str) -> tuple[str, Any]:
        """COMPLETED, FAILED, RUNNING (a pod has started) or PENDING, and pod 0 (or None)."""
        core, batch = self.apis
        ns = self.run.cluster.namespace
        status = batch.read_namespaced_job_status(name, ns).status
        conditions = {c.type: c.status for c in (status.conditions or [])}
        pods = core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
        first = next((p for p in pods if _completion_index(p) == "0"), None)
        if (
            conditions.get("Complete") == "True"
            or (status.succeeded or 0) >= self.run.cluster.nodes
        ):
            return "COMPLETED", first
        if conditions.get("Failed") == "True" or (status.failed or 0) > 0:
            return "FAILED", first
        started = any(p.status.phase in ("Running", "Succeeded", "Failed") for p in pods)
        return ("RUNNING" if started else "PENDING"), first

    def cancel(self, name: str) -> None:
        self.log(f"kubernetes job {name}: deleting it (cancel)")
        _, batch = self.apis
        batch.delete_namespaced_job(
            name, self.run.cluster.namespace, propagation_policy="Foreground"
        )

    def attempt(self, number: int) -> Attempt:
        from kubernetes.client.exceptions import ApiException

        c = self.run.cluster
        core, batch = self.apis
        service, job = kubernetes_objects(
            self.run, str(self.train_dir), str(self.config_path), number
        )
        name = job.metadata.name
        manifest = self.train_dir / f"kubernetes-{number}.yaml"
        manifest.write_text(
            render_kubernetes(self.run, str(self.train_dir), str(self.config_path), number)
        )
        try:
            core.create_namespaced_service(c.namespace, service)
        except ApiException as err:
            if err.status != 409:  # 409: the Service of an earlier attempt is there already
                raise
        batch.create_namespaced_job(c.namespace, job)
        self.log(f"kubernetes job {name} created in namespace {c.namespace}: {manifest}")
        created, printed, started, ended = time.monotonic(), 0, False, False
        state, previous, first = "PENDING", "", None
        try:
            while True:
                state, first = self.state(name)
                printed = self._stream(first, printed)
                if state != previous:
                    self.log(f"kubernetes job {name}: {state}")
                    previous = state
                if state in ("COMPLETED", "FAILED"):
                    ended = True
                    break
                started = started or state == "RUNNING"
                waited = time.monotonic() - created
                if not started and c.start_timeout_s and waited > c.start_timeout_s:
                    raise LaunchTimeoutError(
                        f"kubernetes job {name} did not start within cluster.start_timeout_s="
                        f"{c.start_timeout_s:g} s (no pod running), so it was deleted: check "
                        "the pods' events (kubectl describe pods), or raise "
                        "cluster.start_timeout_s."
                    )
                time.sleep(c.poll_s)
        finally:
            if not ended:
                self.cancel(name)
        detail = f"kubernetes job {name} ended {state}"
        return Attempt(number, name, str(manifest), state, state == "COMPLETED", detail)

    def _stream(self, pod: Any, printed: int) -> int:
        """Log the lines of pod 0 past the first ``printed``; returns how many are logged."""
        if pod is None or pod.status.phase == "Pending":
            return printed
        core, _ = self.apis
        text = core.read_namespaced_pod_log(pod.metadata.name, self.run.cluster.namespace)
        lines = (text or "").splitlines()
        self.forward(lines[printed:])
        return max(printed, len(lines))


def _completion_index(pod: Any) -> str | None:
    key = "batch.kubernetes.io/job-completion-index"
    meta = pod.metadata
    return (meta.labels or {}).get(key) or (meta.annotations or {}).get(key)


def _load_kube_config() -> None:
    """The cluster's credentials: the pod's service account, else the kubeconfig."""
    from kubernetes import config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        try:
            config.load_kube_config()
        except (config.ConfigException, OSError):
            raise ConfigError(
                "cluster.kind='kubernetes' is not allowed on this machine: it has no in-cluster "
                "service account and no usable kubeconfig (run the pipeline where kubectl "
                "reaches the cluster, e.g. a worker of a Kubernetes work pool)."
            ) from None


# ---- choosing one --------------------------------------------------------------------------

LAUNCHERS: dict[str, type[Launcher]] = {
    "local": LocalLauncher,
    "slurm": SlurmLauncher,
    "kubernetes": KubernetesLauncher,
}


def launcher_class(run: RunConfig) -> type[Launcher]:
    """The launcher of ``cluster.kind``."""
    return LAUNCHERS[run.cluster.kind]
