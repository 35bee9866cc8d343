"""Triton kernel for ``adamw.adamw_step_``: one pass over a tensor's parameter, gradient and two
moments, math in fp32, each written back once in its own dtype (and the parameter a second time
into ``out``, the model's copy in its dtype, when given).

The step count, learning rate, gradient scale (clipping) and apply flag (a skipped step stores
nothing) are read from device scalars, so
the kernel never needs a host value that changes between steps: a CUDA graph can replay it and
nothing recompiles. Programs own BLOCK x ITERS contiguous elements with 64-bit offsets, in
ITERS chunks of BLOCK.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv

# Measured on one H200 over OLMoE-1B-7B's parameters in pure bf16 (benchmarks/adamw_update.py):
# 2048 x 1 on 4 warps 4.12 TB/s; 4096 x 1 on 8 warps (before) 4.01; 1024 x 1 on 4 and 2048 x 1
# on 8 (8 elements a thread) within 0.4 % of it but not bit-equal; longer programs slower.
BLOCK = 2048
ITERS = 1
NUM_WARPS = 4


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
        p = p * (1.0 - lr * weight_decay)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - (lr / bias1) * m / (tl.sqrt(v) / tl.sqrt(bias2) + eps)
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
