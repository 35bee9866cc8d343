"""FlashAttention 4's causal attention (``flash-attn-4``'s CuTe kernels) as two PyTorch custom
ops, forward and backward, with autograd registered between them: an alternative to the model's
call (``moe_core.model.attention``: the library's ``flash_attn_func`` behind a compile
boundary), measured and not adopted. On one H200 at OLMoE-1B-7B's shape the compiled attention
block, forward + backward, took 4.727 ms through these ops against 4.719 ms with the graph break
(``benchmarks/attention.py --block``, RESULTS.md), and the ops call the library's private entry
points where the model calls its public one.

As an op, the call is one opaque node that ``torch.compile`` traces through: a compiled
attention block stays one graph (the RMSNorms, rotary embedding and layout changes before it,
the output projection and residual add after it fuse with their neighbours, and the gradients
of the block's input are summed inside the compiled backward), where the library's
``autograd.Function`` is a graph break with eager work on either side.

The ops call the library's forward and backward entry points (``_flash_attn_fwd``,
``_flash_attn_bwd`` of ``flash_attn.cute.interface``; the ``[gpu]`` extra pins the release)
with the defaults its ``flash_attn_func`` uses for causal attention: softmax scale
1/sqrt(head_dim), no softcap, no window. Layout [batch, sequence, heads, head_dim], the last
dimension contiguous; grouped-query heads as the library takes them (fewer k, v heads).
"""

from __future__ import annotations

import torch


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("moe_core::flash4_fwd", mutates_args=())
def flash4_fwd(
    q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention's output [B, S, H, d] and the softmax's log-sum-exp [B, H, S] (fp32),
    which the backward takes."""
    from flash_attn.cute.interface import _flash_attn_fwd

    q, k, v = (_last_dim_contiguous(t) for t in (q_BSHd, k_BSHd, v_BSHd))
    out, lse = _flash_attn_fwd(q, k, v, causal=True, return_lse=True)[:2]
    return out, lse


@flash4_fwd.register_fake
def _(q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor):
    B, S, H, _ = q_BSHd.shape
    out = q_BSHd.new_empty(B, S, H, v_BSHd.shape[-1])
    return out, q_BSHd.new_empty(B, H, S, dtype=torch.float32)


@torch.library.custom_op("moe_core::flash4_bwd", mutates_args=())
def flash4_bwd(
    dout_BSHd: torch.Tensor,
    q_BSHd: torch.Tensor,
    k_BSHd: torch.Tensor,
    v_BSHd: torch.Tensor,
    out_BSHd: torch.Tensor,
    lse_BHS: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of q, k and v (each in its input's shape)."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dout, q, k, v, out = (
        _last_dim_contiguous(t) for t in (dout_BSHd, q_BSHd, k_BSHd, v_BSHd, out_BSHd)
    )
    grads = _flash_attn_bwd(q, k, v, out, dout, lse_BHS, causal=True)[:3]
    # The fake implementation promises each gradient in its input's strides (what the library
    # allocates for aligned inputs); compiled code downstream relies on that promise.
    return tuple(
        g if g.stride() == t.stride() else torch.empty_like(t).copy_(g)
        for g, t in zip(grads, (q_BSHd, k_BSHd, v_BSHd), strict=True)
    )


@flash4_bwd.register_fake
def _(dout_BSHd, q_BSHd, k_BSHd, v_BSHd, out_BSHd, lse_BHS):
    return torch.empty_like(q_BSHd), torch.empty_like(k_BSHd), torch.empty_like(v_BSHd)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout_BSHd: torch.Tensor, _dlse: torch.Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    return flash4_bwd(dout_BSHd, q, k, v, out, lse)


flash4_fwd.register_autograd(_backward, setup_context=_setup_context)


def flash4_attention(
    q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor
) -> torch.Tensor:
    """Causal attention of [B, S, H, d] queries over [B, S, H_kv, d] keys and values, through
    the ops above (differentiable; traced by ``torch.compile`` without a graph break)."""
    return flash4_fwd(q_BSHd, k_BSHd, v_BSHd)[0]
