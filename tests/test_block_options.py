"""The block options of the model families (``ModelConfig``: QK-norm kind, head_dim, partial
rotary, attention biases, leading dense blocks, group-limited routing, routed scale, tied
embeddings, the router losses' layer reduction) against straightforward re-implementations.
Parity with the ``transformers`` classes themselves: ``test_families.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config

from moe_core.config import ConfigError, OptionNotImplementedError
from moe_core.model import build_model
from moe_core.model.attention import Attention, RotaryEmbedding, apply_rotary
from moe_core.model.moe import MoE, Router
from moe_core.model.transformer import init_plan


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _reference_attention(attn: Attention, x: torch.Tensor, rope, qk_norm: str) -> torch.Tensor:
    """The attention written out: projections, the QK-norm kind, partial RoPE, causal softmax."""
    B, S, _ = x.shape
    H, G, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    eps = 1e-5
    if qk_norm == "projection":
        q, k = _rms(q, eps) * attn.q_norm.weight, _rms(k, eps) * attn.k_norm.weight
    q, k, v = q.view(B, S, H, d), k.view(B, S, G, d), v.view(B, S, G, d)
    if qk_norm == "head":
        q, k = _rms(q, eps) * attn.q_norm.weight, _rms(k, eps) * attn.k_norm.weight
    cos, sin = rope
    r = cos.shape[-1]

    def rotate(t):  # [B, S, heads, d]: rotate the first r dimensions by halves
        t_rot, t_pass = t[..., :r], t[..., r:]
        a, b = t_rot[..., : r // 2], t_rot[..., r // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return torch.cat([t_rot * c + torch.cat([-b, a], -1) * s, t_pass], -1)

    q, k = rotate(q), rotate(k)
    k, v = k.repeat_interleave(H // G, dim=2), v.repeat_interleave(H // G, dim=2)
    scores = torch.einsum("bshd,bthd->bhst", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v).reshape(B, S, H * d)
    return attn.o_proj(o)


@pytest.mark.parametrize(
    "options",
    [
        {},  # OLMoE: whole-projection norm
        {"qk_norm": "head", "head_dim": 24, "n_kv_heads": 2},  # Qwen3: per head, own head_dim
        {"qk_norm": "none", "n_kv_heads": 1},  # Mixtral
        {"qk_norm": "none", "rotary_fraction": 0.5, "attention_bias": "qkv"},  # GLM-4.5-Air
        {"qk_norm": "head", "head_dim": 12, "rotary_fraction": 0.5, "attention_bias": "qkvo"},
    ],
)
def test_attention_options_equal_the_written_out_attention(options):
    torch.manual_seed(0)
    cfg = small_config(**options)
    attn = Attention(cfg)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 9, cfg.d_model)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)(9, x.device)
    assert rope[0].shape == (9, cfg.rotary_dim)
    torch.testing.assert_close(attn(x, rope), _reference_attention(attn, x, rope, cfg.qk_norm))
    biases = {n for n, _ in attn.named_parameters() if n.endswith(".bias")}
    expected = {"none": set(), "qkv": {"q_proj.bias", "k_proj.bias", "v_proj.bias"}}
    expected["qkvo"] = expected["qkv"] | {"o_proj.bias"}
    assert biases == expected[cfg.attention_bias]
    if cfg.qk_norm == "none":
        assert attn.q_norm is None and attn.k_norm is None


def test_partial_rotary_passes_the_trailing_dimensions_through():
    x = torch.randn(1, 2, 5, 16)
    cos, sin = RotaryEmbedding(8, 10000.0)(5, x.device)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    torch.testing.assert_close(out[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin))
    assert not torch.equal(out[..., :8], x[..., :8])


def test_leading_dense_blocks_have_a_dense_mlp_and_no_router():
    cfg = small_config(n_layers=3, n_dense_layers=2, dense_hidden=48, n_shared_experts=1)
    model = build_model(cfg)
    kinds = [(b.moe is None, b.mlp is not None) for b in model.layers.values()]
    assert kinds == [(True, True), (True, True), (False, False)]
    assert model.layers["0"].mlp.w_gate.weight.shape == (48, cfg.d_model)
    routers = [n for n, m in model.named_modules() if isinstance(m, Router)]
    assert routers == ["layers.2.moe.router"]
    # the dense block's output is the residual plus its SwiGLU; aux comes from layer 2 alone
    block = model.layers["0"]
    h = torch.randn(2, 5, cfg.d_model)
    rope = model.rope(5, h.device)
    aux = torch.zeros(())
    out, aux_out = block(h, aux, rope)
    mid = h + block.attn(block.attn_norm(h), rope)
    n = block.moe_norm(mid)
    expected = mid + block.mlp.w_down(F.silu(block.mlp.w_gate(n)) * block.mlp.w_up(n))
    torch.testing.assert_close(out, expected)
    assert aux_out is aux


def _group_limited_reference(scores: torch.Tensor, groups: int, keep: int, k: int):
    """Per token: each group's two best scores summed, the ``keep`` best groups, then the
    top ``k`` experts among the experts of those groups."""
    T, E = scores.shape
    per = E // groups
    out = []
    for t in range(T):
        g_score = [scores[t, g * per : (g + 1) * per].topk(2).values.sum() for g in range(groups)]
        kept = torch.stack(g_score).topk(keep).indices.tolist()
        allowed = [e for g in kept for e in range(g * per, (g + 1) * per)]
        best = scores[t, allowed].topk(k).indices
        out.append(sorted(allowed[i] for i in best.tolist()))
    return torch.tensor(out)


@pytest.mark.parametrize("kind", ["softmax", "sigmoid"])
def test_group_limited_routing_picks_the_top_k_of_the_best_groups(kind):
    torch.manual_seed(1)
    cfg = small_config(
        n_experts=16, top_k=3, n_expert_groups=4, top_k_groups=2, router=kind, expert_bias=True
    )
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.expert_bias.normal_(0, 0.05)
    x = torch.randn(50, cfg.d_model)
    r = router(x)
    logits = x @ router.weight.t()
    scores = logits.softmax(-1) if kind == "softmax" else logits.sigmoid()
    expected = _group_limited_reference(scores + router.expert_bias, 4, 2, 3)
    assert torch.equal(r.experts_TK.sort(-1).values, expected)
    # at most top_k_groups groups per token, and the weights are the unbiased scores
    assert all(len(set((row // 4).tolist())) <= 2 for row in r.experts_TK)
    torch.testing.assert_close(r.weights_TK, scores.gather(1, r.experts_TK))


def test_routed_scale_multiplies_the_normalized_weights():
    torch.manual_seed(2)
    base = small_config(router="sigmoid", normalize_top_k=True, top_k=3)
    scaled = small_config(router="sigmoid", normalize_top_k=True, top_k=3, routed_scale=2.5)
    r1, r2 = Router(base), Router(scaled)
    torch.nn.init.normal_(r1.weight, std=0.5)
    r2.weight.data.copy_(r1.weight.data)
    x = torch.randn(20, base.d_model)
    a, b = r1(x), r2(x)
    assert torch.equal(a.experts_TK, b.experts_TK)
    torch.testing.assert_close(b.weights_TK, 2.5 * a.weights_TK)
    torch.testing.assert_close(b.weights_TK.sum(-1), torch.full((20,), 2.5))


def test_tied_embeddings_read_the_embedding_matrix_as_the_head():
    cfg = small_config(tie_embeddings=True)
    model = build_model(cfg, seed=3)
    names = {n for n, _ in model.named_parameters()}
    assert "lm_head.weight" not in names and "embed.weight" in names
    assert all(item.name != "lm_head.weight" for item in init_plan(model))
    tokens = torch.randint(0, cfg.vocab_size, (2, 7))
    logits, _ = model(tokens)
    h = tokens
    x = model.embed(h)
    rope = model.rope(7, x.device)
    aux = torch.zeros(())
    for block in model.layers.values():
        x, aux = block(x, aux, rope)
    torch.testing.assert_close(logits, model.norm(x) @ model.embed.weight.t())
    logits.sum().backward()  # both uses reach the one parameter
    assert model.embed.weight.grad is not None


def test_mean_reduction_divides_each_layers_router_losses_by_the_moe_layers():
    torch.manual_seed(4)
    kw = dict(n_layers=4, n_dense_layers=1, dense_hidden=16, aux_loss_coef=0.3, z_loss_coef=0.1)
    summed = build_model(small_config(**kw, aux_loss_reduction="sum"), seed=5)
    mean = build_model(small_config(**kw, aux_loss_reduction="mean"), seed=5)
    tokens = torch.randint(0, 256, (2, 6))
    aux_sum, aux_mean = summed(tokens)[1], mean(tokens)[1]
    torch.testing.assert_close(aux_mean, aux_sum / 3)  # 3 MoE layers


def test_biases_start_at_zero_and_norms_at_one():
    model = build_model(small_config(attention_bias="qkvo", qk_norm="head", head_dim=8), seed=6)
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert torch.equal(p, torch.zeros_like(p)), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    assert model.layers["0"].attn.q_norm.weight.shape == (8,)


@pytest.mark.parametrize(
    "overrides, sentence",
    [
        (
            {"qk_norm": "both"},
            "model.qk_norm='both' is not allowed: one of 'projection', 'head', 'none'.",
        ),
        (
            {"n_dense_layers": 1},
            "model.dense_hidden=None is not allowed: a positive width exactly when "
            "model.n_dense_layers > 0 (it is unset with n_dense_layers=1).",
        ),
        (
            {"n_expert_groups": 3},
            "model.n_expert_groups=3 is not allowed: it must divide model.n_experts (8).",
        ),
        (
            {"n_expert_groups": 4, "top_k_groups": 1, "top_k": 3},
            "model.top_k=3 is not allowed: at most top_k_groups x experts per group (1 x 2).",
        ),
        (
            {"rotary_fraction": 0.1},
            "model.head_dim=16 is not allowed: head_dim x rotary_fraction (16 x 0.1, rounded "
            "down) must be a positive even number of rotated dimensions.",
        ),
    ],
)
def test_a_bad_block_option_is_one_sentence_naming_it(overrides, sentence):
    from moe_core.config_dict import from_dict

    values = {**small_config().__dict__, **overrides}
    with pytest.raises(ConfigError) as err:
        from_dict(type(small_config()), values, "model.")
    assert str(err.value) == sentence


def test_tied_embeddings_are_refused_with_pipeline_stages_and_fp8_heads():
    from moe_core.compose import compose_run

    with pytest.raises(
        OptionNotImplementedError, match=r"model\.tie_embeddings=true with parallel"
    ):
        compose_run(["model=tiny", "model.tie_embeddings=true", "parallel.pp=2"])
    with pytest.raises(ConfigError, match=r"a list without 'lm_head' when model\.tie_embeddings"):
        compose_run(
            [
                "model=tiny",
                "model.tie_embeddings=true",
                "precision=fp8",
                "precision.fp8_parts=[lm_head]",
            ]
        )


def test_moe_layer_with_options_keeps_its_shapes():
    cfg = small_config(n_shared_experts=1, router="sigmoid", expert_bias=True, routed_scale=2.0)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    y, aux = moe(torch.randn(2, 3, cfg.d_model))
    assert y.shape == (2, 3, cfg.d_model) and aux.shape == ()
