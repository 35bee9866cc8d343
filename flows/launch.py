"""How the train stage launches ``moe train``: the checks before any stage, the retried
attempts, and what a cluster runs (the torchrun command, a Slurm batch script, a Kubernetes Job).

Every node runs one ``torchrun`` that starts ``cluster.procs_per_node`` ranks and joins a c10d
rendezvous hosted on the first node; each rank runs ``moe train --config <resolved JSON>``, so
every node trains exactly the config the pipeline resolved (no Hydra on the nodes). The run
directory must be on storage every node shares (a parallel file system under Slurm, a
ReadWriteMany volume under Kubernetes).

The renderers return text for ``sbatch`` or ``kubectl apply`` and submit nothing: the launcher
of ``cluster.kind`` (``flows.launchers``, which imports them) submits and follows one attempt.
``check_launchable`` and ``launch_attempts`` are given that launcher, so this module never
imports ``flows.launchers``.
"""

from __future__ import annotations

import json
import logging
import re
import shlex
import threading
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any

import torch
import yaml

from moe_core.config import ConfigError, RunConfig, check_path
from moe_core.errors import RunFailedError
from moe_core.files import sha256_hex
from moe_core.plan import (
    check_cluster,
    check_memory,
    check_resources,
    host_memory_bytes,
    plan,
    plan_text,
)

if TYPE_CHECKING:
    from flows.launchers import Attempt, Launcher
    from flows.tracking import Tracker

Logger = logging.Logger | logging.LoggerAdapter

TORCHRUN_ENTRY = ["-m", "moe_core.cli", "train", "--config"]


def run_id(run: RunConfig) -> str:
    """A stable id for a run (its model and output directory): the rendezvous id."""
    digest = sha256_hex(run.out_dir.encode())[:8]
    model = re.sub(r"[^a-z0-9]+", "-", run.model.name.lower()).strip("-")[:40] or "model"
    return f"moe-{model}-{digest}"


def torchrun_command(
    run: RunConfig,
    config_path: str,
    nnodes: int,
    node_rank: int | None,
    rdzv_endpoint: str,
    *,
    rdzv_id: str | None = None,
    python: str | None = None,
    max_restarts: int = 0,
) -> list[str]:
    """The command one node runs: ``torchrun`` with a c10d rendezvous at ``rdzv_endpoint``
    (``host:port`` of the first node), ``cluster.procs_per_node`` ranks, then
    ``moe train --config config_path``.

    c10d assigns node ranks at the rendezvous: torchrun ignores ``--node-rank`` (with a warning),
    so ``node_rank`` is only checked and passed along; None leaves it out (Slurm, Kubernetes).
    ``python`` runs torchrun through that interpreter (``python -m torch.distributed.run``)
    instead of the ``torchrun`` on PATH.
    """
    check_cluster(run)
    procs = run.cluster.procs_per_node
    world = run.parallel.world_size
    if nnodes < 1 or nnodes * procs != world:
        raise ConfigError(
            f"nnodes={nnodes} is not allowed: with cluster.procs_per_node={procs} the layout's "
            f"{world} processes need nnodes={world // procs}."
        )
    if node_rank is not None and not 0 <= node_rank < nnodes:
        raise ConfigError(f"node_rank={node_rank} is not allowed: from 0 to {nnodes - 1}.")
    if not re.fullmatch(r"[^\s:]+:\d+", rdzv_endpoint):
        raise ConfigError(
            f"rdzv_endpoint={rdzv_endpoint!r} is not allowed: host:port of the first node."
        )
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts} is not allowed: zero or more.")
    head = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    cmd = [
        *head,
        f"--nnodes={nnodes}",
        f"--nproc-per-node={procs}",
        *([f"--node-rank={node_rank}"] if node_rank is not None else []),
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id or run_id(run)}",
        f"--max-restarts={max_restarts}",
    ]
    return [*cmd, *TORCHRUN_ENTRY, config_path]


def _shell(args: list[str]) -> str:
    """Shell words; an argument holding ``${`` (our own variables) is expanded by the shell."""
    return " ".join(f'"{a}"' if "${" in a else shlex.quote(a) for a in args)


def render_slurm(run: RunConfig, run_dir: str, config_path: str) -> str:
    """An ``sbatch`` script: one task per node, each a torchrun joining the first node's
    c10d rendezvous; logs in ``run_dir/slurm-<job id>.out``."""
    c = run.cluster
    if c.kind != "slurm":
        raise ConfigError(f"cluster.kind={c.kind!r} is not allowed here: 'slurm' (cluster=slurm).")
    check_cluster(run)
    run_dir = check_path("run_dir", run_dir)
    config_path = check_path("config_path", config_path)
    directives = [
        f"--job-name={run_id(run)}",
        f"--nodes={c.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={c.gpus_per_node}"] if c.gpus_per_node else []),
        *([f"--partition={c.partition}"] if c.partition else []),
        *([f"--account={c.account}"] if c.account else []),
        f"--time={c.time_limit}",
        f"--output={run_dir}/slurm-%j.out",
        f"--chdir={run_dir}",
        "--exclusive",
    ]
    cmd = torchrun_command(
        run,
        config_path,
        c.nodes,
        None,
        f"${{MOE_RDZV_HOST}}:{c.rdzv_port}",
        rdzv_id="${SLURM_JOB_ID}",
    )
    layout = run.parallel
    lines = [
        "#!/bin/bash",
        f"# moe_core: model {run.model.name}, pp {layout.pp} x dp {layout.dp} x ep {layout.ep} "
        f"on {c.nodes} nodes x {c.procs_per_node} processes (rendered by flows/launch.py).",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        "# The first node of the allocation hosts the c10d rendezvous.",
        'MOE_RDZV_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "moe_core: job $SLURM_JOB_ID, rendezvous on $MOE_RDZV_HOST"',
        'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --cpu-bind=none '
        "--kill-on-bad-exit=1 \\",
        "  " + _shell(cmd),
        "",
    ]
    return "\n".join(lines)


def _kubernetes_client() -> Any:
    try:
        from kubernetes import client
    except ImportError:
        raise ConfigError(
            "cluster.kind='kubernetes' is not allowed without the kubernetes package: install it "
            "with pip install 'moe-core[kubernetes]'."
        ) from None
    return client


def kubernetes_objects(
    run: RunConfig, run_dir: str, config_path: str, attempt: int | None = None
) -> tuple[Any, Any]:
    """A headless Service (stable DNS for the rendezvous host, pod 0) and an Indexed Job of
    ``cluster.nodes`` pods, each a torchrun on ``gpus_per_node`` GPUs, as the ``kubernetes``
    client's typed models. The PersistentVolumeClaim ``cluster.volume_claim`` is mounted at
    ``cluster.volume_path`` in every pod, as on the machine that wrote the run directory, which
    must lie below it. ``attempt`` N names the Job ``<run id>-N`` (a Job cannot be rerun, so
    each launch of the pipeline is a Job of its own); None names it ``<run id>``."""
    c = run.cluster
    if c.kind != "kubernetes":
        raise ConfigError(
            f"cluster.kind={c.kind!r} is not allowed here: 'kubernetes' (cluster=kubernetes)."
        )
    check_cluster(run)
    run_dir = check_path("run_dir", run_dir)
    config_path = check_path("config_path", config_path)
    volume = PurePosixPath(c.volume_path)
    for key, path in (("run_dir", run_dir), ("config_path", config_path)):
        if not PurePosixPath(path).is_relative_to(volume):
            raise ConfigError(
                f"{key}={path!r} is not allowed: it must lie below cluster.volume_path "
                f"({c.volume_path}), where the pods mount cluster.volume_claim."
            )
    k8s = _kubernetes_client()
    service_name = run_id(run)
    job_name = service_name if attempt is None else f"{service_name}-{attempt}"
    labels = {"app.kubernetes.io/name": "moe-core", "moe-core/run": service_name}

    def meta(name: str) -> Any:
        return k8s.V1ObjectMeta(name=name, namespace=c.namespace, labels=dict(labels))

    rdzv_host = f"{job_name}-0.{service_name}"  # pod 0 of the Indexed Job, through the Service
    cmd = torchrun_command(run, config_path, c.nodes, None, f"{rdzv_host}:{c.rdzv_port}")
    container = k8s.V1Container(
        name="trainer",
        image=c.image,
        working_dir=run_dir,
        command=cmd,
        env=[k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1")],
        ports=[k8s.V1ContainerPort(name="rdzv", container_port=c.rdzv_port)],
        volume_mounts=[
            k8s.V1VolumeMount(name="runs", mount_path=c.volume_path),
            k8s.V1VolumeMount(name="shm", mount_path="/dev/shm"),
        ],
        resources=(
            k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": str(c.gpus_per_node)})
            if c.gpus_per_node
            else None
        ),
    )
    service = k8s.V1Service(
        api_version="v1",
        kind="Service",
        metadata=meta(service_name),
        spec=k8s.V1ServiceSpec(
            cluster_ip="None",
            publish_not_ready_addresses=True,
            selector={"moe-core/run": service_name},
            ports=[k8s.V1ServicePort(name="rdzv", port=c.rdzv_port, target_port=c.rdzv_port)],
        ),
    )
    pod = k8s.V1PodSpec(
        subdomain=service_name,
        restart_policy="Never",
        containers=[container],
        volumes=[
            k8s.V1Volume(
                name="runs",
                persistent_volume_claim=k8s.V1PersistentVolumeClaimVolumeSource(
                    claim_name=c.volume_claim
                ),
            ),
            k8s.V1Volume(name="shm", empty_dir=k8s.V1EmptyDirVolumeSource(medium="Memory")),
        ],
    )
    job = k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=meta(job_name),
        spec=k8s.V1JobSpec(
            completion_mode="Indexed",
            completions=c.nodes,
            parallelism=c.nodes,
            backoff_limit=0,  # a failed pod fails the Job; the pipeline launches a new one
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=dict(labels)), spec=pod
            ),
        ),
    )
    return service, job


def render_kubernetes(
    run: RunConfig, run_dir: str, config_path: str, attempt: int | None = None
) -> str:
    """The manifests of ``kubernetes_objects`` as YAML, for ``kubectl apply -f``."""
    objects = kubernetes_objects(run, run_dir, config_path, attempt)
    api = _kubernetes_client().ApiClient()
    header = (
        f"# moe_core: model {run.model.name} on {run.cluster.nodes} pods x "
        f"{run.cluster.procs_per_node} processes (rendered by flows/launch.py); kubectl apply -f "
        "this file.\n"
    )
    return header + yaml.safe_dump_all(
        [api.sanitize_for_serialization(o) for o in objects], sort_keys=False
    )


# ---- the train stage's launches ---------------------------------------------------------


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
    if c.kind == "local" and not c.gpus_per_node:  # CPU processes: this machine's memory
        check_memory(run, host_memory_bytes(), None)
    launcher.check(run)


class MetricsSender:
    """While training runs, ``metrics.jsonl`` goes to MLflow every few seconds (and once more
    at the end)."""

    def __init__(
        self, tracker: Tracker, run_id: str | None, metrics: Path, every_s: float = 5.0
    ) -> None:
        self.tracker, self.run_id, self.metrics, self.every_s = tracker, run_id, metrics, every_s
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _send(self) -> None:
        self.tracker.send_metrics_file(self.run_id, self.metrics)

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


def launch_attempts(
    launcher: Launcher, tracker: Tracker, run_id: str | None, logger: Logger
) -> list[Attempt]:
    """Launch training until an attempt finishes, at most ``1 + cluster.launch_retries`` times;
    every attempt resumes from the newest valid checkpoint. Each attempt (job id, submitted
    script, state) is added to ``train/launches.json`` and the stage's MLflow params."""
    run, train_dir = launcher.run, launcher.train_dir
    record = train_dir / "launches.json"
    history = json.loads(record.read_text()) if record.is_file() else []
    before = len(history)  # attempts of earlier flow runs keep their numbers
    tries = 1 + run.cluster.launch_retries
    attempts: list[Attempt] = []
    for i in range(tries):
        number = before + i + 1
        if i:
            logger.warning(
                "%s; launching again (%d of %d), resuming from %s",
                attempts[-1].detail,
                i + 1,
                tries,
                newest_checkpoint(train_dir),
            )
        with MetricsSender(tracker, run_id, train_dir / "metrics.jsonl"):
            attempt = launcher.attempt(number)
        attempts.append(attempt)
        history.append(attempt.record())
        record.write_text(json.dumps(history, indent=1))
        params = {"kind": run.cluster.kind, "job_id": attempt.job_id, "state": attempt.state}
        if attempt.script is not None:
            params["script"] = attempt.script
        tracker.params(run_id, {"launch": {f"attempt_{number}": params}})
        if attempt.ok:
            return attempts
    raise RunFailedError(
        f"{attempts[-1].detail} (see the log above) on attempt {tries} of {tries} "
        f"(cluster.launch_retries={run.cluster.launch_retries}); a rerun resumes from "
        f"{newest_checkpoint(train_dir)}."
    )
