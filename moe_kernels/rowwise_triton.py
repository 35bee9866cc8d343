"""Triton kernels for ``moe_kernels.rowwise``: one program owns BLOCK_T tokens, walks each payload's
columns in chunks, reads a token's row once and stores it into every visited rank's buffer
(put), or loads the rows from every visited rank and sums them in rank order in fp32 (gather).
A rank's buffer address comes from the int64 pointer table; the destination row is computed in
the kernel from the send slot and the rank's base (the fused routing prep). Row offsets are
int64.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2
from moe_kernels.peer_rows import PeerRows

TILE = 4096  # elements per [BLOCK_T, BLOCK_F] tile of the widest payload
MAX_BLOCK_F = 1024


@triton.jit
def _dest_row(slot_ptr, base_ptr, t, tmask, p, capacity, P: tl.constexpr):
    slot = tl.load(slot_ptr + t * P + p, mask=tmask, other=-1)
    dest = slot + tl.load(base_ptr + p)
    ok = tmask & (slot >= 0) & (dest >= 0) & (dest < capacity)
    return dest, ok


@triton.jit
def _put_payload(
    src_ptr, ptrs_ptr, F, stride_src, slot_ptr, base_ptr, t, tmask, capacity,
    P: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_F)
    for f0 in range(0, F, BLOCK_F):
        c = f0 + cols
        m = tmask[:, None] & (c < F)[None, :]
        row = tl.load(src_ptr + t[:, None] * stride_src + c[None, :], mask=m)
        for p in tl.static_range(P):
            dest, ok = _dest_row(slot_ptr, base_ptr, t, tmask, p, capacity, P)
            dst = tl.load(ptrs_ptr + p).to(tl.pointer_type(src_ptr.dtype.element_ty))
            tl.store(dst + dest[:, None] * F + c[None, :], row, mask=m & ok[:, None])


@triton.jit
def _gather_payload(
    out_ptr, ptrs_ptr, F, slot_ptr, base_ptr, t, tmask, capacity,
    P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    cols = tl.arange(0, BLOCK_F)
    for f0 in range(0, F, BLOCK_F):
        c = f0 + cols
        m = tmask[:, None] & (c < F)[None, :]
        acc = tl.zeros([BLOCK_T, BLOCK_F], dtype=tl.float32)
        for p in tl.static_range(P):
            dest, ok = _dest_row(slot_ptr, base_ptr, t, tmask, p, capacity, P)
            src = tl.load(ptrs_ptr + p).to(tl.pointer_type(out_ptr.dtype.element_ty))
            row = tl.load(src + dest[:, None] * F + c[None, :], mask=m & ok[:, None], other=0.0)
            acc += row.to(tl.float32)
        tl.store(out_ptr + t[:, None] * F + c[None, :], acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _put_rows(
    a_ptr, a_ptrs, A, stride_a, b_ptr, b_ptrs, B, stride_b, slot_ptr, base_ptr, T, capacity,
    P: tl.constexpr, HAS_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    _put_payload(a_ptr, a_ptrs, A, stride_a, slot_ptr, base_ptr, t, tmask, capacity, P, BLOCK_A)
    if HAS_B:
        _put_payload(b_ptr, b_ptrs, B, stride_b, slot_ptr, base_ptr, t, tmask, capacity, P, BLOCK_B)


@triton.jit
def _gather_rows(
    a_ptr, a_ptrs, A, b_ptr, b_ptrs, B, slot_ptr, base_ptr, T, capacity,
    P: tl.constexpr, HAS_B: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_B: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    _gather_payload(a_ptr, a_ptrs, A, slot_ptr, base_ptr, t, tmask, capacity, P, BLOCK_T, BLOCK_A)
    if HAS_B:
        _gather_payload(
            b_ptr, b_ptrs, B, slot_ptr, base_ptr, t, tmask, capacity, P, BLOCK_T, BLOCK_B
        )


def _launch(
    peers: Sequence[PeerRows], slot_TP: torch.Tensor
) -> tuple[tuple[int], int, int, int, int]:
    """Grid and block sizes: BLOCK_T tokens by the widest payload's column block."""
    T, P = slot_TP.shape
    widths = [b.views[0].shape[1] for b in peers]
    block_a = min(MAX_BLOCK_F, next_pow2(widths[0]))
    block_b = min(MAX_BLOCK_F, next_pow2(widths[-1]))
    block_t = max(1, min(TILE // max(block_a, block_b), next_pow2(T)))
    return (cdiv(T, block_t),), block_t, block_a, block_b, P


def put_rows(
    rows: Sequence[torch.Tensor],
    peers: Sequence[PeerRows],
    slot_TP: torch.Tensor,
    base_P: torch.Tensor,
) -> None:
    grid, block_t, block_a, block_b, P = _launch(peers, slot_TP)
    srcs = [r if r.stride(1) == 1 else r.contiguous() for r in rows]
    srcs = [s.to(b.views[0].dtype) for s, b in zip(srcs, peers, strict=True)]
    a, b = srcs[0], srcs[-1]
    _put_rows[grid](
        a, peers[0].ptrs_P, a.shape[1], a.stride(0),
        b, peers[-1].ptrs_P, b.shape[1], b.stride(0),
        slot_TP.contiguous(), base_P.contiguous(), slot_TP.shape[0], peers[0].capacity,
        P=P, HAS_B=len(srcs) == 2, BLOCK_T=block_t, BLOCK_A=block_a, BLOCK_B=block_b,
    )  # fmt: skip


def gather_rows(
    peers: Sequence[PeerRows], slot_TP: torch.Tensor, base_P: torch.Tensor
) -> list[torch.Tensor]:
    grid, block_t, block_a, block_b, P = _launch(peers, slot_TP)
    T = slot_TP.shape[0]
    outs = [buf.views[0].new_empty(T, buf.views[0].shape[1]) for buf in peers]
    a, b = outs[0], outs[-1]
    _gather_rows[grid](
        a, peers[0].ptrs_P, a.shape[1], b, peers[-1].ptrs_P, b.shape[1],
        slot_TP.contiguous(), base_P.contiguous(), T, peers[0].capacity,
        P=P, HAS_B=len(outs) == 2, BLOCK_T=block_t, BLOCK_A=block_a, BLOCK_B=block_b,
    )  # fmt: skip
    return outs
