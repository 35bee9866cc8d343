"""Triton kernels for ``swiglu``: ``a = w * silu(gate) * up`` over [M, 2F] rows (``w`` an
optional per-row weight), and its backward.

Forward: a program owns a [BLOCK_M, BLOCK_F] tile of the output: it reads the matching gate and
up tiles (F columns apart in the same row), computes in fp32 and writes once; the grid is 2-D
over rows and columns and every access is a contiguous run along F.

Backward: a program owns BLOCK_M whole rows and walks F in chunks of BLOCK_F, so the row
weight's gradient ``sum_f da * silu(gate) * up`` accumulates in registers and is stored once per
row: no atomics, no partial sums, deterministic. It can also write the forward's output again
(the same fp32 operations in the same order, so the same bits) for a caller that did not keep it
(``moe_kernels.fp8``'s expert MLP: the down weight gradient's input). Chunks of 256 columns keep
each row inside one warp (4 warps, 16 rows), so the final sum over columns needs no cross-warp
exchange.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels import fp8_format
from moe_kernels._triton import cdiv, next_pow2
from moe_kernels.fp8_triton import HW_CAST, _row_scales, _scale_to_e4m3

# moe_kernels.fp8_format's constants as globals a Triton kernel may read
E4M3_MAX = tl.constexpr(fp8_format.E4M3_MAX)
AMAX_FLOOR = tl.constexpr(fp8_format.AMAX_FLOOR)

TILE = 4096
MAX_BLOCK_F = 1024
BACKWARD_BLOCK_F = 256
QUANTIZE_MAX_F = 1024  # the backward's quantized dh: whole rows of 2F values in registers


@triton.jit
def _swiglu_forward(
    h_ptr,
    w_ptr,
    a_ptr,
    M,
    F,
    stride_h,
    stride_a,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < M)[:, None] & (cols < F)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + F, mask=m, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    if HAS_W:
        a = a * tl.load(w_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(a_ptr + rows[:, None] * stride_a + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_backward(
    h_ptr,
    w_ptr,
    da_ptr,
    dh_ptr,
    dw_ptr,
    a_ptr,
    q_ptr,
    qs_ptr,
    M,
    F,
    stride_h,
    stride_da,
    stride_dh,
    stride_a,
    stride_q,
    HAS_W: tl.constexpr,
    EMIT_A: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
    QUANTIZE: tl.constexpr = False,
    HW_CAST: tl.constexpr = False,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_ok = rows < M
    w = tl.load(w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None] if HAS_W else 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_F], dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        m = row_ok[:, None] & (cols < F)[None, :]
        gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
        g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(gate_ptrs + F, mask=m, other=0.0).to(tl.float32)
        da = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=m, other=0.0)
        da = da.to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        if EMIT_A:  # as _swiglu_forward: (g * sigmoid(g)) * u, then the weight
            a = silu * u
            if HAS_W:
                a = a * w
            a_ptrs = a_ptr + rows[:, None] * stride_a + cols[None, :]
            tl.store(a_ptrs, a.to(a_ptr.dtype.element_ty), mask=m)
        if HAS_W:
            acc += da * silu * u
            da = da * w
        dg = (da * u * sig * (1.0 + g * (1.0 - sig))).to(dh_ptr.dtype.element_ty)
        du = (da * silu).to(dh_ptr.dtype.element_ty)
        dgate_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
        tl.store(dgate_ptrs, dg, mask=m)
        tl.store(dgate_ptrs + F, du, mask=m)
        if QUANTIZE:  # the whole row is this one chunk: dh's stored values, quantized by rows
            dg, du = dg.to(tl.float32), du.to(tl.float32)
            amax = tl.maximum(tl.max(tl.abs(dg), axis=1), tl.max(tl.abs(du), axis=1))
            scale, inv = _row_scales(amax, E4M3_MAX, AMAX_FLOOR)
            tl.store(qs_ptr + rows, scale, mask=row_ok)
            q_ptrs = q_ptr + rows[:, None] * stride_q + cols[None, :]
            q_dtype = q_ptr.dtype.element_ty
            qg = _scale_to_e4m3(dg, inv[:, None], q_dtype, E4M3_MAX, HW_CAST)
            tl.store(q_ptrs, qg, mask=m)
            qu = _scale_to_e4m3(du, inv[:, None], q_dtype, E4M3_MAX, HW_CAST)
            tl.store(q_ptrs + F, qu, mask=m)
    if HAS_W:
        tl.store(dw_ptr + rows, tl.sum(acc, axis=1), mask=row_ok)


def _grid_blocks(
    M: int, F: int, block_m: int | None, block_f: int | None, max_block_f: int = MAX_BLOCK_F
) -> tuple[int, int]:
    bf = block_f or min(max_block_f, next_pow2(F))
    bm = block_m or max(1, min(TILE // bf, next_pow2(M)))
    return bm, bf


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu_forward(
    h_M2F: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_f: int | None = None,
) -> torch.Tensor:
    """a_MF = (weight_M *) silu(h[:, :F]) * h[:, F:], fp32 math, h's dtype."""
    h_M2F = _row_major(h_M2F)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    if out is None:
        out = torch.empty(M, F, dtype=h_M2F.dtype, device=h_M2F.device)
    bm, bf = _grid_blocks(M, F, block_m, block_f)
    w = h_M2F if weight_M is None else weight_M.contiguous()
    _swiglu_forward[(cdiv(M, bm), cdiv(F, bf))](
        h_M2F,
        w,
        out,
        M,
        F,
        h_M2F.stride(0),
        out.stride(0),
        HAS_W=weight_M is not None,
        BLOCK_M=bm,
        BLOCK_F=bf,
        num_warps=4,
    )
    return out


def swiglu_backward(
    h_M2F: torch.Tensor,
    da_MF: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    activation: bool = False,
    quantize_into: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_m: int | None = None,
    block_f: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dh_M2F, dweight_M, a_MF): with ``w`` the row weight (1 without one), ``dh = [w * da *
    up * silu'(gate) | w * da * silu(gate)]``, ``dweight = sum_f da * silu(gate) * up`` (None
    without a weight) and, with ``activation``, the forward's output ``a`` (else None); fp32
    math, dh and a in h's dtype, dweight fp32. ``quantize_into`` (E4M3 [M, 2F], fp32 [M]) also
    receives ``moe_kernels.fp8.quantize_rowwise(dh)`` from the same pass: a program then holds
    whole rows (F up to ``QUANTIZE_MAX_F``)."""
    h_M2F, da_MF = _row_major(h_M2F), _row_major(da_MF)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    if out is None:
        out = torch.empty_like(h_M2F, memory_format=torch.contiguous_format)
    if quantize_into is not None:
        if F > QUANTIZE_MAX_F:
            raise ValueError(f"quantize_into takes F up to {QUANTIZE_MAX_F}, got F={F}")
        block_f = next_pow2(F)
        block_m = block_m or max(1, min(QUANTIZE_MAX_F // block_f, next_pow2(M)))
    q, qs = quantize_into if quantize_into is not None else (h_M2F, h_M2F)
    bm, bf = _grid_blocks(M, F, block_m, block_f, BACKWARD_BLOCK_F)
    grid = (cdiv(M, bm),)
    w, dw = h_M2F, h_M2F
    if weight_M is not None:
        w = weight_M.contiguous()
        dw = torch.empty(M, dtype=torch.float32, device=h_M2F.device)
    a = torch.empty(M, F, dtype=h_M2F.dtype, device=h_M2F.device) if activation else h_M2F
    _swiglu_backward[grid](
        h_M2F,
        w,
        da_MF,
        out,
        dw,
        a,
        q,
        qs,
        M,
        F,
        h_M2F.stride(0),
        da_MF.stride(0),
        out.stride(0),
        a.stride(0),
        q.stride(0),
        HAS_W=weight_M is not None,
        EMIT_A=activation,
        BLOCK_M=bm,
        BLOCK_F=bf,
        QUANTIZE=quantize_into is not None,
        HW_CAST=HW_CAST,
        num_warps=4,
    )
    return out, None if weight_M is None else dw, a if activation else None
