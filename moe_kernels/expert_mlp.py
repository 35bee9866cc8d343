"""The SwiGLU expert MLP over expert-ordered rows as one op:
``y[m] = weight_M[m] * (swiglu(x[m] @ w_gate_up[g]^T) @ w_down[g]^T)`` for the rows m of
expert g, with ``swiglu(h) = silu(h[:, :F]) * h[:, F:]`` (``w_gate_up`` [G, 2F, D], gate rows
first; ``w_down`` [G, D, F]; both in their stored layout).

Unfused, this is three ops: the gate+up grouped GEMM, the (weighted) SwiGLU pass
(``moe_kernels.swiglu``) and the down grouped GEMM, keeping the pre-activation h [M, 2F] and the
SwiGLU output a [M, F] for backward. Fused (QuACK where it runs under the caller's ``backend``,
``moe_kernels.grouped_gemm``'s rule; unless ``fused=False``, which measures the unfused path; never
inside ``references_only()``), the elementwise work rides in GEMM epilogues
and a is never stored:

- forward: the gate+up GEMM writes h and ``swiglu(h)`` (its epilogue); the down GEMM scales
  each output row by its weight (its epilogue);
- backward: the down projection's input gradient ``dy @ w_down[g]`` is never written: its
  epilogue applies the SwiGLU backward with the weight folded in, writes dh, recomputes
  ``weight * swiglu(h)`` for the down weight gradient and reduces ``sum_f swiglu(h) * da``, the
  weight's gradient; then the gate+up GEMM's input and weight gradients from dh.

QuACK keeps h with gate and up interleaved by column; its GEMMs read the stored weight as
interleaved pairs (no copy) and write the gate+up weight gradient back in the stored layout, so
only this op ever sees the interleaving. One SwiGLU pass forward and one backward per layer
disappear (issue 16's profile: 2.9 + 5.0 ms per OLMoE-1B-7B step on an H200), and a [M, F]
tensor per layer is no longer kept.

Rows past the last group end are neither read nor written by the fused path (as in
``grouped_mm``); callers never read them.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import in_references_only
from moe_kernels.grouped_gemm import _aligned, _quack_runs, grouped_mm, grouped_mm_supported
from moe_kernels.swiglu import swiglu


def fuses(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    backend: str = "auto",
    fused: bool = True,
) -> bool:
    """Whether ``expert_mlp`` on these operands, with ``backend`` and ``fused``, takes the fused
    QuACK path."""
    if not fused or in_references_only() or not _quack_runs(x_MD, backend):
        return False
    return (
        x_MD.shape[0] > 0  # an expert-parallel rank may receive no rows: the unfused ops then
        and x_MD.stride(-1) == 1
        and _aligned(x_MD)
        and w_gate_up.is_contiguous()
        and w_down.is_contiguous()
        and grouped_mm_supported(x_MD, w_gate_up)
        and w_down.dtype == x_MD.dtype
    )


def expert_mlp_reference(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs_G: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """The unfused composition (differentiable): grouped GEMM, weighted SwiGLU, grouped GEMM."""
    h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offs_G, backend=backend)
    a_MF = swiglu(h_M2F, weight_M)
    return grouped_mm(a_MF, w_down.transpose(-2, -1), offs_G, backend=backend)


class _FusedExpertMLP(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_MD: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        offs_G: torch.Tensor,
        weight_M: torch.Tensor | None,
    ) -> torch.Tensor:
        from moe_kernels import grouped_gemm_quack as quack

        # 16-byte aligned fp32 copy (a slot-weight view may start 4 bytes in): M floats.
        scale_M = None if weight_M is None else weight_M.float().clone()
        h_M2F, a_MF = quack.swiglu_mm(x_MD, w_gate_up, offs_G)
        w_FD = w_down.transpose(-2, -1)
        if scale_M is None:
            y_MD = quack.grouped_mm(a_MF, w_FD, offs_G)
        else:
            y_MD = quack.row_scaled_mm(a_MF, w_FD, offs_G, scale_M)
        ctx.weight_dtype = None if weight_M is None else weight_M.dtype
        ctx.save_for_backward(x_MD, w_gate_up, w_down, offs_G, h_M2F, scale_M)
        return y_MD

    @staticmethod
    def backward(ctx, dy_MD: torch.Tensor):  # type: ignore[override]
        from moe_kernels import grouped_gemm_quack as quack

        x_MD, w_gate_up, w_down, offs_G, h_M2F, scale_M = ctx.saved_tensors
        dy_MD = dy_MD.contiguous()  # a broadcast gradient has zero strides
        dh_M2F, a_MF, dscale_M = quack.dswiglu_mm(dy_MD, w_down, h_M2F, offs_G, scale_M)
        dx = dw_gate_up = dw_down = dweight = None
        if ctx.needs_input_grad[0]:
            dx = quack.interleaved_dgrad(dh_M2F, w_gate_up, offs_G)
        if ctx.needs_input_grad[1]:
            dw_gate_up = quack.interleaved_wgrad(x_MD, dh_M2F, offs_G)
        if ctx.needs_input_grad[2]:
            # [G, D, F] = dy^T @ (weight * a) per group, in the stored layout.
            dw_down = quack.down_wgrad(a_MF, dy_MD, offs_G)
        if ctx.needs_input_grad[4]:
            dweight = dscale_M.to(ctx.weight_dtype)
        return dx, dw_gate_up, dw_down, None, dweight


def check_operands(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs_G: torch.Tensor,
    weight_M: torch.Tensor | None,
) -> None:
    """Refuses, in one sentence, operands that are not an expert MLP's (this op's and
    ``moe_kernels.fp8.fp8_expert_mlp``'s)."""
    if offs_G.dtype != torch.int32:
        raise TypeError(f"offs_G must be int32 cumulative ends, got {offs_G.dtype}")
    G, two_f, d = w_gate_up.shape
    if two_f % 2 or w_down.shape != (G, d, two_f // 2) or x_MD.shape[-1] != d:
        raise ValueError(
            f"w_gate_up {tuple(w_gate_up.shape)} must be [G, 2F, D] and w_down "
            f"{tuple(w_down.shape)} [G, D, F] for x_MD {tuple(x_MD.shape)}"
        )
    if weight_M is not None and weight_M.shape != (x_MD.shape[0],):
        raise ValueError(f"weight_M must be [M] = [{x_MD.shape[0]}], got {tuple(weight_M.shape)}")


def expert_mlp(
    x_MD: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    offs_G: torch.Tensor,
    weight_M: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    fused: bool = True,
) -> torch.Tensor:
    """Differentiable ``weight_M * (swiglu(x @ w_gate_up^T) @ w_down^T)`` per expert segment
    (see the module doc). x_MD: rows sorted by expert; offs_G: int32 cumulative row ends on x's
    device; weight_M: optional per-row scale (the router weights), fp32 math, which gets a
    gradient when it needs one. Weights in x's dtype. ``backend``: the grouped GEMMs'
    (``moe_kernels.grouped_gemm``); ``fused``: fuse where QuACK runs. No host read."""
    check_operands(x_MD, w_gate_up, w_down, offs_G, weight_M)
    if fuses(x_MD, w_gate_up, w_down, backend=backend, fused=fused):
        return _FusedExpertMLP.apply(x_MD, w_gate_up, w_down, offs_G, weight_M)
    return expert_mlp_reference(x_MD, w_gate_up, w_down, offs_G, weight_M, backend=backend)
