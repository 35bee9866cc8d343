"""Triton kernels for ``router_topk.topk_softmax``: softmax, biased top-k selection, weights.

A program owns BLOCK_T tokens and their whole [BLOCK_T, E_PAD] score tile (E <= a few hundred
experts fits in registers). Top-k is K rounds of "row maximum, lowest index among equals,
knock it out", so the experts come out in descending order of the selection score, as
``torch.topk`` returns them. The backward scatters the weight gradients onto the chosen
experts (through the optional renormalization) and applies the softmax Jacobian, all inside
the same tile: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_kernels._triton import cdiv, next_pow2


@triton.jit
def _topk_softmax_forward(
    logits_ptr,
    bias_ptr,
    probs_ptr,
    weights_ptr,
    experts_ptr,
    T,
    E,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = t < T
    cols = tl.arange(0, E_PAD)
    emask = cols < E
    m = tmask[:, None] & emask[None, :]
    # Rows past T load zeros (not -inf) so that no lane computes inf - inf.
    x = tl.load(logits_ptr + t[:, None] * E + cols[None, :], mask=m, other=0.0)
    x = tl.where(emask[None, :], x.to(tl.float32), float("-inf"))
    z = tl.exp(x - tl.max(x, axis=1)[:, None])
    p = z / tl.sum(z, axis=1)[:, None]
    tl.store(probs_ptr + t[:, None] * E + cols[None, :], p, mask=m)
    sel = p
    if HAS_BIAS:
        sel = p + tl.load(bias_ptr + cols, mask=emask, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(emask[None, :], sel, float("-inf"))
    kcols = tl.arange(0, K_PAD)
    ids = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
    w = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
    for k in tl.static_range(K):
        best = tl.max(sel, axis=1)
        idx = tl.min(tl.where(sel == best[:, None], cols[None, :], E_PAD), axis=1)
        hit = cols[None, :] == idx[:, None]
        pk = tl.sum(tl.where(hit, p, 0.0), axis=1)
        ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
        w = tl.where(kcols[None, :] == k, pk[:, None], w)
        sel = tl.where(hit, float("-inf"), sel)
    if NORMALIZE:
        w = w / tl.sum(w, axis=1)[:, None]
    km = tmask[:, None] & (kcols < K)[None, :]
    tl.store(weights_ptr + t[:, None] * K + kcols[None, :], w, mask=km)
    tl.store(experts_ptr + t[:, None] * K + kcols[None, :], ids.to(tl.int64), mask=km)


@triton.jit
def _topk_softmax_backward(
    probs_ptr,
    experts_ptr,
    dprobs_ptr,
    dweights_ptr,
    dlogits_ptr,
    T,
    E,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    E_PAD: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tmask = t < T
    cols = tl.arange(0, E_PAD)
    m = tmask[:, None] & (cols < E)[None, :]
    p = tl.load(probs_ptr + t[:, None] * E + cols[None, :], mask=m, other=0.0)
    dp = tl.load(dprobs_ptr + t[:, None] * E + cols[None, :], mask=m, other=0.0)
    kcols = tl.arange(0, K_PAD)
    km = tmask[:, None] & (kcols < K)[None, :]
    ids = tl.load(experts_ptr + t[:, None] * K + kcols[None, :], mask=km, other=0)
    dw = tl.load(dweights_ptr + t[:, None] * K + kcols[None, :], mask=km, other=0.0)
    if NORMALIZE:
        # w = p_sel / S: dp_sel = (dw - <dw, w>) / S
        p_sel = tl.load(probs_ptr + t[:, None] * E + ids, mask=km, other=0.0)
        s = tl.where(tmask, tl.sum(p_sel, axis=1), 1.0)  # rows past T: no 0 / 0
        w = p_sel / s[:, None]
        dw = (dw - tl.sum(dw * w, axis=1)[:, None]) / s[:, None]
    for k in tl.static_range(K):
        idx = tl.sum(tl.where(kcols[None, :] == k, ids, 0), axis=1)
        dk = tl.sum(tl.where(kcols[None, :] == k, dw, 0.0), axis=1)
        dp += tl.where(cols[None, :] == idx[:, None], dk[:, None], 0.0)
    dl = p * (dp - tl.sum(p * dp, axis=1)[:, None])
    tl.store(dlogits_ptr + t[:, None] * E + cols[None, :], dl, mask=m)


def _block_t(n_tokens: int, e_pad: int) -> int:
    # about 4 Ki scores per program: several tokens each, thousands of programs at 16 Ki tokens
    return max(1, min(4096 // e_pad, next_pow2(n_tokens)))


def topk_softmax_forward(
    logits_TE: torch.Tensor, k: int, bias_E: torch.Tensor | None, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights_TK fp32, experts_TK int64, probs_TE fp32)."""
    logits_TE = logits_TE.contiguous()
    T, E = logits_TE.shape
    e_pad = max(16, next_pow2(E))
    bt = _block_t(T, e_pad)
    dev = logits_TE.device
    probs_TE = torch.empty(T, E, dtype=torch.float32, device=dev)
    weights_TK = torch.empty(T, k, dtype=torch.float32, device=dev)
    experts_TK = torch.empty(T, k, dtype=torch.int64, device=dev)
    _topk_softmax_forward[(cdiv(T, bt),)](
        logits_TE,
        logits_TE if bias_E is None else bias_E.contiguous(),
        probs_TE,
        weights_TK,
        experts_TK,
        T,
        E,
        K=k,
        K_PAD=next_pow2(k),
        HAS_BIAS=bias_E is not None,
        NORMALIZE=normalize,
        BLOCK_T=bt,
        E_PAD=e_pad,
        num_warps=4,
    )
    return weights_TK, experts_TK, probs_TE


def topk_softmax_backward(
    probs_TE: torch.Tensor,
    experts_TK: torch.Tensor,
    dprobs_TE: torch.Tensor,
    dweights_TK: torch.Tensor,
    normalize: bool,
) -> torch.Tensor:
    """dlogits_TE (fp32) from the gradients of the probabilities and of the top-k weights."""
    T, E = probs_TE.shape
    k = experts_TK.shape[1]
    e_pad = max(16, next_pow2(E))
    bt = _block_t(T, e_pad)
    dlogits_TE = torch.empty(T, E, dtype=torch.float32, device=probs_TE.device)
    _topk_softmax_backward[(cdiv(T, bt),)](
        probs_TE,
        experts_TK,
        dprobs_TE.float().contiguous(),
        dweights_TK.float().contiguous(),
        dlogits_TE,
        T,
        E,
        K=k,
        K_PAD=next_pow2(k),
        NORMALIZE=normalize,
        BLOCK_T=bt,
        E_PAD=e_pad,
        num_warps=4,
    )
    return dlogits_TE
