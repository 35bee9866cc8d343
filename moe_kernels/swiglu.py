"""Fused SwiGLU on the expert hidden rows: ``a_MF = silu(gate_MF) * up_MF``, optionally scaled
by a per-row weight ``weight_M``.

``h_M2F`` is the gate+up projection output with the gate in the first F columns and the up in
the last F (the ``w_gate_up`` layout, gate rows first). One pass reads h and writes a; the
backward reads h and da and writes dh, recomputing the sigmoid instead of storing it, so the
only tensors kept for backward are h (and the weight). Math is fp32 inside for bf16 and fp32
inputs.

The row weight is where the MoE layer applies its router weights: scaling the down
projection's input instead of its output is the same function (the product is linear in a
row), and then the combine after it is a plain sum whose backward needs no expert output.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton
from moe_kernels.fp8_quantize import quantize_rowwise


def _check_shape(h_M2F: torch.Tensor) -> None:
    if h_M2F.dim() != 2 or h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F must be [M, 2F], got {tuple(h_M2F.shape)}")


def _halves(h_M2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up in the math dtype: fp32 for half types, fp64 stays fp64 (gradchecks)."""
    _check_shape(h_M2F)
    acc = torch.promote_types(h_M2F.dtype, torch.float32)
    gate_MF, up_MF = h_M2F.to(acc).chunk(2, dim=1)
    return gate_MF, up_MF


def _row_weight(weight_M: torch.Tensor | None, like_MF: torch.Tensor) -> torch.Tensor | float:
    return 1.0 if weight_M is None else weight_M.to(like_MF.dtype).unsqueeze(1)


def swiglu_reference(h_M2F: torch.Tensor, weight_M: torch.Tensor | None = None) -> torch.Tensor:
    """``(weight *) silu(gate) * up`` computed in fp32 (fp64 for fp64), returned in h's dtype."""
    gate_MF, up_MF = _halves(h_M2F)
    a_MF = torch.nn.functional.silu(gate_MF) * up_MF * _row_weight(weight_M, gate_MF)
    return a_MF.to(h_M2F.dtype)


def swiglu_reference_backward(
    h_M2F: torch.Tensor, da_MF: torch.Tensor, weight_M: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``dh = w * [da * up * s * (1 + g * (1 - s)) | da * g * s]`` with ``s = sigmoid(g)`` and
    ``w`` the row weight (1 without one); ``dweight = sum_f da * g * s * up`` (None without)."""
    gate_MF, up_MF = _halves(h_M2F)
    da_MF = da_MF.to(gate_MF.dtype)
    sig_MF = torch.sigmoid(gate_MF)
    dweight_M = None
    if weight_M is not None:
        dweight_M = (da_MF * gate_MF * sig_MF * up_MF).sum(1).to(weight_M.dtype)
    da_MF = da_MF * _row_weight(weight_M, gate_MF)
    dgate_MF = da_MF * up_MF * sig_MF * (1 + gate_MF * (1 - sig_MF))
    dh_M2F = torch.cat([dgate_MF, da_MF * gate_MF * sig_MF], dim=1).to(h_M2F.dtype)
    return dh_M2F, dweight_M


def swiglu_values(h_M2F: torch.Tensor, weight_M: torch.Tensor | None = None) -> torch.Tensor:
    """The forward alone, no autograd (Triton where it runs, else the reference)."""
    if use_triton(h_M2F):
        from moe_kernels import swiglu_triton

        return swiglu_triton.swiglu_forward(h_M2F, weight_M)
    return swiglu_reference(h_M2F, weight_M)


def swiglu_grads(
    h_M2F: torch.Tensor,
    da_MF: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    activation: bool = False,
    quantize_into: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The backward alone: (dh, dweight in the weight's dtype or None, and with ``activation``
    the forward's output ``swiglu_values(h, weight)`` written again, bit for bit, in the same
    pass (else None)) for a caller that keeps h but not the activation. ``quantize_into``
    (E4M3 [M, 2F], fp32 [M]) receives ``moe_kernels.fp8_quantize.quantize_rowwise(dh)``, from the
    same Triton pass where a row fits one program (``swiglu_triton.QUANTIZE_MAX_F``)."""
    if use_triton(h_M2F):
        from moe_kernels import swiglu_triton

        fuse = quantize_into is not None and h_M2F.shape[1] // 2 <= swiglu_triton.QUANTIZE_MAX_F
        dh_M2F, dweight_M, a_MF = swiglu_triton.swiglu_backward(
            h_M2F,
            da_MF,
            weight_M,
            activation=activation,
            quantize_into=quantize_into if fuse else None,
        )
        if dweight_M is not None:
            dweight_M = dweight_M.to(weight_M.dtype)
        if quantize_into is not None and not fuse:
            _quantize_into(dh_M2F, quantize_into)
        return dh_M2F, dweight_M, a_MF
    dh_M2F, dweight_M = swiglu_reference_backward(h_M2F, da_MF, weight_M)
    if quantize_into is not None:
        _quantize_into(dh_M2F, quantize_into)
    return dh_M2F, dweight_M, swiglu_reference(h_M2F, weight_M) if activation else None


def _quantize_into(dh_M2F: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor]) -> None:
    q_M2F, scale_M = quantize_rowwise(dh_M2F)
    out[0].copy_(q_M2F)
    out[1].copy_(scale_M)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F: torch.Tensor, weight_M: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(h_M2F, weight_M)
        return swiglu_values(h_M2F, weight_M)

    @staticmethod
    def backward(ctx, da_MF: torch.Tensor):  # type: ignore[override]
        h_M2F, weight_M = ctx.saved_tensors
        dh_M2F, dweight_M, _ = swiglu_grads(h_M2F, da_MF, weight_M)
        return dh_M2F, dweight_M


def swiglu(h_M2F: torch.Tensor, weight_M: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable fused ``(weight_M[:, None] *) silu(h[:, :F]) * h[:, F:]`` -> [M, F] in h's
    dtype; ``weight_M`` (any float dtype, fp32 math) gets a gradient when it needs one."""
    _check_shape(h_M2F)
    if weight_M is not None and weight_M.shape != (h_M2F.shape[0],):
        raise ValueError(f"weight_M must be [M] = [{h_M2F.shape[0]}], got {tuple(weight_M.shape)}")
    return _SwiGLU.apply(h_M2F, weight_M)
