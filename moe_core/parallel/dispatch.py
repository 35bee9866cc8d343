"""Expert-parallel token dispatch: experts stay on their rank, token rows travel.

Backends share ``moe_core.model.moe.TokenDispatcher``: ``local`` is the model's own
``LocalDispatcher``; ``all_to_all`` (here) uses ``torch.distributed.all_to_all_single`` (NCCL on
GPU, gloo on CPU); ``nvshmem_rowwise`` (``RowwiseDispatcher``, at the end) writes rows straight
into the owners' buffers through symmetric memory and reads the host never.

A token routed to several experts of one rank travels to that rank once; the receiving rank runs
its experts on it, sums their weighted outputs and sends one row back. With top-8 over 2 ranks
that is ~4x fewer rows on the wire than one row per routed assignment, in both directions and in
backward. Every row move is a slot kernel (``moe_kernels.slot_permute``, Triton on GPU):

- sender: the (token, rank) pairs a token visits form a [T, P] slot map into the send buffer
  (rank-major, token order within a rank; -1 where a token does not visit a rank), built by the
  routing kernel with ranks as experts (``expert_slots``: no sort, no scan over tokens).
  ``permute_to_slots`` writes the send buffer, and the same map carries each token's routing
  (its K weights and global expert ids in one row of the weights' dtype, at least fp32: ids
  below 2**24 are exact there);
- receiver: choices of experts on other ranks become -1, ``expert_slots`` with ``n_rows`` the
  exact number of local assignments lays out an expert-ordered buffer with no padding rows,
  ``permute_to_slots`` fills it, ``slot_weights`` lays the received router weights out along
  it, the experts run with the weights applied in their SwiGLU, and ``sum_from_slots`` sums each
  received token's weighted expert outputs (the three as ``Experts.routed``: FP8 experts
  quantize the received rows into their slots);
- back on the sender, ``sum_from_slots`` sums the rows returned by the ranks.

With FP8 rows (``precision.fp8_parts`` naming "dispatch") the sender quantizes the send
buffer by rows (``moe_kernels.fp8.quantize_rowwise``: E4M3 with one fp32 scale per row) and the
two travel in two all-to-alls, about half the bytes of bf16 rows; the receiver dequantizes
into the weights' dtype before its experts (the rowwise dispatcher the same, its scales in the
routing rows: ``RowwiseExchange.put_fp8``). The combine's rows and every gradient travel in
the weights' dtype; the quantization is a straight-through step (its gradient the identity).

Backward passes are the slot kernels' and the all-to-all's own: deterministic (fixed-order sums,
no atomics), with no host read. A routing weight's gradient comes from the one rank holding its
expert (the others give exactly 0 for it) and is summed over ranks in fixed order.

Host synchronization: one per layer forward, reading the per-rank row counts and this rank's
assignment count together (a few integers), because ``all_to_all_single`` takes its split sizes
as Python ints and the receiving rank's buffers are sized by them. Backward reuses those sizes.
Everything else (routing, per-expert counts, offsets, slot maps) stays on the device. The rows
sent to other ranks and the tokens dispatched are added up from those same ints (``rows_sent``,
``tokens``; not inside ``router_stats_paused``), so the trainer logs the rows a token really
sends (``ep_rows_per_token``) at no cost; ``moe plan`` predicts it (``parallel.placement``).
Group-limited routing needs nothing here: a token's rows reach only the ranks its experts lie
on, which its groups bound (``parallel.placement``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from moe_core.model.moe import Experts, Routing, router_stats_recording
from moe_core.parallel.placement import RoutingRule, visit_probabilities
from moe_core.parallel.symmetric import SymmetricHeap
from moe_core.parallel.trace import DISPATCH, TRACE
from moe_kernels.fp8 import E4M3, dequantize, quantize_rowwise
from moe_kernels.routing import ExpertSlots, expert_slots
from moe_kernels.rowwise import PeerRows, gather_rows, put_rows
from moe_kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots

EXACT_FP32_INTS = 2**24  # expert ids travel as fp32 beside the weights
DISPATCH_BACK = "all_to_all (token dispatch, backward)"
ROWWISE = "rowwise exchange (token dispatch)"  # what the hang watchdog's trace names


def check_local_experts(experts: Experts, offset: int, n_local: int) -> None:
    """The experts module must hold exactly the experts this rank routes to."""
    if experts.expert_offset != offset or experts.n_experts != n_local:
        raise ValueError(
            f"experts hold [{experts.expert_offset}, +{experts.n_experts}), this rank routes "
            f"to [{offset}, +{n_local})"
        )


def rank_slots(experts_TK: torch.Tensor, P: int, n_local: int) -> tuple[torch.Tensor, ExpertSlots]:
    """The ranks each token visits ([T, P] bool) and, with ranks as experts, each visit's slot
    in a rank-major send order (``expert_slots``: counts per rank, no sort, no host read)."""
    T, dev = experts_TK.shape[0], experts_TK.device
    dest_TK = torch.div(experts_TK, n_local, rounding_mode="floor")
    visits_TP = torch.zeros(T, P, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)
    rank_TP = torch.where(visits_TP, torch.arange(P, device=dev), -1)
    return visits_TP, expert_slots(rank_TP, P)


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: the backward sends gradients back the same way."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        with TRACE.blocked():
            dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        TRACE.enter(DISPATCH_BACK, group="ep", nbytes=g.nbytes)
        dx = g.new_empty(sum(in_splits), *g.shape[1:])
        with TRACE.blocked():
            dist.all_to_all_single(dx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` with Python split sizes, differentiable when ``x`` needs a grad."""
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group)
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    with TRACE.blocked():
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def _send_fp8_rows(
    x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group
) -> torch.Tensor:
    q_SD, s_S = quantize_rowwise(x_SD)
    q_RD = all_to_all(q_SD.view(torch.uint8), out_splits, in_splits, group)
    s_R = all_to_all(s_S, out_splits, in_splits, group)
    return dequantize(q_RD.view(E4M3), s_R).to(x_SD.dtype)


class _FP8AllToAll(torch.autograd.Function):
    """Rows sent as E4M3 with a scale each (``_send_fp8_rows``); the gradient comes back in
    the rows' dtype, as if they had travelled unquantized (straight-through)."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _send_fp8_rows(x, out_splits, in_splits, group)

    backward = staticmethod(_AllToAll.backward)


def fp8_all_to_all(
    x_SD: torch.Tensor, out_splits: list[int], in_splits: list[int], group
) -> torch.Tensor:
    """``all_to_all`` of [S, D] rows quantized by rows to E4M3 for the trip (module doc)."""
    if x_SD.requires_grad:
        return _FP8AllToAll.apply(x_SD, out_splits, in_splits, group)
    return _send_fp8_rows(x_SD.contiguous(), out_splits, in_splits, group)


class AllToAllDispatcher:
    """Dropless expert parallelism over ``group`` (``ep_size`` ranks, ``n_local`` experts each;
    this rank holds experts ``[ep_rank * n_local, (ep_rank + 1) * n_local)``); ``fp8_rows``:
    token rows travel as E4M3 (module doc)."""

    def __init__(
        self, group: dist.ProcessGroup, ep_size: int, n_local: int, fp8_rows: bool = False
    ) -> None:
        if ep_size * n_local > EXACT_FP32_INTS:
            raise ValueError(f"{ep_size * n_local} experts: ids must stay below 2**24")
        self.group, self.ep_size, self.n_local = group, ep_size, n_local
        self.fp8_rows = fp8_rows
        self.where = ""  # the MoE module it serves (parallelize names it), for the trace
        self.ep_rank = dist.get_rank(group)
        self.expert_offset = self.ep_rank * n_local
        # Rows sent to other ranks and tokens dispatched since ``take_counts``, from the split
        # sizes the host reads anyway (plain ints: no extra transfer; not while recomputing).
        self.rows_sent, self.tokens = 0, 0

    def take_counts(self) -> tuple[int, int]:
        """(rows sent to other ranks, tokens dispatched) since the last call, then reset."""
        counts, (self.rows_sent, self.tokens) = (self.rows_sent, self.tokens), (0, 0)
        return counts

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        P, El = self.ep_size, self.n_local
        K = routing.experts_TK.shape[1]
        check_local_experts(experts, self.expert_offset, El)
        TRACE.enter(DISPATCH, self.where, "ep", x_TD.nbytes)

        # Sender: the ranks each token visits, as a [T, P] slot map into the send buffer.
        _, send = rank_slots(routing.experts_TK, P, El)  # counts_E: rows to each rank

        # Exchange sizes (rows, and routed assignments, per rank pair); one host read.
        sizes_P2 = torch.stack([send.counts_E, routing.counts_E.view(P, El).sum(1)], dim=1)
        recv_sizes_P2 = torch.empty_like(sizes_P2)
        with TRACE.blocked():  # the host waits here for the slowest rank's sizes
            dist.all_to_all_single(recv_sizes_P2, sizes_P2, group=self.group)
            sizes = [send.counts_E, recv_sizes_P2[:, 0], recv_sizes_P2[:, 1].sum(0, True)]
            host_list = torch.cat(sizes).cpu().tolist()
        send_splits, recv_splits = host_list[:P], host_list[P : 2 * P]
        n_send, n_assigned = sum(send_splits), host_list[-1]
        if router_stats_recording():
            self.rows_sent += n_send - send_splits[self.ep_rank]
            self.tokens += x_TD.shape[0]

        # Each visited token once per rank, with its routing (weights and global expert ids).
        route_dtype = torch.promote_types(routing.weights_TK.dtype, torch.float32)
        route_T2K = torch.cat(
            [routing.weights_TK.to(route_dtype), routing.experts_TK.to(route_dtype)], dim=1
        )
        x_SD = permute_to_slots(x_TD, send.slot_TK, n_send, every_row_mapped=True)
        route_S2K = permute_to_slots(route_T2K, send.slot_TK, n_send, every_row_mapped=True)
        send_rows = fp8_all_to_all if self.fp8_rows else all_to_all
        x_RD = send_rows(x_SD, recv_splits, send_splits, self.group)
        route_R2K = all_to_all(route_S2K, recv_splits, send_splits, self.group)

        # Receiver: this rank's experts on the received tokens (other ranks' choices dropped),
        # in an expert-ordered buffer of exactly the local assignments, the router weights
        # applied inside the experts (as ``LocalDispatcher``); outputs pre-summed per token.
        w_RK = route_R2K[:, :K]
        local_RK = route_R2K[:, K:].to(torch.int64) - self.expert_offset
        local_RK = torch.where((local_RK >= 0) & (local_RK < El), local_RK, -1)
        recv = expert_slots(local_RK, El, n_rows=n_assigned)
        weights_M = slot_weights(w_RK, recv.slot_TK, n_assigned)
        y_RD = experts.routed(
            x_RD, recv.slot_TK, n_assigned, recv.offs_E, weights_M, every_row_mapped=True
        )

        # One row back per (token, rank) pair; each token's rows summed over ranks.
        y_SD = all_to_all(y_RD, send_splits, recv_splits, self.group)
        return sum_from_slots(y_SD, send.slot_TK, every_row_mapped=True)


# --------------------------------------------------------------------------------------------
# rowwise over symmetric memory
#
# The algorithm (rank r of P, T tokens, each layer; ``parallel.symmetric`` for the heap):
#
# 1. Sender, as in all-to-all: the ranks each token visits and each (token, rank) pair's place
#    in a rank-major send order (``expert_slots`` with ranks as experts).
# 2. Metadata on the device: r writes its row of counts (rows it sends to each rank) into row r
#    of every rank's [P, P] count matrix (barrier before and after). From the matrix, r knows
#    where its rows land on owner p (after the rows of ranks below r), and p how many it got.
# 3. Put: r writes each visiting token's row, and its routing row (router weights and global
#    expert ids), into the owner's receive buffer at its place there; a row past the buffer's
#    capacity is not moved and is counted in ``dropped`` (from the counts, in closed form).
# 4. Receiver: the first ``received`` rows are real (the count matrix says how many); this
#    rank's experts run on them through the slot kernels into an expert-ordered buffer of a
#    static assignment capacity (assignments past it are dropped and counted), the router
#    weights applied in the SwiGLU, grouped GEMMs stopping at the real rows; each received
#    row's outputs are summed into one row.
# 5. Gather: every rank publishes its per-row results in its buffer, and each source reads its
#    rows back from the ranks its tokens visited and sums them, in rank order, in fp32.
# Backward mirrors it: the gather's adjoint is a put of the output gradients, the put's is a
# gather of the input (and router-weight) gradients. Every move is bracketed by barriers on
# the heap (device-side on the GPU), so buffers are reused layer after layer safely.
#
# Host synchronization: none, in forward and backward. Buffer sizes are static
# (``rowwise_capacity``: dropless by default, or bounded by ``parallel.ep_capacity_factor``);
# rows or assignments that found no room are counted on the device and the trainer stops the
# step at its single host read (``ReceiveBufferOverflowError``), before anything is applied.
# The moves are ``moe_kernels.rowwise`` (Triton on the GPU: one kernel per move carrying token and
# routing rows together, the destination row computed in it from the send slot and the
# owner's base; the PyTorch reference on the CPU). Received rows are read in place from the
# buffer (no copy); a rank's results are copied into its buffer to be read back.


def rowwise_capacity(
    n_experts: int,
    top_k: int,
    ep: int,
    tokens: int,
    factor: float | None,
    n_groups: int = 1,
    top_k_groups: int = 1,
) -> tuple[int, int]:
    """(rows, assignments) one rank's receive buffers hold, for ``tokens`` tokens per rank.

    Dropless (``factor`` None): every token of every rank may visit this rank (``ep * tokens``
    rows) and pick ``min(top_k, n_local)`` of its experts. With a factor: that many times the
    load expected under uniform routing (a token visits a given rank with probability
    ``1 - C(E - E/ep, k) / C(E, k)``, or under group-limited routing, ``n_groups`` and
    ``top_k_groups``, the busiest rank's ``placement.visit_probabilities``; a rank's experts
    get ``tokens * top_k`` assignments either way), never more than the dropless sizes.
    """
    n_local = n_experts // ep
    rows, assignments = ep * tokens, ep * tokens * min(top_k, n_local)
    if factor is None:
        return rows, assignments
    visit = max(visit_probabilities(RoutingRule(n_experts, top_k, n_groups, top_k_groups), ep))
    return (
        min(rows, math.ceil(factor * ep * tokens * visit)),
        min(assignments, math.ceil(factor * tokens * top_k)),
    )


class ReceiveBufferOverflowError(RuntimeError):
    """Routed rows found no room in the rowwise dispatcher's capacity-bounded buffers."""


class RowwiseExchange:
    """The symmetric staging buffers one rank's MoE layers share (one layer uses them at a time)
    and the three moves of ``RowwiseDispatcher``; ``dropped`` counts rows and assignments that
    found no room since it was last reset (the trainer reads it with the step's host read)."""

    def __init__(
        self,
        heap: SymmetricHeap,
        rows: int,
        assignments: int,
        d_model: int,
        top_k: int,
        dtype: torch.dtype,
        fp8_rows: bool = False,
    ) -> None:
        self.heap, self.rows, self.assignments = heap, rows, assignments
        self.d_model, self.top_k, self.dtype = d_model, top_k, dtype
        self.fp8_rows = fp8_rows
        self.route_dtype = torch.promote_types(dtype, torch.float32)  # ids exact below 2**24
        shapes = self.buffer_shapes(heap.size, rows, d_model, top_k, dtype, fp8_rows)
        self.x, self.route, self.counts = (heap.buffer(n, dt) for n, dt in shapes)
        self.dropped = torch.zeros((), dtype=torch.int64, device=heap.device)

    @staticmethod
    def route_width(top_k: int, fp8_rows: bool) -> int:
        """A routing row: the K weights and K expert ids, and with FP8 token rows their scale."""
        return 2 * top_k + int(fp8_rows)

    @classmethod
    def buffer_shapes(
        cls,
        P: int,
        rows: int,
        d_model: int,
        top_k: int,
        dtype: torch.dtype,
        fp8_rows: bool = False,
    ) -> list[tuple[int, torch.dtype]]:
        """(elements, dtype) of the symmetric buffers: token rows (FP8 ones, with
        ``fp8_rows``, in the first bytes of the same allocation, which the backward's bf16
        gradients use) and routing rows, each with a spare row at the end for writes that go
        nowhere, and the [P, P] count matrix."""
        route = torch.promote_types(dtype, torch.float32)
        return [
            ((rows + 1) * d_model, dtype),
            ((rows + 1) * cls.route_width(top_k, fp8_rows), route),
            (P * P, torch.int64),
        ]

    @classmethod
    def buffer_bytes(
        cls,
        P: int,
        rows: int,
        d_model: int,
        top_k: int,
        dtype: torch.dtype,
        fp8_rows: bool = False,
    ) -> int:
        """Bytes of symmetric memory one rank holds (what ``moe plan`` shows)."""
        shapes = cls.buffer_shapes(P, rows, d_model, top_k, dtype, fp8_rows)
        return sum(n * dt.itemsize for n, dt in shapes)

    def exchange_counts(self, mine_P: torch.Tensor) -> torch.Tensor:
        """Every rank's rows sent to each rank as a [P, P] matrix (source, owner), on every
        rank: rank r's row written into row r of every peer's matrix."""
        P, r = self.heap.size, self.heap.rank
        self.heap.barrier()
        for p in range(P):
            self.counts.peer(p).view(P, P)[r].copy_(mine_P)
        self.heap.barrier()
        return self.counts.local.view(P, P).clone()

    def put(
        self, rows: list[torch.Tensor], slot_TP: torch.Tensor, base_P: torch.Tensor
    ) -> list[torch.Tensor]:
        """Each source's token rows (and routing rows) into the receive buffers of the ranks
        they visit (``moe_kernels.rowwise.put_rows``); returns this rank's receive buffers as
        views, valid until the next move (their readers run before it, in stream order)."""
        bufs = self._buffers(rows)
        self.heap.barrier()
        put_rows(rows, bufs, slot_TP, base_P)
        self.heap.barrier()
        return [b.views[self.heap.rank] for b in bufs]

    def put_fp8(
        self, x_TD: torch.Tensor, route_TF: torch.Tensor, slot_TP: torch.Tensor, base_P
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``put`` with the token rows as E4M3 (``quantize_rowwise``), their scales in a last
        column of the routing rows; returns the received rows dequantized into the rows' dtype
        (a tensor of their own, as the all-to-all's FP8 rows) and the routing rows (a view)."""
        q_TD, s_T = quantize_rowwise(x_TD)
        route_TF1 = torch.cat([route_TF, s_T[:, None].to(route_TF.dtype)], dim=1)
        R, D = self.rows + 1, self.d_model
        bufs = [self.x.rows_of(torch.uint8, R, D), self.route.rows(route_TF1.shape[1])]
        self.heap.barrier()
        put_rows([q_TD.view(torch.uint8), route_TF1], bufs, slot_TP, base_P)
        self.heap.barrier()
        q_RD, route_RF1 = (b.views[self.heap.rank] for b in bufs)
        x_RD = dequantize(q_RD.view(E4M3), route_RF1[:, -1].float()).to(x_TD.dtype)
        return x_RD, route_RF1[:, :-1]

    def gather(
        self, rows: list[torch.Tensor], slot_TP: torch.Tensor, base_P: torch.Tensor
    ) -> list[torch.Tensor]:
        """The adjoint of ``put``: each rank publishes its receive-buffer rows, and each source
        sums, in rank order and fp32, the rows its tokens left at the ranks they visited."""
        bufs = self._buffers(rows)
        self.heap.barrier()
        for b, src in zip(bufs, rows, strict=True):
            mine = b.views[self.heap.rank]
            if mine.data_ptr() != src.data_ptr():
                mine.copy_(src)
        self.heap.barrier()
        return gather_rows(bufs, slot_TP, base_P)

    def _buffers(self, rows: list[torch.Tensor]) -> list[PeerRows]:
        return [buf.rows(r.shape[1]) for buf, r in zip((self.x, self.route), rows, strict=False)]


class _Put(torch.autograd.Function):
    """Token rows (and their routing rows) to the ranks they visit; backward: ``gather``."""

    @staticmethod
    def forward(ctx, x_TD, route_TF, slot_TP, base_P, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        ctx.save_for_backward(slot_TP, base_P)
        return tuple(exchange.put([x_TD, route_TF], slot_TP, base_P))

    @staticmethod
    def backward(ctx, g_xR, g_routeR):  # type: ignore[override]
        slot_TP, base_P = ctx.saved_tensors
        g_x, g_route = ctx.exchange.gather(
            [g_xR.contiguous(), g_routeR.contiguous()], slot_TP, base_P
        )
        return g_x, g_route, None, None, None


class _PutFP8(torch.autograd.Function):
    """``_Put`` with the token rows travelling as E4M3 (``RowwiseExchange.put_fp8``); the
    gradient comes back in the rows' dtype, as if they had travelled unquantized (straight
    through, as the all-to-all's FP8 rows)."""

    @staticmethod
    def forward(ctx, x_TD, route_TF, slot_TP, base_P, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        ctx.save_for_backward(slot_TP, base_P)
        return exchange.put_fp8(x_TD, route_TF, slot_TP, base_P)

    @staticmethod
    def backward(ctx, g_xR, g_routeR):  # type: ignore[override]
        slot_TP, base_P = ctx.saved_tensors
        # the routing rows' buffer is one column wider (the scales): their gradient is 0
        g_routeR1 = torch.cat([g_routeR, g_routeR.new_zeros(g_routeR.shape[0], 1)], dim=1)
        g_x, g_route = ctx.exchange.gather([g_xR.contiguous(), g_routeR1], slot_TP, base_P)
        return g_x, g_route[:, :-1], None, None, None


class _Gather(torch.autograd.Function):
    """Each rank's per-row results back to the tokens' ranks, summed; backward: ``put``."""

    @staticmethod
    def forward(ctx, y_RD, slot_TP, base_P, exchange):  # type: ignore[override]
        ctx.exchange = exchange
        ctx.save_for_backward(slot_TP, base_P)
        return exchange.gather([y_RD.contiguous()], slot_TP, base_P)[0]

    @staticmethod
    def backward(ctx, g_TD):  # type: ignore[override]
        slot_TP, base_P = ctx.saved_tensors
        (g_R,) = ctx.exchange.put([g_TD.contiguous()], slot_TP, base_P)
        return g_R, None, None, None


class RowwiseDispatcher:
    """Expert parallelism over symmetric memory with no host read (see the module docstring's
    rowwise section): routing metadata is exchanged on the device, each token row is written
    once into each visited rank's receive buffer, and results are read back."""

    def __init__(self, exchange: RowwiseExchange, n_local: int) -> None:
        P = exchange.heap.size
        if P * n_local > EXACT_FP32_INTS:
            raise ValueError(f"{P * n_local} experts: ids must stay below 2**24")
        self.exchange, self.ep_size, self.n_local = exchange, P, n_local
        self.expert_offset = exchange.heap.rank * n_local
        self.where = ""  # the MoE module it serves (parallelize names it), for the trace

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        ex, P, El = self.exchange, self.ep_size, self.n_local
        K = routing.experts_TK.shape[1]
        dev, R, M = x_TD.device, ex.rows, ex.assignments
        check_local_experts(experts, self.expert_offset, El)
        TRACE.enter(ROWWISE, self.where, "ep", x_TD.nbytes)
        if x_TD.dtype != ex.dtype or ex.top_k != K or x_TD.shape[1] != ex.d_model:
            raise ValueError(
                f"tokens {tuple(x_TD.shape)} {x_TD.dtype} top-{K} do not fit the exchange's "
                f"buffers (d_model {ex.d_model}, {ex.dtype}, top-{ex.top_k})"
            )

        # Sender: the ranks each token visits and its row's place in a rank-major send order.
        _, send = rank_slots(routing.experts_TK, P, El)

        # Routing metadata on the device: every rank learns how many rows each rank sends to
        # each rank, so a source knows where its rows land on each owner: after those of lower
        # ranks (``base_P``: that start less the rows' start in the send order; the moves add
        # it to each row's send slot). Rows past an owner's capacity are counted, not moved.
        counts_PP = ex.exchange_counts(send.counts_E)
        me = ex.heap.rank
        before_P = counts_PP.cumsum(0)[me] - counts_PP[me]
        base_P = before_P - (send.counts_E.cumsum(0) - send.counts_E)
        ex.dropped += (before_P + send.counts_E - R).clamp(min=0).minimum(send.counts_E).sum()

        route_T2K = torch.cat(
            [routing.weights_TK.to(ex.route_dtype), routing.experts_TK.to(ex.route_dtype)], dim=1
        )
        put = _PutFP8 if ex.fp8_rows else _Put
        x_RD, route_R2K = put.apply(x_TD, route_T2K, send.slot_TK, base_P, ex)

        # Receiver: the first ``received`` rows are real. Its experts' assignments go into an
        # expert-ordered buffer of M rows (rows past the real count are never read).
        received = counts_PP[:, me].sum().clamp_max(R)
        real_R = torch.arange(R + 1, device=dev) < received
        local_RK = route_R2K[:, K:].to(torch.int64) - self.expert_offset
        local_RK = torch.where((local_RK >= 0) & (local_RK < El) & real_R[:, None], local_RK, -1)
        fits_R = torch.cumsum((local_RK >= 0).sum(1), 0) <= M
        ex.dropped += ((local_RK >= 0) & ~fits_R[:, None]).sum()
        local_RK = torch.where(fits_R[:, None], local_RK, -1)
        recv = expert_slots(local_RK, El, n_rows=M)
        offs_E = recv.counts_E.cumsum(0).to(torch.int32)  # grouped GEMMs stop at the real rows
        weights_M = slot_weights(route_R2K[:, :K].to(routing.weights_TK.dtype), recv.slot_TK, M)
        if ex.fp8_rows:  # dequantized rows of their own, which FP8 experts may keep
            y_RD = experts.routed(x_RD, recv.slot_TK, M, offs_E, weights_M, every_row_mapped=False)
        else:
            # not ``experts.routed``: FP8 experts would keep x_RD for backward, a view of the
            # receive buffer that the next layer's put overwrites
            x_MD = permute_to_slots(x_RD, recv.slot_TK, M, every_row_mapped=False)
            y_MD = experts(x_MD, offs_E, weights_M)
            y_RD = sum_from_slots(y_MD, recv.slot_TK, every_row_mapped=False)
        return _Gather.apply(y_RD, send.slot_TK, base_P, ex)
