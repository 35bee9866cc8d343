"""Triton kernels for ``slot_permute``: token rows to expert-ordered slots and back.

Every kernel is token-major: a program owns BLOCK_T tokens and walks the model dimension in
chunks of BLOCK_D columns, so each row access is a contiguous, 16-byte vectorizable run, and
anything summed over the K choices of a token is summed inside one program in a fixed order:
deterministic, no atomics. Row offsets are int64 (slot * row stride passes 2**31 at production
sizes).

A slot of -1 is a dropped assignment: the kernels neither read nor write a row for it (its
rows contribute nothing). Every row access is also masked to the
buffer (``0 <= slot < n_rows``), so a slot map that does not fit its buffer can give wrong
values but never touches memory outside it. Rows of the expert-ordered buffer that no
valid slot maps to (alignment padding, or rows left over by dropped assignments) are zero-filled
by ``_zero_unused_rows`` from a byte flag per row that the main kernel sets. Where every row is
mapped (by default: ``n_rows == T * K``, the all-valid bijection; or the caller's word, e.g. a
buffer of exactly the valid assignments) neither the flags nor that pass exist.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2

TILE = 4096  # elements per [BLOCK_T, BLOCK_D] tile: 32 per thread at 4 warps
MAX_BLOCK_D = 1024


def _blocks(n_tokens: int, dim: int, block_t: int | None, block_d: int | None) -> tuple[int, int]:
    bd = block_d or min(MAX_BLOCK_D, next_pow2(dim))
    bt = block_t or max(1, min(TILE // bd, next_pow2(n_tokens)))
    return bt, bd


@triton.jit
def _scatter_rows(
    x_ptr,
    slot_ptr,
    out_ptr,
    used_ptr,
    T,
    D,
    n_rows,
    stride_x,
    stride_out,
    K: tl.constexpr,
    MARK_USED: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """out[slot[t, k]] = x[t] for every valid k: one read of the token row, a write per slot."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = tmask[:, None] & (c < D)[None, :]
        row = tl.load(x_ptr + t[:, None] * stride_x + c[None, :], mask=m)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1)
            mk = m & ((slot >= 0) & (slot < n_rows))[:, None]
            tl.store(out_ptr + slot[:, None] * stride_out + c[None, :], row, mask=mk)
    if MARK_USED:
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1)
            valid = (slot >= 0) & (slot < n_rows)
            tl.store(used_ptr + slot, tl.full([BLOCK_T], 1, tl.int8), mask=valid)


@triton.jit
def _gather_rows(
    src_ptr,
    slot_ptr,
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
    """out[t] = sum_k src[slot[t, k]] over valid slots, in fp32, k in order."""
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
            # A dropped slot reads nothing: it adds exactly +0.
            row = tl.load(
                src_ptr + slot[:, None] * stride_src + c[None, :],
                mask=m & valid[:, None],
                other=0.0,
            )
            acc += row.to(tl.float32)
        dst = out_ptr + t[:, None] * stride_out + c[None, :]
        tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _zero_unused_rows(
    out_ptr, used_ptr, n_rows, D, stride_out, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr
):
    """out[r] = 0 for every row r whose flag is unset; blocks with no such row exit at once."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < n_rows
    free = rmask & (tl.load(used_ptr + r, mask=rmask, other=1) == 0)
    if tl.sum(free.to(tl.int32), axis=0) > 0:
        # A new name: Triton (3.6+) rejects an `if` body that changes a variable's dtype.
        r64 = r.to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        zeros = tl.zeros([BLOCK_R, BLOCK_D], dtype=out_ptr.dtype.element_ty)
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            m = free[:, None] & (c < D)[None, :]
            tl.store(out_ptr + r64[:, None] * stride_out + c[None, :], zeros, mask=m)


def zero_unmarked(out_MD: torch.Tensor, used_M: torch.Tensor) -> None:
    """Most row blocks hold no padding and exit after reading 16 flag bytes."""
    n_rows, D = out_MD.shape
    if n_rows == 0 or D == 0:
        return
    block_d = min(TILE // 16, next_pow2(D))
    _zero_unused_rows[(cdiv(n_rows, 16),)](
        out_MD, used_M, n_rows, D, out_MD.stride(0), BLOCK_R=16, BLOCK_D=block_d, num_warps=4
    )


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _must_zero(n_rows: int, n_assignments: int, zero_unmapped: bool | None) -> bool:
    """Whether rows may be left unmapped: the caller's word, else ``n_rows != T * K``."""
    return n_rows != n_assignments if zero_unmapped is None else zero_unmapped


def scatter_rows(
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    *,
    zero_unmapped: bool | None = None,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    block_d: int | None = None,
) -> torch.Tensor:
    """``out[slot_TK[t, k]] = x_TD[t]`` for valid slots, unmapped rows zero (``zero_unmapped``:
    whether any row may be unmapped; default ``n_rows != T * K``): the permute forward."""
    T, D = x_TD.shape
    K = slot_TK.shape[1]
    x_TD, slot_TK = _row_major(x_TD), slot_TK.contiguous()
    if out is None:
        out = torch.empty(n_rows, D, dtype=x_TD.dtype, device=x_TD.device)
    if out.shape != (n_rows, D):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(n_rows, D)}")
    bt, bd = _blocks(T, D, block_t, block_d)
    padded = _must_zero(n_rows, T * K, zero_unmapped)
    used = torch.zeros(n_rows if padded else 1, dtype=torch.int8, device=x_TD.device)
    _scatter_rows[(cdiv(T, bt),)](
        x_TD,
        slot_TK,
        out,
        used,
        T,
        D,
        n_rows,
        x_TD.stride(0),
        out.stride(0),
        K=K,
        MARK_USED=padded,
        BLOCK_T=bt,
        BLOCK_D=bd,
        num_warps=4,
    )
    if padded:
        zero_unmarked(out, used)
    return out


def gather_rows(
    src_MD: torch.Tensor,
    slot_TK: torch.Tensor,
    *,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
    block_t: int | None = None,
    block_d: int | None = None,
) -> torch.Tensor:
    """``out[t] = sum_k src_MD[slot_TK[t, k]]`` over valid slots, with fp32 accumulation: the
    sum of a token's expert rows (and the permute's backward)."""
    T, K = slot_TK.shape
    D = src_MD.shape[1]
    src_MD, slot_TK = _row_major(src_MD), slot_TK.contiguous()
    if out is None:
        out = torch.empty(T, D, dtype=out_dtype, device=src_MD.device)
    bt, bd = _blocks(T, D, block_t, block_d)
    _gather_rows[(cdiv(T, bt),)](
        src_MD,
        slot_TK,
        out,
        T,
        D,
        src_MD.shape[0],
        src_MD.stride(0),
        out.stride(0),
        K=K,
        BLOCK_T=bt,
        BLOCK_D=bd,
        num_warps=4,
    )
    return out
