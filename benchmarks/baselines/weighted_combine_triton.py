"""Triton kernels of the weighted combine (``weighted_combine``; a baseline): forward and backward.

Built on ``moe_kernels.slot_permute_triton``'s launch helpers and conventions (token-major
programs, no atomics, rows masked to the buffer, unmapped rows zero-filled from per-row flags).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2
from moe_kernels.slot_permute_triton import _blocks, _must_zero, _row_major, zero_unmarked


@triton.jit
def _weighted_gather_rows(
    src_ptr,
    slot_ptr,
    w_ptr,
    out_ptr,
    T,
    D,
    n_rows,
    stride_src,
    stride_out,
    K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[t] = sum_k w[t, k] * src[slot[t, k]] over valid slots, in fp32, k in order."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = tmask[:, None] & (c < D)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1)
            valid = (slot >= 0) & (slot < n_rows)
            # A dropped slot reads row 0 and weight 0: it adds exactly +0 (never w * NaN).
            row = tl.load(
                src_ptr + slot[:, None] * stride_src + c[None, :],
                mask=m & valid[:, None],
                other=0.0,
            )
            w = tl.load(w_ptr + t * K + k, mask=valid, other=0.0).to(tl.float32)
            acc += row.to(tl.float32) * w[:, None]
        dst = out_ptr + t[:, None] * stride_out + c[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _combine_backward(
    dy_ptr,
    y_ptr,
    slot_ptr,
    w_ptr,
    dy_rows_ptr,
    dw_ptr,
    used_ptr,
    T,
    D,
    n_rows,
    stride_dy,
    stride_y,
    stride_dy_rows,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    NEED_DW: tl.constexpr,
    MARK_USED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dy_rows[slot[t, k]] = w[t, k] * dy[t]; dw[t, k] = <y[slot[t, k]], dy[t]> in fp32;
    a dropped slot (-1) writes no row and gets dw = 0."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    kcols = tl.arange(0, K_PAD)
    dw = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = tmask[:, None] & (c < D)[None, :]
        g = tl.load(dy_ptr + t[:, None] * stride_dy + c[None, :], mask=m, other=0.0)
        g = g.to(tl.float32)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1)
            valid = (slot >= 0) & (slot < n_rows)
            mk = m & valid[:, None]
            w = tl.load(w_ptr + t * K + k, mask=valid, other=0.0).to(tl.float32)
            dst = dy_rows_ptr + slot[:, None] * stride_dy_rows + c[None, :]
            tl.store(dst, (g * w[:, None]).to(dy_rows_ptr.dtype.element_ty), mask=mk)
            if NEED_DW:
                y = tl.load(y_ptr + slot[:, None] * stride_y + c[None, :], mask=mk, other=0.0)
                part = tl.sum(y.to(tl.float32) * g, axis=1)
                dw += tl.where(kcols[None, :] == k, part[:, None], 0.0)
    if NEED_DW:
        kmask = tmask[:, None] & (kcols < K)[None, :]
        dst = dw_ptr + t[:, None] * K + kcols[None, :]
        tl.store(dst, dw.to(dw_ptr.dtype.element_ty), mask=kmask)
    if MARK_USED:
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1)
            valid = (slot >= 0) & (slot < n_rows)
            tl.store(used_ptr + slot, tl.full([BLOCK_T], 1, tl.int8), mask=valid)


def combine_forward(
    y_MD: torch.Tensor,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    block_d: int | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k weights_TK[t, k] * y_MD[slot_TK[t, k]]`` over valid slots, fp32 sums."""
    T, K = slot_TK.shape
    D = y_MD.shape[1]
    y_MD, slot_TK, weights_TK = _row_major(y_MD), slot_TK.contiguous(), weights_TK.contiguous()
    if out is None:
        out = torch.empty(T, D, dtype=out_dtype, device=y_MD.device)
    bt, bd = _blocks(T, D, block_t, block_d)
    _weighted_gather_rows[(cdiv(T, bt),)](
        y_MD,
        slot_TK,
        weights_TK,
        out,
        T,
        D,
        y_MD.shape[0],
        y_MD.stride(0),
        out.stride(0),
        K=K,
        BLOCK_T=bt,
        BLOCK_D=bd,
        num_warps=4,
    )
    return out


def combine_backward(
    dy_TD: torch.Tensor,
    y_MD: torch.Tensor | None,
    slot_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    n_rows: int,
    *,
    zero_unmapped: bool | None = None,
    out_rows: torch.Tensor | None = None,
    out_dw: torch.Tensor | None = None,
    block_t: int | None = None,
    block_d: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dy_MD, dweights_TK): rows scattered and scaled, unmapped rows zero (``zero_unmapped`` as
    in ``scatter_rows``); dweights in fp32 (cast to the weights' dtype; 0 for dropped slots), or
    None when ``y_MD`` is None (weights need no gradient)."""
    T, D = dy_TD.shape
    K = slot_TK.shape[1]
    dy_TD, slot_TK, weights_TK = _row_major(dy_TD), slot_TK.contiguous(), weights_TK.contiguous()
    need_dw = y_MD is not None
    if y_MD is not None and y_MD.shape != (n_rows, D):
        raise ValueError(f"y_MD has shape {tuple(y_MD.shape)}, expected {(n_rows, D)}")
    y = _row_major(y_MD) if y_MD is not None else dy_TD
    if out_rows is None:
        out_rows = torch.empty(n_rows, D, dtype=dy_TD.dtype, device=dy_TD.device)
    if out_rows.shape != (n_rows, D):
        raise ValueError(f"out_rows has shape {tuple(out_rows.shape)}, expected {(n_rows, D)}")
    if need_dw and out_dw is None:
        out_dw = torch.empty(T, K, dtype=weights_TK.dtype, device=dy_TD.device)
    bt, bd = _blocks(T, D, block_t, block_d)
    padded = _must_zero(n_rows, T * K, zero_unmapped)
    used = torch.zeros(n_rows if padded else 1, dtype=torch.int8, device=dy_TD.device)
    _combine_backward[(cdiv(T, bt),)](
        dy_TD,
        y,
        slot_TK,
        weights_TK,
        out_rows,
        out_dw if need_dw else weights_TK,
        used,
        T,
        D,
        n_rows,
        dy_TD.stride(0),
        y.stride(0),
        out_rows.stride(0),
        K=K,
        K_PAD=next_pow2(K),
        NEED_DW=need_dw,
        MARK_USED=padded,
        BLOCK_T=bt,
        BLOCK_D=bd,
        num_warps=4,
    )
    if padded:
        zero_unmarked(out_rows, used)
    return out_rows, out_dw if need_dw else None
