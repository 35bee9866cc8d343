"""FP8 (E4M3) expert GEMMs with rowwise dynamic scales: the forward and the input gradient in
FP8 on Hopper tensor cores, the weight gradient in bf16.

Scaling: each row of an operand, along the dimension the product contracts, gets its own fp32
scale ``amax / 448`` (448 is E4M3's largest finite value; an all-zero row takes scale 1; amax is
floored at 2^-116 so that its inverse stays finite), and its values ``x * (448 / amax)`` (one
IEEE division per row, an exact fp32 product per value, as torchao's quantizers do) are rounded
to nearest E4M3 (ties to even), saturating at +-448; a value that rounds to zero is stored +0
(never -0, so every path gives the same bytes). The
product is then ``(q_a @ q_b) * scale_a[row] * scale_b[col]``, which ``torch._scaled_grouped_mm``
computes with fp32 accumulation (unless told to accumulate fast, below) and a bf16 output,
whatever ``parallel.expert_gemm`` says: QuACK's sm90 GEMM computes the same bytes with the
scales in its epilogue (``grouped_gemm_quack.fp8_scaled_mm``) but ran at about half of torch's
FP8 GEMM on one H200 (QuACK 0.6.5; ``benchmarks/fp8_gemm.py``, RESULTS.md issues 41 and 42), so
training does not take it.

- forward ``y = x @ w[g]``: ``x`` by rows (over K), the weight by its output columns (over K:
  for experts stored [G, N, K] those are its rows, so the quantized copy is already the
  column-major operand the GEMM takes);
- input gradient ``dx = dy @ w[g]^T``: ``dy`` by rows (over N), the weight over N, one scale
  per (g, k): ``quantize_columnwise`` writes it straight into the row-major [G, K, N] layout
  the GEMM takes, with no transposed copy of the weight (its bytes are the rowwise
  quantization of that copy, which defines it);
- weight gradient: bf16 ``moe_kernels.grouped_gemm`` (contracting over each group's rows needs
  per-(group, column) scales over the tokens and a transposed FP8 copy of both operands; on one
  H200 torch's FP8 form of it ran at 273-647 TFLOP/s against 723-732 for QuACK's bf16 weight
  gradients, before that copy: RESULTS.md, issues 41 and 42).

``fp8_expert_mlp`` is the experts' whole SwiGLU MLP on these GEMMs as one op, which keeps x and
the pre-activation h for backward but not the SwiGLU output: the SwiGLU backward writes it
again in its pass (``moe_kernels.swiglu.swiglu_grads``) for the down weight gradient. With rowwise
scales its forward never writes that output at all: one Triton pass computes the SwiGLU and
quantizes it (``fp8_triton.swiglu_quantize_rowwise``: the bytes of ``quantize_rowwise`` of the
SwiGLU kernel's output), the down GEMM's operand; in backward the SwiGLU's pass also quantizes
dh by rows for the gate+up input gradient (``swiglu_grads(quantize_into=...)``), so dh is not
read again for it.

MX scaling (``scaling="mx"``, OCP Microscaling MXFP8): each block of 32 consecutive values along
K gets a power-of-two scale stored as E8M0 (a biased exponent byte, ``2^(byte - 127)``). The
exponent is ``ceil(log2(amax / 448))`` (NVIDIA's round-up recipe rather than the spec's floor, so
no value saturates), clamped to [-127, 127]; an all-zero block takes 2^-127. Its values are
rounded to E4M3 as above (its input gradient still quantizes a transposed copy). Blackwell
(sm_100) runs these GEMMs natively; that path is not built here yet, so MX runs as the
dequantized product everywhere (on CPU: its tested emulation), and
``moe_core.parallel.parallelize.choose_kernels`` refuses it on a GPU.

``quantize_rowwise`` is the one quantizer (Triton: amax, scale and cast in one kernel per row
block, reading a row once where it fits; the reference below defines it);
``quantize_columnwise`` applies its rules to the weight's columns (Triton: a program per expert
and block of K, the amax over N tiles, then each tile scaled, rounded and stored transposed).
Where ``_scaled_grouped_mm`` cannot run (CPU, before sm90), ``fp8_grouped_mm`` computes the same
function from the dequantized operands: its numerics are those of the GPU path up to fp32
summation order (and, with fast accumulation, the GPU accumulator's fewer bits).

``fp8_linear`` is the same recipe for one dense weight (``nn.Linear``'s [N, K]; attention and
dense projections, the LM head): forward and input gradient as ``torch._scaled_mm`` with
rowwise scales, the weight gradient in bf16; it keeps the bf16 input for backward, as the
bf16 linear does. Inside ``torch.compile`` its quantizers are the references above
(``moe_kernels._triton``'s rule), which Inductor fuses with the ops around them.

Accumulation (``fast_accum=``): Hopper's FP8 tensor cores can accumulate a product's partial
sums in their own reduced-precision accumulator ("fast accumulation") or have CUTLASS/cuBLAS
promote them into fp32 registers as K goes (the default, "none"). "forward" takes fast
accumulation for the forward products only, torchao's FP8 training recipe (the gradients keep
fp32 promotion); "all" for the input gradients too. It is a GPU choice only: off the GPU every
product is the dequantized one. On one H100 the experts' FP8 grouped GEMMs ran 1.12-1.19x
faster with it at 2,048 rows an expert and up to 3.3x at 1,024, where torch's tile choice
makes promotion slow; the experts' MLP stayed within 0.04 % of promotion's error
(``benchmarks/fp8_accumulate.py``, RESULTS.md).

Both ``fp8_expert_mlp`` and ``fp8_linear`` take ``cached=``: a weight's two quantized operands
made once per optimizer step (``moe_kernels.fp8_cache``, the same bytes), used instead of
quantizing the weight in the call, so the micro-batches of a step share them.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton
from moe_kernels.expert_mlp import check_operands
from moe_kernels.fp8_cache import FP8Weight
from moe_kernels.fp8_format import E4M3 as E4M3
from moe_kernels.fp8_format import E4M3_MAX as E4M3_MAX
from moe_kernels.fp8_quantize import check_tokens_and_slots
from moe_kernels.fp8_quantize import dequantize as dequantize
from moe_kernels.fp8_quantize import dequantize_mx as dequantize_mx
from moe_kernels.fp8_quantize import quantize_columnwise as quantize_columnwise
from moe_kernels.fp8_quantize import quantize_columnwise_reference as quantize_columnwise_reference
from moe_kernels.fp8_quantize import quantize_mx as quantize_mx
from moe_kernels.fp8_quantize import quantize_mx_reference as quantize_mx_reference
from moe_kernels.fp8_quantize import quantize_rowwise as quantize_rowwise
from moe_kernels.fp8_quantize import quantize_rowwise_reference as quantize_rowwise_reference
from moe_kernels.fp8_quantize import quantize_to_slots as quantize_to_slots
from moe_kernels.grouped_gemm import check_backend, grouped_mm_reference, grouped_mm_wgrad
from moe_kernels.slot_permute import (
    _check_rows,
    _scatter_to_slots,
    _sum_over_slots,
    unmapped_rows_possible,
)
from moe_kernels.swiglu import swiglu_grads, swiglu_values

# The quantizers live in moe_kernels.fp8_quantize (moe_kernels.swiglu and the dispatcher use them
# without the GEMMs) and the format's numbers in moe_kernels.fp8_format; they are named here too,
# as the FP8 ops' public surface.


def scaled_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._scaled_mm`` runs rowwise-scaled FP8 here (CUDA, sm90 and newer)."""
    return x.device.type == "cuda" and torch.cuda.get_device_capability(x.device)[0] >= 9


def scaled_grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs FP8 here (CUDA, sm90 and newer)."""
    return hasattr(torch, "_scaled_grouped_mm") and scaled_mm_supported(x)


FAST_ACCUM = ("none", "forward", "all")


def fast_accum_flags(fast_accum: str) -> tuple[bool, bool]:
    """(forward, input gradients): which FP8 products accumulate fast under ``fast_accum``
    (module doc); any other value than ``FAST_ACCUM``'s is refused."""
    if fast_accum not in FAST_ACCUM:
        raise ValueError(f"fast_accum={fast_accum!r} is not allowed: 'none', 'forward' or 'all'")
    return fast_accum != "none", fast_accum == "all"


def _scaled_mm(
    a_MK: torch.Tensor,
    b_GNK: torch.Tensor,
    offs_G: torch.Tensor,
    out_dtype: torch.dtype,
    scaling: str = "rowwise",
    fast: bool = False,
) -> torch.Tensor:
    """``a @ b[g]^T`` per group with both operands quantized over K (rows of ``a``, rows of
    each ``b[g]``): FP8 on the GPU, the dequantized product elsewhere (and for MX, always)."""
    G, N, K = b_GNK.shape
    if scaling == "mx":
        qa, sa = quantize_mx(a_MK)
        qb, sb = quantize_mx(b_GNK.reshape(G * N, K))
        w_GKN = dequantize_mx(qb, sb).view(G, N, K).transpose(-2, -1)
        return grouped_mm_reference(dequantize_mx(qa, sa), w_GKN, offs_G).to(out_dtype)
    return _rowwise_mm(a_MK, *_quantize_weight_rows(b_GNK), offs_G, out_dtype, fast)


def _quantize_weight_rows(b_GNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight quantized over K, by rows: values [G, N, K], scales [G, N]."""
    G, N, K = b_GNK.shape
    qb, sb = quantize_rowwise(b_GNK.reshape(G * N, K))
    return qb.view(G, N, K), sb.view(G, N)


def _rowwise_mm(
    a_MK: torch.Tensor,
    qb_GNK: torch.Tensor,
    sb_GN: torch.Tensor,
    offs_G: torch.Tensor,
    out_dtype: torch.dtype,
    fast: bool = False,
) -> torch.Tensor:
    """``a @ b[g]^T`` per group for ``b`` already quantized over K (rowwise: values [G, N, K]
    row-major, scales [G, N]); ``a`` is quantized here, by rows."""
    qa, sa = quantize_rowwise(a_MK)
    return _quantized_mm(qa, sa, qb_GNK, sb_GN, offs_G, out_dtype, fast)


def _quantized_mm(
    qa_MK: torch.Tensor,
    sa_M: torch.Tensor,
    qb_GNK: torch.Tensor,
    sb_GN: torch.Tensor,
    offs_G: torch.Tensor,
    out_dtype: torch.dtype,
    fast: bool = False,
) -> torch.Tensor:
    """``a @ b[g]^T`` per group from both operands quantized rowwise over K:
    ``torch._scaled_grouped_mm`` (accumulating ``fast`` or with fp32 promotion), off the GPU
    the dequantized product."""
    if scaled_grouped_mm_supported(qa_MK):
        return torch._scaled_grouped_mm(
            qa_MK,
            qb_GNK.transpose(-2, -1),
            sa_M,
            sb_GN,
            offs=offs_G,
            out_dtype=out_dtype,
            use_fast_accum=fast,
        )
    G, N, K = qb_GNK.shape
    w_GKN = dequantize(qb_GNK.view(G * N, K), sb_GN.reshape(G * N)).view(G, N, K)
    a_MK = dequantize(qa_MK, sa_M)
    return grouped_mm_reference(a_MK, w_GKN.transpose(-2, -1), offs_G).to(out_dtype)


def _swiglu_quantized(
    h_M2F: torch.Tensor, weight_M: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rowwise(swiglu_values(h, weight))``: one pass in Triton where the rows fit,
    else the two kernels (the same bytes)."""
    if use_triton(h_M2F):
        from moe_kernels import fp8_triton

        if h_M2F.shape[1] // 2 <= fp8_triton.SWIGLU_QUANTIZE_MAX_F:
            return fp8_triton.swiglu_quantize_rowwise(h_M2F, weight_M)
    return quantize_rowwise(swiglu_values(h_M2F, weight_M))


def _weight_rows(w_GNK: torch.Tensor, cached: FP8Weight | None):
    """The forward's weight operand: the cached one, else quantized now."""
    return cached.rows if cached is not None else _quantize_weight_rows(w_GNK)


def _weight_cols(w_GNK: torch.Tensor, cached: FP8Weight | None):
    """The input gradient's weight operand: the cached one, else ``quantize_columnwise`` now
    (written transposed by the quantizer: no copy)."""
    return cached.cols if cached is not None else quantize_columnwise(w_GNK)


def _input_grad(
    dy_MN: torch.Tensor,
    w_GNK: torch.Tensor,
    offs_G: torch.Tensor,
    scaling: str,
    cached: FP8Weight | None = None,
    fast: bool = False,
):
    """``dy @ w[g]`` per group, the input gradient of ``x @ w[g]^T``, both quantized over N."""
    if scaling == "mx":  # over N: the transposed copy
        w_GKN = w_GNK.transpose(-2, -1).contiguous()
        return _scaled_mm(dy_MN, w_GKN, offs_G, dy_MN.dtype, scaling)
    return _rowwise_mm(dy_MN, *_weight_cols(w_GNK, cached), offs_G, dy_MN.dtype, fast)


def _weight_grad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor, w_GNK, backend: str
) -> torch.Tensor:
    """``dy[rows of g]^T @ x[rows of g]`` in bf16, in the weight's own [G, N, K] layout (the
    grouped GEMM ``backend``'s, ``moe_kernels.grouped_gemm``)."""
    w_GKN = w_GNK.transpose(-2, -1)
    dw_GKN = grouped_mm_wgrad(x_MK, dy_MN, offs_G, w_GKN, backend)
    return dw_GKN.transpose(-2, -1).to(w_GNK.dtype)


def _swiglu_backward(
    h_M2F: torch.Tensor,
    da_MF: torch.Tensor,
    weight_M: torch.Tensor | None,
    quantize_dh: bool,
    activation: bool,
):
    """(dh, dweight, the SwiGLU output or None, dh's E4M3 rows and scales or None): the
    SwiGLU's backward pass (``swiglu_grads``), writing dh by rows in E4M3 for the gate+up input
    gradient where ``quantize_dh``, and the SwiGLU output for the down weight gradient where
    ``activation``."""
    qdh = None
    if quantize_dh:
        M, F2 = h_M2F.shape
        qdh = (
            torch.empty(M, F2, dtype=E4M3, device=h_M2F.device),
            torch.empty(M, dtype=torch.float32, device=h_M2F.device),
        )
    dh_M2F, dweight, a_MF = swiglu_grads(
        h_M2F, da_MF, weight_M, activation=activation, quantize_into=qdh
    )
    return dh_M2F, dweight, a_MF, qdh


class _FP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GNK, offs_G, scaling: str, backend: str, fast_accum: str):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        ctx.scaling, ctx.backend = scaling, backend
        fast_forward, ctx.fast_grad = fast_accum_flags(fast_accum)
        return _scaled_mm(x_MK, w_GNK, offs_G, x_MK.dtype, scaling, fast_forward)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # type: ignore[override]
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _input_grad(dy_MN, w_GNK, offs_G, ctx.scaling, fast=ctx.fast_grad)
        if ctx.needs_input_grad[1]:
            dw = _weight_grad(x_MK, dy_MN, offs_G, w_GNK, ctx.backend)
        return dx, dw, None, None, None, None


def _check_scaling(offs_G: torch.Tensor, scaling: str) -> None:
    if offs_G.dtype != torch.int32:
        raise TypeError(f"offs_G must be int32 cumulative ends, got {offs_G.dtype}")
    if scaling not in ("rowwise", "mx"):
        raise ValueError(f"scaling={scaling!r} is not allowed: 'rowwise' or 'mx'")


def fp8_grouped_mm(
    x_MK: torch.Tensor,
    w_GNK: torch.Tensor,
    offs_G: torch.Tensor,
    scaling: str = "rowwise",
    *,
    backend: str = "auto",
    fast_accum: str = "none",
) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g]^T`` for experts stored [G, N, K], forward and input
    gradient in FP8 (module doc) with ``scaling`` "rowwise" or "mx"; int32 cumulative
    ``offs_G`` as ``grouped_mm`` takes them; ``backend``: the bf16 weight gradient's;
    ``fast_accum``: which FP8 products accumulate fast on the GPU (module doc)."""
    _check_scaling(offs_G, scaling)
    check_backend(backend)
    fast_accum_flags(fast_accum)
    return _FP8GroupedMM.apply(x_MK, w_GNK, offs_G, scaling, backend, fast_accum)


class _FP8ExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_MD,
        w_gate_up,
        w_down,
        offs_G,
        weight_M,
        scaling: str,
        backend: str,
        cached,
        fast_accum: str,
    ):  # type: ignore[override]
        cached_gate_up, cached_down = cached
        fast, ctx.fast_grad = fast_accum_flags(fast_accum)
        if scaling == "mx":
            h_M2F = _scaled_mm(x_MD, w_gate_up, offs_G, x_MD.dtype, scaling)
        else:
            qw, sw = _weight_rows(w_gate_up, cached_gate_up)
            h_M2F = _rowwise_mm(x_MD, qw, sw, offs_G, x_MD.dtype, fast)
            del qw, sw  # a weight quantized here is not kept past its GEMM
        ctx.save_for_backward(x_MD, w_gate_up, w_down, offs_G, h_M2F, weight_M)
        ctx.scaling, ctx.backend, ctx.cached = scaling, backend, cached
        if scaling == "mx":
            return _scaled_mm(swiglu_values(h_M2F, weight_M), w_down, offs_G, x_MD.dtype, "mx")
        qa_MF, sa_M = _swiglu_quantized(h_M2F, weight_M)  # the SwiGLU output is never written
        qw, sw = _weight_rows(w_down, cached_down)
        return _quantized_mm(qa_MF, sa_M, qw, sw, offs_G, x_MD.dtype, fast)

    @staticmethod
    def backward(ctx, dy_MD: torch.Tensor):  # type: ignore[override]
        x_MD, w_gate_up, w_down, offs_G, h_M2F, weight_M = ctx.saved_tensors
        cached_gate_up, cached_down = ctx.cached
        dy_MD = dy_MD.contiguous()
        need = ctx.needs_input_grad
        da_MF = _input_grad(dy_MD, w_down, offs_G, ctx.scaling, cached_down, ctx.fast_grad)
        # with rowwise scales, dh is quantized for the input gradient in the SwiGLU's own pass
        dh_M2F, dweight, a_MF, qdh = _swiglu_backward(
            h_M2F, da_MF, weight_M, need[0] and ctx.scaling == "rowwise", need[2]
        )
        del da_MF
        dw_down = _weight_grad(a_MF, dy_MD, offs_G, w_down, ctx.backend) if need[2] else None
        del a_MF
        dx = None
        if qdh is not None:
            qw, sw = _weight_cols(w_gate_up, cached_gate_up)
            dx = _quantized_mm(*qdh, qw, sw, offs_G, dy_MD.dtype, ctx.fast_grad)
            del qdh, qw, sw  # not alive beside the weight gradient below
        elif need[0]:
            dx = _input_grad(dh_M2F, w_gate_up, offs_G, ctx.scaling)
        dw_gate_up = None
        if need[1]:
            dw_gate_up = _weight_grad(x_MD, dh_M2F, offs_G, w_gate_up, ctx.backend)
        return dx, dw_gate_up, dw_down, None, dweight if need[4] else None, None, None, None, None


def fp8_expert_mlp(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs_G: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    scaling: str = "rowwise",
    *,
    backend: str = "auto",
    cached: tuple[FP8Weight | None, FP8Weight | None] = (None, None),
    fast_accum: str = "none",
) -> torch.Tensor:
    """The experts' SwiGLU MLP ``weight_M * (swiglu(x @ w_gate_up[g]^T) @ w_down[g]^T)`` per
    expert segment (``moe_kernels.expert_mlp``'s function) with both projections as
    ``fp8_grouped_mm``: equal to that composition with ``moe_kernels.swiglu`` between them, in
    output and every gradient, but keeping only x and the pre-activation h for backward. The
    SwiGLU output, the down projection's input, is written again by the SwiGLU backward's pass
    for the down weight gradient instead of being kept: a [M, F] tensor per layer less (the
    fused bf16 path keeps none either). ``backend``: the bf16 weight gradients' grouped GEMMs
    (``moe_kernels.grouped_gemm``). ``cached``: the two weights' FP8 operands
    (``moe_kernels.fp8_cache``, rowwise scaling only), taken instead of quantizing the weights
    here; the caller vouches that they are the current weights' (``FP8WeightCache.get``).
    ``fast_accum``: which FP8 products accumulate fast on the GPU (module doc)."""
    _check_scaling(offs_G, scaling)
    check_backend(backend)
    fast_accum_flags(fast_accum)
    check_operands(x_MD, w_gate_up, w_down, offs_G, weight_M)
    for c, w, name in zip(cached, (w_gate_up, w_down), ("w_gate_up", "w_down"), strict=True):
        if c is not None:
            if scaling != "rowwise":
                raise ValueError(f"cached FP8 weights are rowwise-scaled, not scaling={scaling!r}")
            c.check(w, name)
    return _FP8ExpertMLP.apply(
        x_MD, w_gate_up, w_down, offs_G, weight_M, scaling, backend, tuple(cached), fast_accum
    )


class _FP8RoutedMLP(torch.autograd.Function):
    """The experts' MLP between the permute and the sum (``fp8_routed_mlp``): its row operands
    quantized by the passes that write them (``quantize_to_slots``)."""

    @staticmethod
    def forward(
        ctx,
        x_TD,
        slot_TK,
        n_rows,
        every_row_mapped,
        w_gate_up,
        w_down,
        offs_G,
        weight_M,
        backend: str,
        cached,
        fast_accum: str,
    ):  # type: ignore[override]
        cached_gate_up, cached_down = cached
        fast, ctx.fast_grad = fast_accum_flags(fast_accum)
        qx_MD, sx_M, _ = quantize_to_slots(x_TD, slot_TK, n_rows, every_row_mapped=every_row_mapped)
        qw, sw = _weight_rows(w_gate_up, cached_gate_up)
        h_M2F = _quantized_mm(qx_MD, sx_M, qw, sw, offs_G, x_TD.dtype, fast)
        del qx_MD, sx_M, qw, sw
        qa_MF, sa_M = _swiglu_quantized(h_M2F, weight_M)
        qw, sw = _weight_rows(w_down, cached_down)
        y_MD = _quantized_mm(qa_MF, sa_M, qw, sw, offs_G, x_TD.dtype, fast)
        del qa_MF, sa_M, qw, sw
        # x_TD, not its expert-ordered copy: the backward permutes it again for the one GEMM
        # that reads it in bf16 (the gate+up weight gradient)
        ctx.save_for_backward(x_TD, slot_TK, w_gate_up, w_down, offs_G, h_M2F, weight_M)
        ctx.n_rows, ctx.every_row_mapped = n_rows, every_row_mapped
        ctx.backend, ctx.cached = backend, cached
        return _sum_over_slots(y_MD, slot_TK)

    @staticmethod
    def backward(ctx, dy_TD: torch.Tensor):  # type: ignore[override]
        x_TD, slot_TK, w_gate_up, w_down, offs_G, h_M2F, weight_M = ctx.saved_tensors
        cached_gate_up, cached_down = ctx.cached
        need = ctx.needs_input_grad
        n_rows, mapped = ctx.n_rows, ctx.every_row_mapped
        # the sum's backward writes dy into each slot, quantized in the same pass
        qdy_MD, sdy_M, dy_MD = quantize_to_slots(
            dy_TD.contiguous(), slot_TK, n_rows, keep_rows=True, every_row_mapped=mapped
        )
        da_MF = _quantized_mm(
            qdy_MD, sdy_M, *_weight_cols(w_down, cached_down), offs_G, dy_TD.dtype, ctx.fast_grad
        )
        del qdy_MD, sdy_M
        dh_M2F, dweight, a_MF, qdh = _swiglu_backward(h_M2F, da_MF, weight_M, need[0], need[5])
        del da_MF
        dw_down = _weight_grad(a_MF, dy_MD, offs_G, w_down, ctx.backend) if need[5] else None
        del a_MF, dy_MD
        dx_TD = None
        if qdh is not None:
            dx_MD = _quantized_mm(
                *qdh,
                *_weight_cols(w_gate_up, cached_gate_up),
                offs_G,
                dy_TD.dtype,
                ctx.fast_grad,
            )
            del qdh
            dx_TD = _sum_over_slots(dx_MD, slot_TK)  # the permute's backward
            del dx_MD
        dw_gate_up = None
        if need[4]:
            x_MD = _scatter_to_slots(
                x_TD, slot_TK, n_rows, unmapped_rows_possible(slot_TK, n_rows, mapped)
            )
            dw_gate_up = _weight_grad(x_MD, dh_M2F, offs_G, w_gate_up, ctx.backend)
        dweight = dweight if need[7] else None
        return dx_TD, None, None, None, dw_gate_up, dw_down, None, dweight, None, None, None


def fp8_routed_mlp(
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs_G: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    cached: tuple[FP8Weight | None, FP8Weight | None] = (None, None),
    every_row_mapped: bool | None = None,
    fast_accum: str = "none",
) -> torch.Tensor:
    """``sum_from_slots(fp8_expert_mlp(permute_to_slots(x_TD, slot_TK, n_rows), ...), slot_TK)``
    with rowwise scaling: the same output and gradients, bit for bit, with each row operand
    quantized by the pass that writes it. The token rows go into their slots already in E4M3
    (``quantize_to_slots``: a token's scale found once for its K slots), with no bf16 permuted
    copy made or kept (the backward permutes ``x_TD`` again for the gate+up weight gradient:
    an [M, D] activation less per layer); in backward the sum's scatter of dy writes its E4M3
    rows beside the bf16 ones the down weight gradient reads. ``slot_TK``, ``n_rows`` and
    ``every_row_mapped`` as ``moe_kernels.slot_permute``; the rest as ``fp8_expert_mlp``."""
    check_backend(backend)
    fast_accum_flags(fast_accum)
    _check_rows(slot_TK, n_rows, every_row_mapped)
    check_tokens_and_slots(x_TD, slot_TK, "fp8_routed_mlp")
    x_rows = torch.empty(n_rows, x_TD.shape[1], device="meta")  # the permuted rows' shape
    check_operands(x_rows, w_gate_up, w_down, offs_G, weight_M)
    for c, w, name in zip(cached, (w_gate_up, w_down), ("w_gate_up", "w_down"), strict=True):
        if c is not None:
            c.check(w, name)
    return _FP8RoutedMLP.apply(
        x_TD, slot_TK, n_rows, every_row_mapped, w_gate_up, w_down, offs_G, weight_M, backend,
        tuple(cached), fast_accum,
    )  # fmt: skip


def _dense_mm(
    qa_MK: torch.Tensor,
    sa_M: torch.Tensor,
    qb_NK: torch.Tensor,
    sb_N: torch.Tensor,
    out_dtype: torch.dtype,
    tensor_cores: bool,
    fast: bool = False,
) -> torch.Tensor:
    """``a @ b^T`` from both operands quantized rowwise over K: ``torch._scaled_mm`` with
    ``tensor_cores`` (accumulating ``fast`` or with fp32 promotion), else the dequantized
    product."""
    if tensor_cores:
        return torch._scaled_mm(
            qa_MK,
            qb_NK.t(),
            scale_a=sa_M[:, None],
            scale_b=sb_N[None, :],
            out_dtype=out_dtype,
            use_fast_accum=fast,
        )
    return (dequantize(qa_MK, sa_M) @ dequantize(qb_NK, sb_N).t()).to(out_dtype)


def _quantize_dense_rows(w_NK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight quantized over K, by rows (the forward's operand)."""
    return quantize_rowwise(w_NK)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, w_NK: torch.Tensor, tensor_cores: bool, cached, fast_accum: str
    ):  # type: ignore[override]
        N, K = w_NK.shape
        x_MK = x.reshape(-1, K)
        ctx.save_for_backward(x_MK, w_NK)
        ctx.tensor_cores, ctx.cached = tensor_cores, cached
        fast, ctx.fast_grad = fast_accum_flags(fast_accum)
        qw, sw = cached.rows_2d() if cached is not None else _quantize_dense_rows(w_NK)
        y_MN = _dense_mm(*quantize_rowwise(x_MK), qw, sw, x.dtype, tensor_cores, fast)
        return y_MN.view(*x.shape[:-1], N)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # type: ignore[override]
        x_MK, w_NK = ctx.saved_tensors
        N, K = w_NK.shape
        dy_MN = dy.reshape(-1, N).contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            qw_1KN, sw_1K = _weight_cols(w_NK[None], ctx.cached)  # w over N: the rows of w^T
            dx_MK = _dense_mm(
                *quantize_rowwise(dy_MN),
                qw_1KN[0],
                sw_1K[0],
                dy.dtype,
                ctx.tensor_cores,
                ctx.fast_grad,
            )
            dx = dx_MK.view(*dy.shape[:-1], K)
        if ctx.needs_input_grad[1]:
            dw = (dy_MN.t() @ x_MK).to(w_NK.dtype)
        return dx, dw, None, None, None


def fp8_linear(
    x: torch.Tensor,
    w_NK: torch.Tensor,
    tensor_cores: bool,
    cached: FP8Weight | None = None,
    fast_accum: str = "none",
) -> torch.Tensor:
    """``x @ w^T`` (``F.linear`` without bias) with the forward and the input gradient in FP8,
    both operands quantized rowwise over the contracted dimension (module doc), and the weight
    gradient in bf16. ``tensor_cores``: run ``torch._scaled_mm`` (``scaled_mm_supported``;
    decided once by the caller, outside any compiled region), else the dequantized product,
    the same function up to fp32 summation order. ``cached``: the weight's FP8 operands
    (``moe_kernels.fp8_cache``), taken instead of quantizing it here. ``fast_accum``: which
    products accumulate fast on the tensor cores (module doc)."""
    fast_accum_flags(fast_accum)
    if w_NK.ndim != 2 or x.shape[-1] != w_NK.shape[1]:
        raise ValueError(
            f"fp8_linear takes x [..., K] and w [N, K], got {tuple(x.shape)} and "
            f"{tuple(w_NK.shape)}"
        )
    if cached is not None:
        cached.check(w_NK, "the linear's weight")
    return _FP8Linear.apply(x, w_NK, tensor_cores, cached, fast_accum)
