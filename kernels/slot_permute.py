"""Slot-based permutation: token rows into expert-ordered slots ("rowwise") and back, combined.

``slot_TK`` comes from ``kernels.routing.expert_slots``: an injective map of the T * K
assignments onto the rows of an ``n_rows``-row buffer. Rows no assignment maps to are padding
(see ``kernels.routing`` for the layout): the permute writes zeros there, the combine never reads
them, and the combine's backward writes zero gradients there, so grouped GEMMs over padded
segments add nothing to weight gradients.

Both ops are autograd Functions with deterministic backward passes (no atomics: every sum runs
inside one program, in a fixed order) and fp32 accumulation. Triton runs them on CUDA tensors
(or under the interpreter); the PyTorch references below define them and run elsewhere.
"""

from __future__ import annotations

import torch

from kernels._triton import use_triton


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 math for half types; fp64 stays fp64 (so the references can be gradchecked)."""
    return torch.promote_types(dtype, torch.float32)


def permute_to_slots_reference(
    x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int
) -> torch.Tensor:
    """``x_MD[slot_TK[t, k]] = x_TD[t]``; rows no assignment maps to are zero."""
    T, K = slot_TK.shape
    x_MD = x_TD.new_zeros(n_rows, x_TD.shape[1])
    rows_AD = x_TD.unsqueeze(1).expand(T, K, -1).reshape(T * K, x_TD.shape[1])
    return x_MD.index_copy(0, slot_TK.reshape(-1), rows_AD)


def permute_to_slots_reference_backward(g_MD: torch.Tensor, slot_TK: torch.Tensor) -> torch.Tensor:
    """``dx_TD[t] = sum_k g_MD[slot_TK[t, k]]`` in fp32."""
    return g_MD[slot_TK].to(_acc_dtype(g_MD.dtype)).sum(1).to(g_MD.dtype)


def combine_from_slots_reference(
    y_MD: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_MD[slot_TK[t, k]]`` in fp32, in y's dtype."""
    acc = _acc_dtype(y_MD.dtype)
    y_TKD = y_MD[slot_TK].to(acc)
    return (y_TKD * weights_TK.to(acc).unsqueeze(-1)).sum(1).to(y_MD.dtype)


def combine_from_slots_reference_backward(
    dy_TD: torch.Tensor,
    y_MD: torch.Tensor | None,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    n_rows: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy_MD, dweights_TK): ``dy_MD[slot] = w_tk * dy_t`` (unmapped rows 0) and
    ``dweights_TK[t, k] = <y_MD[slot_TK[t, k]], dy_t>`` in fp32, in the weights' dtype
    (None when ``y_MD`` is None: the weights need no gradient)."""
    (T, K), D = slot_TK.shape, dy_TD.shape[1]
    acc = _acc_dtype(dy_TD.dtype)
    dy_acc_TD = dy_TD.to(acc)
    rows_AD = (weights_TK.to(acc).unsqueeze(-1) * dy_acc_TD.unsqueeze(1)).reshape(T * K, D)
    dy_MD = dy_TD.new_zeros(n_rows, D)
    dy_MD.index_copy_(0, slot_TK.reshape(-1), rows_AD.to(dy_TD.dtype))
    if y_MD is None:
        return dy_MD, None
    dw_TK = (y_MD[slot_TK].to(acc) * dy_acc_TD.unsqueeze(1)).sum(-1)
    return dy_MD, dw_TK.to(weights_TK.dtype)


class _PermuteToSlots(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
        ctx.save_for_backward(slot_TK)
        if use_triton(x_TD, slot_TK):
            from kernels import slot_permute_triton

            return slot_permute_triton.scatter_rows(x_TD, slot_TK, n_rows)
        return permute_to_slots_reference(x_TD, slot_TK, n_rows)

    @staticmethod
    def backward(ctx, g_MD: torch.Tensor):  # type: ignore[override]
        (slot_TK,) = ctx.saved_tensors
        if use_triton(g_MD, slot_TK):
            from kernels import slot_permute_triton

            dx_TD = slot_permute_triton.gather_rows(g_MD, slot_TK, None, out_dtype=g_MD.dtype)
        else:
            dx_TD = permute_to_slots_reference_backward(g_MD, slot_TK)
        return dx_TD, None, None


class _CombineFromSlots(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, y_MD: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor
    ) -> torch.Tensor:
        # y_MD is kept only when the weights need a gradient (it is the expert output: large).
        ctx.n_rows = y_MD.shape[0]
        ctx.save_for_backward(y_MD if ctx.needs_input_grad[2] else None, slot_TK, weights_TK)
        if use_triton(y_MD, slot_TK):
            from kernels import slot_permute_triton

            return slot_permute_triton.gather_rows(y_MD, slot_TK, weights_TK, out_dtype=y_MD.dtype)
        return combine_from_slots_reference(y_MD, slot_TK, weights_TK)

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        y_MD, slot_TK, weights_TK = ctx.saved_tensors
        if use_triton(dy_TD, slot_TK):
            from kernels import slot_permute_triton

            dy_MD, dw_TK = slot_permute_triton.combine_backward(
                dy_TD, y_MD, slot_TK, weights_TK, ctx.n_rows
            )
        else:
            dy_MD, dw_TK = combine_from_slots_reference_backward(
                dy_TD, y_MD, slot_TK, weights_TK, ctx.n_rows
            )
        return dy_MD, None, dw_TK


def permute_to_slots(x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
    """Expert-ordered rows ``x_MD`` [n_rows, D]: token t's row in each of its K slots, unmapped
    rows zero. Backward: ``dx_TD[t] = sum_k dx_MD[slot_TK[t, k]]`` (fp32 sum, no atomics)."""
    if n_rows < slot_TK.numel():
        raise ValueError(f"n_rows={n_rows} cannot hold {slot_TK.numel()} routed assignments")
    return _PermuteToSlots.apply(x_TD, slot_TK, n_rows)


def combine_from_slots(
    y_MD: torch.Tensor, slot_TK: torch.Tensor, weights_TK: torch.Tensor
) -> torch.Tensor:
    """``y_TD[t] = sum_k weights_TK[t, k] * y_MD[slot_TK[t, k]]``: un-permute and weighted sum
    over the K choices in one pass, fp32 accumulation, output in y's dtype. Backward gives
    ``dy_MD[slot] = w_tk * dy_t`` (unmapped rows 0) and ``dweights = <y_MD[slot], dy_t>``."""
    return _CombineFromSlots.apply(y_MD, slot_TK, weights_TK)
