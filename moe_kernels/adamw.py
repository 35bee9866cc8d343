"""AdamW's update of one tensor: parameter, gradient and moments in any float dtype, fp32 math.

Decoupled weight decay, then the bias-corrected Adam step, as ``torch.optim.AdamW`` computes
it. ``lr``, ``step`` (already counting this step), the optional gradient ``scale`` (global
norm clipping) and the optional ``apply`` flag (false: the call changes nothing, a step the
guards skip, decided on the device) are device scalars, so a step needs no host value and can be
captured in a CUDA graph. ``out`` (optional) receives the updated parameter in its own dtype in
the same pass: the model's bf16 weights written from fp32 master weights without a second pass
over them. Triton on CUDA tensors (one pass: each tensor read once and written once); the
PyTorch reference below elsewhere.

``rows`` (optional, for a tensor of whole rows of K values) also writes the updated weight
(``out``, or ``p`` itself without one) quantized to E4M3 by rows (the bytes of
``moe_kernels.fp8_quantize.quantize_rowwise``) in the same pass: the FP8 copy the next step's
forward GEMMs read (``moe_kernels.fp8_cache``); a skipped step leaves it as it was, like the
weight.
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton
from moe_kernels.fp8_quantize import quantize_rowwise


def adamw_reference_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    scale: torch.Tensor | None,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    out: torch.Tensor | None = None,
    apply: torch.Tensor | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The definition, in PyTorch (fp32 math, results cast back to each tensor's dtype)."""
    if rows is not None:  # the updated weight by rows; kept as they were where not applied
        adamw_reference_(p, g, m, v, lr, step, scale, beta1, beta2, eps, weight_decay, out, apply)
        weight = p if out is None else out
        q, s = quantize_rowwise(weight.view(rows[0].shape))
        if apply is not None:
            keep = ~apply.bool()
            q = torch.where(keep, rows[0].view(torch.uint8), q.view(torch.uint8)).view(q.dtype)
            s = torch.where(keep, rows[1], s)
        rows[0].copy_(q)
        rows[1].copy_(s)
        return
    if apply is not None:  # every tensor keeps its value where the step is not applied
        keep = [t.clone() for t in (p, m, v, *(() if out is None else (out,)))]
        adamw_reference_(p, g, m, v, lr, step, scale, beta1, beta2, eps, weight_decay, out)
        for t, old in zip((p, m, v, *(() if out is None else (out,))), keep, strict=True):
            t.copy_(torch.where(apply.bool(), t, old))
        return
    lr32, step32 = lr.float(), step.float()
    g32 = g.float() if scale is None else g.float() * scale.float()
    p32 = p.float() * (1 - lr32 * weight_decay)
    m32 = beta1 * m.float() + (1 - beta1) * g32
    v32 = beta2 * v.float() + (1 - beta2) * g32 * g32
    bias1, bias2 = 1 - beta1**step32, 1 - beta2**step32
    p32 = p32 - (lr32 / bias1) * m32 / (v32.sqrt() / bias2.sqrt() + eps)
    p.copy_(p32)
    m.copy_(m32)
    v.copy_(v32)
    if out is not None:
        out.copy_(p)


def adamw_step_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    lr: torch.Tensor,
    step: torch.Tensor,
    scale: torch.Tensor | None = None,
    *,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    out: torch.Tensor | None = None,
    apply: torch.Tensor | None = None,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Update ``p``, ``m``, ``v`` in place from gradient ``g`` (all the same shape); also write
    the updated ``p`` into ``out`` (same shape, any float dtype) when given; change nothing
    where the 0-d ``apply`` (bool or number, on the device) is false. ``rows``: (E4M3 values
    [R, K], fp32 scales [R], contiguous) receive the updated weight (``out``, else ``p``),
    viewed [R, K], quantized by rows (module doc)."""
    if not (p.shape == g.shape == m.shape == v.shape) or (out is not None and out.shape != p.shape):
        extra = "" if out is None else f", out {out.shape}"
        raise ValueError(
            f"shapes differ: p {p.shape}, g {g.shape}, m {m.shape}, v {v.shape}{extra}"
        )
    if apply is not None and apply.numel() != 1:
        raise ValueError(f"apply must be one value, got shape {tuple(apply.shape)}")
    if rows is not None:
        q, s = rows
        if q.ndim != 2 or q.numel() != p.numel() or tuple(s.shape) != (q.shape[0],):
            raise ValueError(
                f"rows must be values [R, K] with R * K = {p.numel()} and scales [R], got "
                f"{tuple(q.shape)} and {tuple(s.shape)}"
            )
    args = (p, g, m, v, lr, step, scale, beta1, beta2, eps, weight_decay, out, apply, rows)
    tensors = (p, g, m, v) if out is None else (p, g, m, v, out)
    if rows is not None:
        tensors = (*tensors, *rows)
    if use_triton(p) and all(t.is_contiguous() for t in tensors):
        from moe_kernels import adamw_triton

        if rows is None:
            adamw_triton.adamw_step_(*args[:-1])
        else:
            adamw_triton.adamw_rows_step_(*args)
    else:
        adamw_reference_(*args)
