"""The argsort permutation path: the PyTorch MoE dispatch the slot kernels replaced (a baseline).

``benchmarks/moe_ops.py`` times it against the slot kernels (``moe_kernels.slot_permute``) and
the tests check that both compute the same rows. Training does not call it.

A routed assignment is a pair (token t, choice k); flattened it is ``a = t * K + k``. Sorting the
assignments by expert gives ``order_M`` (M = T * K): the assignment placed at expert-ordered slot
``m``. Everything here keeps shapes static and reads nothing on the host, so it runs inside a
CUDA graph. The backward passes are deterministic: no float atomics accumulate into one row.
"""

from __future__ import annotations

import torch


def expert_order(experts_TK: torch.Tensor) -> torch.Tensor:
    """``order_M``: assignments sorted by expert, stable (token order within an expert)."""
    return torch.argsort(experts_TK.reshape(-1), stable=True)


def cumulative_offsets(counts_E: torch.Tensor) -> torch.Tensor:
    """int32 cumulative segment ends, the form grouped GEMMs take."""
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, order_M: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order_M)
        ctx.top_k = top_k
        ctx.n_tokens = x_TD.shape[0]
        return x_TD.index_select(0, torch.div(order_M, top_k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, g_MD: torch.Tensor):  # type: ignore[override]
        (order_M,) = ctx.saved_tensors
        n_assignments = ctx.n_tokens * ctx.top_k
        if order_M.numel() == n_assignments:
            g_AD = torch.empty_like(g_MD)
        else:  # a subset of the assignments was gathered: the others get no gradient
            g_AD = g_MD.new_zeros(n_assignments, g_MD.shape[1])
        g_AD.index_copy_(0, order_M, g_MD)  # back to assignment order
        g_TD = g_AD.view(ctx.n_tokens, ctx.top_k, -1).sum(1)
        return g_TD, None, None


def permute_rows(x_TD: torch.Tensor, order_M: torch.Tensor, top_k: int) -> torch.Tensor:
    """``x_MD[m] = x_TD[order_M[m] // top_k]``: one row per routed assignment, expert-ordered.

    ``order_M`` is a permutation of ``range(T * top_k)`` or, for a partial gather, a subset of it
    (distinct indices either way).
    """
    return _PermuteRows.apply(x_TD, order_M, top_k)


def combine_rows(
    y_MD: torch.Tensor, order_M: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_MD[slot of (t, k)]``, accumulated in fp32 by bmm.

    ``order_M`` may cover a subset of the assignments (their weights should then be zero).
    The un-permutation is an index_copy with unique indices, so its backward (a gather) and
    the bmm's are deterministic.
    """
    T, K = weights_TK.shape
    if order_M.numel() == T * K:
        y_AD = torch.index_copy(torch.empty_like(y_MD), 0, order_M, y_MD)
    else:  # a subset of the assignments was computed: the others contribute nothing
        y_AD = torch.index_copy(y_MD.new_zeros(T * K, y_MD.shape[1]), 0, order_M, y_MD)
    w_T1K = weights_TK.to(y_MD.dtype).unsqueeze(1)
    return torch.bmm(w_T1K, y_AD.view(T, K, -1)).squeeze(1)
