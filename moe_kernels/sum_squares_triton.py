"""Triton kernel for ``sum_squares.sum_squares``: each program reads ``BLOCK x ITERS``
contiguous elements of one tensor (64-bit offsets, the loop unrolled so that its loads are in
flight together), squares them in fp32 and writes one partial sum. Every tensor's programs
write into one fp32 buffer, which one reduction sums: a launch per tensor, no atomics, the same
result for the same inputs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv

# Measured on one H200 over OLMoE-1B-7B's large gradients (benchmarks/grad_norm.py): 4096 x 4
# read at 4.1 TB/s, 2048 x 8 and 4096 x 8 within 2.5 % of it, 8192 x 4 and 4096 x 16 10 % slower.
BLOCK = 4096
ITERS = 4


@triton.jit
def _sum_squares(x_ptr, partial_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(partial_ptr + tl.program_id(0), tl.sum(acc, axis=0))


def sum_squares(
    tensors: list[torch.Tensor], block: int = BLOCK, iters: int = ITERS
) -> torch.Tensor:
    """fp32 sum of squares of contiguous, non-empty ``tensors`` on one device (0-d)."""
    grids = [cdiv(t.numel(), block * iters) for t in tensors]
    partials = torch.empty(sum(grids), dtype=torch.float32, device=tensors[0].device)
    start = 0
    for t, grid in zip(tensors, grids, strict=True):
        _sum_squares[(grid,)](t, partials[start:], t.numel(), BLOCK=block, ITERS=iters, num_warps=8)
        start += grid
    return partials.sum()
