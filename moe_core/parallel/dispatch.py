"""Expert-parallel token dispatch: experts stay on their rank, routed token rows travel.

Backends share ``moe_core.model.moe.TokenDispatcher``: ``local`` is the model's own
``LocalDispatcher``; ``all_to_all`` (here) uses ``torch.distributed.all_to_all_single`` (NCCL on
GPU, gloo on CPU). Per layer and direction it reads one small tensor to the host: the per-rank
row counts, because ``all_to_all_single`` takes its split sizes as Python ints. Everything else
(routing, counts, offsets, permutations) stays on the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kernels.permute import combine_rows, cumulative_offsets, expert_order, permute_rows
from moe_core.model.moe import Experts, Routing


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
    return _AllToAll.apply(x, out_splits, in_splits, group)


class AllToAllDispatcher:
    """Dropless expert parallelism over ``group`` (``ep`` ranks, ``n_local`` experts each).

    1. sort this rank's assignments by global expert (so by destination rank too);
    2. exchange per-expert counts (a tensor all-to-all), then the token rows;
    3. regroup received rows by local expert, run the grouped GEMMs;
    4. send results back and combine them with the routing weights.
    """

    def __init__(self, group: dist.ProcessGroup, ep_size: int, n_local: int) -> None:
        self.group, self.ep_size, self.n_local = group, ep_size, n_local

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        P, El = self.ep_size, self.n_local
        top_k = routing.experts_TK.shape[1]
        order_M = expert_order(routing.experts_TK)
        x_MD = permute_rows(x_TD, order_M, top_k)

        # counts_PE[p, j]: rows rank p sends to my local expert j
        send_counts_PE = routing.counts_E.view(P, El)
        recv_counts_PE = torch.empty_like(send_counts_PE)
        dist.all_to_all_single(recv_counts_PE, send_counts_PE.contiguous(), group=self.group)
        splits = torch.stack([send_counts_PE.sum(1), recv_counts_PE.sum(1)]).cpu()  # the host read
        send_splits, recv_splits = splits[0].tolist(), splits[1].tolist()
        n_recv = sum(recv_splits)

        x_RD = all_to_all(x_MD, recv_splits, send_splits, self.group)  # rows by (source, expert)
        expert_of_row = torch.repeat_interleave(
            torch.arange(El, device=x_TD.device).repeat(P),
            recv_counts_PE.reshape(-1),
            output_size=n_recv,
        )
        regroup_R = torch.argsort(expert_of_row, stable=True)  # rows by (expert, source)
        x_GD = x_RD.index_select(0, regroup_R)
        y_GD = experts(x_GD, cumulative_offsets(recv_counts_PE.sum(0)))
        y_RD = torch.index_copy(torch.empty_like(y_GD), 0, regroup_R, y_GD)
        y_MD = all_to_all(y_RD, send_splits, recv_splits, self.group)
        return combine_rows(y_MD, order_M, routing.weights_TK)
