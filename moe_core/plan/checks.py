"""Refusals before any process starts: a layout the cluster cannot start, a run this machine
cannot hold, a rank too large for its GPU; each one sentence."""

from __future__ import annotations

from moe_core.config import ConfigError, RunConfig
from moe_core.plan.memory import GIB
from moe_core.plan.planner import Plan, plan


class InsufficientResourcesError(ConfigError):
    """The run needs more GPUs (or GPU memory) than the machine offers; one sentence."""


def fit_refusal(p: Plan) -> str | None:
    """One sentence when the busiest rank does not fit ``cluster.gpu_memory_gib``, else None."""
    if p.fits():
        return None
    par, c = p.parallel, p.cluster
    return (
        f"{p.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
        f"{p.per_gpu_gib:.1f} GiB per GPU but a {c.gpu_type} has {c.gpu_memory_gib:g} GiB: "
        "raise parallel.ep or parallel.pp, lower train.micro_batch_size or turn on "
        "parallel.recompute."
    )


def check_cluster(run: RunConfig) -> None:
    """The cluster must start exactly the layout's processes (``nodes x procs_per_node``)."""
    c, par = run.cluster, run.parallel
    if c.world_size == par.world_size:
        return
    hint = (
        f"set cluster.nodes={par.world_size // c.procs_per_node}"
        if par.world_size % c.procs_per_node == 0
        else "change cluster.nodes/procs_per_node or parallel.pp/dp/ep"
    )
    raise ConfigError(
        f"cluster {c.name!r} starts cluster.nodes x cluster.procs_per_node = {c.nodes} x "
        f"{c.procs_per_node} = {c.world_size} processes but the layout parallel.pp x dp x ep = "
        f"{par.pp} x {par.dp} x {par.ep} needs {par.world_size}: {hint}."
    )


def check_resources(
    run: RunConfig, available_gpus: int, available_gpu_memory_gib: float | None
) -> None:
    """Refuse, in one sentence, a run this machine cannot hold: too few GPUs, or (when the
    memory is known) GPUs smaller than the plan's busiest rank. CPU layouts (a cluster with
    ``gpus_per_node == 0``) need no GPU."""
    if run.cluster.gpus_per_node == 0:
        return
    par = run.parallel
    needed = par.world_size
    if needed > available_gpus:
        raise InsufficientResourcesError(
            f"model {run.model.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
            f"{needed} GPUs but this machine has {available_gpus}: launch it on a cluster "
            "(cluster=slurm or cluster=kubernetes) or choose a smaller layout."
        )
    if available_gpu_memory_gib is None:
        return
    p = plan(run)
    if p.memory.total > available_gpu_memory_gib * GIB:
        raise InsufficientResourcesError(
            f"model {run.model.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
            f"{p.per_gpu_gib:.1f} GiB per GPU but this machine's GPUs have "
            f"{available_gpu_memory_gib:.1f} GiB: raise parallel.ep or parallel.pp, lower "
            "train.micro_batch_size or turn on parallel.recompute."
        )
