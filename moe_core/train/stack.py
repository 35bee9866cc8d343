"""What a run trains with, built once: the model's chunks on this rank (``parallelize``), the
loss, gradient buckets, the ZeRO-1 optimizer, the autocast context and, with ``pp > 1``, the
pipeline runner."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_core.config import RunConfig
from moe_core.model import Transformer
from moe_core.model.dtypes import DTYPES
from moe_core.parallel.compile import loss_function
from moe_core.parallel.ddp import GradBuckets
from moe_core.parallel.mesh import Mesh
from moe_core.parallel.optimizer import ShardedAdamW
from moe_core.parallel.parallelize import parallelize
from moe_core.parallel.pipeline import PipelineRunner, p2p_groups


@dataclass(frozen=True)
class Stack:
    chunks: dict[int, Transformer]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    buckets: GradBuckets
    optimizer: ShardedAdamW
    autocast: torch.autocast
    pipeline: PipelineRunner | None
    mtp_weight: torch.Tensor  # the MTP loss weight of the step (``schedule.mtp_weight``)


def build_stack(cfg: RunConfig, mesh: Mesh) -> Stack:
    """Build this rank's part of the run (collective where the layout is)."""
    tc, pc = cfg.train, cfg.parallel
    tokens = tc.micro_batch_size * tc.seq_len // pc.cp  # this rank's, per micro-batch
    chunks = parallelize(cfg.model, pc, cfg.precision, mesh, tc.seed, tokens, tc.seq_len)
    loss_fn = loss_function(pc.compile_on(mesh.device.type))
    state_dtype = DTYPES[cfg.precision.optimizer]
    buckets = GradBuckets(
        list(chunks.values()),
        mesh,
        pc.bucket_mb,
        divisor=pc.loss_ranks,
        grad_dtype=state_dtype,
        micro_batches=cfg.micro_batches,
    )
    # The learning rate is the schedule's, set before every step (``ShardedAdamW.set_lr``).
    optimizer = ShardedAdamW(
        buckets,
        mesh,
        (tc.beta1, tc.beta2),
        tc.eps,
        tc.weight_decay,
        state_dtype=state_dtype,
    )
    # Autocast only where it changes something: bf16 compute over fp32 weights. bf16 weights
    # compute in bf16 as they are (norms, router and loss keep fp32 inside the model).
    bf16_over_fp32 = cfg.precision.compute == "bf16" and cfg.precision.params == "fp32"
    autocast = torch.autocast(mesh.device.type, torch.bfloat16, enabled=bf16_over_fp32)
    # A device scalar set before every step, so a captured step (CUDA graphs) reads it.
    mtp_weight = torch.zeros((), device=mesh.device)
    pipeline = None
    if pc.pp > 1:
        shape = (tc.micro_batch_size, tc.seq_len, cfg.model.d_model)
        dtype = DTYPES[cfg.precision.params]
        groups = p2p_groups(pc, mesh)
        pipeline = PipelineRunner(chunks, mesh, groups, shape, dtype, autocast, mtp_weight)
    return Stack(chunks, loss_fn, buckets, optimizer, autocast, pipeline, mtp_weight)
