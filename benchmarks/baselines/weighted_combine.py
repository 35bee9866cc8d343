"""The weighted combine: un-permute and sum a token's K expert rows scaled by its router
weights, in one pass (a baseline).

The MoE layer no longer runs it: it applies the router weights inside the SwiGLU and combines
with the plain ``moe_kernels.slot_permute.sum_from_slots``, which keeps no expert output for
backward. ``benchmarks/moe_ops.py`` times this path; its forward reference
(``combine_from_slots_reference``) stays in ``moe_kernels.slot_permute``, the definition the layer's
combine is tested against. Its Triton kernels (``weighted_combine_triton``) follow
``moe_kernels.slot_permute_triton``'s conventions and reuse its launch helpers.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton
from moe_kernels.slot_permute import (
    _acc_dtype,
    _check_rows,
    _rows_at,
    _scatter_into,
    combine_from_slots_reference,
    unmapped_rows_possible,
)


def combine_from_slots_reference_backward(
    dy_TD: torch.Tensor,
    y_MD: torch.Tensor | None,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    n_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy_MD, dweights_TK): ``dy_MD[slot] = w_tk * dy_t`` for valid slots (other rows 0) and
    ``dweights_TK[t, k] = <y_MD[slot_TK[t, k]], dy_t>`` (0 for dropped slots) in fp32, in the
    weights' dtype (None when ``y_MD`` is None: the weights need no gradient)."""
    (T, K), D = slot_TK.shape, dy_TD.shape[1]
    acc = _acc_dtype(dy_TD.dtype)
    dy_acc_TD = dy_TD.to(acc)
    rows_AD = (weights_TK.to(acc).unsqueeze(-1) * dy_acc_TD.unsqueeze(1)).reshape(T * K, D)
    dy_MD = _scatter_into(dy_TD.new_zeros(n_rows + 1, D), slot_TK, rows_AD.to(dy_TD.dtype))
    if y_MD is None:
        return dy_MD, None
    dw_TK = (_rows_at(y_MD, slot_TK).to(acc) * dy_acc_TD.unsqueeze(1)).sum(-1)
    return dy_MD, dw_TK.to(weights_TK.dtype)


class _CombineFromSlots(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        y_MD: torch.Tensor,
        slot_TK: torch.Tensor,
        weights_TK: torch.Tensor,
        zero_unmapped: bool,
    ) -> torch.Tensor:
        # y_MD is kept only when the weights need a gradient (it is the expert output: large).
        ctx.n_rows, ctx.zero_unmapped = y_MD.shape[0], zero_unmapped
        ctx.save_for_backward(y_MD if ctx.needs_input_grad[2] else None, slot_TK, weights_TK)
        if use_triton(y_MD, slot_TK):
            from benchmarks.baselines import weighted_combine_triton

            return weighted_combine_triton.combine_forward(
                y_MD, slot_TK, weights_TK, out_dtype=y_MD.dtype
            )
        return combine_from_slots_reference(y_MD, slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        y_MD, slot_TK, weights_TK = ctx.saved_tensors
        if use_triton(dy_TD, slot_TK):
            from benchmarks.baselines import weighted_combine_triton

            dy_MD, dw_TK = weighted_combine_triton.combine_backward(
                dy_TD, y_MD, slot_TK, weights_TK, ctx.n_rows, zero_unmapped=ctx.zero_unmapped
            )
        else:
            dy_MD, dw_TK = combine_from_slots_reference_backward(
                dy_TD, y_MD, slot_TK, weights_TK, ctx.n_rows
            )
        return dy_MD, None, dw_TK, None


def combine_from_slots(
    y_MD: torch.Tensor,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    every_row_mapped: bool | None = None,
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_MD[slot_TK[t, k]]`` over valid slots: un-permute
    and weighted sum over the K choices in one pass, fp32 accumulation, output in y's dtype.
    Backward gives ``dy_MD[slot] = w_tk * dy_t`` (unmapped rows 0, see ``every_row_mapped`` in
    the module doc) and ``dweights = <y_MD[slot], dy_t>`` (0 for dropped slots)."""
    _check_rows(slot_TK, y_MD.shape[0], every_row_mapped)
    zero = unmapped_rows_possible(slot_TK, y_MD.shape[0], every_row_mapped)
    return _CombineFromSlots.apply(y_MD, slot_TK, weights_TK, zero)
