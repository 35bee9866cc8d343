"""Triton kernel for ``adamw.adamw_step_``: one pass over a tensor's parameter, gradient and two
moments, math in fp32, each written back once in its own dtype (and the parameter a second time
into ``out``, the model's copy in its dtype, when given).

The step count, learning rate, gradient scale (clipping) and apply flag (a skipped step stores
nothing) are read from device scalars, so
the kernel never needs a host value that changes between steps: a CUDA graph can replay it and
nothing recompiles. Programs own BLOCK x ITERS contiguous elements with 64-bit offsets, in
ITERS chunks of BLOCK.

``_adamw_rows`` is the same update for a weight whose FP8 copy it also writes
(``adamw.adamw_step_(rows=)``): programs own BLOCK_M whole rows of K values (the rowwise scale
needs a row's maximum), walked in chunks of BLOCK_K; a row that fits one chunk is quantized from
registers, a longer one read back from the weight just written (mostly from cache). Its
arithmetic is ``_update``, the plain kernel's, so the weights are the same bits either way. The
columnwise copy (scales over N) is not written here: a row block never sees a whole column, so
``quantize_columnwise`` reads the new weight once more after this pass (``moe_kernels.fp8_cache``).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_kernels._triton import INTERPRET, cdiv, next_pow2
from moe_kernels.fp8_format import AMAX_FLOOR, E4M3_MAX
from moe_kernels.fp8_triton import _row_scales, _scale_to_e4m3

# Measured on one H200 over OLMoE-1B-7B's parameters in pure bf16 (benchmarks/adamw_update.py):
# 2048 x 1 on 4 warps 4.12 TB/s; 4096 x 1 on 8 warps (before) 4.01; 1024 x 1 on 4 and 2048 x 1
# on 8 (8 elements a thread) within 0.4 % of it but not bit-equal; longer programs slower.
BLOCK = 2048
ITERS = 1
NUM_WARPS = 4


@triton.jit
def _update(p, g, m, v, lr, bias1, bias2, beta1, beta2, eps, weight_decay):
    """One element's AdamW update in fp32 (both kernels: the same bits)."""
    p = p * (1.0 - lr * weight_decay)
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
    return p, m, v


@triton.jit
def _adamw(
    p_ptr,
    g_ptr,
    m_ptr,
    v_ptr,
    out_ptr,
    n,
    lr_ptr,
    step_ptr,
    scale_ptr,
    apply_ptr,
    beta1,
    beta2,
    log2_beta1,
    log2_beta2,
    eps,
    weight_decay,
    HAS_SCALE: tl.constexpr,
    HAS_OUT: tl.constexpr,
    HAS_APPLY: tl.constexpr,
    BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
):
    if HAS_APPLY:  # not applied: no element is in range, nothing is read or written
        n = n * (tl.load(apply_ptr).to(tl.float32) != 0.0).to(tl.int64)
    lr = tl.load(lr_ptr).to(tl.float32)
    step = tl.load(step_ptr).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2 = 1.0 - tl.exp2(step * log2_beta2)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
        m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        p, m, v = _update(p, g, m, v, lr, bias1, bias2, beta1, beta2, eps, weight_decay)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
        if HAS_OUT:
            # The model's copy is the stored parameter cast once more (as ``out.copy_(p)``).
            p = p.to(p_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + offs, p, mask=mask)


def adamw_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    scale: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    out: torch.Tensor | None = None,
    apply: torch.Tensor | None = None,
    block: int = BLOCK,
    iters: int = ITERS,
    num_warps: int = NUM_WARPS,
) -> None:
    """In place on contiguous ``p``, ``m``, ``v`` (see ``adamw.adamw_step_``)."""
    n = p.numel()
    _adamw[(cdiv(n, block * iters),)](
        p,
        g,
        m,
        v,
        out if out is not None else p,
        n,
        lr,
        step,
        scale if scale is not None else lr,
        apply if apply is not None else lr,
        beta1,
        beta2,
        math.log2(beta1) if beta1 > 0 else -math.inf,
        math.log2(beta2) if beta2 > 0 else -math.inf,
        eps,
        weight_decay,
        HAS_SCALE=scale is not None,
        HAS_OUT=out is not None,
        HAS_APPLY=apply is not None,
        BLOCK=block,
        ITERS=iters,
        num_warps=num_warps,
    )


@triton.jit
def _update_chunk(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, mask, lr, bias1, bias2, scale, beta1, beta2, eps,
    weight_decay, HAS_OUT: tl.constexpr,
):  # fmt: skip
    """Update one chunk as ``_adamw`` does and return the weight as stored (``out``'s dtype, or
    ``p``'s), in fp32."""
    p = tl.load(p_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) * scale
    m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p, m, v = _update(p, g, m, v, lr, bias1, bias2, beta1, beta2, eps, weight_decay)
    p = p.to(p_ptr.dtype.element_ty)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)
    w = p.to(out_ptr.dtype.element_ty)  # without ``out``, out_ptr is p_ptr: no conversion
    if HAS_OUT:
        tl.store(out_ptr + offs, w, mask=mask)
    return w.to(tl.float32)


@triton.jit
def _adamw_rows(
    p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, q_ptr, s_ptr, R, K, lr_ptr, step_ptr, scale_ptr,
    apply_ptr, beta1, beta2, log2_beta1, log2_beta2, eps, weight_decay,
    HAS_SCALE: tl.constexpr, HAS_OUT: tl.constexpr, HAS_APPLY: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    if HAS_APPLY:  # not applied: no row is in range, nothing is read or written
        R = R * (tl.load(apply_ptr).to(tl.float32) != 0.0).to(tl.int32)
    lr = tl.load(lr_ptr).to(tl.float32)
    step = tl.load(step_ptr).to(tl.float32)
    bias1 = 1.0 - tl.exp2(step * log2_beta1)
    bias2 = 1.0 - tl.exp2(step * log2_beta2)
    scale = 1.0
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < R
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # whole rows in one chunk: quantized from registers
        mask = rmask[:, None] & (cols < K)[None, :]
        offs = rows[:, None] * K + cols[None, :]
        w = _update_chunk(
            p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, mask, lr, bias1, bias2, scale, beta1,
            beta2, eps, weight_decay, HAS_OUT,
        )  # fmt: skip
        s, inv = _row_scales(tl.max(tl.abs(w), axis=1), FP8_MAX, AMAX_FLOOR)
        tl.store(s_ptr + rows, s, mask=rmask)
        q = _scale_to_e4m3(w, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
        tl.store(q_ptr + offs, q, mask=mask)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            mask = rmask[:, None] & (c < K)[None, :]
            offs = rows[:, None] * K + c[None, :]
            w = _update_chunk(
                p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, offs, mask, lr, bias1, bias2, scale, beta1,
                beta2, eps, weight_decay, HAS_OUT,
            )  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.abs(w), axis=1))
        s, inv = _row_scales(amax, FP8_MAX, AMAX_FLOOR)
        tl.store(s_ptr + rows, s, mask=rmask)
        tl.debug_barrier()  # the program's stores of the new weight before its loads of them
        w_ptr = out_ptr if HAS_OUT else p_ptr
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            mask = rmask[:, None] & (c < K)[None, :]
            offs = rows[:, None] * K + c[None, :]
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            q = _scale_to_e4m3(w, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
            tl.store(q_ptr + offs, q, mask=mask)


# Rows of up to this many values are updated and quantized from registers in one chunk.
ROWS_ONE_PASS_K = 2048


def adamw_rows_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    scale: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    out: torch.Tensor | None,
    apply: torch.Tensor | None,
    rows: tuple[torch.Tensor, torch.Tensor],
    block_k: int = 0,
    num_warps: int = NUM_WARPS,
) -> None:
    """``adamw_step_`` that also writes ``rows`` (see ``adamw.adamw_step_``): BLOCK_M x BLOCK_K
    tiles of about ``BLOCK`` values (the plain kernel's), whole rows up to
    ``ROWS_ONE_PASS_K`` values, else chunks of 512 (``block_k`` overrides: the tests)."""
    q, s = rows
    R, K = q.shape
    if not block_k:
        block_k = next_pow2(K) if K <= ROWS_ONE_PASS_K else 512
    block_m = max(1, min(BLOCK // block_k, next_pow2(R)))
    _adamw_rows[(cdiv(R, block_m),)](
        p, g, m, v, out if out is not None else p, q, s, R, K, lr, step,
        scale if scale is not None else lr, apply if apply is not None else lr,
        beta1, beta2,
        math.log2(beta1) if beta1 > 0 else -math.inf,
        math.log2(beta2) if beta2 > 0 else -math.inf,
        eps, weight_decay,
        HAS_SCALE=scale is not None, HAS_OUT=out is not None, HAS_APPLY=apply is not None,
        BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=block_k >= K, FP8_MAX=E4M3_MAX,
        AMAX_FLOOR=AMAX_FLOOR, HW_CAST=not INTERPRET, num_warps=num_warps,
    )  # fmt: skip
