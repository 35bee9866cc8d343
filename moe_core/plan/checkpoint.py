"""What a checkpoint costs a run: the bytes each rank writes and the time to write them.

A checkpoint (``train.checkpoint``) holds the ZeRO-1 optimizer's shards: for each element a rank
owns, the master weight (an fp32 copy, or the weight itself where the weights are as precise as
the optimizer state, as under ``pure-bf16``) and two Adam moments. Router buffers and the
trainer's state are a few kilobytes beside that. The time to write is the busiest node's bytes
at ``cluster.storage_write_gbps``, the ranks of a node writing at once. Background saves
(``train.async_checkpoint``) keep a host copy of each rank's bytes for the run's life.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import RunConfig
from moe_core.parallel.ddp import reduce_groups
from moe_core.plan.memory import StageMemory, element_bytes


@dataclass(frozen=True)
class CheckpointPlan:
    per_rank: int  # bytes, the busiest rank (its stage's)
    total: int  # bytes, every rank together
    per_node: int  # bytes, the busiest node
    seconds: float  # the busiest node's bytes at the stated write rate
    write_gbps: float
    # host memory the busiest node holds for the run's life under train.async_checkpoint: each
    # rank's copy that background saves stage into (pinned on GPUs); 0 for synchronous saves
    staged_per_node: int = 0
    every: int = 0  # train.checkpoint_every (0: none periodic)
    background: bool = False  # train.async_checkpoint


def rank_checkpoint_bytes(run: RunConfig, stage: StageMemory) -> int:
    """Bytes one rank of ``stage`` writes: its shard of every parameter's master and moments."""
    bp, _, bo = element_bytes(run)
    groups = reduce_groups(run.parallel)
    per_element = 2 * bo + (4 if bp < bo else bp)
    shard = stage.dense_params / groups.dense + stage.expert_params / groups.expert
    return round(per_element * shard)


def checkpoint_plan(run: RunConfig, stages: tuple[StageMemory, ...]) -> CheckpointPlan:
    """The bytes and the write time of one checkpoint of ``run`` (every stage's ranks)."""
    per_stage = [rank_checkpoint_bytes(run, s) for s in stages]
    ranks_per_stage = run.parallel.dp * run.parallel.ep
    busiest = max(per_stage)
    per_node = busiest * min(run.cluster.procs_per_node, run.parallel.world_size)
    gbps = run.cluster.storage_write_gbps
    return CheckpointPlan(
        per_rank=busiest,
        total=ranks_per_stage * sum(per_stage),
        per_node=per_node,
        seconds=per_node / (gbps * 1e9),
        write_gbps=gbps,
        staged_per_node=per_node if run.train.async_checkpoint else 0,
        every=run.train.checkpoint_every,
        background=run.train.async_checkpoint,
    )
