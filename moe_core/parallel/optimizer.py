"""ZeRO-1 AdamW: fp32 master weights and Adam moments sharded over each bucket's group.

Per step: the gradient buckets have been reduce-scattered (``ddp.GradBuckets``); the global
gradient norm is summed over every shard of every stage; each rank updates its fp32 shard with
torch's AdamW (fused on GPU) and all-gathers the updated weights into the bucket's flat
parameter buffer, which the model's parameters view.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_core.parallel.ddp import Bucket, GradBuckets, group_size
from moe_core.parallel.mesh import Mesh, all_gather_flat

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


class ShardedAdamW:
    def __init__(
        self,
        buckets: GradBuckets,
        mesh: Mesh,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
    ) -> None:
        self.buckets, self.mesh = buckets.buckets, mesh
        # fp32 model weights are their own masters (the shard is a view, updated in place);
        # lower-precision weights get an fp32 copy.
        self.masters: list[nn.Parameter] = [
            nn.Parameter(
                b.param_flat[b.shard].detach()
                if b.param_flat.dtype == torch.float32
                else b.param_flat[b.shard].detach().float().clone()
            )
            for b in self.buckets
        ]
        decay = [m for m, b in zip(self.masters, self.buckets, strict=True) if b.decay]
        no_decay = [m for m, b in zip(self.masters, self.buckets, strict=True) if not b.decay]
        fused = mesh.device.type == "cuda"
        self.inner = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=lr,
            betas=betas,
            eps=eps,
            fused=fused,
        )

    def set_lr(self, lr: float) -> None:
        for g in self.inner.param_groups:
            g["lr"] = lr

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, over all shards of all stages."""
        sq = torch.zeros((), dtype=torch.float32, device=self.mesh.device)
        for b in self.buckets:
            sq += b.grad_shard.float().square().sum()
        if self.mesh.distributed:
            dist.all_reduce(sq)
        return sq.sqrt()

    def step(self, max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` (inf: no clipping), update the shards, gather the weights."""
        norm = self.grad_norm()
        self.update(norm, max_norm)
        return norm

    def update(self, norm: torch.Tensor, max_norm: float) -> None:
        """Apply the step given the global gradient norm (see ``grad_norm``)."""
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for m, b in zip(self.masters, self.buckets, strict=True):
            m.grad = b.grad_shard
            if max_norm != float("inf"):
                m.grad.mul_(coef)
        self.inner.step()
        for m in self.masters:
            m.grad = None
        self.publish_weights()

    def publish_weights(self) -> None:
        """Model weights := masters (cast to the model dtype), gathered over each bucket's group."""
        for m, b in zip(self.masters, self.buckets, strict=True):
            if m.data_ptr() != b.param_flat[b.shard].data_ptr():
                b.param_flat[b.shard].copy_(m.detach())
            if b.group is not None:
                shard = b.param_flat[b.shard].clone()
                all_gather_flat(b.param_flat, shard, group=b.group)

    def shards(self, index: int, allocate: bool = False) -> dict[str, torch.Tensor]:
        """Bucket ``index``'s fp32 master shard and moments (zeros before the first step, or
        freshly allocated state to load into when ``allocate``)."""
        m = self.masters[index]
        if allocate and m not in self.inner.state:
            fused = bool(self.inner.param_groups[0].get("fused"))
            step = torch.tensor(0.0, dtype=torch.float32, device=m.device if fused else "cpu")
            self.inner.state[m] = {
                "step": step,
                "exp_avg": torch.zeros_like(m),
                "exp_avg_sq": torch.zeros_like(m),
            }
        state = self.inner.state.get(m, {})
        zeros = torch.zeros_like(m)
        return {
            "param": m.data,
            "exp_avg": state.get("exp_avg", zeros),
            "exp_avg_sq": state.get("exp_avg_sq", zeros),
        }

    def set_step(self, step: int) -> None:
        for state in self.inner.state.values():
            state["step"].fill_(float(step))

    def state_numel(self) -> int:
        """Elements of optimizer state held by this rank (master + two moments)."""
        total = 0
        for m in self.masters:
            state = self.inner.state.get(m, {})
            total += m.numel() + sum(
                state[k].numel() for k in ("exp_avg", "exp_avg_sq") if k in state
            )
        return total

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Unsharded fp32 master weights and moments by parameter name (this stage's names).

        Collective over the rank's groups: every rank of the stage must call it.
        """
        out: dict[str, dict[str, torch.Tensor]] = {}
        for i, b in enumerate(self.buckets):
            flats = {k: _gather(v, b) for k, v in self.shards(i).items()}
            for name, p, off in zip(b.names, b.params, b.offsets, strict=True):
                pieces = {k: flat[off : off + p.numel()].view(p.shape) for k, flat in flats.items()}
                if b.is_expert and self.mesh.ep_group is not None:
                    pieces = {k: _gather_experts(v, self.mesh) for k, v in pieces.items()}
                out[name] = {k: v.clone() for k, v in pieces.items()}
        return out

    @property
    def step_count(self) -> int:
        for state in self.inner.state.values():
            return int(state["step"])
        return 0


def _gather(shard: torch.Tensor, b: Bucket) -> torch.Tensor:
    if b.group is None:
        return shard
    out = shard.new_empty(shard.numel() * group_size(b.group))
    all_gather_flat(out, shard.contiguous(), group=b.group)
    return out


def _gather_experts(local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    parts = [torch.empty_like(local) for _ in range(mesh.cfg.ep)]
    dist.all_gather(parts, local.contiguous(), group=mesh.ep_group)
    return torch.cat(parts, dim=0)
