"""Multi-head latent attention on the GPU: bf16 through SDPA (cuDNN on Hopper) and through
FlashAttention 4's 192/128 kernels, eagerly and compiled, gives what the fp32 module gives
(forward and every gradient), at DeepSeek-V3's head sizes (128 non-rotary + 64 rotary, values
of 128) with YaRN."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from moe_core.config import ModelConfig
from moe_core.model.attention import LatentAttention, RotaryEmbedding, YarnScaling
from moe_core.model.eager import seal
from moe_core.model.kernel_choice import Kernels

pytestmark = pytest.mark.gpu

V3_HEADS = dict(
    n_heads=8,
    n_kv_heads=None,
    qk_norm="none",
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    rope_scaling="yarn",
    yarn_factor=40.0,
    yarn_mscale_all_dim=1.0,
)
CORES = ["sdpa"] + ["flash4"] * (importlib.util.find_spec("flash_attn") is not None)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("core", CORES)
def test_latent_attention_in_bf16_matches_fp32(core, compiled):
    if core == "flash4" and importlib.util.find_spec("flash_attn.cute") is None:
        pytest.skip("needs flash-attn-4")
    cfg = ModelConfig(d_model=1024, max_seq_len=2048, **V3_HEADS)
    torch.manual_seed(0)
    ref = LatentAttention(cfg).cuda()
    with torch.no_grad():  # latent norms off their init, so a dropped one shows
        ref.q_a_norm.weight.add_(0.1 * torch.randn_like(ref.q_a_norm.weight))
        ref.kv_a_norm.weight.add_(0.1 * torch.randn_like(ref.kv_a_norm.weight))
    fast = copy.deepcopy(ref).to(torch.bfloat16)
    fast.kernels = Kernels(attention=core)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, YarnScaling.of(cfg))
    tables = rope(2048, torch.device("cuda"))
    x = torch.randn(2, 2048, cfg.d_model, device="cuda")
    dy = torch.randn_like(x)
    seal()
    results = []
    for module, dtype in ((ref, torch.float32), (fast, torch.bfloat16)):
        fn = torch.compile(module) if compiled else module
        xi = x.to(dtype).requires_grad_()
        y = fn(xi, tables)
        results.append((y, *torch.autograd.grad(y, [xi, *module.parameters()], dy.to(dtype))))
    for got, want in zip(results[1], results[0], strict=True):
        scale = want.abs().max().item()
        err = (got.float() - want).abs().max().item()
        assert err <= 0.03 * scale, (err, scale)
