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
there (``silu(0) * 0 = 0`` too, and ``slot_weights`` gives them weight 0) and adds nothing to
weight gradients; ``sum_from_slots`` never reads them, and its backward pass writes zero
gradients into them. No row of any buffer on the path holds uninitialized memory. With
``align=1`` there is no padding: ``n_rows = T * K``.

Dropped assignments: an expert id < 0 means "not routed here" (an expert-parallel receiver marks
the choices of a token that live on other ranks this way). Such an assignment gets ``slot = -1``,
is not counted and takes no row; the slot ops skip it. A caller that knows how many assignments
are valid (a host int, e.g. after a count exchange) passes it as ``n_rows``: the buffer and the
last segment end there, so with ``align=1`` it has no padding rows at all and grouped GEMMs do no
extra work.

Nothing here reads the device from the host (no ``.item()``, no data-dependent shape), so a
step using it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from moe_kernels._triton import use_triton


class ExpertSlots(NamedTuple):
    """What ``expert_slots`` returns; unpacks as a 4-tuple."""

    slot_TK: torch.Tensor  # int64 [T, K]: expert-ordered row of each assignment (-1: dropped)
    counts_E: torch.Tensor  # int64 [E]: real assignments per expert
    offs_E: torch.Tensor  # int32 [E]: cumulative (padded) segment ends; offs_E[-1] == n_rows
    n_rows: int  # static row count of the expert-ordered buffer


def expert_counts(experts_TK: torch.Tensor, n_experts: int) -> torch.Tensor:
    """int64 number of assignments per expert (a scatter-add: no host read, unlike bincount);
    what the router counts, every id in ``[0, n_experts)``."""
    flat_M = experts_TK.reshape(-1)
    counts_E = torch.zeros(n_experts, dtype=torch.int64, device=flat_M.device)
    return counts_E.scatter_add_(0, flat_M, torch.ones_like(flat_M))


def slot_rows(n_assignments: int, n_experts: int, align: int = 1) -> int:
    """Static row count that holds any routing: each segment pads by at most ``align - 1``.

    ``sum_e roundup(c_e, align)`` is a multiple of ``align`` and at most
    ``M + E * (align - 1)``, so the bound rounded *down* to ``align`` still holds it.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    return (n_assignments + n_experts * (align - 1)) // align * align


def expert_slots_reference(
    experts_TK: torch.Tensor, n_experts: int, align: int = 1, n_rows: int | None = None
) -> ExpertSlots:
    """The definition, in PyTorch: a stable argsort by expert (dropped assignments last), then
    padded segment starts; dropped assignments get slot -1."""
    T, K = experts_TK.shape
    n_rows = _buffer_rows(T * K, n_experts, align, n_rows)
    flat_M = experts_TK.reshape(-1)
    valid_M = flat_M >= 0
    key_M = torch.where(valid_M, flat_M, n_experts)  # dropped: a virtual last expert
    counts_X = torch.zeros(n_experts + 1, dtype=torch.int64, device=flat_M.device)
    counts_X.scatter_add_(0, key_M, torch.ones_like(key_M))
    counts_E = counts_X[:n_experts].clone()
    padded_E = (counts_E + (align - 1)) // align * align
    ends_E = torch.cumsum(padded_E, 0)
    if flat_M.device.type == "cpu" and n_experts and int(ends_E[-1]) > n_rows:
        raise ValueError(f"n_rows={n_rows} cannot hold {int(ends_E[-1])} (padded) routed rows")
    order_M = torch.argsort(key_M, stable=True)
    key_sorted_M = key_M[order_M]
    rank_M = torch.arange(flat_M.numel(), device=flat_M.device) - (
        torch.cumsum(counts_X, 0) - counts_X
    ).index_select(0, key_sorted_M)
    starts_X = torch.cat([ends_E - padded_E, ends_E.new_full((1,), -1)])
    slot_sorted_M = torch.where(
        key_sorted_M < n_experts, starts_X.index_select(0, key_sorted_M) + rank_M, -1
    )
    slot_M = torch.empty_like(flat_M)
    slot_M.scatter_(0, order_M, slot_sorted_M)
    offs_E = ends_E.to(torch.int32)
    if n_experts:
        offs_E[-1] = n_rows  # the last segment takes the slack: every row is in a segment
    return ExpertSlots(slot_M.view(T, K), counts_E, offs_E, n_rows)


def _buffer_rows(n_assignments: int, n_experts: int, align: int, n_rows: int | None) -> int:
    """The static bound ``slot_rows``, or the caller's exact row count."""
    if n_rows is None:
        return slot_rows(n_assignments, n_experts, align)
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    return n_rows


def expert_slots(
    experts_TK: torch.Tensor, n_experts: int, align: int = 1, n_rows: int | None = None
) -> ExpertSlots:
    """Counts, int32 cumulative segment ends and the token->slot map of a routing.

    experts_TK: int64 expert id in ``[0, n_experts)`` per (token, choice), distinct per token or
    not (a repeated expert just gets two slots), or < 0 for a dropped assignment (slot -1, not
    counted). ``n_rows``: the buffer's row count when the caller knows it (a host int at least
    the sum of the padded counts, e.g. the number of valid assignments with ``align=1``);
    default the static bound ``slot_rows(T * K, n_experts, align)``. Triton (three small
    launches, no sort) on the GPU; the PyTorch reference elsewhere (see ``moe_kernels._triton``).
    Both give identical results.
    """
    T, K = experts_TK.shape
    if not use_triton(experts_TK):
        return expert_slots_reference(experts_TK, n_experts, align, n_rows)
    from moe_kernels import routing_triton

    n_rows = _buffer_rows(T * K, n_experts, align, n_rows)
    slot_TK, counts_E, offs_E = routing_triton.expert_slots(experts_TK, n_experts, align, n_rows)
    return ExpertSlots(slot_TK, counts_E, offs_E, n_rows)
