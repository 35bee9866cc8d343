"""FlashAttention 4's attention core (``parallel.attention=flash4``, the ``[gpu]`` extra) gives
what SDPA gives, forward and gradients, with grouped-query heads, eagerly and in a compiled
block."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_core.config import ModelConfig
from moe_core.model.attention import Attention, RotaryEmbedding
from moe_core.model.eager import seal
from moe_core.model.kernel_choice import Kernels

pytestmark = pytest.mark.gpu
pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4")


# the families' attention blocks (issue 37): Qwen3's per-head QK-norm with a head_dim of its own,
# GLM-4.5-Air's half-rotated heads with q/k/v biases and no QK-norm
BLOCKS = {
    "olmoe": {},
    "qwen3": dict(n_heads=16, head_dim=128, qk_norm="head"),
    "glm": dict(
        n_heads=12, head_dim=128, qk_norm="none", rotary_fraction=0.5, attention_bias="qkv"
    ),
}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_flash4_attention_equals_sdpa(block, kv_heads, compiled):
    options = {"n_heads": 8, **BLOCKS[block]}
    if options["n_heads"] % kv_heads:
        pytest.skip("kv heads must divide the query heads")
    cfg = ModelConfig(d_model=1024, n_kv_heads=kv_heads, max_seq_len=1024, **options)
    torch.manual_seed(0)
    sdpa = Attention(cfg).cuda().to(torch.bfloat16)
    with torch.no_grad():  # norms and biases off their init, so a dropped one shows
        for name, p in sdpa.named_parameters():
            if not name.endswith("proj.weight"):
                p.add_(0.1 * torch.randn_like(p))
    flash = copy.deepcopy(sdpa)
    flash.kernels = Kernels(attention="flash4")
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)(1024, torch.device("cuda"))
    x = torch.randn(2, 1024, cfg.d_model, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    results = []
    seal()  # the model's compile boundaries (model.eager), as apply_compile does
    for module in (sdpa, flash):
        fn = torch.compile(module) if compiled else module
        xi = x.clone().requires_grad_()
        y = fn(xi, rope)
        leaves = [xi, *module.parameters()]
        results.append((y, *torch.autograd.grad(y, leaves, dy)))
    for got, ref in zip(results[1], results[0], strict=True):
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * scale)
