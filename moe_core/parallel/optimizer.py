"""ZeRO-1 AdamW: master weights and Adam moments sharded over each bucket's group.

State precision (``precision.optimizer``): ``fp32`` keeps fp32 moments and, for bf16 weights,
an fp32 master copy of this rank's shard (fp32 weights are their own masters); ``bf16`` keeps
bf16 moments and no master: the bf16 weights are updated in place (math in fp32).

Per step: the gradient buckets have been reduce-scattered (``ddp.GradBuckets``); the global
gradient norm comes from one pass over this rank's shards (``sum_of_squares``: a read-bound
kernel over the large shards, one multi-tensor pass over the small ones; fp32 accumulation)
summed over every shard of every stage; each rank updates its shards with the fused AdamW
update of ``moe_kernels.adamw`` (one pass per shard on the GPU: gradient, master and moments read
once, master and moments written once, the clipping scale applied inside it, and
the bf16 model weights written from the fp32 masters in the same pass) and all-gathers the
updated weights into the bucket's flat parameter buffer, which the model's parameters view.
Step count, learning rate, clipping scale and whether the step applies at all stay on the
device: the update reads nothing back.

FP8 weights (``precision.fp8_parts``: parameters with a ``moe_kernels.fp8_cache`` attached) get
their FP8 copies, the operands the next step's GEMMs read, once per step here, never per
micro-batch: where the rank's update covers the whole bucket (its group is this rank alone:
no data parallelism, or experts under expert parallelism with ``dp x cp = 1``), the fused
update writes each such weight's rowwise copy in its own pass (``adamw_step_(rows=)``) and
``quantize_columnwise`` reads the new weight once more for the input gradient's copy (its
scales reduce over N, which the update's row blocks never see whole); where a shard cuts
tensors, both copies are quantized from the gathered weights. ``publish_weights`` (a loaded
checkpoint) does the same.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from moe_core.parallel.ddp import Bucket, GradBuckets, group_size
from moe_core.parallel.mesh import Mesh, all_gather_flat, gather_experts
from moe_core.parallel.trace import TRACE
from moe_kernels.adamw import adamw_step_
from moe_kernels.fp8_cache import cache_of, quantize_columns_into, weights_written
from moe_kernels.sum_squares import sum_squares

STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")

# Tensors of at least this many elements get a reduction of their own in ``sum_of_squares``.
LARGE = 1 << 20


def sum_of_squares(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The sum of the squares of every element of ``tensors``, accumulated in ``dtype``, as a
    0-d tensor on their device (zero for none). The large tensors go through one read-bound
    pass (``moe_kernels.sum_squares``); the many small ones (norms, router, biases) share one
    ``torch._foreach_norm`` pass, for which a launch per tensor would cost more than the
    reading (``benchmarks/grad_norm.py`` times both against the alternatives)."""
    large = [t for t in tensors if t.numel() >= LARGE]
    small = [t for t in tensors if t.numel() < LARGE]
    parts = [sum_squares(large, dtype)] if large else []
    if small:
        parts.append(torch.stack(torch._foreach_norm(small, 2, dtype=dtype)).square().sum())
    if not parts:
        return torch.zeros((), dtype=dtype, device=tensors[0].device if tensors else None)
    return torch.stack(parts).sum()


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all of ``tensors`` together, fp32 (``sum_of_squares`` in fp32)."""
    return sum_of_squares(tensors, torch.float32).sqrt()


class ShardedAdamW:
    def __init__(
        self,
        buckets: GradBuckets,
        mesh: Mesh,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.buckets, self.mesh = buckets.buckets, mesh
        self.betas, self.eps, self.weight_decay = betas, eps, weight_decay
        self.state_dtype = state_dtype
        # Weights at least as precise as the state are their own masters (the shard is a view,
        # updated in place); bf16 weights under fp32 state get an fp32 copy.
        self.masters: list[torch.Tensor] = [
            b.param_flat[b.shard].detach()
            if b.param_flat.dtype in (torch.float32, state_dtype)
            else b.param_flat[b.shard].detach().to(state_dtype)
            for b in self.buckets
        ]
        # Moments per bucket, allocated at the first update (or when a checkpoint loads).
        self.moments: list[dict[str, torch.Tensor]] = [{} for _ in self.buckets]
        # The learning rate, set before every step (``set_lr``: the schedule's value).
        self.lr_t = torch.zeros((), dtype=torch.float32, device=mesh.device)
        self.step_t = torch.zeros((), dtype=torch.float32, device=mesh.device)

    def set_lr(self, lr: float) -> None:
        self.lr_t.fill_(lr)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the reduced gradients, over all shards of all stages."""
        shards = [g for b in self.buckets for _, g in b.gradients()]
        # fp32 accumulation on the GPU (tree reductions); the CPU's norm kernel sums in order,
        # which loses ~1e-5 over a million fp32 squares, so it accumulates in fp64 there.
        acc = torch.float32 if self.mesh.device.type == "cuda" else torch.float64
        sq = sum_of_squares(shards, acc).to(self.mesh.device).float()
        if self.mesh.distributed:
            TRACE.enter("all_reduce (gradient norm)", group="world", nbytes=sq.nbytes)
            with TRACE.blocked():
                dist.all_reduce(sq)
        return sq.sqrt()

    def update(
        self, norm: torch.Tensor, max_norm: float, apply: torch.Tensor | None = None
    ) -> None:
        """Apply the step given the global gradient norm (see ``grad_norm``): clip to
        ``max_norm`` (inf: no clipping), update the shards, gather the weights. Where the 0-d
        device flag ``apply`` is false nothing changes (the step count neither): the trainer
        queues the update before reading whether the guards skip the step."""
        scale = None
        if max_norm != float("inf"):
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        self.step_t += 1 if apply is None else apply.to(self.step_t.dtype)
        rows_written: list[nn.Parameter] = []
        for i, (m, b) in enumerate(zip(self.masters, self.buckets, strict=True)):
            state = self.shards(i, allocate=True)
            weights = b.param_flat[b.shard]
            copy = not _same(m, weights)
            for start, g, p in _pieces(b):
                part = slice(start, start + g.numel())
                rows = None
                if p is not None:  # a whole FP8 weight: its rowwise copy in the same pass
                    rows = cache_of(p).buffers(p).rows_2d()  # type: ignore[union-attr]
                    rows_written.append(p)
                adamw_step_(
                    m[part],
                    g,
                    state["exp_avg"][part],
                    state["exp_avg_sq"][part],
                    self.lr_t,
                    self.step_t,
                    scale,
                    beta1=self.betas[0],
                    beta2=self.betas[1],
                    eps=self.eps,
                    weight_decay=self.weight_decay if b.decay else 0.0,
                    out=weights[part] if copy else None,
                    apply=apply,
                    rows=rows,
                )
            b.release_gradients()
        self._gather_weights()
        self._refresh_fp8(rows_written)

    def _refresh_fp8(self, rows_written: list[nn.Parameter]) -> None:
        """The FP8 copies of every weight that has them, after the weights are final for the
        step: the columnwise copy of those whose rows the update wrote, both copies of the
        rest; each cache then tagged with its weight's new version (module doc)."""
        cached = [p for b in self.buckets for p in b.params if cache_of(p) is not None]
        weights_written(cached)  # written by kernels and collectives torch does not count
        fused = {id(p) for p in rows_written}
        with torch.no_grad():
            for p in cached:
                cache = cache_of(p)
                assert cache is not None
                if id(p) in fused and cache.operands is not None:  # rows already written
                    quantize_columns_into(p, cache.operands)
                    cache.filled(p)
                else:
                    cache.refill(p)

    def reset_masters(self) -> None:
        """Masters := the model's weights, after they were set from outside (a run that starts
        from a checkpoint's weights instead of its own init, ``init.from_hf``)."""
        for m, b in zip(self.masters, self.buckets, strict=True):
            if not _same(m, b.param_flat[b.shard]):
                m.copy_(b.param_flat[b.shard])

    def publish_weights(self) -> None:
        """Model weights := masters (cast to the model dtype), gathered over each bucket's group."""
        for m, b in zip(self.masters, self.buckets, strict=True):
            if not _same(m, b.param_flat[b.shard]):
                b.param_flat[b.shard].copy_(m)
        self._gather_weights()
        self._refresh_fp8([])

    def _gather_weights(self) -> None:
        for b in self.buckets:
            if b.group is not None:
                shard = b.param_flat[b.shard].clone()
                TRACE.enter(
                    "all_gather (updated weights)", group=b.kind, nbytes=b.param_flat.nbytes
                )
                with TRACE.blocked():
                    all_gather_flat(b.param_flat, shard, group=b.group)

    def shards(self, index: int, allocate: bool = False) -> dict[str, torch.Tensor]:
        """Bucket ``index``'s fp32 master shard and moments (zeros before the first step, or
        freshly allocated state to load into when ``allocate``)."""
        m, state = self.masters[index], self.moments[index]
        if allocate and not state:
            state["exp_avg"] = torch.zeros_like(m, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(m, dtype=self.state_dtype)
        zeros = torch.zeros_like(m, dtype=self.state_dtype) if not state else None
        return {
            "param": m,
            "exp_avg": state.get("exp_avg", zeros),
            "exp_avg_sq": state.get("exp_avg_sq", zeros),
        }

    def allocate_state(self) -> None:
        """Allocate the moments of every bucket now (before a step is captured as a graph)."""
        for i in range(len(self.buckets)):
            self.shards(i, allocate=True)

    def set_step(self, step: int) -> None:
        self.step_t.fill_(float(step))

    def state_numel(self) -> int:
        """Elements of optimizer state held by this rank (master + two moments)."""
        return sum(
            m.numel() + sum(v.numel() for v in state.values())
            for m, state in zip(self.masters, self.moments, strict=True)
        )

    def full_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Unsharded fp32 master weights and moments by parameter name (this stage's names).

        Collective over the rank's groups: every rank of the stage must call it.
        """
        out: dict[str, dict[str, torch.Tensor]] = {}
        for i, b in enumerate(self.buckets):
            flats = {k: _gather(v, b) for k, v in self.shards(i).items()}
            for name, p, off in zip(b.names, b.params, b.offsets, strict=True):
                pieces = {k: flat[off : off + p.numel()].view(p.shape) for k, flat in flats.items()}
                if b.is_expert:
                    pieces = {k: gather_experts(v, self.mesh) for k, v in pieces.items()}
                out[name] = {k: v.clone() for k, v in pieces.items()}
        return out

    @property
    def step_count(self) -> int:
        """Updates applied so far (a host read: for checkpoints and logs, not the step)."""
        return int(self.step_t)


def _pieces(b: Bucket) -> list[tuple[int, torch.Tensor, nn.Parameter | None]]:
    """This rank's gradient pieces (``Bucket.gradients``) as (offset in the shard, gradient,
    the FP8 weight the piece is, or None): where the rank updates the whole bucket, each
    parameter with an FP8 cache is a piece of its own, so that its update can write its rowwise
    FP8 copy (the update is elementwise: cutting pieces changes no bit)."""
    pieces = b.gradients()
    fp8 = [(p, off) for p, off in zip(b.params, b.offsets, strict=True) if cache_of(p) is not None]
    if b.group is not None or not fp8:
        return [(start, g, None) for start, g in pieces]
    out: list[tuple[int, torch.Tensor, nn.Parameter | None]] = []
    for start, g in pieces:
        end, cursor = start + g.numel(), start
        for p, off in fp8:
            if off < start or off + p.numel() > end:
                continue
            if off > cursor:
                out.append((cursor, g[cursor - start : off - start], None))
            out.append((off, g[off - start : off - start + p.numel()], p))
            cursor = off + p.numel()
        if cursor < end:
            out.append((cursor, g[cursor - start :], None))
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same memory (a master that is the weights themselves)."""
    return a.data_ptr() == b.data_ptr() and a.dtype == b.dtype


def _gather(shard: torch.Tensor, b: Bucket) -> torch.Tensor:
    if b.group is None:
        return shard
    out = shard.new_empty(shard.numel() * group_size(b.group))
    all_gather_flat(out, shard.contiguous(), group=b.group)
    return out
