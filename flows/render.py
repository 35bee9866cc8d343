"""What a cluster runs for the train stage: the torchrun command of one node, a Slurm batch
script, a Kubernetes Job and its headless Service.

Every node runs one ``torchrun`` that starts ``cluster.procs_per_node`` ranks and joins a c10d
rendezvous hosted on the first node; each rank runs ``moe train --config <resolved JSON>``, so
every node trains exactly the config the pipeline resolved (no Hydra on the nodes). The run
directory must be on storage every node shares (a parallel file system under Slurm, a
ReadWriteMany volume under Kubernetes).

These functions return text (for ``sbatch`` or ``kubectl apply``) or the ``kubernetes``
client's models and submit nothing; ``flows.launchers`` submits them. This module imports no
other module of ``flows``.
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import yaml

from moe_core.config import ConfigError, RunConfig, check_path
from moe_core.files import sha256_hex
from moe_core.plan import check_cluster, plan
from moe_core.train.torchrun import NODE


def run_id(run: RunConfig) -> str:
    """A stable id for a run (its model and output directory): the rendezvous id."""
    digest = sha256_hex(run.out_dir.encode())[:8]
    model = re.sub(r"[^a-z0-9]+", "-", run.model.name.lower()).strip("-")[:40] or "model"
    return f"moe-{model}-{digest}"


# The batch script's variable holding the nodes a shrinking job trains on (``render_slurm``).
NODES_VAR = "${MOE_NODES}"


def torchrun_command(
    run: RunConfig,
    config_path: str,
    nnodes: int | str,
    node_rank: int | None,
    rdzv_endpoint: str,
    *,
    rdzv_id: str | None = None,
    python: str | None = None,
    max_restarts: int = 0,
    log_dir: str | None = None,
) -> list[str]:
    """The command one node runs: ``torchrun`` with a c10d rendezvous at ``rdzv_endpoint``
    (``host:port`` of the first node), ``cluster.procs_per_node`` ranks, then
    ``moe train --config config_path``. With ``log_dir`` (holding ``NODE``, each node's
    number), through ``moe_core.train.torchrun`` as ``standalone_command`` runs it.

    c10d assigns node ranks at the rendezvous: torchrun ignores ``--node-rank`` (with a warning),
    so ``node_rank`` is only checked and passed along; None leaves it out (Slurm, Kubernetes).
    ``python`` runs torchrun through that interpreter (``python -m torch.distributed.run``)
    instead of the ``torchrun`` on PATH.

    ``nnodes`` fewer than ``cluster.nodes`` (one of ``RunConfig.node_counts``, with
    ``cluster.on_node_loss=shrink``), or ``NODES_VAR`` (the count a Slurm job chose), is passed
    to ``moe train --nodes`` as well, which trains at that count's smaller dp.
    """
    check_cluster(run)
    procs = run.cluster.procs_per_node
    world = run.parallel.world_size
    counts = run.node_counts
    if nnodes != NODES_VAR and (not isinstance(nnodes, int) or nnodes not in counts):
        if len(counts) == 1:
            raise ConfigError(
                f"nnodes={nnodes} is not allowed: with cluster.procs_per_node={procs} the "
                f"layout's {world} processes need nnodes={world // procs}."
            )
        raise ConfigError(
            f"nnodes={nnodes} is not allowed: one of the node counts the layout shrinks to "
            f"({', '.join(map(str, sorted(counts)))})."
        )
    if node_rank is not None and not (isinstance(nnodes, int) and 0 <= node_rank < nnodes):
        last = nnodes - 1 if isinstance(nnodes, int) else "nnodes - 1"
        raise ConfigError(f"node_rank={node_rank} is not allowed: from 0 to {last}.")
    if not re.fullmatch(r"[^\s:]+:\d+", rdzv_endpoint):
        raise ConfigError(
            f"rdzv_endpoint={rdzv_endpoint!r} is not allowed: host:port of the first node."
        )
    if max_restarts < 0:
        raise ConfigError(f"max_restarts={max_restarts} is not allowed: zero or more.")
    options = [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={procs}",
        *([f"--node-rank={node_rank}"] if node_rank is not None else []),
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_endpoint}",
        f"--rdzv-id={rdzv_id or run_id(run)}",
        f"--max-restarts={max_restarts}",
    ]
    shrunk = [] if nnodes == run.cluster.nodes else ["--nodes", str(nnodes)]
    if log_dir is not None:
        return _recorded(python or "python", log_dir, options, config_path) + shrunk
    return _torchrun(python, options, config_path) + shrunk


def standalone_command(
    config_path: str, nproc: int, python: str, log_dir: str | None = None
) -> list[str]:
    """One node on its own (``cluster.kind='local'``): ``torchrun --standalone`` of ``nproc``
    ranks through ``python``, each running ``moe train --config config_path``. With
    ``log_dir``, through ``moe_core.train.torchrun``: every rank's output is kept there (and
    still printed, each line prefixed with its rank) and a failed rank is recorded in
    ``log_dir/failure.json`` instead of torchrun's summary on the console."""
    options = ["--standalone", f"--nproc-per-node={nproc}"]
    if log_dir is None:
        return _torchrun(python, options, config_path)
    return _recorded(python, log_dir, options, config_path)


def _recorded(python: str, log_dir: str, options: list[str], config_path: str) -> list[str]:
    """torchrun through ``moe_core.train.torchrun``: each rank's output kept in ``log_dir``
    (and printed, each line prefixed with its rank), a failed rank recorded in
    ``log_dir/failure.json`` and torchrun's summary in ``log_dir/torchrun.log``."""
    logs = ["--log-dir", log_dir, "--redirects", "3", "--tee", "3"]
    wrapper = [python, "-m", "moe_core.train.torchrun", "--failure", f"{log_dir}/failure.json"]
    return [*wrapper, *logs, *_torchrun(python, options, config_path)[3:]]


def _torchrun(python: str | None, options: list[str], config_path: str) -> list[str]:
    """torchrun (``python -m torch.distributed.run`` when ``python`` is given, else the
    ``torchrun`` on PATH) with ``options``, every rank running ``moe train --config``."""
    head = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    return [*head, *options, "-m", "moe_core.cli", "train", "--config", config_path]


def _shell(args: list[str]) -> str:
    """Shell words; an argument holding ``${`` (our own variables) is expanded by the shell."""
    return " ".join(f'"{a}"' if "${" in a else shlex.quote(a) for a in args)


def _slurm_head(
    run: RunConfig, run_dir: str, config_path: str, *, gpus: bool, nodes: str | None = None
) -> list[str]:
    """The checks, ``#SBATCH`` directives and first lines every batch script of a run has:
    the job named after the run on ``nodes`` (default ``cluster.nodes``), its log
    ``run_dir/slurm-<job id>.out``, and ``MOE_HOST``, the allocation's first node (where the
    batch script itself runs)."""
    c = run.cluster
    if c.kind != "slurm":
        raise ConfigError(f"cluster.kind={c.kind!r} is not allowed here: 'slurm' (cluster=slurm).")
    check_cluster(run)
    run_dir = check_path("run_dir", run_dir)
    check_path("config_path", config_path)
    directives = [
        f"--job-name={run_id(run)}",
        f"--nodes={nodes or c.nodes}",
        "--ntasks-per-node=1",
        *([f"--gpus-per-node={c.gpus_per_node}"] if gpus and c.gpus_per_node else []),
        *([f"--partition={c.partition}"] if c.partition else []),
        *([f"--account={c.account}"] if c.account else []),
        f"--time={c.time_limit}",
        f"--output={run_dir}/slurm-%j.out",
        f"--chdir={run_dir}",
        "--exclusive",
    ]
    return [
        "#!/bin/bash",
        *(f"#SBATCH {d}" for d in directives),
        "set -euo pipefail",
        'MOE_HOST=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
    ]


def shutdown_timeout_s(run: RunConfig) -> int:
    """Seconds torchrun lets its workers stop after SIGTERM (its default, 30, is less than a
    large model's checkpoint): a step's hang limit and twice the plan's checkpoint write on
    the fewest nodes the run trains on (``RunConfig.node_counts``)."""
    slowest = max(plan(run.on_nodes(n)).checkpoint.seconds for n in run.node_counts)
    return math.ceil(run.train.hang_min_s + 2 * slowest)


def _node_range(run: RunConfig) -> str:
    """``sbatch --nodes``: ``cluster.nodes``, or with ``cluster.on_node_loss=shrink`` the range
    ``MIN-MAX`` of ``RunConfig.node_counts`` (Slurm starts the job on what it can get)."""
    counts = run.node_counts
    return f"{min(counts)}-{max(counts)}" if len(counts) > 1 else str(max(counts))


# Every node's srun task, one per node, using all its cores.
_SRUN = 'srun --ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" --cpu-bind=none'


def slurm_log_dir(run_dir: str, job_id: str = "${SLURM_JOB_ID}") -> str:
    """Where a Slurm job's nodes keep their ranks' logs and failure records: one folder a node
    (``NODE``) under ``logs/job-<id>`` of the run directory."""
    return f"{run_dir}/logs/job-{job_id}/node-{NODE}"


def kubernetes_log_dir(run_dir: str, job: str) -> str:
    """The same for a Kubernetes Job's pods, under ``logs/<job name>``."""
    return f"{run_dir}/logs/{job}/node-{NODE}"


def render_slurm(run: RunConfig, run_dir: str, config_path: str) -> str:
    """An ``sbatch`` script: one task per node, each a torchrun joining the first node's
    c10d rendezvous; logs in ``run_dir/slurm-<job id>.out``."""
    c = run.cluster
    head = _slurm_head(run, run_dir, config_path, gpus=True, nodes=_node_range(run))
    counts = run.node_counts
    shrink = len(counts) > 1
    cmd = torchrun_command(
        run,
        config_path,
        NODES_VAR if shrink else c.nodes,
        None,
        f"${{MOE_HOST}}:{c.rdzv_port}",
        rdzv_id="${SLURM_JOB_ID}",
        log_dir=slurm_log_dir(run_dir),
    )
    layout = run.parallel
    srun = _SRUN
    choose = []
    if shrink:  # the largest node count the layout allows within what Slurm gave
        srun = _SRUN.replace("srun ", 'srun --nodes="$MOE_NODES" --ntasks="$MOE_NODES" ', 1)
        choose = [
            "# cluster.on_node_loss=shrink: train on the most nodes of the allocation that the",
            "# layout allows (RunConfig.node_counts), at a smaller dp when fewer than planned.",
            'MOE_GOT="${SLURM_JOB_NUM_NODES:-$SLURM_NNODES}"',
            "MOE_NODES=0",
            f"for n in {' '.join(map(str, counts))}; do",
            '  if [ "$n" -le "$MOE_GOT" ]; then MOE_NODES=$n; break; fi',
            "done",
            'echo "moe_core: training on $MOE_NODES of the $MOE_GOT nodes allocated '
            f'(cluster.nodes={c.nodes})"',
            "# Growing back stops the job with SIGTERM: torchrun kills its workers this many",
            "# seconds later (30 by default), so they have time to end their step with a",
            "# checkpoint (train.hang_min_s and twice the plan's slowest checkpoint write).",
            f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT={shutdown_timeout_s(run)}",
        ]
    lines = [
        head[0],
        f"# moe_core: model {run.model.name}, pp {layout.pp} x dp {layout.dp} x ep {layout.ep} "
        f"on {c.nodes} nodes x {c.procs_per_node} processes (rendered by flows/launch.py).",
        *head[1:],
        *choose,
        "# The first node of the allocation hosts the c10d rendezvous.",
        'echo "moe_core: job $SLURM_JOB_ID, rendezvous on $MOE_HOST"',
        f"{srun} --kill-on-bad-exit=1 \\",
        "  " + _shell(cmd),
        "",
    ]
    return "\n".join(lines)


# A worker whose scheduler is gone (the job's first node lost) exits after a minute.
_WORKER_OPTIONS = ["--no-dashboard", "--death-timeout=60"]


# When the driver ends, however it ends: the scheduler closes its workers, then both are stopped.
_STOP_AT_EXIT = [
    "moe_stop() {",
    '  python -m moe_core.data.engine stop "$MOE_DASK" || true',
    "  kill ${MOE_PIDS:-} 2>/dev/null || true",
    "}",
    "trap moe_stop EXIT",
]


def render_slurm_tokenize(run: RunConfig, run_dir: str, config_path: str) -> str:
    """An ``sbatch`` script that tokenizes on the allocation: a Dask scheduler on the first
    node, Dask workers on every node (``data.workers`` processes each, or one per core), and
    ``moe tokenize --config config_path`` as the driver, connected to them; the scheduler and
    its workers are stopped when the driver ends, however it ends. Every node must see
    ``data.dir`` (shared storage), as it must see the run directory for training."""
    c = run.cluster
    head = _slurm_head(run, run_dir, config_path, gpus=False)
    address = f"tcp://${{MOE_HOST}}:{c.dask_port}"
    per_node = str(run.data.workers) if run.data.workers else "${SLURM_CPUS_ON_NODE}"
    scheduler = ["python", "-m", "distributed.cli.dask_scheduler", "--host", "${MOE_HOST}"]
    worker = ["python", "-m", "distributed.cli.dask_worker", "${MOE_DASK}"]
    driver = ["python", "-m", "moe_core.cli", "tokenize", "--config", config_path]
    lines = [
        head[0],
        f"# moe_core: tokenize {run.data.dir} on {c.nodes} nodes, a Dask cluster "
        "(rendered by flows/launchers.py).",
        *head[1:],
        f'MOE_DASK="{address}"',
        'echo "moe_core: job $SLURM_JOB_ID, Dask scheduler at $MOE_DASK"',
        *_STOP_AT_EXIT,
        _shell([*scheduler, "--port", str(c.dask_port), "--no-dashboard"]) + " &",
        "MOE_PIDS=$!",
        f"{_SRUN} \\",
        "  " + _shell([*worker, f"--nworkers={per_node}", "--nthreads=1", *_WORKER_OPTIONS]) + " &",
        'MOE_PIDS="$MOE_PIDS $!"',
        _shell([*driver, "--scheduler", "${MOE_DASK}"]),
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
    run: RunConfig,
    run_dir: str,
    config_path: str,
    attempt: int | None = None,
    nodes: int | None = None,
) -> tuple[Any, Any]:
    """A headless Service (stable DNS for the rendezvous host, pod 0) and an Indexed Job of
    ``cluster.nodes`` pods, each a torchrun on ``gpus_per_node`` GPUs, as the ``kubernetes``
    client's typed models. The PersistentVolumeClaim ``cluster.volume_claim`` is mounted at
    ``cluster.volume_path`` in every pod, as on the machine that wrote the run directory, which
    must lie below it. ``attempt`` N names the Job ``<run id>-N`` (a Job cannot be rerun, so
    each launch of the pipeline is a Job of its own); None names it ``<run id>``. ``nodes``
    fewer than ``cluster.nodes`` (``cluster.on_node_loss=shrink``) makes that many pods, which
    train at its smaller dp (``moe train --nodes``)."""
    c = run.cluster
    nodes = nodes or c.nodes
    service, job = _kubernetes_names(run, run_dir, config_path, attempt, "")
    rdzv = f"{job}-0.{service}:{c.rdzv_port}"
    log_dir = kubernetes_log_dir(run_dir, job)
    cmd = torchrun_command(run, config_path, nodes, None, rdzv, log_dir=log_dir)
    return _kubernetes_job(
        run, run_dir, service, job, "trainer", cmd, "rdzv", c.rdzv_port, True, nodes
    )


def kubernetes_tokenize_objects(
    run: RunConfig, run_dir: str, config_path: str, attempt: int | None = None
) -> tuple[Any, Any]:
    """The tokenize stage's Service and Indexed Job (``<run id>-tok[-N]``): pod 0 runs a Dask
    scheduler, a worker and ``moe tokenize --config config_path`` as the driver; every other
    pod runs Dask workers that join pod 0's scheduler through the Service (``data.workers``
    processes each, or one per core). No GPUs. The driver stops the scheduler and its workers
    when it ends; a worker pod ends successfully then (the Job's outcome is pod 0's)."""
    c = run.cluster
    service, job = _kubernetes_names(run, run_dir, config_path, attempt, "-tok")
    address = f"tcp://{job}-0.{service}:{c.dask_port}"
    per_node = str(run.data.workers) if run.data.workers else "$(nproc)"
    worker = " ".join(
        [
            "python -m distributed.cli.dask_worker",
            '"$MOE_DASK"',
            f"--nworkers={per_node}",
            "--nthreads=1",
            *_WORKER_OPTIONS,
        ]
    )
    driver = ["python", "-m", "moe_core.cli", "tokenize", "--config", config_path]
    script = "\n".join(
        [
            "set -euo pipefail",
            f"MOE_DASK={shlex.quote(address)}",
            'if [ "$JOB_COMPLETION_INDEX" = 0 ]; then',
            *(f"  {line}" for line in _STOP_AT_EXIT),
            f"  python -m distributed.cli.dask_scheduler --port {c.dask_port} --no-dashboard &",
            "  MOE_PIDS=$!",
            f"  {worker} &",
            '  MOE_PIDS="$MOE_PIDS $!"',
            "  " + " ".join(shlex.quote(a) for a in driver) + ' --scheduler "$MOE_DASK"',
            "else",
            f"  {worker} || true  # stopped by the driver, or its scheduler gone",
            "fi",
        ]
    )
    cmd = ["bash", "-c", script]
    return _kubernetes_job(run, run_dir, service, job, "tokenize", cmd, "dask", c.dask_port, False)


def _kubernetes_names(
    run: RunConfig, run_dir: str, config_path: str, attempt: int | None, suffix: str
) -> tuple[str, str]:
    """The Service's and the Job's names, once the cluster and the paths are checked."""
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
    service = run_id(run) + suffix
    return service, service if attempt is None else f"{service}-{attempt}"


def _kubernetes_job(
    run: RunConfig,
    run_dir: str,
    service_name: str,
    job_name: str,
    container_name: str,
    cmd: list[str],
    port_name: str,
    port: int,
    gpus: bool,
    nodes: int | None = None,
) -> tuple[Any, Any]:
    """A headless Service over the Job's pods (pod 0 reachable as ``<job>-0.<service>``) and
    the Indexed Job of ``nodes`` (default ``cluster.nodes``) pods running ``cmd`` in
    ``run_dir``, the runs volume mounted."""
    c = run.cluster
    nodes = nodes or c.nodes
    k8s = _kubernetes_client()
    labels = {"app.kubernetes.io/name": "moe-core", "moe-core/run": service_name}

    def meta(name: str) -> Any:
        return k8s.V1ObjectMeta(name=name, namespace=c.namespace, labels=dict(labels))

    container = k8s.V1Container(
        name=container_name,
        image=c.image,
        working_dir=run_dir,
        command=cmd,
        env=[k8s.V1EnvVar(name="PYTHONUNBUFFERED", value="1")],
        ports=[k8s.V1ContainerPort(name=port_name, container_port=port)],
        volume_mounts=[
            k8s.V1VolumeMount(name="runs", mount_path=c.volume_path),
            k8s.V1VolumeMount(name="shm", mount_path="/dev/shm"),
        ],
        resources=(
            k8s.V1ResourceRequirements(limits={"nvidia.com/gpu": str(c.gpus_per_node)})
            if gpus and c.gpus_per_node
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
            ports=[k8s.V1ServicePort(name=port_name, port=port, target_port=port)],
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
            completions=nodes,
            parallelism=nodes,
            backoff_limit=0,  # a failed pod fails the Job; the pipeline launches a new one
            template=k8s.V1PodTemplateSpec(
                metadata=k8s.V1ObjectMeta(labels=dict(labels)), spec=pod
            ),
        ),
    )
    return service, job


def render_kubernetes(
    run: RunConfig,
    run_dir: str,
    config_path: str,
    attempt: int | None = None,
    make: Callable[..., tuple[Any, Any]] = kubernetes_objects,
    nodes: int | None = None,
) -> str:
    """The manifests of ``make`` (``kubernetes_objects``, or ``kubernetes_tokenize_objects``)
    as YAML, for ``kubectl apply -f``; ``nodes``: ``kubernetes_objects``'s."""
    objects = make(run, run_dir, config_path, attempt, *([nodes] if nodes else []))
    api = _kubernetes_client().ApiClient()
    header = (
        f"# moe_core: model {run.model.name} on {nodes or run.cluster.nodes} pods x "
        f"{run.cluster.procs_per_node} processes (rendered by flows/launch.py); kubectl apply -f "
        "this file.\n"
    )
    return header + yaml.safe_dump_all(
        [api.sanitize_for_serialization(o) for o in objects], sort_keys=False
    )
