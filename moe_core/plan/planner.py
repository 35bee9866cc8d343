"""``plan(run)``: a layout's parameters, GPUs, memory per stage and communication per step.

Everything is computed from the config alone (parameter shapes from a meta-device model), so a
1.2T-parameter layout is checked on a laptop before any process starts. The formulas are in the
docstrings of ``memory`` and ``communication``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ClusterConfig, ParallelConfig, RunConfig
from moe_core.model.flops import count
from moe_core.plan.checkpoint import CheckpointPlan, checkpoint_plan
from moe_core.plan.communication import Communication, communication
from moe_core.plan.memory import (
    GIB,
    StageMemory,
    parameter_counts,
    stage_memory,
    tokens_per_micro_batch,
)


@dataclass(frozen=True)
class Plan:
    """What a run needs: parameters, GPUs, the busiest rank's memory and traffic per step."""

    name: str
    total_params: int
    active_params: int
    parallel: ParallelConfig
    cluster: ClusterConfig
    param_dtype: str
    compute_dtype: str
    optimizer_dtype: str
    tokens_per_micro_batch: int
    micro_batches: int
    stages: tuple[StageMemory, ...]
    comm: Communication
    flops_per_token: int  # model FLOPs, forward + backward, at train.seq_len
    checkpoint: CheckpointPlan
    # cluster.on_node_loss=shrink: the smaller node counts the run may continue on, each as
    # (nodes, dp, micro-batches per rank and step), from RunConfig.node_counts
    shrinks_to: tuple[tuple[int, int, int], ...] = ()

    @property
    def gpus(self) -> int:
        return self.parallel.world_size

    @property
    def memory(self) -> StageMemory:
        """The most loaded rank (ties: the first stage)."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def per_gpu_gib(self) -> float:
        return self.memory.total / GIB

    def fits(self, cluster: ClusterConfig | None = None) -> bool:
        """Whether the busiest rank's memory fits ``cluster.gpu_memory_gib`` (default: the run's
        cluster). A cluster without GPUs (CPU processes) sets no per-device limit: True."""
        c = cluster or self.cluster
        if c.gpus_per_node == 0 or c.gpu_memory_gib <= 0:
            return True
        return self.memory.total <= c.gpu_memory_gib * GIB


def plan(run: RunConfig) -> Plan:
    """Plan ``run``'s layout: every pipeline stage's memory, then the busiest rank's traffic."""
    m, t, par = run.model, run.train, run.parallel
    counts = count(m, t.seq_len)
    shapes = parameter_counts(m)
    stages = tuple(stage_memory(run, shapes, s) for s in range(par.pp))
    return Plan(
        name=_run_name(run),
        total_params=counts.total_params,
        active_params=counts.active_params,
        parallel=par,
        cluster=run.cluster,
        param_dtype=run.precision.params,
        compute_dtype=run.precision.compute,
        optimizer_dtype=run.precision.optimizer,
        tokens_per_micro_batch=tokens_per_micro_batch(run),
        micro_batches=run.micro_batches,
        stages=stages,
        comm=communication(run, stages),
        flops_per_token=counts.flops_per_token,
        checkpoint=checkpoint_plan(run, stages),
        shrinks_to=tuple(
            (n, dp, run.on_nodes(n).micro_batches)
            for n, dp in run.node_counts.items()
            if n < run.cluster.nodes
        ),
    )


def _run_name(run: RunConfig) -> str:
    """How the plan, its table and its refusals name a run."""
    return f"model {run.model.name}"
