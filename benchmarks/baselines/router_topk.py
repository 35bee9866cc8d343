"""Fused softmax router top-k: probabilities, (bias-steered) expert choice and combine weights.

A baseline, not on the training path: the router takes ``torch.topk``, which Inductor fuses
with the softmax inside a compiled block; ``benchmarks/moe_ops.py`` times this kernel
against the PyTorch router.

``topk_softmax(logits_TE, k, bias_E, normalize)`` computes what ``moe_core``'s softmax
``Router`` does after its fp32 logits: ``probs = softmax(logits)``; the experts are the top-k of
``probs + bias`` (the bias steers selection only), in descending order; the weights are the
chosen experts' probabilities, renormalized to sum to one if asked. Gradients reach the logits
through both the weights and the returned probabilities (which the load-balancing loss uses).
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton


def topk_softmax_reference(
    logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None = None, normalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_TK, experts_TK, probs_TE) by torch ops; differentiable."""
    probs_TE = torch.softmax(logits_TE, dim=-1)
    select_TE = probs_TE if bias_E is None else probs_TE + bias_E
    experts_TK = torch.topk(select_TE.detach(), k, dim=-1).indices
    weights_TK = probs_TE.gather(1, experts_TK)
    if normalize:
        weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
    return weights_TK, experts_TK, probs_TE


def topk_softmax_reference_backward(
    probs_TE: torch.Tensor,
    experts_TK: torch.Tensor,
    dprobs_TE: torch.Tensor,
    dweights_TK: torch.Tensor,
    normalize: bool,
) -> torch.Tensor:
    """dlogits: the weight gradients land on the chosen probabilities, then the softmax
    Jacobian ``p * (g - <p, g>)``."""
    dsel_TK = dweights_TK
    if normalize:
        p_sel_TK = probs_TE.gather(1, experts_TK)
        s_T1 = p_sel_TK.sum(-1, keepdim=True)
        w_TK = p_sel_TK / s_T1
        dsel_TK = (dweights_TK - (dweights_TK * w_TK).sum(-1, keepdim=True)) / s_T1
    g_TE = dprobs_TE.scatter_add(1, experts_TK, dsel_TK.to(dprobs_TE.dtype))
    return probs_TE * (g_TE - (probs_TE * g_TE).sum(-1, keepdim=True))


class _TopKSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_TE, k, bias_E, normalize):  # type: ignore[override]
        ctx.normalize = normalize
        if use_triton(logits_TE):
            from benchmarks.baselines import router_topk_triton

            out = router_topk_triton.topk_softmax_forward(logits_TE, k, bias_E, normalize)
        else:
            with torch.no_grad():
                out = topk_softmax_reference(logits_TE.float(), k, bias_E, normalize)
        weights_TK, experts_TK, probs_TE = out
        ctx.save_for_backward(probs_TE, experts_TK)
        ctx.mark_non_differentiable(experts_TK)
        return weights_TK, experts_TK, probs_TE

    @staticmethod
    def backward(ctx, dweights_TK, _dexperts, dprobs_TE):  # type: ignore[override]
        probs_TE, experts_TK = ctx.saved_tensors
        if use_triton(probs_TE):
            from benchmarks.baselines import router_topk_triton

            dlogits_TE = router_topk_triton.topk_softmax_backward(
                probs_TE, experts_TK, dprobs_TE, dweights_TK, ctx.normalize
            )
        else:
            dlogits_TE = topk_softmax_reference_backward(
                probs_TE, experts_TK, dprobs_TE.float(), dweights_TK.float(), ctx.normalize
            )
        return dlogits_TE, None, None, None


def topk_softmax(
    logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None = None, normalize: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_TK fp32, experts_TK int64, probs_TE fp32) from fp32 router logits [T, E]."""
    if logits_TE.dtype != torch.float32:
        raise TypeError(f"router logits must be fp32, got {logits_TE.dtype}")
    return _TopKSoftmax.apply(logits_TE, k, bias_E, normalize)
