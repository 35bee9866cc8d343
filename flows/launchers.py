"""How the train stage starts training and follows it: one launcher per ``cluster.kind``.

Every launcher does the same four things for one attempt: start the training of the resolved
config (``train/config.json``), stream its rank-0 log line by line, wait for its end, and stop it
when the attempt is left early (the flow run cancelled, the stage timed out, the job never
started). ``local`` runs ``torchrun`` as a child of the flow; ``slurm`` submits the batch script
``flows.render`` renders with ``sbatch``, follows it through ``squeue``/``sacct`` and ends it with
``scancel``; ``kubernetes`` creates the Indexed Job and headless Service ``flows.render`` builds
through the ``kubernetes`` client, follows the Job and its pods, and deletes the Job; both
follow their job in one poll loop (``ClusterLauncher.attempt``). Retries
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from flows.render import (
    kubernetes_log_dir,
    kubernetes_objects,
    kubernetes_tokenize_objects,
    render_kubernetes,
    render_slurm,
    render_slurm_tokenize,
    slurm_log_dir,
    standalone_command,
)
from moe_core.config import ConfigError, RunConfig, nodes_within, shrink_sentence
from moe_core.errors import RunFailedError
from moe_core.train.torchrun import (
    KILLED_FROM_OUTSIDE,
    REPORT,
    cluster_failure,
    failure_context,
    failure_detail,
    read_failure,
    split_rank,
)

Log = Callable[[str], None]

# Slurm job states (squeue %T, sacct State): still queued, and ended.
SLURM_QUEUED = frozenset({"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"})
SLURM_ENDED = frozenset(
    {
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
)
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
    nodes: int | None = None  # the nodes it trained on (None: not known, it never ran)
    dp: int | None = None  # parallel.dp at that node count
    accumulation: int | None = None  # micro-batches per data rank and step there
    grow: bool = False  # stopped at a checkpoint to relaunch on all cluster.nodes
    # what the log and the stage's error add to it (a failed rank's last lines, where its log is)
    context: str = ""

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def layout(self, run: RunConfig, nodes: int | None) -> Attempt:
        """This attempt with the layout it ran at on ``nodes`` (``RunConfig.on_nodes``)."""
        if nodes is None:
            return self
        at = run.on_nodes(nodes)
        return replace(self, nodes=nodes, dp=at.parallel.dp, accumulation=at.micro_batches)


class LaunchTimeoutError(RunFailedError):
    """The job did not start within ``cluster.start_timeout_s``; it was cancelled."""


class Launcher(ABC):
    """Starts one attempt of the training in ``train_dir`` and follows it to its end."""

    kind: ClassVar[str]
    # whether a job running on fewer than cluster.nodes is stopped to grow back when they are
    # free (cluster launchers; launch_attempts turns it off after MAX_GROW_BACKS such stops)
    grow_back = True

    def __init__(self, run: RunConfig, train_dir: Path, log: Log) -> None:
        self.run, self.train_dir, self.log = run, train_dir, log
        self.config_path = train_dir / "config.json"

    @classmethod
    @abstractmethod
    def check(cls, run: RunConfig) -> None:
        """Refuse, in one sentence, a launch this machine cannot make (before any stage)."""

    def forward(self, lines: list[str]) -> None:
        """Log the lines of the training's output worth reading (progress bars are dropped);
        a rank's line (``moe_core.train.torchrun``'s prefix) as "rank N: ...", rank 0's bare."""
        for raw in lines:
            rank, line = split_rank(raw.rstrip())
            if line and "━" not in line:
                self.log(line if not rank else f"rank {rank}: {line}")

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


def _set_aside(logs: Path) -> None:
    """A logs folder of this name from a run folder's earlier pipeline (one stopped during this
    attempt, which ``launches.json`` never recorded) moves to ``<name>.old``: kept to read,
    never taken for this attempt's."""
    if logs.exists():
        shutil.rmtree(logs.with_name(f"{logs.name}.old"), ignore_errors=True)
        logs.rename(logs.with_name(f"{logs.name}.old"))


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
        logs = self.train_dir / "logs" / f"attempt-{number}"
        _set_aside(logs)
        logs.mkdir(parents=True)
        cmd = standalone_command(
            str(self.config_path), self.run.cluster.procs_per_node, sys.executable, str(logs)
        )
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
        detail, context = f"training exited with code {code}", ""
        failed = read_failure(logs / "failure.json") if code else None
        if failed is not None:  # a rank failed: torchrun's summary condensed to one sentence
            detail, context = failure_detail(failed), failure_context(failed, logs / REPORT)
        return Attempt(
            number, str(proc.pid), None, f"exit {code}", code == 0, detail, context=context
        ).layout(self.run, self.run.cluster.nodes)


# ---- a cluster's job: submitted, then polled until it ends ---------------------------------


class ClusterLauncher(Launcher):
    """A launcher that submits a job to a cluster and polls it: the loop is here, each cluster
    gives its hooks (``start``, ``state``, ``stream``, ``cancel``) and its words."""

    noun: ClassVar[str]  # how the log names a job, e.g. "slurm job"
    _stopped = False  # this attempt's job was asked to stop at a checkpoint
    queued: ClassVar[frozenset[str]]  # states of a job that has not started
    ended: ClassVar[frozenset[str]]  # states of a job that has ended
    lost: ClassVar[str] = "is unknown to the cluster"  # the detail of a job ``state`` lost

    @abstractmethod
    def start(self, number: int) -> tuple[str, Path]:
        """Submit attempt ``number``; returns the job's id and the file submitted."""

    @abstractmethod
    def state(self, job_id: str) -> str | None:
        """The job's state now; None if the cluster does not know it (yet, or any more)."""

    @abstractmethod
    def stream(self, job_id: str, final: bool = False) -> None:
        """Log the job's output written since the last call (``final``: the job has ended)."""

    @abstractmethod
    def cancel(self, job_id: str) -> None:
        """Stop the job (the attempt is left before it ended)."""

    @abstractmethod
    def not_started(self, job_id: str, state: str | None) -> str:
        """The sentence of a job that did not start within ``cluster.start_timeout_s``."""

    def nodes(self, job_id: str) -> int | None:
        """The nodes the running job trains on (None: not known yet)."""
        return self.run.cluster.nodes

    def all_nodes_free(self, job_id: str, nodes: int) -> bool:
        """Whether all ``cluster.nodes`` could run now, the ``nodes`` this job holds counted
        (asked between polls of a job that runs on fewer, to grow back)."""
        return False

    def stop_at_checkpoint(self, job_id: str) -> None:
        """Ask the job's ranks to stop after their step with a checkpoint (SIGTERM)."""
        raise NotImplementedError

    def failure_root(self, job_id: str) -> Path | None:
        """The folder of the job's per-node failure records (``cluster_failure``), if any."""
        return None

    def outcome(self, number: int, job_id: str, script: Path, state: str | None) -> Attempt:
        """The attempt of a job that ended in ``state`` (None: lost); a failed one says what
        its nodes recorded (the first rank that failed, nodes that stopped without a word)."""
        final = state or "LOST"
        ok = final == "COMPLETED"
        detail = f"{self.noun} {job_id} " + (f"ended {state}" if state else self.lost)
        root = None if ok else self.failure_root(job_id)
        found = None if root is None else cluster_failure(root)
        # asked to stop (to grow back) and no rank failed: it ended at that stop, no kill
        if found is None or (self._stopped and found[0] == KILLED_FROM_OUTSIDE):
            return Attempt(number, job_id, str(script), final, ok, detail)
        said, context = found
        return Attempt(number, job_id, str(script), final, ok, f"{detail}: {said}", context=context)

    def attempt(self, number: int) -> Attempt:
        c = self.run.cluster
        self._stopped = False  # asked to stop at a checkpoint (to grow back)
        job_id, script = self.start(number)
        submitted = time.monotonic()
        started, unknown, ended = False, 0, False
        state: str | None = None
        nodes: int | None = None
        grow = False
        try:
            while True:
                previous, state = state, self.state(job_id)
                self.stream(job_id)
                if state != previous and state is not None:
                    self.log(f"{self.noun} {job_id}: {state}")
                unknown = unknown + 1 if state is None else 0
                if state in self.ended or unknown >= LOST_AFTER_POLLS:
                    ended = state in self.ended
                    break
                if state is not None and state not in self.queued:
                    started = True
                    if nodes is None:
                        nodes = self._running_on(job_id)
                    elif (
                        nodes < c.nodes
                        and not grow
                        and self.grow_back
                        # the stop must end in a checkpoint, or the steps since the last one
                        # would be lost: without train.checkpoint_at_end the run stays smaller
                        and self.run.train.checkpoint_at_end
                        and self.all_nodes_free(job_id, nodes)
                    ):
                        self.log(
                            f"all {c.nodes} nodes are free again: stopping {self.noun} {job_id} "
                            "at a checkpoint to relaunch on them"
                        )
                        self.stop_at_checkpoint(job_id)
                        grow = self._stopped = True
                waited = time.monotonic() - submitted
                if not started and c.start_timeout_s and waited > c.start_timeout_s:
                    raise LaunchTimeoutError(self.not_started(job_id, state))
                time.sleep(c.poll_s)
        finally:
            if not ended:
                self.cancel(job_id)
        self.stream(job_id, final=True)
        if nodes is None and ended and started:
            nodes = self.nodes(job_id)
        done = self.outcome(number, job_id, script, state if ended else None)
        done = done.layout(self.run, nodes)
        if grow:  # stopped on purpose: not a success, not a failure either
            detail = f"{done.detail} (stopped at a checkpoint to grow back to {c.nodes} nodes)"
            done = replace(done, ok=False, grow=True, detail=detail)
        return done

    def _running_on(self, job_id: str) -> int | None:
        """The nodes the job that just started trains on; said when fewer than planned."""
        nodes = self.nodes(job_id)
        if nodes is not None and nodes < self.run.cluster.nodes:
            self.log(f"{self.noun} {job_id}: " + shrink_sentence(self.run, nodes))
        return nodes


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


class SlurmLauncher(ClusterLauncher):
    """``sbatch`` of ``train/slurm.sbatch`` (rendered by ``flows.render.render_slurm``), state
    from ``squeue`` while the job is queued or running and from ``sacct`` once it has left,
    the job's log (``train/slurm-<id>.out``: the trainer prints on rank 0) streamed, and
    ``scancel`` when the attempt is left before the job ended."""

    kind = "slurm"
    noun = "slurm job"
    queued = SLURM_QUEUED
    ended = SLURM_ENDED
    lost = "left the queue without an accounting record (sacct)"

    @classmethod
    def check(cls, run: RunConfig) -> None:
        commands: tuple[str, ...] = ("sbatch", "squeue", "sacct", "scancel")
        if len(run.node_counts) > 1:  # growing back asks sinfo for idle nodes
            commands += ("sinfo",)
        missing = [t for t in commands if not shutil.which(t)]
        if missing:
            named = " and ".join(filter(None, [", ".join(missing[:-1]), missing[-1]]))
            gone = (
                "none of them is"
                if len(missing) == len(commands)
                else f"{named} {'is' if len(missing) == 1 else 'are'} not"
            )
            raise ConfigError(
                f"cluster.kind='slurm' is not allowed on this machine: it submits with sbatch and "
                f"follows with {', '.join(commands[1:-1])} and {commands[-1]}, and {gone} on "
                "PATH (run the pipeline on a Slurm login node, infra/README.md)."
            )

    @property
    def script_path(self) -> Path:
        return self.train_dir / "slurm.sbatch"

    def render(self) -> str:
        return render_slurm(self.run, str(self.train_dir), str(self.config_path))

    def submit(self) -> str:
        """Write the rendered script and ``sbatch`` it; returns the job id."""
        self.script_path.write_text(self.render())
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

    def start(self, number: int) -> tuple[str, Path]:
        job_id = self.submit()
        self.log(f"slurm job {job_id} submitted: {self.script_path}")
        self._tail = _Tail(self.train_dir / f"slurm-{job_id}.out")
        return job_id, self.script_path

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

    def nodes(self, job_id: str) -> int | None:
        """The nodes the job trains on: with ``cluster.on_node_loss=shrink`` the most of its
        allocation (squeue's %D) that the layout allows, as its batch script chooses."""
        if len(self.run.node_counts) == 1:
            return self.run.cluster.nodes
        held = self._held(job_id)
        return None if held is None else nodes_within(self.run, held)

    def _held(self, job_id: str) -> int | None:
        """The nodes allocated to the job (squeue's %D; None: not known)."""
        queue = _slurm(["squeue", "--noheader", "--jobs", job_id, "--format=%D"])
        got = queue.stdout.split() if queue.returncode == 0 else []
        return int(got[0]) if got and got[0].isdigit() else None

    def all_nodes_free(self, job_id: str, nodes: int) -> bool:
        """Idle nodes of the job's partition (sinfo) and the job's own make ``cluster.nodes``.
        One line a node and partition (``--Node``), so a node in several partitions counts
        once; without ``cluster.partition`` only the default partition's (``%P`` marks it
        ``*``), where sbatch puts the job. The job's own: all it holds, which can be more than
        the ``nodes`` it trains on (given 7 where the layout allows 4 or 8, it trains on 4)."""
        c = self.run.cluster
        nodes = max(nodes, self._held(job_id) or 0)
        part = [f"--partition={c.partition}"] if c.partition else []
        query = ["sinfo", "--noheader", "--Node", *part, "--states=idle", "--format=%N %P"]
        idle = _slurm(query)
        lines = idle.stdout.splitlines() if idle.returncode == 0 else []
        names = {
            words[0]
            for words in map(str.split, lines)
            if len(words) == 2 and (c.partition or words[1].endswith("*"))
        }
        return len(names) + nodes >= c.nodes

    def stop_at_checkpoint(self, job_id: str) -> None:
        """``scancel --signal=TERM``: the job's steps (torchrun, which passes it to its ranks)
        get SIGTERM, and the trainer stops after its step with a checkpoint."""
        done = _slurm(["scancel", "--signal=TERM", job_id])
        if done.returncode != 0:
            why = (done.stderr or done.stdout).strip()
            self.log(f"scancel --signal=TERM {job_id} failed: {why}")

    def cancel(self, job_id: str) -> None:
        self.log(f"slurm job {job_id}: cancelling (scancel {job_id})")
        done = _slurm(["scancel", job_id])
        if done.returncode != 0:
            self.log(f"scancel {job_id} failed: {(done.stderr or done.stdout).strip()}")

    def stream(self, job_id: str, final: bool = False) -> None:
        self.forward(self._tail.lines(final))

    def failure_root(self, job_id: str) -> Path | None:
        return Path(slurm_log_dir(str(self.train_dir), job_id)).parent

    def not_started(self, job_id: str, state: str | None) -> str:
        return (
            f"slurm job {job_id} did not start within cluster.start_timeout_s="
            f"{self.run.cluster.start_timeout_s:g} s (still {state or 'unknown to squeue'}), so "
            "it was cancelled: check the partition and queue (squeue), or raise "
            "cluster.start_timeout_s."
        )

    def outcome(self, number: int, job_id: str, script: Path, state: str | None) -> Attempt:
        if state == "CANCELLED":
            raise RunFailedError(
                f"slurm job {job_id} was cancelled outside the pipeline (scancel), so it is not "
                "resubmitted: run the pipeline again to resume from the newest checkpoint."
            )
        return super().outcome(number, job_id, script, state)


class SlurmTokenizeLauncher(SlurmLauncher):
    """The tokenize stage on Slurm: ``tokenize/tokenize.sbatch`` (``render_slurm_tokenize``: a
    Dask scheduler and workers on the allocation, ``moe tokenize --config`` the driver),
    submitted and followed like training. ``train_dir`` is the stage's folder here."""

    @property
    def script_path(self) -> Path:
        return self.train_dir / "tokenize.sbatch"

    def render(self) -> str:
        return render_slurm_tokenize(self.run, str(self.train_dir), str(self.config_path))

    def nodes(self, job_id: str) -> int | None:
        return None  # Dask workers on cluster.nodes, no training layout

    def outcome(self, number: int, job_id: str, script: Path, state: str | None) -> Attempt:
        if state == "CANCELLED":
            raise RunFailedError(
                f"slurm job {job_id} was cancelled outside the pipeline (scancel): run the "
                "pipeline again to resume tokenizing from the units already written."
            )
        return ClusterLauncher.outcome(self, number, job_id, script, state)


# ---- kubernetes: an Indexed Job and a headless Service through the client -------------------


class KubernetesLauncher(ClusterLauncher):
    """A headless Service (created once) and, per attempt, an Indexed Job ``<run id>-<attempt>``
    built by ``flows.render.kubernetes_objects`` (its YAML kept as
    ``train/kubernetes-<attempt>.yaml``), created through the ``kubernetes`` client; the Job's
    status and its pods' phases followed, pod 0's log streamed, the Job deleted when the
    attempt is left before it ended. ``apis`` (core, batch) replaces the client's APIs."""

    kind = "kubernetes"
    noun = "kubernetes job"
    make = staticmethod(kubernetes_objects)  # the Service and Job of one attempt
    queued = frozenset({"PENDING"})
    ended = frozenset({"COMPLETED", "FAILED"})

    def __init__(self, run: RunConfig, train_dir: Path, log: Log, apis: tuple | None = None):
        super().__init__(run, train_dir, log)
        self._apis = apis
        self._pod0: Any = None  # pod 0 of the Job as the last state read saw it
        self._printed = 0  # lines of its log logged so far
        self._nodes = run.cluster.nodes  # pods of the current Job

    def ready_nodes(self) -> int:
        """Nodes that can take a pod now: Ready, schedulable, and with GPU jobs holding
        ``cluster.gpus_per_node`` allocatable GPUs (the cluster's other work is not
        subtracted: a pod that does not fit stays pending, as without shrinking)."""
        core, _ = self.apis
        want = self.run.cluster.gpus_per_node
        ready = 0
        for node in core.list_node().items:
            conditions = {c.type: c.status for c in (node.status.conditions or [])}
            gpus = int((node.status.allocatable or {}).get("nvidia.com/gpu", 0))
            usable = conditions.get("Ready") == "True" and not node.spec.unschedulable
            ready += usable and (not want or gpus >= want)
        return ready

    def job_nodes(self) -> int:
        """The pods of the next Job: ``cluster.nodes``, or with ``cluster.on_node_loss=shrink``
        the most that the ready nodes hold and the layout allows (``cluster.nodes`` when fewer
        than ``min_nodes`` are ready: the Job waits for them)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        c = self.run.cluster
        if len(self.run.node_counts) == 1:
            return c.nodes
        try:
            ready = self.ready_nodes()
        except (ApiException, HTTPError, OSError) as err:
            # a service account that may not list nodes, or an API server that did not answer
            # (creating the Job then says so, as without shrinking)
            why = f"{err.status} {err.reason}" if isinstance(err, ApiException) else str(err)
            self.log(f"cannot list the cluster's nodes ({why}): asking for all {c.nodes}")
            return c.nodes
        nodes = nodes_within(self.run, ready)
        if nodes is None:
            self.log(f"{ready} of {c.nodes} nodes are ready, fewer than any layout allows: waiting")
        return nodes or c.nodes

    def nodes(self, job_id: str) -> int | None:
        return self._nodes

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

    def state(self, name: str) -> str:
        """COMPLETED, FAILED, RUNNING (a pod has started) or PENDING; pod 0 (or None) is kept
        for ``stream``."""
        core, batch = self.apis
        ns = self.run.cluster.namespace
        status = batch.read_namespaced_job_status(name, ns).status
        conditions = {c.type: c.status for c in (status.conditions or [])}
        pods = core.list_namespaced_pod(ns, label_selector=f"job-name={name}").items
        self._pod0 = next((p for p in pods if _completion_index(p) == "0"), None)
        if conditions.get("Complete") == "True" or (status.succeeded or 0) >= self._nodes:
            return "COMPLETED"
        if conditions.get("Failed") == "True" or (status.failed or 0) > 0:
            return "FAILED"
        started = any(p.status.phase in ("Running", "Succeeded", "Failed") for p in pods)
        return "RUNNING" if started else "PENDING"

    def cancel(self, name: str) -> None:
        self.log(f"kubernetes job {name}: deleting it (cancel)")
        _, batch = self.apis
        batch.delete_namespaced_job(
            name, self.run.cluster.namespace, propagation_policy="Foreground"
        )

    def start(self, number: int) -> tuple[str, Path]:
        """Keep the manifests as ``train/kubernetes-<number>.yaml``, create the Service (unless
        an earlier attempt did) and the Job; returns the Job's name and the manifest."""
        from kubernetes.client.exceptions import ApiException

        c = self.run.cluster
        core, batch = self.apis
        self._nodes = self.job_nodes() if self.make is kubernetes_objects else c.nodes
        args = (self.run, str(self.train_dir), str(self.config_path), number)
        shrunk = (self._nodes,) if self._nodes != c.nodes else ()
        service, job = self.make(*args, *shrunk)
        name = job.metadata.name
        root = self.failure_root(name)
        if root is not None:  # an earlier Job of this name's failure records are not this one's
            _set_aside(root)
        manifest = self.train_dir / f"kubernetes-{number}.yaml"
        manifest.write_text(render_kubernetes(*args, make=self.make, nodes=(shrunk or (None,))[0]))
        try:
            core.create_namespaced_service(c.namespace, service)
        except ApiException as err:
            if err.status != 409:  # 409: the Service of an earlier attempt is there already
                raise
        batch.create_namespaced_job(c.namespace, job)
        self.log(f"kubernetes job {name} created in namespace {c.namespace}: {manifest}")
        self._pod0, self._printed = None, 0
        return name, manifest

    def stream(self, job_id: str, final: bool = False) -> None:
        """Log the lines of pod 0 past those logged already (its whole log is read each time,
        so the last look has logged everything: ``final`` reads nothing more)."""
        pod = self._pod0
        if final or pod is None or pod.status.phase == "Pending":
            return
        core, _ = self.apis
        text = core.read_namespaced_pod_log(pod.metadata.name, self.run.cluster.namespace)
        lines = (text or "").splitlines()
        self.forward(lines[self._printed :])
        self._printed = max(self._printed, len(lines))

    def not_started(self, job_id: str, state: str | None) -> str:
        return (
            f"kubernetes job {job_id} did not start within cluster.start_timeout_s="
            f"{self.run.cluster.start_timeout_s:g} s (no pod running), so it was deleted: check "
            "the pods' events (kubectl describe pods), or raise cluster.start_timeout_s."
        )

    def failure_root(self, job_id: str) -> Path | None:
        return Path(kubernetes_log_dir(str(self.train_dir), job_id)).parent


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


class KubernetesTokenizeLauncher(KubernetesLauncher):
    """The tokenize stage on Kubernetes: the Service and Indexed Job of
    ``kubernetes_tokenize_objects`` (a Dask scheduler, workers and the driver on
    ``cluster.nodes`` pods), created and followed like training; ``train_dir`` is the stage's
    folder here."""

    make = staticmethod(kubernetes_tokenize_objects)

    def nodes(self, job_id: str) -> int | None:
        return None  # Dask workers, no training layout


LAUNCHERS: dict[str, type[Launcher]] = {
    "local": LocalLauncher,
    "slurm": SlurmLauncher,
    "kubernetes": KubernetesLauncher,
}


def launcher_class(run: RunConfig) -> type[Launcher]:
    """The launcher of ``cluster.kind``."""
    return LAUNCHERS[run.cluster.kind]
