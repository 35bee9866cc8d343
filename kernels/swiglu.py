"""Fused SwiGLU on the expert hidden rows: ``a_MF = silu(gate_MF) * up_MF``.

``h_M2F`` is the gate+up projection output with the gate in the first F columns and the up in
the last F (the ``w_gate_up`` layout, gate rows first). One pass reads h and writes a; the
backward reads h and da and writes dh, recomputing the sigmoid instead of storing it, so the
only tensor kept for backward is h. Math is fp32 inside for bf16 and fp32 inputs.
"""

from __future__ import annotations

import torch

from kernels._triton import use_triton


def _check_shape(h_M2F: torch.Tensor) -> None:
    if h_M2F.dim() != 2 or h_M2F.shape[1] % 2:
        raise ValueError(f"h_M2F must be [M, 2F], got {tuple(h_M2F.shape)}")


def _halves(h_M2F: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up in the math dtype: fp32 for half types, fp64 stays fp64 (gradchecks)."""
    _check_shape(h_M2F)
    acc = torch.promote_types(h_M2F.dtype, torch.float32)
    gate_MF, up_MF = h_M2F.to(acc).chunk(2, dim=1)
    return gate_MF, up_MF


def swiglu_reference(h_M2F: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` computed in fp32 (fp64 for fp64), returned in h's dtype."""
    gate_MF, up_MF = _halves(h_M2F)
    return (torch.nn.functional.silu(gate_MF) * up_MF).to(h_M2F.dtype)


def swiglu_reference_backward(h_M2F: torch.Tensor, da_MF: torch.Tensor) -> torch.Tensor:
    """``dh = [da * up * s * (1 + g * (1 - s)) | da * g * s]`` with ``s = sigmoid(g)``."""
    gate_MF, up_MF = _halves(h_M2F)
    da_MF = da_MF.to(gate_MF.dtype)
    sig_MF = torch.sigmoid(gate_MF)
    dgate_MF = da_MF * up_MF * sig_MF * (1 + gate_MF * (1 - sig_MF))
    return torch.cat([dgate_MF, da_MF * gate_MF * sig_MF], dim=1).to(h_M2F.dtype)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_M2F: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(h_M2F)
        if use_triton(h_M2F):
            from kernels import swiglu_triton

            return swiglu_triton.swiglu_forward(h_M2F)
        return swiglu_reference(h_M2F)

    @staticmethod
    def backward(ctx, da_MF: torch.Tensor):  # type: ignore[override]
        (h_M2F,) = ctx.saved_tensors
        if use_triton(h_M2F):
            from kernels import swiglu_triton

            return swiglu_triton.swiglu_backward(h_M2F, da_MF)
        return swiglu_reference_backward(h_M2F, da_MF)


def swiglu(h_M2F: torch.Tensor) -> torch.Tensor:
    """Differentiable fused ``silu(h[:, :F]) * h[:, F:]`` -> [M, F] in h's dtype."""
    _check_shape(h_M2F)
    return _SwiGLU.apply(h_M2F)
