"""FP8 (E4M3) expert GEMMs with rowwise dynamic scales: the forward and the input gradient in
FP8 on Hopper tensor cores, the weight gradient in bf16.

Scaling: each row of an operand, along the dimension the product contracts, gets its own fp32
scale ``amax / 448`` (448 is E4M3's largest finite value; an all-zero row takes scale 1), and
its values ``x / scale`` are rounded to nearest E4M3 (ties to even), saturating at +-448; a
value that rounds to zero is stored +0 (never -0, so every path gives the same bytes). The
product is then ``(q_a @ q_b) * scale_a[row] * scale_b[col]``, which ``torch._scaled_grouped_mm``
computes with fp32 accumulation and a bf16 output.

- forward ``y = x @ w[g]``: ``x`` by rows (over K), the weight by its output columns (over K:
  for experts stored [G, N, K] those are its rows, so the quantized copy is already the
  column-major operand the GEMM takes);
- input gradient ``dx = dy @ w[g]^T``: ``dy`` by rows (over N), the weight quantized over N
  (the transposed copy);
- weight gradient: bf16 ``kernels.grouped_gemm`` (contracting over each group's rows would need
  per-group scales along M: a measured follow-up).

``quantize_rowwise`` is the one quantizer (Triton: amax, scale and cast in one kernel per row
block, reading the row twice; the reference below defines it). Where ``_scaled_grouped_mm``
cannot run (CPU, before sm90), ``fp8_grouped_mm`` computes the same function from the
dequantized operands: its numerics are those of the GPU path up to fp32 summation order.
"""

from __future__ import annotations

import torch

from kernels._triton import use_triton
from kernels.grouped_gemm import grouped_mm_reference, grouped_mm_wgrad

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


def quantize_rowwise_reference(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [M, K], fp32 scales [M]) with ``x ~= q * scale[:, None]`` (module doc)."""
    x32 = x_MK.float()
    amax_M = x32.abs().amax(dim=1)
    # Tensor by tensor: correctly rounded on the GPU too (torch divides by a Python number
    # through its reciprocal there, an ulp off).
    scale_M = torch.where(amax_M > 0, amax_M / torch.full_like(amax_M, E4M3_MAX), 1.0)
    y_MK = (x32 / scale_M[:, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q_MK = (y_MK.to(E4M3).float() + 0.0).to(E4M3)  # + 0.0: a zero is +0, also from -1e-9
    return q_MK, scale_M


def quantize_rowwise(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise E4M3 quantization of a 2D tensor with a contiguous last dimension."""
    if x_MK.ndim != 2:
        raise ValueError(f"quantize_rowwise takes [M, K], got {tuple(x_MK.shape)}")
    if use_triton(x_MK):
        from kernels import fp8_triton

        return fp8_triton.quantize_rowwise(x_MK)
    return quantize_rowwise_reference(x_MK)


def dequantize(q_MK: torch.Tensor, scale_M: torch.Tensor) -> torch.Tensor:
    return q_MK.float() * scale_M[:, None]


def scaled_grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether ``torch._scaled_grouped_mm`` runs FP8 here (CUDA, sm90 and newer)."""
    if not hasattr(torch, "_scaled_grouped_mm") or x.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9


def _scaled_mm(
    a_MK: torch.Tensor, b_GNK: torch.Tensor, offs_G: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``a @ b[g]^T`` per group with both operands quantized over K (rows of ``a``, rows of
    each ``b[g]``): FP8 on the GPU, the dequantized product elsewhere."""
    G, N, K = b_GNK.shape
    qa, sa = quantize_rowwise(a_MK)
    qb, sb = quantize_rowwise(b_GNK.reshape(G * N, K))
    if scaled_grouped_mm_supported(a_MK):
        return torch._scaled_grouped_mm(
            qa,
            qb.view(G, N, K).transpose(-2, -1),
            sa,
            sb.view(G, N),
            offs=offs_G,
            out_dtype=out_dtype,
        )
    w_GKN = dequantize(qb, sb).view(G, N, K).transpose(-2, -1)
    return grouped_mm_reference(dequantize(qa, sa), w_GKN, offs_G).to(out_dtype)


class _FP8GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor):  # type: ignore[override]
        ctx.save_for_backward(x_MK, w_GNK, offs_G)
        return _scaled_mm(x_MK, w_GNK, offs_G, x_MK.dtype)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # type: ignore[override]
        x_MK, w_GNK, offs_G = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            w_GKN = w_GNK.transpose(-2, -1).contiguous()  # quantized over N: the transposed copy
            dx = _scaled_mm(dy_MN, w_GKN, offs_G, dy_MN.dtype)
        if ctx.needs_input_grad[1]:  # bf16, in the weight's own [G, N, K] layout
            w_GKN = w_GNK.transpose(-2, -1)
            dw = grouped_mm_wgrad(x_MK, dy_MN, offs_G, w_GKN).transpose(-2, -1).to(w_GNK.dtype)
        return dx, dw, None


def fp8_grouped_mm(x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """``y[rows of g] = x[rows of g] @ w[g]^T`` for experts stored [G, N, K], forward and input
    gradient in FP8 (module doc); int32 cumulative ``offs_G`` as ``grouped_mm`` takes them."""
    if offs_G.dtype != torch.int32:
        raise TypeError(f"offs_G must be int32 cumulative ends, got {offs_G.dtype}")
    return _FP8GroupedMM.apply(x_MK, w_GNK, offs_G)
