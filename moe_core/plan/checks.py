"""Refusals before any process starts: a layout the cluster cannot start, a run this machine
cannot hold, a rank too large for its GPU; each one sentence."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

from moe_core.config import ConfigError, ParallelConfig, RunConfig
from moe_core.plan.memory import GIB
from moe_core.plan.planner import Plan, plan


class InsufficientResourcesError(ConfigError):
    """The run needs more GPUs (or GPU memory) than the machine offers; one sentence."""


def layout_text(par: ParallelConfig) -> str:
    """``pp 1 x dp 2 x ep 4``, with ``x cp 2`` before ep where context parallelism is on."""
    return f"pp {par.pp} x dp {par.dp}{f' x cp {par.cp}' if par.cp > 1 else ''} x ep {par.ep}"


def fit_refusal(p: Plan) -> str | None:
    """One sentence when the busiest rank does not fit ``cluster.gpu_memory_gib``, else None."""
    if p.fits():
        return None
    par, c = p.parallel, p.cluster
    return (
        f"{p.name} with layout {layout_text(par)} needs "
        f"{p.per_gpu_gib:.1f} GiB per GPU but a {c.gpu_type} has {c.gpu_memory_gib:g} GiB: "
        "raise parallel.ep or parallel.pp, lower train.micro_batch_size or turn on "
        "parallel.recompute."
    )


def check_cluster(run: RunConfig) -> None:
    """The cluster must start exactly the layout's processes (``nodes x procs_per_node``)."""
    c, par = run.cluster, run.parallel
    if c.world_size == par.world_size:
        return
    axes = ("pp", "dp", "cp", "ep") if par.cp > 1 else ("pp", "dp", "ep")
    hint = (
        f"set cluster.nodes={par.world_size // c.procs_per_node}"
        if par.world_size % c.procs_per_node == 0
        else f"change cluster.nodes/procs_per_node or parallel.{'/'.join(axes)}"
    )
    raise ConfigError(
        f"cluster {c.name!r} starts cluster.nodes x cluster.procs_per_node = {c.nodes} x "
        f"{c.procs_per_node} = {c.world_size} processes but the layout parallel."
        f"{' x '.join(axes)} = {' x '.join(str(getattr(par, a)) for a in axes)} needs "
        f"{par.world_size}: {hint}."
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
            f"model {run.model.name} with layout {layout_text(par)} needs "
            f"{needed} GPUs but this machine has {available_gpus}: launch it on a cluster "
            "(cluster=slurm or cluster=kubernetes) or choose a smaller layout."
        )
    if available_gpu_memory_gib is None:
        return
    p = plan(run)
    if p.memory.total > available_gpu_memory_gib * GIB:
        raise InsufficientResourcesError(
            f"model {run.model.name} with layout {layout_text(par)} needs "
            f"{p.per_gpu_gib:.1f} GiB per GPU but this machine's GPUs have "
            f"{available_gpu_memory_gib:.1f} GiB: raise parallel.ep or parallel.pp, lower "
            "train.micro_batch_size or turn on parallel.recompute."
        )


def check_shrink_fits(run: RunConfig) -> None:
    """With ``cluster.on_node_loss=shrink``, the fewest nodes the run may shrink to must hold
    it too (a smaller dp shards the optimizer over fewer ranks, so each holds more)."""
    counts = run.node_counts
    fewest = min(counts)
    if fewest == run.cluster.nodes:
        return
    p = plan(run.on_nodes(fewest))
    if p.fits():
        return
    fitting = [n for n in sorted(counts) if plan(run.on_nodes(n)).fits()]
    c = run.cluster
    raise InsufficientResourcesError(
        f"cluster.min_nodes={c.min_nodes} is not allowed: on {fewest} nodes (dp "
        f"{p.parallel.dp}) each GPU needs {p.per_gpu_gib:.1f} GiB but a {c.gpu_type} has "
        f"{c.gpu_memory_gib:g} GiB, so set cluster.min_nodes={fitting[0]}, the fewest nodes "
        "that fit."
    )


def host_memory_bytes() -> int:
    """This machine's physical memory (what a CPU run and a conversion can hold at most)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_disk_bytes(path: str | os.PathLike) -> int:
    """Free bytes on the file system that ``path`` (or its nearest existing parent) is on."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def _gib(n: float) -> str:
    return f"{n:,.0f} bytes ({n / GIB:,.1f} GiB)"


def check_memory(run: RunConfig, host_bytes: int, gpu_bytes: int | None) -> None:
    """Refuse, in one sentence, a run whose planned peak exceeds this machine before any model
    is built: the busiest rank against ``gpu_bytes`` (one GPU's free memory) when it trains on
    GPUs, else every process on this host together against ``host_bytes``."""
    if gpu_bytes is not None and not run.cluster.gpus_per_node:
        # Planned as it will run: on this process's GPU (its reserve, compiled blocks).
        gpus = dataclasses.replace(run.cluster, gpus_per_node=run.cluster.procs_per_node)
        run = dataclasses.replace(run, cluster=gpus)
    p = plan(run)
    par = run.parallel
    layout = f"model {run.model.name} with layout {layout_text(par)}"
    hint = (
        "choose a smaller model (model=tiny), raise parallel.ep or parallel.pp on more devices, "
        "lower train.micro_batch_size or turn on parallel.recompute"
    )
    staged = p.checkpoint.staged_per_node
    if gpu_bytes is not None:
        if p.memory.total > gpu_bytes:
            raise InsufficientResourcesError(
                f"{layout} needs {_gib(p.memory.total)} per GPU (the plan's peak) but this "
                f"GPU has {_gib(gpu_bytes)} free: {hint}."
            )
        # pinned pages cannot be swapped; leave a quarter for the processes and page cache
        if staged > host_bytes * 3 // 4:
            raise InsufficientResourcesError(
                f"train.async_checkpoint=true keeps a pinned host copy of every rank's "
                f"checkpoint, {_gib(staged)} on this node, more than three quarters of its "
                f"{_gib(host_bytes)} of memory: set train.async_checkpoint=false or spread the "
                "run over more nodes."
            )
        return
    # Every rank of a stage holds the same; this host runs its share of the ranks.
    needed = sum(s.total for s in p.stages) * (par.world_size // par.pp) // run.cluster.nodes
    needed += staged  # background saves' host copy
    if needed > host_bytes:
        raise InsufficientResourcesError(
            f"{layout} needs {_gib(needed)} of memory on this machine (the plan's peak of its "
            f"processes{', with the host copy async saves keep' if staged else ''}) but it has "
            f"{_gib(host_bytes)}: {hint}."
        )


def check_conversion(
    src: str | os.PathLike, out: str | os.PathLike, params: int, memory: int, disk: int
) -> None:
    """Refuse, in one sentence, converting the Hugging Face folder ``src`` (whose config.json
    describes ``params`` parameters) when its weight files cannot hold them even in 16 bits (a
    config claiming sizes its files lack, whose tensor-by-tensor check would take minutes), or
    when they cannot be held (``memory`` bytes: the tensors read and the experts stacked, about
    twice the files) or written (``disk`` bytes free where ``out`` goes), before any tensor is
    read."""
    files = sum(f.stat().st_size for f in Path(src).glob("*.safetensors"))
    if 2 * params > files:
        raise InsufficientResourcesError(
            f"{Path(src) / 'config.json'} describes {params:,} parameters, at least "
            f"{_gib(2 * params)} in 16 bits, but the weight files of {src} hold {_gib(files)}: "
            "the config does not describe those weights; fix its sizes or convert the folder "
            "they came with."
        )
    if 2 * files > memory:
        raise InsufficientResourcesError(
            f"{src} holds {_gib(files)} of weights and converting them needs about twice that, "
            f"{_gib(2 * files)} of memory, but this machine has {_gib(memory)}: convert on a "
            "machine with more memory."
        )
    if files > disk:
        raise InsufficientResourcesError(
            f"{out} needs {_gib(files)} of disk for the converted weights but its file system "
            f"has {_gib(disk)} free: free space there or choose another output folder."
        )
