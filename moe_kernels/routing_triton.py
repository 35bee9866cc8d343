"""Triton kernels for ``routing.expert_slots``: the token->slot map without a sort.

Three launches over the flattened assignments ``a = t * K + k`` (M = T * K of them):

1. ``_block_rank``: one program per block of BLOCK_A assignments builds the one-hot tile
   [BLOCK_A, E_PAD], its column sums (the block's histogram over experts) and, by a cumulative
   sum down the columns, each assignment's rank among the block's earlier assignments to the
   same expert. Ranks go straight into the output slot buffer.
2. ``_scan``: one program walks the [n_blocks, E_PAD] histogram top to bottom, turning it into
   the exclusive prefix over blocks (in place), and from the totals writes the counts, the
   padded segment starts and the int32 cumulative ends (the last one is ``n_rows``). Its input
   is M / BLOCK_A * E_PAD ints (128 KiB at T=16384, K=8, E=64), so one program is enough.
3. ``_finalize``: slot = segment start of its expert + the expert's assignments in earlier
   blocks + rank within the block; -1 for a dropped assignment (expert id < 0), which matches
   no column of the one-hot tile and so is neither ranked nor counted.

Integer sums only, no atomics: the result is exact and identical on every run, and it is the
stable order (token order within an expert), the layout a stable argsort gives.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2


@triton.jit
def _block_rank(experts_ptr, slot_ptr, hist_ptr, M, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < M
    e = tl.load(experts_ptr + a, mask=amask, other=-1).to(tl.int32)
    hit = (e[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)
    earlier = tl.cumsum(hit, axis=0) - hit
    rank = tl.sum(earlier * hit, axis=1)
    tl.store(slot_ptr + a, rank.to(tl.int64), mask=amask)
    tl.store(hist_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.sum(hit, axis=0))


@triton.jit
def _scan(
    hist_ptr,
    starts_ptr,
    counts_ptr,
    offs_ptr,
    n_blocks,
    n_experts,
    n_rows,
    ALIGN: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    cols = tl.arange(0, E_PAD)
    total = tl.zeros([E_PAD], dtype=tl.int32)
    for b0 in range(0, n_blocks, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        ptrs = hist_ptr + rows[:, None] * E_PAD + cols[None, :]
        rmask = (rows < n_blocks)[:, None]
        h = tl.load(ptrs, mask=rmask, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + total[None, :], mask=rmask)
        total += tl.sum(h, axis=0)
    padded = (total + (ALIGN - 1)) // ALIGN * ALIGN
    ends = tl.cumsum(padded, axis=0)
    emask = cols < n_experts
    tl.store(counts_ptr + cols, total.to(tl.int64), mask=emask)
    tl.store(starts_ptr + cols, ends - padded, mask=emask)
    # The last segment runs to the end of the buffer: every row belongs to a segment.
    tl.store(offs_ptr + cols, tl.where(cols == n_experts - 1, n_rows, ends), mask=emask)


@triton.jit
def _finalize(
    experts_ptr, slot_ptr, hist_ptr, starts_ptr, M, BLOCK_A: tl.constexpr, E_PAD: tl.constexpr
):
    pid = tl.program_id(0)
    a = pid * BLOCK_A + tl.arange(0, BLOCK_A)
    amask = a < M
    e = tl.load(experts_ptr + a, mask=amask, other=0).to(tl.int32)
    valid = amask & (e >= 0)
    base = tl.load(hist_ptr + pid * E_PAD + e, mask=valid, other=0)
    base += tl.load(starts_ptr + e, mask=valid, other=0)
    rank = tl.load(slot_ptr + a, mask=amask, other=0)
    tl.store(slot_ptr + a, tl.where(valid, rank + base.to(tl.int64), -1), mask=amask)


def expert_slots(
    experts_TK: torch.Tensor,
    n_experts: int,
    align: int,
    n_rows: int,
    *,
    block_a: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot_TK int64, counts_E int64, offs_E int32) for a buffer of ``n_rows`` rows (see
    ``routing.expert_slots``); ``block_a`` overrides the assignments per program (tests)."""
    T, K = experts_TK.shape
    M = T * K
    if M >= 2**31:
        raise ValueError(f"{M} routed assignments do not fit the kernels' int32 counters")
    device = experts_TK.device
    flat_M = experts_TK.reshape(-1).contiguous()
    e_pad = max(16, next_pow2(n_experts))
    # The one-hot tile holds 16 Ki int32 (64 per thread at 8 warps): wide enough for many
    # assignments per program, small enough to stay in registers.
    block = block_a or max(16, min(1024, 16384 // e_pad))
    n_blocks = max(1, cdiv(M, block))
    slot_M = torch.empty(M, dtype=torch.int64, device=device)
    hist = torch.empty(n_blocks, e_pad, dtype=torch.int32, device=device)
    starts_E = torch.empty(n_experts, dtype=torch.int32, device=device)
    counts_E = torch.empty(n_experts, dtype=torch.int64, device=device)
    offs_E = torch.empty(n_experts, dtype=torch.int32, device=device)
    _block_rank[(n_blocks,)](flat_M, slot_M, hist, M, BLOCK_A=block, E_PAD=e_pad, num_warps=8)
    _scan[(1,)](
        hist,
        starts_E,
        counts_E,
        offs_E,
        n_blocks,
        n_experts,
        n_rows,
        ALIGN=align,
        E_PAD=e_pad,
        BLOCK_B=max(1, 8192 // e_pad),
        num_warps=8,
    )
    _finalize[(n_blocks,)](flat_M, slot_M, hist, starts_E, M, BLOCK_A=block, E_PAD=e_pad)
    return slot_M.view(T, K), counts_E, offs_E
