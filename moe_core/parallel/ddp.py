"""Gradient reduction: dense weights over the stage's ``dp x cp x ep`` ranks, experts over
``dp x cp``.

Parameters are packed into buckets (one kind of weight, one weight-decay setting, bounded
size). Each bucket owns a flat parameter buffer (the model's parameters become views into it)
and a flat gradient buffer in the optimizer's dtype (fp32, or bf16 for the pure-bf16 preset). A
post-accumulate hook moves each micro-batch's gradient into that buffer (the first micro-batch
of a step is copied, later ones added, so the buffer is never zeroed: one pass less per step);
once every parameter of a bucket has received all micro-batches of the step, the bucket is
reduce-scattered asynchronously while backward goes on. Each rank ends up with the reduced
gradient of its own shard, which is what the ZeRO-1 optimizer updates.

A rank that reduces nothing (``dp x ep = 1``) needs no flat gradient buffer when the step has
one micro-batch, or when gradients accumulate in the weights' own dtype: autograd's gradients
(``param.grad``, accumulated in place over micro-batches) are used as they are, with no copy
and no buffer (measured on one H200: the copy of a bf16 gradient into the buffer is most of the
trainer's overhead over a bare step). ``Bucket.gradients`` hides which of the two a bucket does.

Gradients are averaged over ``dp x cp x ep`` for both kinds: every rank's loss is a mean over its
own tokens (a context-parallel rank's: over its slice of the sequences, an equal share), and an
expert on one rank has already summed, through the all-to-all backward, the gradient of every
token of its expert-parallel group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moe_core.config import ParallelConfig
from moe_core.model.moe import Experts
from moe_core.parallel.mesh import Mesh, reduce_scatter_flat
from moe_core.parallel.trace import TRACE


@dataclass(frozen=True)
class ReduceGroups:
    """How many ranks of a pipeline stage reduce (and ZeRO-1 shard) each kind of weight: the
    sizes of ``Mesh.dense_dp_group`` and ``Mesh.expert_dp_group``."""

    dense: int  # every one of the stage's dp x cp x ep ranks holds the dense weights
    expert: int  # the dp x cp ranks holding the same experts


def reduce_groups(par: ParallelConfig) -> ReduceGroups:
    """The reduction groups of layout ``par`` (what ``plan`` counts buffers and traffic over)."""
    return ReduceGroups(dense=par.dp * par.cp * par.ep, expert=par.dp * par.cp)


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


@dataclass
class Bucket:
    names: list[str]
    params: list[nn.Parameter]
    offsets: list[int]
    global_starts: list[int]  # each parameter's first element in its flattened global tensor
    numel: int  # without padding
    group: dist.ProcessGroup | None
    is_expert: bool
    decay: bool
    keeps_autograd_grads: bool  # param.grad used as it is: no flat gradient buffer

    @property
    def kind(self) -> str:
        """The group it reduces over, in words (the hang watchdog's trace)."""
        return "dp (experts)" if self.is_expert else "dp x ep (dense)"

    param_flat: torch.Tensor = field(init=False)  # model dtype, padded; params are views
    grad_flat: torch.Tensor | None = field(init=False)  # accumulation buffer, padded (zeros)
    grad_shard: torch.Tensor | None = field(init=False)  # reduced gradient of this rank's shard
    pending: int = 0  # hook calls still expected this step
    work: dist.Work | None = None

    def gradients(self) -> list[tuple[int, torch.Tensor]]:
        """This rank's reduced gradient as (offset in the shard, flat tensor) pieces: the whole
        shard, or each parameter's own autograd gradient."""
        if self.grad_shard is not None:
            return [(0, self.grad_shard)]
        pieces = []
        for p, off in zip(self.params, self.offsets, strict=True):
            assert p.grad is not None, "gradients read before backward"
            pieces.append((off, p.grad.reshape(-1)))
        return pieces

    def release_gradients(self) -> None:
        """Drop autograd's gradients once used (nothing for a flat buffer, which is reused)."""
        if self.keeps_autograd_grads:
            for p in self.params:
                p.grad = None

    @property
    def size(self) -> int:
        return group_size(self.group)

    @property
    def shard_numel(self) -> int:
        return -(-self.numel // self.size)  # ceil

    @property
    def shard(self) -> slice:
        start = group_rank(self.group) * self.shard_numel
        return slice(start, start + self.shard_numel)


def _expert_offsets(modules: list[nn.Module]) -> dict[int, int]:
    """Expert parameters (by id) and the first global expert each local stack holds."""
    return {
        id(p): e.expert_offset
        for m in modules
        for e in m.modules()
        if isinstance(e, Experts)
        for p in e.parameters()
    }


class GradBuckets:
    """Owns the flat buffers of a rank's model chunks and reduces their gradients."""

    def __init__(
        self,
        chunks: list[nn.Module],
        mesh: Mesh,
        bucket_mb: float,
        divisor: int,
        grad_dtype: torch.dtype = torch.float32,
        micro_batches: int = 1,
    ) -> None:
        self.mesh, self.divisor, self.grad_dtype = mesh, divisor, grad_dtype
        self.micro_batches = micro_batches
        named: dict[str, nn.Parameter] = {}
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if p.requires_grad:
                    named[name] = p
        self._expert_offsets = _expert_offsets(chunks)
        cap = int(bucket_mb * 2**20 / 4)
        self.buckets: list[Bucket] = []
        open_buckets: dict[tuple[bool, bool], list[tuple[str, nn.Parameter]]] = {}
        # Reverse registration order ~ the order gradients become ready in backward.
        for name, p in reversed(list(named.items())):
            key = (id(p) in self._expert_offsets, p.ndim >= 2)
            items = open_buckets.setdefault(key, [])
            items.append((name, p))
            if sum(q.numel() for _, q in items) >= cap:
                self._add(items, *key)
                open_buckets[key] = []
        for key, items in open_buckets.items():
            if items:
                self._add(items, *key)
        self._owner = {id(p): b for b in self.buckets for p in b.params}
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad)
            for b in self.buckets
            for p in b.params
        ]
        self._fresh: set[int] = set()  # parameters without a gradient yet this step

    def _add(self, items: list[tuple[str, nn.Parameter]], is_expert: bool, decay: bool) -> None:
        group = self.mesh.expert_dp_group if is_expert else self.mesh.dense_dp_group
        offsets, starts, total = [], [], 0
        for _, p in items:
            offsets.append(total)
            per_expert = p.numel() // p.shape[0]
            starts.append(self._expert_offsets.get(id(p), 0) * per_expert)
            total += p.numel()
        names, params = [n for n, _ in items], [p for _, p in items]
        first = items[0][1]
        keeps = (
            group is None
            and self.divisor == 1
            and (self.micro_batches == 1 or first.dtype == self.grad_dtype)
        )
        b = Bucket(names, params, offsets, starts, total, group, is_expert, decay, keeps)
        padded = b.shard_numel * b.size
        b.param_flat = torch.zeros(padded, dtype=first.dtype, device=first.device)
        b.grad_flat = b.grad_shard = None
        if not keeps:
            b.grad_flat = torch.zeros(padded, dtype=self.grad_dtype, device=first.device)
            b.grad_shard = b.grad_flat if b.group is None else b.grad_flat.new_zeros(b.shard_numel)
        for p, off in zip(b.params, offsets, strict=True):
            view = b.param_flat[off : off + p.numel()].view_as(p)
            view.copy_(p.data)
            p.data = view
            if b.grad_flat is not None:
                p.main_grad = b.grad_flat[off : off + p.numel()].view_as(p)  # type: ignore[attr-defined]
        self.buckets.append(b)

    def start_step(self) -> None:
        """Expect ``micro_batches`` backward passes before reducing (the first one of each
        parameter overwrites its gradient, so nothing is zeroed)."""
        self._fresh = set(self._owner)
        for b in self.buckets:
            b.release_gradients()
            b.pending = len(b.params) * self.micro_batches
            b.work = None

    def _on_grad(self, p: nn.Parameter) -> None:
        assert p.grad is not None
        b = self._owner[id(p)]
        if b.keeps_autograd_grads:  # autograd accumulates into p.grad itself
            b.pending -= 1
            return
        if id(p) in self._fresh:
            self._fresh.discard(id(p))
            p.main_grad.copy_(p.grad)  # type: ignore[attr-defined]
        else:
            p.main_grad.add_(p.grad)  # type: ignore[attr-defined]
        p.grad = None
        b.pending -= 1
        if b.pending == 0:
            self._launch(b)

    def _launch(self, b: Bucket) -> None:
        assert b.grad_flat is not None and b.grad_shard is not None
        if self.divisor != 1:
            b.grad_flat.div_(self.divisor)
        if b.group is not None:
            TRACE.enter("reduce_scatter (gradient bucket)", group=b.kind, nbytes=b.grad_flat.nbytes)
            b.work = reduce_scatter_flat(b.grad_shard, b.grad_flat, group=b.group, async_op=True)

    def finish(self) -> None:
        """Wait for every bucket's reduction (launching any whose gradients never all arrived)."""
        for b in self.buckets:
            if b.pending > 0:
                raise RuntimeError(
                    f"{b.pending} gradient accumulations missing in a bucket holding {b.names[0]}: "
                    "every parameter must take part in every micro-batch"
                )
            if b.work is not None:
                with TRACE.blocked():
                    b.work.wait()
                b.work = None
