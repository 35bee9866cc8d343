"""Activation recompute, applied to a built model from outside.

``block``: each transformer block keeps only its inputs and recomputes the rest in backward.
``selective``: only the experts' SwiGLU activation (and the down projection's input) is
recomputed, the largest activation of an MoE layer for a small share of its FLOPs, and in
multi-head latent attention the key-value expansion and the attention core
(``LatentAttention.attend``): a block keeps the compressed key-value and q instead of the
expanded keys and values, for the core's forward once more. (Where the
experts' MLP runs as one op, ``moe_kernels.expert_mlp`` fused or FP8 experts'
``moe_kernels.fp8``, it already keeps no SwiGLU output and writes it again in backward, so
there is nothing left for ``selective`` to do there.)
Recomputed forwards do not add to router statistics.
"""

from __future__ import annotations

import contextlib
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from moe_core.model.attention import LatentAttention
from moe_core.model.moe import Experts, router_stats_paused
from moe_core.model.transformer import Block


def _contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    return contextlib.nullcontext(), router_stats_paused()


def _checkpointed(forward, routes: bool = True):
    """``forward`` checkpointed; where it ``routes`` tokens, its recomputation adds nothing to
    router statistics (a context torch.compile cannot trace: only eager regions route)."""
    context = {"context_fn": _contexts} if routes else {}

    def run(*args):
        if not torch.is_grad_enabled():
            return forward(*args)
        return checkpoint(forward, *args, use_reentrant=False, **context)

    return run


def apply_recompute(model: torch.nn.Module, mode: Literal["none", "block", "selective"]) -> None:
    """Wrap every block's (or every expert layer's activation's) forward in a checkpoint.

    The wrapping replaces instance ``forward`` attributes, so parameter names are unchanged.
    """
    if mode == "none":
        return
    for module in model.modules():
        if mode == "block" and isinstance(module, Block):
            module.forward = _checkpointed(module.forward)
        elif mode == "selective" and isinstance(module, Experts):
            module.activation_and_down = _checkpointed(module.activation_and_down)
        elif mode == "selective" and isinstance(module, LatentAttention):
            module.attend = _checkpointed(module.attend, routes=False)  # in compiled blocks
