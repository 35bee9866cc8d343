"""What one training step reports, and how its values cross ranks and reach the host.

``StepValues`` names every value a step reads back (summed losses, router statistics, dropped
rows, the stop flag, peak memory, the gradient norm, the all-to-all's rows and tokens, every
rank's times of the previous step); each field says how ranks combine it.
``all_reduce`` packs them into one float64 vector and reduces it in one collective (a sum over
all ranks: a maximum travels as one slot per rank, taken after the sum; a per-rank field too,
kept as every rank's row); ``read`` brings the
result to the host in one transfer (the step's only host read), as the same structure on the
CPU, so the trainer reads each value by name; ``start_read`` starts that transfer without
waiting for it, so the trainer queues the optimizer before it waits. ``StepMetrics`` is the
logged record of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch
import torch.distributed as dist

from moe_core.parallel.trace import TRACE

# how a field combines over ranks (LOCAL: it does not; PER_RANK: every rank's value, by rank)
SUM, MAX, LOCAL, PER_RANK = "sum", "max", "local", "per_rank"
SUMMED, MAXIMUM, AS_IS, BY_RANK = ({"reduce": r} for r in (SUM, MAX, LOCAL, PER_RANK))


@dataclass
class StepValues:
    """One step's values (device tensors, any float or integer dtype, any shape); each field's
    ``reduce`` says how ranks combine it."""

    ce: torch.Tensor = field(metadata=SUMMED)  # cross-entropy over micro-batches and data ranks
    aux: torch.Tensor = field(metadata=SUMMED)  # weighted router losses, likewise
    mtp: torch.Tensor = field(metadata=SUMMED)  # [mtp_depth]: each MTP depth's ce, likewise
    lb: torch.Tensor = field(metadata=SUMMED)  # load-balancing scores over routers and calls
    z: torch.Tensor = field(metadata=SUMMED)  # z-losses, likewise
    routers: torch.Tensor = field(metadata=SUMMED)  # router layers over ranks (lb's divisor)
    dropped: torch.Tensor = field(metadata=SUMMED)  # rows the rowwise dispatchers had no room for
    stop: torch.Tensor = field(metadata=SUMMED)  # ranks asked to stop (SIGTERM / SIGINT)
    peak_mem_gib: torch.Tensor = field(metadata=MAXIMUM)  # the busiest rank's peak memory
    grad_norm: torch.Tensor = field(metadata=AS_IS)  # already global (the optimizer reduced it)
    # [layers, experts + 1]: per layer (global index) assignments per expert and summed
    # load-balancing score; a layer's row is summed over the ranks that hold it.
    router_table: torch.Tensor = field(metadata=SUMMED)
    # [this rank's layers, 2 x experts]: the expert bias before and after this step's update,
    # computed from the reduced table (so set after ``all_reduce``).
    expert_bias: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0), metadata=AS_IS)
    # the all-to-all dispatchers' rows sent to other ranks and tokens dispatched (host counts)
    ep_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(()), metadata=SUMMED)
    ep_tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(()), metadata=SUMMED)
    # [3] this rank's previous step: wall, own work and data-wait seconds (``stragglers``);
    # [world, 3] after ``all_reduce``, every rank's row
    rank_times: torch.Tensor = field(default_factory=lambda: torch.zeros(3), metadata=BY_RANK)
    # times the CUDA caching allocator found no free memory, freed its cache and retried while
    # this step was queued (each a device-wide sync), summed over ranks
    alloc_retries: torch.Tensor = field(default_factory=lambda: torch.zeros(()), metadata=SUMMED)

    def _names(self, reduce: str) -> list[str]:
        return [f.name for f in fields(self) if f.metadata["reduce"] == reduce]

    def pack(self, rank: int, world: int) -> torch.Tensor:
        """The communicated fields as one float64 vector: sums as they are, each maximum (and
        per-rank field) as ``world`` slots holding this rank's value in slot ``rank`` (zeros
        elsewhere)."""
        parts = [getattr(self, n).double().flatten() for n in self._names(SUM)]
        for n in self._names(MAX) + self._names(PER_RANK):
            v = getattr(self, n).double().flatten()
            slots = v.new_zeros(world, v.numel())
            slots[rank] = v
            parts.append(slots.flatten())
        device = self.grad_norm.device
        return torch.cat([p.to(device) for p in parts]) if parts else torch.zeros(0)

    def unpack(self, flat: torch.Tensor, world: int) -> StepValues:
        """The fields of a reduced ``pack`` vector (shaped as this structure's, float64), with
        this structure's local fields."""
        out: dict[str, torch.Tensor] = {}
        at = 0
        for n in self._names(SUM):
            like = getattr(self, n)
            out[n] = flat[at : at + like.numel()].view(like.shape)
            at += like.numel()
        for n in self._names(MAX):
            like = getattr(self, n)
            slots = flat[at : at + world * like.numel()].view(world, *like.shape)
            out[n] = slots.amax(dim=0)
            at += world * like.numel()
        for n in self._names(PER_RANK):
            like = getattr(self, n)
            out[n] = flat[at : at + world * like.numel()].view(world, *like.shape)
            at += world * like.numel()
        if at != flat.numel():
            raise ValueError(f"a packed step holds {flat.numel()} values, its fields {at}")
        return replace(self, **out)

    def all_reduce(self, rank: int = 0, world: int = 1) -> StepValues:
        """Every rank's values combined as each field says, in one collective over all ranks
        (none when ``world`` is 1); local fields are kept as they are."""
        flat = self.pack(rank, world)
        if world > 1:
            TRACE.enter("all_reduce (step values)", group="world", nbytes=flat.nbytes)
            with TRACE.blocked():
                dist.all_reduce(flat)
        return self.unpack(flat, world)

    def read(self) -> StepValues:
        """Every field on the host as float64, in one device-to-host transfer."""
        return self.start_read()()

    def start_read(self) -> Callable[[], StepValues]:
        """Start ``read``'s one transfer and return what finishes it: on CUDA a non-blocking
        copy into pinned memory and an event after it, which the returned function waits for,
        so device work queued in between (the optimizer) runs while the host waits only for the
        values."""
        names = [f.name for f in fields(self)]
        values = [getattr(self, n) for n in names]
        device = self.grad_norm.device
        flat = torch.cat([v.double().flatten().to(device) for v in values])
        done = None
        if device.type == "cuda":
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = flat.cpu()

        def finish() -> StepValues:
            if done is not None:
                with TRACE.blocked():  # the device's all-reduce waits for the slowest rank
                    done.synchronize()
            out, at = {}, 0
            for n, v in zip(names, values, strict=True):
                out[n] = host[at : at + v.numel()].view(v.shape)
                at += v.numel()
            return StepValues(**out)

        return finish


@dataclass
class StepMetrics:
    """One step as logged (``metrics.jsonl``, the console, MLflow)."""

    step: int
    loss: float  # next-token cross-entropy, mean over the global batch (never MTP's)
    aux_loss: float  # weighted router losses summed over layers (part of the objective)
    lb_loss: float  # load-balancing score, mean over layers and micro-batches (1.0 = uniform)
    z_loss: float
    grad_norm: float
    lr: float
    tokens_per_s_per_gpu: float
    model_tflops_per_gpu: float
    step_time_s: float
    skipped: bool = False
    spike: bool = False
    mfu: float | None = None
    peak_mem_gib: float | None = None
    # the ranks' CUDA allocator retries while the step was queued (``StepValues``; None off CUDA)
    alloc_retries: int | None = None
    eval_loss: float | None = None
    mtp_loss: float | None = None  # the MTP depths' cross-entropy, mean over depths and batch
    mtp_losses: list[float] | None = None  # each depth's (k = 0: the token two ahead)
    downstream: dict[str, dict[str, float]] | None = None  # per task: its accuracies
    router: dict[str, dict[str, Any]] = field(default_factory=dict)
    # rows a token sent to other expert-parallel ranks per MoE layer (all_to_all dispatcher;
    # what ``moe plan``'s rows per token predicts)
    ep_rows_per_token: float | None = None
    # a mixture's sources (data.sources), all ranks together: tokens trained on so far
    # (train.seq_len per instance) and epochs read (above 1: the source repeats)
    data_tokens: dict[str, int] | None = None
    data_epochs: dict[str, float] | None = None
    # every train.log_every steps with more than one rank: the ranks' times over the steps
    # since the last report and the stragglers (``stragglers.Stragglers.close``)
    ranks: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and k != "step"}


def alloc_retry_warning(step: int, retries: int) -> str:
    """The one warning of a run whose CUDA allocator ran out of free memory (said once: every
    step's count is in ``metrics.jsonl`` as ``alloc_retries``)."""
    times = "once" if retries == 1 else f"{retries} times"
    return (
        f"at step {step} the CUDA allocator found no free memory {times} and emptied its cache "
        "to retry, a device-wide sync that slows every step it happens in: lower "
        "train.micro_batch_size or turn on parallel.recompute (metrics.jsonl counts "
        "alloc_retries each step; said once)."
    )
