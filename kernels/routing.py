"""Routing metadata on the device: per-expert counts, segment offsets and the token->slot map.

An assignment is a (token t, choice k) pair, flattened ``a = t * K + k``. ``slot_TK[t, k]`` is
the row of the expert-ordered buffer that assignment goes to. Experts own contiguous segments
in expert order; within a segment rows follow token order (stable), so ``align=1`` gives exactly
the layout of a stable argsort of the assignments by expert.

Layout of the expert-ordered buffer (``n_rows`` rows, a static Python int, ``slot_rows``):

- expert e's segment is ``[start_e, offs_E[e])`` with ``start_e = offs_E[e-1]`` (0 for e = 0);
  its length is ``counts_E[e]`` rounded up to a multiple of ``align``, so every segment starts on
  a multiple of ``align`` (what MXFP8 scales and tile-aligned grouped GEMMs want); the last
  segment runs on to ``offs_E[-1] = n_rows``, so every row of the buffer is in some segment;
- the first ``counts_E[e]`` rows of a segment are real rows, the rest are padding (fewer than
  ``align`` rows, except in the last segment, which also takes the slack of the static bound).

``permute_to_slots`` writes zeros into the padding rows, so a grouped GEMM computes zero rows
there (``silu(0) * 0 = 0`` too) and adds nothing to weight gradients; ``combine_from_slots``
never reads them, and its backward writes zero gradients into them. No row of any buffer on the
path holds uninitialized memory. With ``align=1`` there is no padding: ``n_rows = T * K``.

Nothing here reads the device from the host (no ``.item()``, no data-dependent shape), so a
step using it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels._triton import use_triton


class ExpertSlots(NamedTuple):
    """What ``expert_slots`` returns; unpacks as a 4-tuple."""

    slot_TK: torch.Tensor  # int64 [T, K]: expert-ordered row of each assignment
    counts_E: torch.Tensor  # int64 [E]: real assignments per expert
    offs_E: torch.Tensor  # int32 [E]: cumulative (padded) segment ends; offs_E[-1] == n_rows
    n_rows: int  # static row count of the expert-ordered buffer


def slot_rows(n_assignments: int, n_experts: int, align: int = 1) -> int:
    """Static row count that holds any routing: each segment pads by at most ``align - 1``.

    ``sum_e roundup(c_e, align)`` is a multiple of ``align`` and at most
    ``M + E * (align - 1)``, so the bound rounded *down* to ``align`` still holds it.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return (n_assignments + n_experts * (align - 1)) // align * align


def expert_slots_reference(experts_TK: torch.Tensor, n_experts: int, align: int = 1) -> ExpertSlots:
    """The definition, in PyTorch: a stable argsort by expert, then padded segment starts."""
    T, K = experts_TK.shape
    n_rows = slot_rows(T * K, n_experts, align)
    flat_M = experts_TK.reshape(-1)
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=flat_M.device)
    counts_E.scatter_add_(0, flat_M, torch.ones_like(flat_M))
    padded_E = (counts_E + (align - 1)) // align * align
    ends_E = torch.cumsum(padded_E, 0)
    order_M = torch.argsort(flat_M, stable=True)
    expert_M = flat_M[order_M]
    rank_M = torch.arange(flat_M.numel(), device=flat_M.device) - (
        torch.cumsum(counts_E, 0) - counts_E
    ).index_select(0, expert_M)
    slot_M = torch.empty_like(flat_M)
    slot_M.scatter_(0, order_M, (ends_E - padded_E).index_select(0, expert_M) + rank_M)
    offs_E = ends_E.to(torch.int32)
    offs_E[-1] = n_rows  # the last segment takes the slack: every row is in a segment
    return ExpertSlots(slot_M.view(T, K), counts_E, offs_E, n_rows)


def expert_slots(experts_TK: torch.Tensor, n_experts: int, align: int = 1) -> ExpertSlots:
    """Counts, int32 cumulative segment ends and the token->slot map of a routing.

    experts_TK: int64 expert id in ``[0, n_experts)`` per (token, choice), distinct per token or
    not (a repeated expert just gets two slots). Triton (three small launches, no sort) on the
    GPU; the PyTorch reference elsewhere (see ``kernels._triton``). Both give identical results.
    """
    T, K = experts_TK.shape
    if not use_triton(experts_TK):
        return expert_slots_reference(experts_TK, n_experts, align)
    from kernels import routing_triton

    n_rows = slot_rows(T * K, n_experts, align)
    slot_TK, counts_E, offs_E = routing_triton.expert_slots(experts_TK, n_experts, align, n_rows)
    return ExpertSlots(slot_TK, counts_E, offs_E, n_rows)
