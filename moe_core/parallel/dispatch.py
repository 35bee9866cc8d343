"""Expert-parallel token dispatch: experts stay on their rank, token rows travel.

Backends share ``moe_core.model.moe.TokenDispatcher``: ``local`` is the model's own
``LocalDispatcher``; ``all_to_all`` (here) uses ``torch.distributed.all_to_all_single`` (NCCL on
GPU, gloo on CPU).

A token routed to several experts of one rank travels to that rank once; the receiving rank runs
its experts on it, sums their weighted outputs and sends one row back. With top-8 over 2 ranks
that is ~4x fewer rows on the wire than one row per routed assignment, in both directions and in
backward. Every row move is a slot kernel (``kernels.slot_permute``, Triton on GPU):

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
  received token's weighted expert outputs;
- back on the sender, ``sum_from_slots`` sums the rows returned by the ranks.

Backward passes are the slot kernels' and the all-to-all's own: deterministic (fixed-order sums,
no atomics), with no host read. A routing weight's gradient comes from the one rank holding its
expert (the others give exactly 0 for it) and is summed over ranks in fixed order.

Host synchronization: one per layer forward, reading the per-rank row counts and this rank's
assignment count together (a few integers), because ``all_to_all_single`` takes its split sizes
as Python ints and the receiving rank's buffers are sized by them. Backward reuses those sizes.
Everything else (routing, per-expert counts, offsets, slot maps) stays on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.routing import expert_slots
from kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots
from moe_core.model.moe import Experts, Routing

EXACT_FP32_INTS = 2**24  # expert ids travel as fp32 beside the weights


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: the backward sends gradients back the same way."""

    @staticmethod
    def forward(
        ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group
    ) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        dx = g.new_empty(sum(in_splits), *g.shape[1:])
        dist.all_to_all_single(dx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """``all_to_all_single`` with Python split sizes, differentiable when ``x`` needs a grad."""
    if x.requires_grad:
        return _AllToAll.apply(x, out_splits, in_splits, group)
    out = x.new_empty(sum(out_splits), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAllDispatcher:
    """Dropless expert parallelism over ``group`` (``ep_size`` ranks, ``n_local`` experts each;
    this rank holds experts ``[ep_rank * n_local, (ep_rank + 1) * n_local)``)."""

    def __init__(self, group: dist.ProcessGroup, ep_size: int, n_local: int) -> None:
        if ep_size * n_local > EXACT_FP32_INTS:
            raise ValueError(f"{ep_size * n_local} experts: ids must stay below 2**24")
        self.group, self.ep_size, self.n_local = group, ep_size, n_local
        self.expert_offset = dist.get_rank(group) * n_local

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        P, El = self.ep_size, self.n_local
        T, K = routing.experts_TK.shape
        dev = x_TD.device
        if experts.expert_offset != self.expert_offset or experts.n_experts != El:
            raise ValueError(
                f"experts hold [{experts.expert_offset}, +{experts.n_experts}), this rank routes "
                f"to [{self.expert_offset}, +{El})"
            )

        # Sender: the ranks each token visits, as a [T, P] slot map into the send buffer.
        dest_TK = torch.div(routing.experts_TK, El, rounding_mode="floor")
        visits_TP = torch.zeros(T, P, dtype=torch.bool, device=dev).scatter_(1, dest_TK, True)
        rank_TP = torch.where(visits_TP, torch.arange(P, device=dev), -1)
        send = expert_slots(rank_TP, P)  # counts_E: rows to each rank

        # Exchange sizes (rows, and routed assignments, per rank pair); one host read.
        sizes_P2 = torch.stack([send.counts_E, routing.counts_E.view(P, El).sum(1)], dim=1)
        recv_sizes_P2 = torch.empty_like(sizes_P2)
        dist.all_to_all_single(recv_sizes_P2, sizes_P2, group=self.group)
        host = torch.cat([send.counts_E, recv_sizes_P2[:, 0], recv_sizes_P2[:, 1].sum(0, True)])
        host_list = host.cpu().tolist()
        send_splits, recv_splits = host_list[:P], host_list[P : 2 * P]
        n_send, n_assigned = sum(send_splits), host_list[-1]

        # Each visited token once per rank, with its routing (weights and global expert ids).
        route_dtype = torch.promote_types(routing.weights_TK.dtype, torch.float32)
        route_T2K = torch.cat(
            [routing.weights_TK.to(route_dtype), routing.experts_TK.to(route_dtype)], dim=1
        )
        x_SD = permute_to_slots(x_TD, send.slot_TK, n_send, every_row_mapped=True)
        route_S2K = permute_to_slots(route_T2K, send.slot_TK, n_send, every_row_mapped=True)
        x_RD = all_to_all(x_SD, recv_splits, send_splits, self.group)
        route_R2K = all_to_all(route_S2K, recv_splits, send_splits, self.group)

        # Receiver: this rank's experts on the received tokens (other ranks' choices dropped),
        # in an expert-ordered buffer of exactly the local assignments, the router weights
        # applied inside the experts (as ``LocalDispatcher``); outputs pre-summed per token.
        w_RK = route_R2K[:, :K]
        local_RK = route_R2K[:, K:].to(torch.int64) - self.expert_offset
        local_RK = torch.where((local_RK >= 0) & (local_RK < El), local_RK, -1)
        recv = expert_slots(local_RK, El, n_rows=n_assigned)
        x_MD = permute_to_slots(x_RD, recv.slot_TK, n_assigned, every_row_mapped=True)
        weights_M = slot_weights(w_RK, recv.slot_TK, n_assigned)
        y_MD = experts(x_MD, recv.offs_E, weights_M)
        y_RD = sum_from_slots(y_MD, recv.slot_TK, every_row_mapped=True)

        # One row back per (token, rank) pair; each token's rows summed over ranks.
        y_SD = all_to_all(y_RD, send_splits, recv_splits, self.group)
        return sum_from_slots(y_SD, send.slot_TK, every_row_mapped=True)
