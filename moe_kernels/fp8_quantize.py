"""The FP8 quantizers (``moe_kernels.fp8``'s module doc states their rules): E4M3 with one fp32
scale per row (``quantize_rowwise``; ``quantize_to_slots`` writes it for token rows permuted to
their experts' slots), the same rules over an expert weight's columns written
transposed (``quantize_columnwise``), and MXFP8's E8M0 scale per 32 values (``quantize_mx``).
Each is a PyTorch reference that defines it plus a Triton kernel (``moe_kernels.fp8_triton``) taken
by ``moe_kernels._triton``'s rule. Apart from ``moe_kernels.fp8`` so that the SwiGLU backward
(``moe_kernels.swiglu``) and the token dispatch can quantize without importing the GEMMs.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton
from moe_kernels.fp8_format import AMAX_FLOOR, E4M3, E4M3_MAX, E8M0, MX_BLOCK
from moe_kernels.slot_permute import permute_to_slots_reference, unmapped_rows_possible


def quantize_rowwise_reference(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [M, K], fp32 scales [M]) with ``x ~= q * scale[:, None]`` (module doc)."""
    x32 = x_MK.float()
    amax_M = x32.abs().amax(dim=1)
    floored_M = amax_M.clamp_min(AMAX_FLOOR)
    fp8_max_M = torch.full_like(amax_M, E4M3_MAX)
    # Tensor by tensor: correctly rounded on the GPU too (torch divides by a Python number
    # through its reciprocal there, an ulp off).
    scale_M = torch.where(amax_M > 0, floored_M / fp8_max_M, 1.0)
    inv_M = torch.where(amax_M > 0, fp8_max_M / floored_M, 1.0)
    y_MK = (x32 * inv_M[:, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q_MK = (y_MK.to(E4M3).float() + 0.0).to(E4M3)  # + 0.0: a zero is +0, also from -1e-9
    return q_MK, scale_M


Pair = tuple[torch.Tensor, torch.Tensor]


def _written_into(result: Pair, out: Pair | None) -> Pair:
    """``result``, or ``out`` with ``result`` copied into it (the references' ``out=``)."""
    if out is None:
        return result
    for dst, src in zip(out, result, strict=True):
        dst.copy_(src)
    return out


def _check_out(out: Pair | None, shapes: tuple[tuple[int, ...], tuple[int, ...]], name: str):
    if out is None:
        return
    got = (tuple(out[0].shape), tuple(out[1].shape))
    kinds = (out[0].dtype, out[1].dtype) == (E4M3, torch.float32)
    if got != shapes or not kinds or not (out[0].is_contiguous() and out[1].is_contiguous()):
        raise ValueError(
            f"{name} out= takes contiguous E4M3 values and fp32 scales of shapes {shapes}, got "
            f"{got} of {out[0].dtype} and {out[1].dtype}"
        )


def quantize_rowwise(x_MK: torch.Tensor, out: Pair | None = None) -> Pair:
    """Rowwise E4M3 quantization of a 2D tensor with a contiguous last dimension; ``out``:
    (values, scales) to write into (contiguous; the cached FP8 weights, ``moe_kernels.fp8_cache``)
    instead of new tensors."""
    if x_MK.ndim != 2:
        raise ValueError(f"quantize_rowwise takes [M, K], got {tuple(x_MK.shape)}")
    _check_out(out, (tuple(x_MK.shape), (x_MK.shape[0],)), "quantize_rowwise")
    if use_triton(x_MK):
        from moe_kernels import fp8_triton

        return fp8_triton.quantize_rowwise(x_MK, out=out)
    return _written_into(quantize_rowwise_reference(x_MK), out)


def check_tokens_and_slots(x_TD: torch.Tensor, slot_TK: torch.Tensor, op: str) -> None:
    """Refuses, in one sentence naming ``op``, token rows and a slot map of other shapes."""
    if x_TD.ndim != 2 or slot_TK.ndim != 2 or slot_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"{op} takes x [T, D] and slots [T, K], got {tuple(x_TD.shape)} and "
            f"{tuple(slot_TK.shape)}"
        )


def quantize_to_slots_reference(
    x_TD: torch.Tensor, slot_TK: torch.Tensor, n_rows: int, keep_rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``quantize_rowwise`` of ``permute_to_slots(x_TD, slot_TK, n_rows)``, and that permuted
    copy itself where ``keep_rows`` (else None)."""
    x_MD = permute_to_slots_reference(x_TD, slot_TK, n_rows)
    q_MD, scale_M = quantize_rowwise_reference(x_MD)
    return q_MD, scale_M, x_MD if keep_rows else None


def quantize_to_slots(
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    *,
    keep_rows: bool = False,
    every_row_mapped: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The expert-ordered rows of ``moe_kernels.slot_permute.permute_to_slots`` quantized by
    rows, (E4M3 [n_rows, D], fp32 scales [n_rows], the bf16 rows where ``keep_rows``): the
    producer of an FP8 GEMM's row operand, in one pass over the tokens where Triton runs
    (each token's scale found once for its K slots) instead of a permuted copy and a
    quantizer reading it back. Not differentiable: the callers are autograd Functions."""
    check_tokens_and_slots(x_TD, slot_TK, "quantize_to_slots")
    if use_triton(x_TD, slot_TK) and n_rows > 0:
        from moe_kernels import fp8_triton

        zero = unmapped_rows_possible(slot_TK, n_rows, every_row_mapped)
        return fp8_triton.scatter_quantize_rows(
            x_TD, slot_TK, n_rows, zero_unmapped=zero, keep_rows=keep_rows
        )
    return quantize_to_slots_reference(x_TD, slot_TK, n_rows, keep_rows)


def quantize_columnwise_reference(w_GNK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [G, K, N], fp32 scales [G, K]): each ``w[g]`` quantized over N, one scale
    per column, by the rowwise rules; defined as the rowwise quantization of the transposed
    copy (what the input gradient's operand was before the fused kernel)."""
    G, N, K = w_GNK.shape
    q, scale = quantize_rowwise_reference(w_GNK.transpose(-2, -1).contiguous().view(G * K, N))
    return q.view(G, K, N), scale.view(G, K)


def quantize_columnwise(w_GNK: torch.Tensor, out: Pair | None = None) -> Pair:
    """Expert weights [G, N, K] quantized over N, already in the row-major [G, K, N] layout the
    input gradient's GEMM takes, with scales [G, K] (Triton: straight from ``w``, no copy);
    ``out``: (values, scales) to write into instead of new tensors."""
    if w_GNK.ndim != 3:
        raise ValueError(f"quantize_columnwise takes [G, N, K], got {tuple(w_GNK.shape)}")
    G, N, K = w_GNK.shape
    _check_out(out, ((G, K, N), (G, K)), "quantize_columnwise")
    if use_triton(w_GNK):
        from moe_kernels import fp8_triton

        return fp8_triton.quantize_columnwise(w_GNK, out=out)
    return _written_into(quantize_columnwise_reference(w_GNK), out)


def dequantize(q_MK: torch.Tensor, scale_M: torch.Tensor) -> torch.Tensor:
    return q_MK.float() * scale_M[:, None]


def quantize_mx_reference(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [M, K], E8M0 scales [M, K / 32]) with ``x ~= q * 2^e`` per 32-value block
    along K (module doc)."""
    M, K = x_MK.shape
    x = x_MK.float().view(M, K // MX_BLOCK, MX_BLOCK)
    amax = x.abs().amax(dim=2)
    ratio = amax / torch.full_like(amax, E4M3_MAX)  # correctly rounded, as the kernel's
    # ceil(log2(ratio)) read off the fp32 bits: the exponent, plus one unless a power of two;
    # zero and subnormal ratios (below 2^-126) take the floor, -127.
    bits = ratio.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    exponent = biased - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    exponent = torch.where(biased == 0, -127, exponent).clamp(-127, 127)
    scale = torch.ldexp(torch.ones_like(ratio), exponent)
    y = (x / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = (y.to(E4M3).float() + 0.0).to(E4M3).view(M, K)
    return q, (exponent + 127).to(torch.uint8).view(E8M0)


def quantize_mx(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP8 quantization of a 2D tensor whose last dimension is a multiple of 32."""
    if x_MK.ndim != 2 or x_MK.shape[1] % MX_BLOCK:
        raise ValueError(
            f"quantize_mx takes [M, K] with K a multiple of 32, got {tuple(x_MK.shape)}"
        )
    if use_triton(x_MK):
        from moe_kernels import fp8_triton

        return fp8_triton.quantize_mx(x_MK)
    return quantize_mx_reference(x_MK)


def dequantize_mx(q_MK: torch.Tensor, scale_MB: torch.Tensor) -> torch.Tensor:
    M, K = q_MK.shape
    exponent = scale_MB.view(torch.uint8).to(torch.int32) - 127
    scale = torch.ldexp(torch.ones(exponent.shape, device=q_MK.device), exponent)
    return (q_MK.float().view(M, -1, MX_BLOCK) * scale[..., None]).view(M, K)
