"""Jobs the distributed tests launch under torchrun (one process per rank, gloo)."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from moe_core.compose import compose_run
from moe_core.train.trainer import Trainer


def optimizer_state(out: str, overrides: list[str]) -> None:
    """Train a few steps; rank 0 saves the gathered optimizer state and per-rank state sizes."""
    trainer = Trainer(compose_run(overrides))
    for _ in range(trainer.cfg.train.steps):
        trainer.train_step()
    opt = trainer.optimizer
    expected = sum(3 * b.shard_numel for b in opt.buckets)
    sizes = {
        "state_numel": opt.state_numel(),
        "expected": expected,
        "bucket_groups": [(b.is_expert, b.size, b.numel) for b in opt.buckets],
    }
    all_sizes = [None] * dist.get_world_size()
    dist.all_gather_object(all_sizes, sizes)
    full = opt.full_state()
    if dist.get_rank() == 0:
        torch.save({"full": full, "sizes": all_sizes, "step": opt.step_count}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    optimizer_state(sys.argv[1], sys.argv[2:])
