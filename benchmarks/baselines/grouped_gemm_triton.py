"""Triton grouped GEMMs over expert segments, with the group offsets only on the device.

A baseline, not on the training path (``moe_kernels.grouped_gemm`` takes ``torch._grouped_mm`` or
QuACK): slower than ``torch._grouped_mm`` at the model's shapes except skewed down-projection
weight gradients (benchmarks/RESULTS.md); ``benchmarks/grouped_gemm.py`` times it, and it is
the starting point for a persistent grouped GEMM.

``grouped_mm``: ``y[rows of g] = x[rows of g] @ w[g]`` (the forward, and the input gradient
``dy @ w[g]^T`` with ``w`` passed transposed); ``grouped_wgrad``: ``dw[g] = x[rows of g]^T @
dy[rows of g]`` (the weight gradient, as [G, K, N] or, transposed, as [G, N, K]). Rows of group g
are ``[offs_G[g-1], offs_G[g])``; ``offs_G`` holds int32 cumulative ends on the device, the last
equal to M, empty groups allowed.

Why: the group sizes live on the device (routing computes them there), and reading them on the
host would stall the CPU until the GPU catches up. So nothing here reads ``offs_G`` on the host:
every launch grid is a static function of the shapes, and each program finds its work on the
device.

- Forward: a row tile never straddles two groups, so group g needs ``cdiv(size_g, BLOCK_M)``
  tiles, and all groups together at most ``cdiv(M, BLOCK_M) + G`` (one partial tile per group
  boundary). The grid is that bound times ``cdiv(N, BLOCK_N)``; each program loads all of
  ``offs_G`` (G values: a vector op), takes the cumulative tile counts, and reads off its group
  and first row; programs past the real tile count exit at once. Row tiles are ordered group by
  group and swizzled ``GROUP_M`` at a time, so neighbouring programs share ``w[g]`` in L2.
  Loads clamp rows to ``M - 1`` (the rows of a tile past its group's end belong to the next
  group: read, multiplied, never stored), so the main loop has no row mask; only a ragged K
  edge is masked (to zero: it enters the sums).
- Weight gradient: one program per (group, [BLOCK_P, BLOCK_Q] output tile); it loops over its
  group's rows in chunks of BLOCK_M, masked to the group (rows of other groups must not enter the
  sum). An empty group's tiles are stored as zeros. The transposed result ``dy^T @ x`` is the
  same kernel with the operands swapped.

Both accumulate in fp32 (``tl.dot``) and store the input dtype. Every operand is addressed by its
strides: ``w_GKN`` may be any view, e.g. the transpose of a contiguous [G, N, K] weight (the
model's layout); nothing is copied. On a GPU the block sizes are autotuned over a few Hopper
configs, keyed on the shapes except M (forward: N, K, G and the weight's strides; weight
gradient: the output's shape and G), so a new row count does not retune. The first call for a
key benchmarks the configs (host syncs then: warm up before capturing a CUDA graph). On CPU
(Triton's interpreter, for the tests) small fixed blocks run, and tl.dot takes fp32 copies of
the operands (``_upcast``). fp32 inputs run tl.dot's default precision: TF32 on a GPU. Rows
past ``offs_G[-1]`` (none when it equals M, as it must) are neither written by the forward nor
read by the weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2

# (BLOCK_M, BLOCK_N, BLOCK_K) for the forward and (BLOCK_M, BLOCK_P, BLOCK_Q) for the weight
# gradient where no override is given on CPU (the interpreter: few, small programs).
CPU_BLOCK = (32, 32, 32)
GROUP_M = 8  # row tiles per L2 swizzle group of the forward


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages
    )


def _wcfg(bm: int, bp: int, bq: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_P": bp, "BLOCK_Q": bq}, num_warps=warps, num_stages=stages
    )


# Hopper (sm_90, 228 KB shared memory per SM): 128-row tiles for wgmma, BLOCK_K 64 (a 128-byte
# bf16 row: full-width shared-memory swizzle), 3-4 stages of cp.async pipelining.
FWD_CONFIGS = [
    _cfg(128, 256, 64, 8, 3),
    _cfg(128, 128, 64, 8, 4),
    _cfg(128, 128, 64, 4, 4),
    _cfg(64, 128, 64, 4, 4),
    _cfg(64, 256, 64, 8, 3),
]
WGRAD_CONFIGS = [
    _wcfg(64, 128, 256, 8, 3),
    _wcfg(64, 128, 128, 8, 4),
    _wcfg(64, 128, 128, 4, 4),
    _wcfg(32, 128, 128, 4, 4),
]


@triton.jit
def _mma(a, b, acc, UPCAST: tl.constexpr):
    """acc + a @ b in fp32; UPCAST: on fp32 copies of a and b (see ``_upcast``)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    offs_ptr,
    M,
    N,
    K,
    G,
    stride_xm,
    stride_xk,
    stride_wg,
    stride_wk,
    stride_wn,
    stride_ym,
    stride_yn,
    G_PAD: tl.constexpr,
    GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[rows] = x[rows] @ w[g] for one [BLOCK_M, BLOCK_N] tile of one group."""
    # Program -> (row tile, column tile): GROUP_M row tiles sweep every column tile together.
    n_tiles_m = tl.cdiv(M, BLOCK_M) + G  # static bound on the row tiles of all groups
    n_tiles_n = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    per_band = GROUP_M * n_tiles_n
    first_m = (pid // per_band) * GROUP_M
    band_m = tl.minimum(n_tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_band) % band_m
    tile_n = (pid % per_band) // band_m

    # Row tile -> (group, first row), from the tile counts of every group.
    gs = tl.arange(0, G_PAD)
    ends = tl.load(offs_ptr + gs, mask=gs < G, other=0)
    starts = tl.load(offs_ptr + gs - 1, mask=(gs > 0) & (gs < G), other=0)
    tiles = tl.cdiv(ends - starts, BLOCK_M)
    cum = tl.cumsum(tiles, axis=0)  # inclusive: tiles of groups 0..g
    if tile_m < tl.sum(tiles, axis=0):
        g = tl.sum((cum <= tile_m).to(tl.int32), axis=0)
        sel = gs == g
        row_end = tl.sum(tl.where(sel, ends, 0), axis=0)
        first_tile = tl.sum(tl.where(sel, cum - tiles, 0), axis=0)
        row0 = tl.sum(tl.where(sel, starts, 0), axis=0) + (tile_m - first_tile) * BLOCK_M

        rows = row0 + tl.arange(0, BLOCK_M)
        rows_in = tl.minimum(rows, M - 1).to(tl.int64)  # other groups' rows: read, not stored
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # columns past N: read again, never stored
        cols_in = cols if EVEN_N else tl.minimum(cols, N - 1)
        ks = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + rows_in[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + g.to(tl.int64) * stride_wg
        w_ptrs = w_ptrs + ks[:, None] * stride_wk + cols_in[None, :] * stride_wn
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, tl.cdiv(K, BLOCK_K)):
            if EVEN_K:
                a = tl.load(x_ptrs)
                b = tl.load(w_ptrs)
            else:
                k_in = ks < K - k0 * BLOCK_K  # the ragged K edge enters the sum: zero it
                a = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
            acc = _mma(a, b, acc, UPCAST)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk

        mask = ((rows < row_end) & (rows < M))[:, None] & (cols < N)[None, :]
        y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grouped_wgrad_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    offs_ptr,
    P,
    Q,
    G,  # unused: in the autotune key (rows per group set the best row chunk)
    stride_am,
    stride_ap,
    stride_bm,
    stride_bq,
    stride_cg,
    stride_cp,
    stride_cq,
    EVEN_P: tl.constexpr,
    EVEN_Q: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
):
    """c[g] = a[rows of g]^T @ b[rows of g] for one [BLOCK_P, BLOCK_Q] tile of c[g]."""
    n_tiles_q = tl.cdiv(Q, BLOCK_Q)
    tile_p = tl.program_id(0) // n_tiles_q
    tile_q = tl.program_id(0) % n_tiles_q
    g = tl.program_id(1)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    end = tl.load(offs_ptr + g)

    ps = tile_p * BLOCK_P + tl.arange(0, BLOCK_P)
    qs = tile_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    # Output columns past P (Q) are read again and never stored: no column masks in the loop.
    ps_in = ps if EVEN_P else tl.minimum(ps, P - 1)
    qs_in = qs if EVEN_Q else tl.minimum(qs, Q - 1)
    ms = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + ms
        r_in = (rows < end)[:, None]  # rows of the next group must not enter the sum
        rows64 = rows.to(tl.int64)
        a = tl.load(a_ptr + rows64[:, None] * stride_am + ps_in[None, :] * stride_ap, r_in, 0.0)
        b = tl.load(b_ptr + rows64[:, None] * stride_bm + qs_in[None, :] * stride_bq, r_in, 0.0)
        acc = _mma(tl.trans(a), b, acc, UPCAST)

    c_ptrs = c_ptr + g.to(tl.int64) * stride_cg + ps[:, None] * stride_cp + qs[None, :] * stride_cq
    mask = (ps < P)[:, None] & (qs < Q)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


_grouped_mm = triton.heuristics(
    {
        "EVEN_K": lambda a: a["K"] % a["BLOCK_K"] == 0,
        "EVEN_N": lambda a: a["N"] % a["BLOCK_N"] == 0,
    }
)(_grouped_mm_kernel)
_grouped_mm_tuned = triton.autotune(
    configs=FWD_CONFIGS, key=["N", "K", "G", "stride_wk", "stride_wn"]
)(_grouped_mm)
_grouped_wgrad = triton.heuristics(
    {
        "EVEN_P": lambda a: a["P"] % a["BLOCK_P"] == 0,
        "EVEN_Q": lambda a: a["Q"] % a["BLOCK_Q"] == 0,
    }
)(_grouped_wgrad_kernel)
_grouped_wgrad_tuned = triton.autotune(configs=WGRAD_CONFIGS, key=["P", "Q", "G"])(_grouped_wgrad)


def _check_offs(offs_G: torch.Tensor, x: torch.Tensor) -> None:
    if offs_G.dtype != torch.int32 or offs_G.dim() != 1:
        raise TypeError(f"offs_G must be 1-D int32 cumulative ends, got {offs_G.dtype}")
    if offs_G.device != x.device:
        raise ValueError(f"offs_G is on {offs_G.device}, the operands on {x.device}")


def _upcast(x: torch.Tensor) -> bool:
    """Whether tl.dot takes fp32 copies of the operands: in Triton's interpreter (CPU tensors),
    whose tl.dot multiplies bf16 bit patterns as integers (triton-lang/triton#11584). A product
    of two bf16 values is exact in fp32, so this is the GPU's bf16 MMA with fp32 accumulation."""
    return x.device.type == "cpu"


def _block(block: tuple[int, int, int] | None, device: torch.device) -> tuple[int, ...] | None:
    """The caller's blocks, the CPU default (interpreter), or None: autotune on the GPU."""
    if block is not None:
        return tuple(block)
    return CPU_BLOCK if device.type == "cpu" else None


def grouped_mm(
    x_MK: torch.Tensor,
    w_GKN: torch.Tensor,
    offs_G: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``y_MN[rows of g] = x_MK[rows of g] @ w_GKN[g]``, fp32 accumulation, x's dtype.

    x_MK: rows sorted by group (any strides); w_GKN: [G, K, N], any strides (e.g. a transposed
    [G, N, K] weight); offs_G: int32 cumulative row ends on x's device, the last equal to M
    (rows past it are not written). ``block``: (BLOCK_M, BLOCK_N, BLOCK_K) instead of the
    autotuned (GPU) or fixed (CPU) blocks; each a power of two, at least 16.
    """
    _check_offs(offs_G, x_MK)
    if x_MK.dim() != 2 or w_GKN.dim() != 3:
        raise ValueError(f"expected x [M, K] and w [G, K, N], got {x_MK.shape}, {w_GKN.shape}")
    M, K = x_MK.shape
    G, N = w_GKN.shape[0], w_GKN.shape[2]
    if w_GKN.shape[1] != K or offs_G.shape[0] != G:
        raise ValueError(f"x {tuple(x_MK.shape)}, w {tuple(w_GKN.shape)}, offs {G} disagree")
    if w_GKN.dtype != x_MK.dtype:
        raise TypeError(f"x is {x_MK.dtype}, w is {w_GKN.dtype}")
    if out is None:
        out = torch.empty(M, N, dtype=x_MK.dtype, device=x_MK.device)
    if out.shape != (M, N):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(M, N)}")
    if M == 0 or N == 0 or G == 0:
        return out
    if K == 0:
        return out.zero_()
    args = (
        x_MK,
        w_GKN,
        out,
        offs_G,
        M,
        N,
        K,
        G,
        x_MK.stride(0),
        x_MK.stride(1),
        w_GKN.stride(0),
        w_GKN.stride(1),
        w_GKN.stride(2),
        out.stride(0),
        out.stride(1),
    )
    consts = dict(G_PAD=max(2, next_pow2(G)), GROUP_M=GROUP_M, UPCAST=_upcast(x_MK))
    blocks = _block(block, x_MK.device)
    if blocks is None:

        def grid(meta: dict) -> tuple[int]:
            return ((cdiv(M, meta["BLOCK_M"]) + G) * cdiv(N, meta["BLOCK_N"]),)

        _grouped_mm_tuned[grid](*args, **consts)
    else:
        bm, bn, bk = blocks
        grid = ((cdiv(M, bm) + G) * cdiv(N, bn),)
        _grouped_mm[grid](
            *args, **consts, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=4, num_stages=3
        )
    return out


def grouped_wgrad(
    x_MK: torch.Tensor,
    dy_MN: torch.Tensor,
    offs_G: torch.Tensor,
    *,
    transposed: bool = False,
    out: torch.Tensor | None = None,
    block: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """``dw_GKN[g] = x_MK[rows of g]^T @ dy_MN[rows of g]`` (zero for an empty group), fp32
    accumulation, x's dtype; with ``transposed`` the contiguous ``dw_GNK[g] = dy^T @ x`` (the
    gradient of a weight stored as [G, N, K]). ``block``: (BLOCK_M rows per step, BLOCK_P,
    BLOCK_Q of the output tile) instead of the autotuned (GPU) or fixed (CPU) blocks.
    """
    _check_offs(offs_G, x_MK)
    if x_MK.dim() != 2 or dy_MN.dim() != 2 or dy_MN.shape[0] != x_MK.shape[0]:
        raise ValueError(f"expected x [M, K] and dy [M, N], got {x_MK.shape}, {dy_MN.shape}")
    if dy_MN.dtype != x_MK.dtype:
        raise TypeError(f"x is {x_MK.dtype}, dy is {dy_MN.dtype}")
    a, b = (dy_MN, x_MK) if transposed else (x_MK, dy_MN)
    G, P, Q = offs_G.shape[0], a.shape[1], b.shape[1]
    if out is None:
        out = torch.empty(G, P, Q, dtype=x_MK.dtype, device=x_MK.device)
    if out.shape != (G, P, Q):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(G, P, Q)}")
    if out.numel() == 0:
        return out
    if a.shape[0] == 0:
        return out.zero_()
    args = (
        a,
        b,
        out,
        offs_G,
        P,
        Q,
        G,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        out.stride(2),
    )
    blocks = _block(block, x_MK.device)
    if blocks is None:

        def grid(meta: dict) -> tuple[int, int]:
            return (cdiv(P, meta["BLOCK_P"]) * cdiv(Q, meta["BLOCK_Q"]), G)

        _grouped_wgrad_tuned[grid](*args, UPCAST=_upcast(x_MK))
    else:
        bm, bp, bq = blocks
        grid = (cdiv(P, bp) * cdiv(Q, bq), G)
        _grouped_wgrad[grid](
            *args,
            UPCAST=_upcast(x_MK),
            BLOCK_M=bm,
            BLOCK_P=bp,
            BLOCK_Q=bq,
            num_warps=4,
            num_stages=3,
        )
    return out
