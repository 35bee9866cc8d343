"""``torch.compile`` applied to a built model from outside, block by block.

Inductor fuses each block's dense part (norms, RoPE, residual adds, the router's softmax,
top-k and losses) around the attention and projection GEMMs. Token dispatch stays eager
(``moe._dispatch`` is a compile boundary: ``model.eager``, sealed here before compiling); its
Triton kernels and grouped GEMMs are fused already. Every MoE block has the same code and
shapes, so one compilation serves all of them (the leading dense blocks, where a model has
them, one more).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moe_core.model.eager import seal
from moe_core.model.norm import RMSNorm
from moe_core.model.transformer import Block, MTPModule, lm_loss


def apply_compile(model: torch.nn.Module) -> None:
    """Compile every block (the MTP modules' too), the final norm and the MTP modules' norms
    in place (parameter names stay unchanged)."""
    seal()
    for module in model.modules():
        if isinstance(module, Block):
            module.compile()
        elif isinstance(module, MTPModule):
            for norm in (module.enorm, module.hnorm, module.norm):
                norm.compile()
    norm = getattr(model, "norm", None)
    if isinstance(norm, RMSNorm):
        norm.compile()


@functools.cache
def _compiled_lm_loss() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return torch.compile(lm_loss)


def loss_function(compile: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``lm_loss``, compiled with ``compile``: the fp32 upcast then fuses into the
    cross-entropy, so no fp32 copy of the logits is written."""
    return _compiled_lm_loss() if compile else lm_loss
