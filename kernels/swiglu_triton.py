"""Triton kernels for ``swiglu``: ``a = silu(gate) * up`` over [M, 2F] rows, and its backward.

A program owns a [BLOCK_M, BLOCK_F] tile of the output: it reads the matching gate and up tiles
(F columns apart in the same row), computes in fp32 and writes once. Elementwise, so the grid is
2-D over rows and columns and every access is a contiguous run along F.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._triton import cdiv, next_pow2

TILE = 4096
MAX_BLOCK_F = 1024


@triton.jit
def _swiglu_forward(
    h_ptr, a_ptr, M, F, stride_h, stride_a, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < M)[:, None] & (cols < F)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + F, mask=m, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + rows[:, None] * stride_a + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=m)


@triton.jit
def _swiglu_backward(
    h_ptr,
    da_ptr,
    dh_ptr,
    M,
    F,
    stride_h,
    stride_da,
    stride_dh,
    BLOCK_M: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = (rows < M)[:, None] & (cols < F)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + F, mask=m, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows[:, None] * stride_da + cols[None, :], mask=m, other=0.0)
    da = da.to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    dgate_ptrs = dh_ptr + rows[:, None] * stride_dh + cols[None, :]
    tl.store(dgate_ptrs, dg.to(dh_ptr.dtype.element_ty), mask=m)
    tl.store(dgate_ptrs + F, (da * silu).to(dh_ptr.dtype.element_ty), mask=m)


def _grid_blocks(M: int, F: int, block_m: int | None, block_f: int | None) -> tuple[int, int]:
    bf = block_f or min(MAX_BLOCK_F, next_pow2(F))
    bm = block_m or max(1, min(TILE // bf, next_pow2(M)))
    return bm, bf


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def swiglu_forward(
    h_M2F: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_f: int | None = None,
) -> torch.Tensor:
    """a_MF = silu(h[:, :F]) * h[:, F:], fp32 math, h's dtype."""
    h_M2F = _row_major(h_M2F)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    if out is None:
        out = torch.empty(M, F, dtype=h_M2F.dtype, device=h_M2F.device)
    bm, bf = _grid_blocks(M, F, block_m, block_f)
    _swiglu_forward[(cdiv(M, bm), cdiv(F, bf))](
        h_M2F, out, M, F, h_M2F.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_F=bf, num_warps=4
    )
    return out


def swiglu_backward(
    h_M2F: torch.Tensor,
    da_MF: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_f: int | None = None,
) -> torch.Tensor:
    """dh_M2F = [da * up * silu'(gate) | da * silu(gate)], fp32 math, h's dtype."""
    h_M2F, da_MF = _row_major(h_M2F), _row_major(da_MF)
    M, F = h_M2F.shape[0], h_M2F.shape[1] // 2
    if out is None:
        out = torch.empty_like(h_M2F, memory_format=torch.contiguous_format)
    bm, bf = _grid_blocks(M, F, block_m, block_f)
    _swiglu_backward[(cdiv(M, bm), cdiv(F, bf))](
        h_M2F,
        da_MF,
        out,
        M,
        F,
        h_M2F.stride(0),
        da_MF.stride(0),
        out.stride(0),
        BLOCK_M=bm,
        BLOCK_F=bf,
        num_warps=4,
    )
    return out
