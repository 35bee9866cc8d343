"""Slot-based permutation: token rows into expert-ordered slots ("rowwise") and back, summed.

``slot_TK`` comes from ``moe_kernels.routing.expert_slots``: an injective map of the T * K
assignments onto the rows of an ``n_rows``-row buffer, where a slot of -1 is a dropped
assignment (routed elsewhere): it takes no row, the permute writes nothing for it (its backward
gives it no gradient), the sum adds nothing for it. Rows no valid slot maps to are padding (see
``moe_kernels.routing`` for the layout): the permute writes zeros there, the sum never reads them,
and the sum's backward writes zero gradients there, so grouped GEMMs over padded segments add
nothing to weight gradients.

Zero-filling needs a pass over per-row flags, which the all-valid path must not pay for.
``every_row_mapped`` says whether it is needed: by default (None) every row counts as mapped
exactly when ``n_rows == T * K`` (right for any map without dropped assignments); a caller that
knows better says True (e.g. a buffer of exactly the valid assignments with ``align=1``: no
padding, no pass) or False (dropped assignments into a buffer of exactly ``T * K`` rows, whose
last rows are then unmapped). True is a promise: the Triton path leaves unmapped rows unwritten.

Both ops are autograd Functions with deterministic backward passes (no atomics: every sum runs
inside one program, in a fixed order) and fp32 accumulation. Triton runs them on CUDA tensors
(or under the interpreter); the PyTorch references below define them and run elsewhere.
``combine_from_slots_reference`` defines the weighted combine that ``slot_weights`` (the router
weights applied in the SwiGLU) followed by ``sum_from_slots`` computes, which the tests check;
the weighted combine as one op is a baseline (``benchmarks/baselines/weighted_combine.py``).
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for half types; fp64 stays fp64 (so the references can be gradchecked)."""
    return torch.promote_types(dtype, torch.float32)


def _rows_at(src_MD: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """``src_MD[slot_TK]`` as [T, K, D], zero where the slot is -1 (dropped)."""
    if src_MD.shape[0] == 0:  # every slot dropped: gather zeros, still through src's graph
        src_MD = torch.cat([src_MD, src_MD.new_zeros(1, src_MD.shape[1])])
    rows_TKD = src_MD[slot_TK.clamp_min(0)]
    return torch.where((slot_TK >= 0).unsqueeze(-1), rows_TKD, 0)


def _scatter_into(
    out_MD: torch.Tensor, slot_TK: torch.Tensor, rows_AD: torch.Tensor
) -> torch.Tensor:
    """``out_MD[slot] = rows`` for valid slots, without a host read: dropped ones go to a spare
    first row of ``out_MD`` (which has ``n_rows + 1`` rows), cut off on return (a spare row in
    front keeps a slot past the buffer an index error)."""
    slot_A = slot_TK.reshape(-1)
    return out_MD.index_copy(0, torch.where(slot_A >= 0, slot_A + 1, 0), rows_AD)[1:]


def permute_to_slots_reference(
    x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int
) -> torch.Tensor:
    """``x_MD[slot_TK[t, k]] = x_TD[t]`` for valid slots; rows no valid slot maps to are zero."""
    T, K = slot_TK.shape
    x_MD = x_TD.new_zeros(n_rows + 1, x_TD.shape[1])
    rows_AD = x_TD.unsqueeze(1).expand(T, K, -1).reshape(T * K, x_TD.shape[1])
    return _scatter_into(x_MD, slot_TK, rows_AD)


def permute_to_slots_reference_backward(g_MD: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """``dx_TD[t] = sum_k g_MD[slot_TK[t, k]]`` over valid slots, in fp32."""
    return _rows_at(g_MD, slot_TK).to(_acc_dtype(g_MD.dtype)).sum(1).to(g_MD.dtype)


def combine_from_slots_reference(
    y_MD: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_MD[slot_TK[t, k]]`` over valid slots in fp32, in
    y's dtype."""
    acc = _acc_dtype(y_MD.dtype)
    y_TKD = _rows_at(y_MD, slot_TK).to(acc)
    w_TK = torch.where(slot_TK >= 0, weights_TK.to(acc), 0)
    return (y_TKD * w_TK.unsqueeze(-1)).sum(1).to(y_MD.dtype)


def unmapped_rows_possible(
    slot_TK: torch.Tensor, n_rows: int, every_row_mapped: bool | None
) -> bool:
    """Whether the kernels must zero-fill rows no valid slot maps to (see the module doc)."""
    if every_row_mapped is None:
        return n_rows != slot_TK.numel()
    return not every_row_mapped


def _scatter_to_slots(
    x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int, zero_unmapped: bool
) -> torch.Tensor:
    """The permute (and the plain sum's backward): Triton where it runs, else the reference."""
    if use_triton(x_TD, slot_TK):
        from moe_kernels import slot_permute_triton

        return slot_permute_triton.scatter_rows(x_TD, slot_TK, n_rows, zero_unmapped=zero_unmapped)
    return permute_to_slots_reference(x_TD, slot_TK, n_rows)


def _sum_over_slots(y_MD: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """The plain sum (and the permute's backward): Triton where it runs, else the reference."""
    if use_triton(y_MD, slot_TK):
        from moe_kernels import slot_permute_triton

        return slot_permute_triton.gather_rows(y_MD, slot_TK, out_dtype=y_MD.dtype)
    return permute_to_slots_reference_backward(y_MD, slot_TK)


class _PermuteToSlots(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int, zero_unmapped: bool
    ) -> torch.Tensor:
        ctx.save_for_backward(slot_TK)
        return _scatter_to_slots(x_TD, slot_TK, n_rows, zero_unmapped)

    @staticmethod
    def backward(ctx, g_MD: torch.Tensor):  # type: ignore[override]
        (slot_TK,) = ctx.saved_tensors
        return _sum_over_slots(g_MD, slot_TK), None, None, None


class _SumFromSlots(torch.autograd.Function):
    """The unweighted combine: the adjoint of ``_PermuteToSlots`` (its forward is the permute's
    backward and its backward the permute's forward), so it keeps nothing but the slot map."""

    @staticmethod
    def forward(ctx, y_MD: torch.Tensor, slot_TK: torch.Tensor, zero_unmapped: bool):
        ctx.n_rows, ctx.zero_unmapped = y_MD.shape[0], zero_unmapped
        ctx.save_for_backward(slot_TK)
        return _sum_over_slots(y_MD, slot_TK)

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        (slot_TK,) = ctx.saved_tensors
        return _scatter_to_slots(dy_TD, slot_TK, ctx.n_rows, ctx.zero_unmapped), None, None


def _check_rows(slot_TK: torch.Tensor, n_rows: int, every_row_mapped: bool | None) -> None:
    """Host-side sanity checks that need no device read."""
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    if every_row_mapped and n_rows > slot_TK.numel():
        raise ValueError(f"{slot_TK.numel()} assignments cannot map every one of {n_rows} rows")


def permute_to_slots(
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    *,
    every_row_mapped: bool | None = None,
) -> torch.Tensor:
    """Expert-ordered rows ``x_MD`` [n_rows, D]: token t's row in each of its valid slots,
    unmapped rows zero (see the module doc for ``every_row_mapped``). ``n_rows`` must hold every
    valid slot. Backward: ``dx_TD[t] = sum_k dx_MD[slot_TK[t, k]]`` over valid slots (fp32 sum,
    no atomics)."""
    _check_rows(slot_TK, n_rows, every_row_mapped)
    zero = unmapped_rows_possible(slot_TK, n_rows, every_row_mapped)
    return _PermuteToSlots.apply(x_TD, slot_TK, n_rows, zero)


def sum_from_slots(
    y_MD: torch.Tensor, slot_TK: torch.Tensor, *, every_row_mapped: bool | None = None
) -> torch.Tensor:
    """``y_TD[t] = sum_k y_MD[slot_TK[t, k]]`` over valid slots (fp32 sum, y's dtype): the
    combine for expert rows already scaled by their weights (see ``slot_weights``). Backward
    writes ``dy_t`` into each of t's slots (unmapped rows 0); unlike the weighted combine it
    keeps no expert output for backward."""
    _check_rows(slot_TK, y_MD.shape[0], every_row_mapped)
    zero = unmapped_rows_possible(slot_TK, y_MD.shape[0], every_row_mapped)
    return _SumFromSlots.apply(y_MD, slot_TK, zero)


def slot_weights(weights_TK: torch.Tensor, slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Each assignment's weight at its slot, ``weights_M[slot_TK[t, k]] = weights_TK[t, k]``,
    0 on rows no valid slot maps to; differentiable (the backward gathers). No host read."""
    _check_rows(slot_TK, n_rows, None)
    w_M1 = _scatter_into(weights_TK.new_zeros(n_rows + 1, 1), slot_TK, weights_TK.reshape(-1, 1))
    return w_M1[:, 0]


def slot_tokens(slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Each row's token, int32 [n_rows]: ``idx_M[slot_TK[t, k]] = t`` for valid slots, T (one
    past the last token) on rows no valid slot maps to. The row index of
    ``moe_kernels.grouped_gemm.gathered_grouped_mm``: gathering ``x_TD`` by it is the permute. No
    host read."""
    _check_rows(slot_TK, n_rows, None)
    T, K = slot_TK.shape
    t_A1 = torch.arange(T * K, device=slot_TK.device, dtype=torch.int32) // K
    idx_M1 = _scatter_into(t_A1.new_full((n_rows + 1, 1), T), slot_TK, t_A1.view(-1, 1))
    return idx_M1[:, 0].clone()  # off the spare row's 4 bytes: QuACK wants 16-byte aligned
