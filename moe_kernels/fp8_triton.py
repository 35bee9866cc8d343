"""Triton kernels for ``moe_kernels.fp8``'s quantizers. ``quantize_rowwise``: a program owns BLOCK_M
rows, finds each row's absolute maximum over K, then writes the values multiplied by the row's
inverse scale, saturated and rounded to nearest even E4M3 (the GPU's conversion instruction;
under Triton's interpreter, rounded in fp32 first and cast exactly), and the fp32 scale: one
launch, one IEEE division per row and none per value; a row that fits one chunk is read once
and kept in registers, a longer one is walked in chunks twice (the second read mostly from
cache).
``quantize_columnwise`` does the same over the columns of each expert's weight and stores the
result transposed; ``quantize_mx`` the MXFP8 blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import INTERPRET, cdiv, next_pow2
from moe_kernels.fp8_format import AMAX_FLOOR, E4M3_MAX, MX_BLOCK

HW_CAST = not INTERPRET  # the GPU's E4M3 conversion; the interpreter's rounds wrongly


@triton.jit
def _round_to_e4m3(y):
    """``y`` (fp32, |y| <= 448) rounded to the nearest E4M3 value, ties to even, in fp32: the
    spacing at y's binade (2^(e-3); subnormals share 2^-6's) divided out by multiplying with
    its inverse 2^(3-e) (a power of two: exact), then the add-and-subtract of 1.5 * 2^23 that
    rounds to an integer in round-to-nearest-even. The cast after it is exact (Triton's
    interpreter mis-rounds casts that round up into the next binade)."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    ulp = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    inv_ulp = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) * inv_ulp + 12582912.0) - 12582912.0) * ulp
    return tl.where(r == 0, 0.0, tl.where(y < 0, -r, r))  # a zero is +0 (module doc of fp8)


@triton.jit
def _scale_to_e4m3(x, inv, dtype, FP8_MAX: tl.constexpr, HW_CAST: tl.constexpr):
    """``x * inv`` (fp32; ``inv`` from ``_row_scales``, broadcast by the caller) saturated at
    +-448 and stored as E4M3, rounded to nearest even: the GPU's conversion instruction, or
    ``_round_to_e4m3`` and an exact cast (Triton's interpreter). A value that rounds to zero
    (|y| <= 2^-10) is stored +0 either way."""
    y = tl.clamp(x * inv, -FP8_MAX, FP8_MAX)
    if HW_CAST:
        return tl.where(tl.abs(y) <= 0.0009765625, 0.0, y).to(dtype)
    return _round_to_e4m3(y).to(dtype)


@triton.jit
def _row_scales(amax, FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr):
    """(scale, inverse) for rows with these absolute maxima, as
    ``moe_kernels.fp8.quantize_rowwise_reference``: IEEE divisions (the GPU's default fp32 division
    is approximate)."""
    floored = tl.maximum(amax, AMAX_FLOOR)
    scale = tl.where(amax > 0, tl.div_rn(floored, FP8_MAX), 1.0)
    inv = tl.where(amax > 0, tl.div_rn(tl.zeros_like(floored) + FP8_MAX, floored), 1.0)
    return scale, inv


@triton.jit
def _quantize_rows(
    x_ptr, q_ptr, scale_ptr, M, K, stride_x, stride_q,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr, FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    if ONE_PASS:  # the whole row in one chunk (BLOCK_K >= K): read once, kept in registers
        m = rmask[:, None] & (cols < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0)
        x = x.to(tl.float32)
        scale, inv = _row_scales(tl.max(tl.abs(x), axis=1), FP8_MAX, AMAX_FLOOR)
        tl.store(scale_ptr + rows, scale, mask=rmask)
        q = _scale_to_e4m3(x, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
        tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=m)
    else:
        amax = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            m = rmask[:, None] & (c < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=m, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
        scale, inv = _row_scales(amax, FP8_MAX, AMAX_FLOOR)
        tl.store(scale_ptr + rows, scale, mask=rmask)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + cols
            m = rmask[:, None] & (c < K)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=m, other=0.0)
            x = x.to(tl.float32)
            q = _scale_to_e4m3(x, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
            tl.store(q_ptr + rows[:, None] * stride_q + c[None, :], q, mask=m)


def _row_blocks(M: int, K: int, block_m: int = 0, block_k: int = 0) -> tuple[int, int]:
    """(rows, columns) a program of the rowwise quantizers takes, where the caller names none:
    a row of up to 2048 values whole (its width rounded up to a power of two), a longer one
    in chunks of 512; tiles of 2048 values (``quantize_rowwise``'s doc says why)."""
    block_k = block_k or (next_pow2(K) if K <= 2048 else 512)
    block_m = block_m or max(1, min(2048 // block_k, next_pow2(M)))
    return block_m, block_k


def quantize_rowwise(
    x_MK: torch.Tensor,
    block_m: int = 0,
    block_k: int = 0,
    num_warps: int = 4,
    hw_cast: bool = HW_CAST,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks (``benchmarks/fp8_quantize.py`` sweeps them): a row of up to 2048 values is read
    once, whole (``block_k`` its width rounded up to a power of two), in tiles of 2048 values;
    a longer one in chunks of 512, four rows a program, read twice. (On one H200, rows of 2048
    bf16 values: 0.189 ms for 131,072 rows, within 2 % of the best of 49 tiles and faster than
    a copy of the same tensor, 0.257, since E4M3 is half the bytes to write; with the fp32
    rounding before an exact cast instead of the conversion instruction, 0.235.)"""
    M, K = x_MK.shape
    x = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    if out is None:
        q_MK = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
        scale_M = torch.empty(M, dtype=torch.float32, device=x.device)
    else:
        q_MK, scale_M = out
    block_m, block_k = _row_blocks(M, K, block_m, block_k)
    _quantize_rows[(cdiv(M, block_m),)](
        x, q_MK, scale_M, M, K, x.stride(0), q_MK.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, ONE_PASS=block_k >= K, FP8_MAX=E4M3_MAX,
        AMAX_FLOOR=AMAX_FLOOR, HW_CAST=hw_cast, num_warps=num_warps,
    )  # fmt: skip
    return q_MK, scale_M


@triton.jit
def _quantize_columns_transposed(
    w_ptr, q_ptr, scale_ptr, N, K, stride_wg, stride_wn, stride_wk, stride_qg, stride_qk,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """``moe_kernels.fp8.quantize_columnwise``: a program owns BLOCK_K columns of one ``w[g]``
    ([N, K]); pass 1 walks N in tiles for each column's absolute maximum, pass 2 reads the
    tiles again (from cache), scales, rounds and writes each one transposed into ``q[g]``
    ([K, N], row-major): no transposed copy of the weight is ever made."""
    g = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    cmask = cols < K
    rows = tl.arange(0, BLOCK_N)
    w_g = w_ptr + g * stride_wg
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        r = n0 + rows
        m = (r < N)[:, None] & cmask[None, :]
        w = tl.load(w_g + r[:, None] * stride_wn + cols[None, :] * stride_wk, mask=m, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(w.to(tl.float32)), axis=0))
    scale, inv = _row_scales(amax, FP8_MAX, AMAX_FLOOR)
    tl.store(scale_ptr + g * K + cols, scale, mask=cmask)
    q_g = q_ptr + g * stride_qg
    for n0 in range(0, N, BLOCK_N):
        r = n0 + rows
        m = (r < N)[:, None] & cmask[None, :]
        w = tl.load(w_g + r[:, None] * stride_wn + cols[None, :] * stride_wk, mask=m, other=0.0)
        w = w.to(tl.float32)
        q_KN = tl.trans(_scale_to_e4m3(w, inv[None, :], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST))
        m_KN = cmask[:, None] & (r < N)[None, :]
        tl.store(q_g + cols[:, None] * stride_qk + r[None, :], q_KN, mask=m_KN)


def quantize_columnwise(
    w_GNK: torch.Tensor,
    block_n: int = 0,
    block_k: int = 0,
    num_warps: int = 4,
    hw_cast: bool = HW_CAST,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks: ``block_k`` columns per program, ``block_n`` rows per tile; 128 x 64 by default
    (``benchmarks/fp8_quantize.py`` on one H200 at OLMoE's two expert weights: with one IEEE
    division per column, 128 x 64 took 0.45 / 0.23 ms and the 16 x 64 of before 0.62 / 0.32;
    with two per value it had been best at 0.81 / 0.42; a copy takes 0.26 / 0.13)."""
    G, N, K = w_GNK.shape
    if out is None:
        q_GKN = torch.empty(G, K, N, dtype=torch.float8_e4m3fn, device=w_GNK.device)
        scale_GK = torch.empty(G, K, dtype=torch.float32, device=w_GNK.device)
    else:
        q_GKN, scale_GK = out
    block_k = block_k or min(64, next_pow2(K))
    block_n = block_n or min(128, next_pow2(N))
    _quantize_columns_transposed[(G, cdiv(K, block_k))](
        w_GNK, q_GKN, scale_GK, N, K, *w_GNK.stride(), q_GKN.stride(0), q_GKN.stride(1),
        BLOCK_N=block_n, BLOCK_K=block_k, FP8_MAX=E4M3_MAX, AMAX_FLOOR=AMAX_FLOOR,
        HW_CAST=hw_cast, num_warps=num_warps,
    )  # fmt: skip
    return q_GKN, scale_GK


@triton.jit
def _quantize_mx_rows(
    x_ptr, q_ptr, scale_ptr, M, K, stride_x, stride_q, stride_s,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, MX: tl.constexpr, FP8_MAX: tl.constexpr,
):  # fmt: skip
    """MXFP8 (``moe_kernels.fp8.quantize_mx``): a program owns BLOCK_M rows and walks K in chunks
    of BLOCK_K (whole 32-value blocks), each chunk read once: its blocks' absolute maxima,
    the E8M0 exponents ceil(log2(amax / 448)) read off the fp32 bits, the values divided by
    their power of two (exact), rounded to E4M3 and stored with one exponent byte per block."""
    NB: tl.constexpr = BLOCK_K // MX
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    blocks = tl.arange(0, NB)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + cols
        m = rmask[:, None] & (c < K)[None, :]
        x = tl.load(x_ptr + rows[:, None] * stride_x + c[None, :], mask=m, other=0.0)
        x3 = tl.reshape(x.to(tl.float32), (BLOCK_M, NB, MX))
        amax = tl.max(tl.abs(x3), axis=2)
        bits = tl.div_rn(amax, FP8_MAX).to(tl.int32, bitcast=True)
        biased = (bits >> 23) & 0xFF
        e = biased - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        e = tl.minimum(tl.maximum(tl.where(biased == 0, -127, e), -127), 127)
        # dividing by 2^e is multiplying by 2^-e, exactly: 2^-e as fp32 (-e in [-127, 127]),
        # a normal number's exponent field or the subnormal 2^-127
        inv = tl.where(e <= 126, (127 - e) << 23, 0x00400000).to(tl.float32, bitcast=True)
        y = tl.clamp(x3 * inv[:, :, None], -FP8_MAX, FP8_MAX)
        q = tl.reshape(_round_to_e4m3(y), (BLOCK_M, BLOCK_K)).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + rows[:, None] * stride_q + c[None, :], q, mask=m)
        b = k0 // MX + blocks
        bm = rmask[:, None] & (b < K // MX)[None, :]
        tl.store(scale_ptr + rows[:, None] * stride_s + b[None, :], (e + 127).to(tl.uint8), mask=bm)


def quantize_mx(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    M, K = x_MK.shape
    x = x_MK if x_MK.stride(1) == 1 else x_MK.contiguous()
    q_MK = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    scale_MB = torch.empty(M, K // MX_BLOCK, dtype=torch.uint8, device=x.device)
    block_k = min(1024, next_pow2(K))
    block_m = max(1, min(4096 // block_k, next_pow2(M)))
    _quantize_mx_rows[(cdiv(M, block_m),)](
        x, q_MK, scale_MB, M, K, x.stride(0), q_MK.stride(0), scale_MB.stride(0),
        BLOCK_M=block_m, BLOCK_K=block_k, MX=MX_BLOCK, FP8_MAX=E4M3_MAX,
    )  # fmt: skip
    return q_MK, scale_MB.view(torch.float8_e8m0fnu)


@triton.jit
def _swiglu_quantize_rows(
    h_ptr, w_ptr, q_ptr, scale_ptr, M, F, stride_h, stride_q,
    HAS_W: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, FP8_MAX: tl.constexpr,
    AMAX_FLOOR: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """``quantize_rowwise(swiglu(h, w))`` in one pass (``moe_kernels.fp8``'s expert MLP): a program
    owns BLOCK_M whole rows (BLOCK_F >= F), computes ``a`` as ``moe_kernels.swiglu_triton`` does,
    rounds it to h's dtype (the bf16 values the two-kernel path would write and read back),
    then quantizes the row from registers; ``a`` itself never reaches memory."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    m = rmask[:, None] & (cols < F)[None, :]
    gate_ptrs = h_ptr + rows[:, None] * stride_h + cols[None, :]
    g = tl.load(gate_ptrs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + F, mask=m, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    if HAS_W:
        a = a * tl.load(w_ptr + rows, mask=rmask, other=0.0).to(tl.float32)[:, None]
    a = a.to(h_ptr.dtype.element_ty).to(tl.float32)
    scale, inv = _row_scales(tl.max(tl.abs(a), axis=1), FP8_MAX, AMAX_FLOOR)
    tl.store(scale_ptr + rows, scale, mask=rmask)
    q = _scale_to_e4m3(a, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=m)


SWIGLU_QUANTIZE_MAX_F = 2048  # whole rows in registers: wider ones take the two kernels


def swiglu_quantize_rowwise(
    h_M2F: torch.Tensor, weight_M: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 [M, F], fp32 scales [M]) of ``(weight *) silu(gate) * up`` for F up to
    ``SWIGLU_QUANTIZE_MAX_F``; rows of 2048 values per program, as ``quantize_rowwise``."""
    h = h_M2F if h_M2F.stride(1) == 1 else h_M2F.contiguous()
    M, F = h.shape[0], h.shape[1] // 2
    q_MF = torch.empty(M, F, dtype=torch.float8_e4m3fn, device=h.device)
    scale_M = torch.empty(M, dtype=torch.float32, device=h.device)
    block_f = next_pow2(F)
    block_m = max(1, min(2048 // block_f, next_pow2(M)))
    w = h if weight_M is None else weight_M.contiguous()
    _swiglu_quantize_rows[(cdiv(M, block_m),)](
        h, w, q_MF, scale_M, M, F, h.stride(0), q_MF.stride(0),
        HAS_W=weight_M is not None, BLOCK_M=block_m, BLOCK_F=block_f, FP8_MAX=E4M3_MAX,
        AMAX_FLOOR=AMAX_FLOOR, HW_CAST=HW_CAST,
    )  # fmt: skip
    return q_MF, scale_M


@triton.jit
def _scatter_quantize_rows(
    x_ptr, slot_ptr, q_ptr, scale_ptr, rows_ptr, used_ptr, T, D, n_rows, stride_x, stride_q,
    stride_rows, K: tl.constexpr, KEEP_ROWS: tl.constexpr, MARK_USED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, ONE_PASS: tl.constexpr,
    FP8_MAX: tl.constexpr, AMAX_FLOOR: tl.constexpr, HW_CAST: tl.constexpr,
):  # fmt: skip
    """``quantize_rowwise(permute_to_slots(x))`` without the permuted copy: a program owns
    BLOCK_T token rows, finds each row's scale once (a token's K slots hold the same row, so
    the same bytes), and writes the E4M3 row and its scale into each valid slot (with
    KEEP_ROWS, the unquantized row too: the combine's backward, whose bf16 rows the weight
    gradient reads). Slots as ``slot_permute_triton._scatter_rows``: -1 writes nothing, every
    access masked to the buffer."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < T
    t = t.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    amax = tl.zeros([BLOCK_T], dtype=tl.float32)
    if not ONE_PASS:  # a row in chunks: its maximum first, then each chunk read again
        for d0 in range(0, D, BLOCK_D):
            c = d0 + cols
            m = tmask[:, None] & (c < D)[None, :]
            x = tl.load(x_ptr + t[:, None] * stride_x + c[None, :], mask=m, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x.to(tl.float32)), axis=1))
    for d0 in range(0, D, BLOCK_D):
        c = d0 + cols
        m = tmask[:, None] & (c < D)[None, :]
        raw = tl.load(x_ptr + t[:, None] * stride_x + c[None, :], mask=m, other=0.0)
        x = raw.to(tl.float32)
        if ONE_PASS:  # the whole row in this one chunk: its maximum from registers
            amax = tl.max(tl.abs(x), axis=1)
        scale, inv = _row_scales(amax, FP8_MAX, AMAX_FLOOR)
        q = _scale_to_e4m3(x, inv[:, None], q_ptr.dtype.element_ty, FP8_MAX, HW_CAST)
        for k in tl.static_range(K):
            slot = tl.load(slot_ptr + t * K + k, mask=tmask, other=-1).to(tl.int64)
            valid = tmask & (slot >= 0) & (slot < n_rows)
            mk = m & valid[:, None]
            tl.store(q_ptr + slot[:, None] * stride_q + c[None, :], q, mask=mk)
            if KEEP_ROWS:
                tl.store(rows_ptr + slot[:, None] * stride_rows + c[None, :], raw, mask=mk)
            if d0 == 0:
                tl.store(scale_ptr + slot, scale, mask=valid)
                if MARK_USED:
                    tl.store(used_ptr + slot, tl.full([BLOCK_T], 1, tl.int8), mask=valid)


def scatter_quantize_rows(
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    *,
    zero_unmapped: bool,
    keep_rows: bool,
    block_t: int = 0,
    block_d: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(E4M3 [n_rows, D], fp32 scales [n_rows], the unquantized rows or None): each token row
    quantized by rows and written into its slots, in one launch (``moe_kernels.fp8_quantize.
    quantize_to_slots`` defines it). Unmapped rows (``zero_unmapped``) are a zero row: +0 values
    and scale 1, as ``quantize_rowwise`` gives a zero row. Blocks as ``quantize_rowwise``: rows
    of up to 2048 values read once, longer ones in chunks of 512, read twice."""
    from moe_kernels import slot_permute_triton

    T, D = x_TD.shape
    K = slot_TK.shape[1]
    x = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
    slot_TK = slot_TK.contiguous()
    dev = x.device
    q_MD = torch.empty(n_rows, D, dtype=torch.float8_e4m3fn, device=dev)
    # unmapped rows keep these: scale 1 (a zero row's), and their values zeroed below
    scale_M = (torch.ones if zero_unmapped else torch.empty)(
        n_rows, dtype=torch.float32, device=dev
    )
    rows_MD = torch.empty(n_rows, D, dtype=x.dtype, device=dev) if keep_rows else None
    used = torch.zeros(n_rows if zero_unmapped else 1, dtype=torch.int8, device=dev)
    block_t, block_d = _row_blocks(T, D, block_t, block_d)
    _scatter_quantize_rows[(cdiv(T, block_t),)](
        x, slot_TK, q_MD, scale_M, q_MD if rows_MD is None else rows_MD, used, T, D, n_rows,
        x.stride(0), q_MD.stride(0), D, K=K, KEEP_ROWS=keep_rows, MARK_USED=zero_unmapped,
        BLOCK_T=block_t, BLOCK_D=block_d, ONE_PASS=block_d >= D, FP8_MAX=E4M3_MAX,
        AMAX_FLOOR=AMAX_FLOOR, HW_CAST=HW_CAST, num_warps=4,
    )  # fmt: skip
    if zero_unmapped:
        slot_permute_triton.zero_unmarked(q_MD.view(torch.uint8), used)  # +0 is the zero byte
        if rows_MD is not None:
            slot_permute_triton.zero_unmarked(rows_MD, used)
    return q_MD, scale_M, rows_MD
