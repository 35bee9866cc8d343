"""The torchtitan peer at our DeepSeek shapes (``benchmarks/peer_torchtitan.py``): our config's
fields become torchtitan's, and torchtitan's DeepSeek-V3 model built from them holds the
parameters ours does and runs forward. The model tests skip where torchtitan is not installed."""

from __future__ import annotations

import dataclasses
import importlib
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# torchtitan's router asks for fp32 autocast, which CPU autocast declines (it runs in fp32 anyway)
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype")

# DeepSeek-V3's block, and V2-Lite's (full-rank queries, softmax, one group)
V3 = dict(
    name="v3",
    d_model=7168,
    n_layers=61,
    n_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_dense_layers=3,
    dense_hidden=18432,
    n_experts=256,
    expert_hidden=2048,
    n_shared_experts=1,
    top_k=8,
    router="sigmoid",
    n_expert_groups=8,
    top_k_groups=4,
    normalize_top_k=True,
    routed_scale=2.5,
    vocab_size=129280,
    rope_theta=10000.0,
    norm_eps=1e-6,
    mtp_depth=1,
    rope_scaling="yarn",
    yarn_factor=40.0,
    yarn_original_max_seq_len=4096,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=1.0,
    tie_embeddings=False,
)
V2_LITE = V3 | dict(
    d_model=2048,
    n_layers=27,
    n_heads=16,
    q_lora_rank=None,
    n_dense_layers=1,
    dense_hidden=10944,
    n_experts=64,
    expert_hidden=1408,
    n_shared_experts=2,
    top_k=6,
    router="softmax",
    n_expert_groups=1,
    top_k_groups=1,
    normalize_top_k=False,
    routed_scale=1.0,
    vocab_size=102400,
    mtp_depth=0,
    yarn_mscale=0.707,
    yarn_mscale_all_dim=0.707,
)
# V3's options at a size a CPU builds in a second: both query forms, groups, MTP
TINY = V3 | dict(
    d_model=64,
    n_layers=3,
    n_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    n_dense_layers=1,
    dense_hidden=96,
    n_experts=16,
    expert_hidden=32,
    n_shared_experts=1,
    top_k=4,
    n_expert_groups=4,
    top_k_groups=2,
    vocab_size=256,
)


@pytest.fixture
def peer(monkeypatch):
    """``peer_torchtitan`` imported as the benchmarks import it, dropped afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    yield importlib.import_module("peer_torchtitan")
    sys.modules.pop("peer_torchtitan", None)


def titan():
    """torchtitan's DeepSeek-V3 family, or a skip where it does not import."""
    try:
        return importlib.import_module("torchtitan.models.deepseek_v3")
    except Exception as err:  # absent, or built for another torch
        pytest.skip(f"torchtitan's deepseek_v3 does not import here: {err!r}")


def hand_count(c: dict) -> int:
    """Our DeepSeek model's parameters in closed form: embedding, blocks (MLA, a dense SwiGLU
    or routed + shared experts and the router, two norms), final norm, LM head, MTP blocks
    (eh_proj, three norms and a block like the last)."""
    d, h = c["d_model"], c["n_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    q = d * h * qk if not c["q_lora_rank"] else c["q_lora_rank"] * (d + 1 + h * qk)
    kv = d * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
    kv += c["kv_lora_rank"] * h * (c["qk_nope_head_dim"] + c["v_head_dim"])
    attention = q + kv + h * c["v_head_dim"] * d + 2 * d
    expert = 3 * d * c["expert_hidden"]
    moe = (c["n_experts"] + c["n_shared_experts"]) * expert + c["n_experts"] * d
    dense = 3 * d * c["dense_hidden"]
    n_moe = c["n_layers"] - c["n_dense_layers"]
    blocks = c["n_layers"] * attention + c["n_dense_layers"] * dense + n_moe * moe
    mtp = c["mtp_depth"] * (2 * d * d + 3 * d + attention + moe)
    return 2 * c["vocab_size"] * d + d + blocks + mtp


def titan_model(peer, c: dict, device: str):
    """torchtitan's model at ``c`` on ``device`` (meta: shapes only), weights initialised."""
    spec = peer.deepseek_spec(peer.shape_of(SimpleNamespace(**c)), "flex", 64)
    with torch.device("meta"):
        model = spec.model.build()
    if device != "meta":
        model.to_empty(device=device)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


def test_our_deepseek_fields_become_torchtitans(peer):
    v3 = peer.shape_of(SimpleNamespace(**V3))
    assert v3["family"] == "deepseek_v3"
    assert (v3["q_lora_rank"], v3["kv_lora_rank"], v3["v_head_dim"]) == (1536, 512, 128)
    assert (v3["n_groups"], v3["topk_groups"], v3["score_func"]) == (8, 4, "sigmoid")
    assert (v3["route_norm"], v3["route_scale"], v3["mtp_depth"]) == (True, 2.5, 1)
    assert v3["yarn_mscale_all_dim"] == 1.0 and "yarn_rotation_scale_not_applied" not in v3
    lite = peer.shape_of(SimpleNamespace(**V2_LITE))
    assert lite["q_lora_rank"] == 0  # full-rank queries: torchtitan's wq
    assert (lite["n_groups"], lite["topk_groups"]) == (None, None)  # plain top-k
    assert (lite["route_norm"], lite["score_func"], lite["n_shared_experts"]) == (
        False,
        "softmax",
        2,
    )
    qwen = V3 | dict(kv_lora_rank=None, qk_norm="head", n_shared_experts=0, n_dense_layers=0)
    with pytest.raises(AssertionError, match="no MTP"):  # standard attention: torchtitan's qwen3
        peer.shape_of(SimpleNamespace(**qwen))


@pytest.mark.parametrize("mtp_depth, q_lora_rank", [(0, None), (1, 32)])
def test_torchtitans_deepseek_holds_our_parameters(peer, mtp_depth, q_lora_rank):
    titan()
    c = TINY | dict(mtp_depth=mtp_depth, q_lora_rank=q_lora_rank)
    model = titan_model(peer, c, "meta")
    assert sum(p.numel() for p in model.parameters()) == hand_count(c)
    from moe_core.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    if {"kv_lora_rank", "mtp_depth"} <= fields:  # ours, once MLA and MTP are in ModelConfig
        from moe_core.model.transformer import parameter_shapes

        ours = ModelConfig(**{k: v for k, v in c.items() if k in fields})
        assert sum(math.prod(s) for s in parameter_shapes(ours).values()) == hand_count(c)


def test_torchtitans_deepseek_runs_forward_with_mtp(peer, monkeypatch):
    titan()
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention

    def causal_sdpa(q, k, v, *, block_mask, scale, **_):  # flex attention compiles on CPU
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale), None

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", staticmethod(causal_sdpa))
    torch.manual_seed(0)
    model = titan_model(peer, TINY, "cpu")
    tokens = torch.randint(0, TINY["vocab_size"], (2, 64))
    mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 64, 64, device="cpu")
    logits = model(tokens, attention_masks=mask)
    assert [tuple(x.shape) for x in logits] == [(2, 64, 256)] * 2  # next token, MTP's
    assert all(torch.isfinite(x).all() for x in logits)
