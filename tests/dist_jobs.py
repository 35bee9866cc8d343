"""Jobs the distributed tests launch under torchrun (one process per rank, gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from moe_core.compose import compose_run
from moe_core.train.trainer import Trainer


def optimizer_state(out: str, overrides: list[str]) -> None:
    """Train; rank 0 saves the losses, the gathered optimizer state and per-rank state sizes."""
    trainer = Trainer(compose_run(overrides))
    losses = [trainer.train_step().loss for _ in range(trainer.cfg.train.steps)]
    opt = trainer.optimizer
    expected = sum(3 * b.shard_numel for b in opt.buckets)
    sizes = {
        "state_numel": opt.state_numel(),
        "expected": expected,
        "bucket_groups": [(b.is_expert, b.size, b.numel) for b in opt.buckets],
    }
    all_sizes = [sizes]
    if dist.is_initialized():
        all_sizes = [None] * dist.get_world_size()
        dist.all_gather_object(all_sizes, sizes)
    full = opt.full_state()
    if trainer.is_main:
        record = {"full": full, "sizes": all_sizes, "step": opt.step_count, "losses": losses}
        torch.save(record, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def evaluate(out: str, overrides: list[str]) -> None:
    """Build (and resume) a trainer; rank 0 saves its step and held-out loss as JSON."""
    trainer = Trainer(compose_run(overrides))
    loss = trainer.evaluate()
    if trainer.is_main:
        Path(out).write_text(json.dumps({"step": trainer.step, "eval_loss": loss}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    job = {"optimizer": optimizer_state, "eval": evaluate}[sys.argv[1]]
    job(sys.argv[2], sys.argv[3:])
