"""Multi-head latent attention (``model.attention.LatentAttention``) and YaRN: forward and
backward against a plain PyTorch reference written here (fp64 on the CPU: explicit softmax over
a causal mask, RoPE as complex rotations of (x_j, x_{j + r/2}) pairs), the config's refusals,
the FLOP and parameter counts, and a training step of the ``small-mla`` named model."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import small_config

from moe_core.compose import compose_run
from moe_core.config import ConfigError
from moe_core.model.attention import LatentAttention, RotaryEmbedding, YarnScaling
from moe_core.model.flops import count
from moe_core.model.transformer import Transformer, build_model, lm_loss

MLA = dict(
    n_kv_heads=None,
    qk_norm="none",
    kv_lora_rank=12,
    qk_rope_head_dim=6,
    qk_nope_head_dim=10,
    v_head_dim=7,
)


def _rope_reference(x: torch.Tensor, angle: torch.Tensor, scale: float) -> torch.Tensor:
    """Rotate pairs (x_j, x_{j + r/2}) by ``angle`` (broadcast over x), as complex numbers, and
    scale them (YaRN's table scale)."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half], x[..., half:])
    z = z * torch.polar(torch.full_like(angle, scale), angle)
    return torch.cat([z.real, z.imag], dim=-1)


def _reference(attn: LatentAttention, x: torch.Tensor, inv_freq: torch.Tensor, table_scale: float):
    """What latent attention computes, from its weights, in plain operations."""

    def rms(t, w, eps):
        return w * t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    B, S, _ = x.shape
    H, nope, r, v = attn.n_heads, attn.nope, attn.rope, attn.v_dim
    if attn.q_proj is not None:
        q = x @ attn.q_proj.weight.T
    else:
        c_q = rms(x @ attn.q_a_proj.weight.T, attn.q_a_norm.weight, attn.q_a_norm.eps)
        q = c_q @ attn.q_b_proj.weight.T
    q = q.view(B, S, H, nope + r)
    kv_a = x @ attn.kv_a_proj.weight.T
    c_kv, k_rot = kv_a[..., : attn.kv_rank], kv_a[..., attn.kv_rank :]
    kv = rms(c_kv, attn.kv_a_norm.weight, attn.kv_a_norm.eps) @ attn.kv_b_proj.weight.T
    kv = kv.view(B, S, H, nope + v)
    angle_Sh = torch.arange(S, dtype=torch.float64)[:, None] * inv_freq[None, :]
    q_rot = _rope_reference(q[..., nope:], angle_Sh[:, None, :], table_scale)
    k_rot = _rope_reference(k_rot, angle_Sh, table_scale)[:, :, None, :].expand(B, S, H, r)
    q_full = torch.cat([q[..., :nope], q_rot], -1)
    k_full = torch.cat([kv[..., :nope], k_rot], -1)
    scores = torch.einsum("bshd,bthd->bhst", q_full, k_full) * attn.scale
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), kv[..., nope:])
    return out.reshape(B, S, H * v) @ attn.o_proj.weight.T


@pytest.mark.parametrize(
    "options",
    [
        dict(q_lora_rank=9),
        dict(),  # a full-rank query projection (DeepSeek-V2-Lite)
        dict(
            q_lora_rank=8,
            rope_scaling="yarn",
            yarn_factor=6.0,
            yarn_original_max_seq_len=4096,  # the ramp spans rotary pairs 0 to 3 here
            yarn_mscale=0.9,
            yarn_mscale_all_dim=0.6,
        ),
    ],
    ids=["q-lora", "full-q", "yarn"],
)
def test_latent_attention_matches_a_plain_reference_forward_and_backward(options):
    cfg = small_config(d_model=24, n_heads=3, **MLA, **options)
    torch.manual_seed(0)
    attn = LatentAttention(cfg).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    x = torch.randn(2, 9, 24, dtype=torch.float64, requires_grad=True)
    yarn = YarnScaling.of(cfg)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, yarn)
    cos, sin = rope(9, x.device)
    ours = attn(x, (cos.double(), sin.double()))

    # the reference's own frequencies: YaRN's blend by hand, or plain RoPE
    r = cfg.rotary_dim
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    table_scale, softmax = 1.0, 1.0
    if yarn is not None:
        f, n0 = cfg.yarn_factor, cfg.yarn_original_max_seq_len

        def dim_of(turns):
            return r * math.log(n0 / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

        low = max(math.floor(dim_of(cfg.yarn_beta_fast)), 0)
        high = min(math.ceil(dim_of(cfg.yarn_beta_slow)), r - 1)
        assert (low, high) == (0, 3)
        ramp = ((torch.arange(r // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        inv_freq = inv_freq / f * ramp + inv_freq * (1 - ramp)

        def m(v):
            return 0.1 * v * math.log(f) + 1

        table_scale = m(cfg.yarn_mscale) / m(cfg.yarn_mscale_all_dim)
        softmax = m(cfg.yarn_mscale_all_dim) ** 2
    assert attn.scale == pytest.approx((cfg.qk_nope_head_dim + r) ** -0.5 * softmax)
    reference = _reference(attn, x, inv_freq, table_scale)
    # fp32 tables (cos/sin are built in fp32 as on the GPU) bound the agreement
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)

    g = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, [x, *attn.parameters()], g)
    ref_grads = torch.autograd.grad(reference, [x, *attn.parameters()], g)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_the_rotary_part_is_all_that_moves_with_position():
    """A key that differs only in its rotary dims changes the scores; the non-rotary part of
    every head sees no position (shifting the sequence leaves a lone token's output as is)."""
    cfg = small_config(**MLA, q_lora_rank=8)
    attn = LatentAttention(cfg)
    x = torch.randn(1, 1, cfg.d_model)
    rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    cos, sin = rope(5, x.device)
    first = attn(x, (cos[:1], sin[:1]))
    later = attn(x, (cos[4:5], sin[4:5]))  # one token alone: position cancels in q.k
    torch.testing.assert_close(first, later)


@pytest.mark.parametrize(
    "override, message",
    [
        (dict(qk_rope_head_dim=6), "model.qk_rope_head_dim=6 is not allowed: unset unless"),
        (
            dict(kv_lora_rank=8, qk_nope_head_dim=4, v_head_dim=4, qk_norm="none"),
            "model.qk_rope_head_dim=None is not allowed: a positive size when",
        ),
        (
            dict(MLA, qk_rope_head_dim=5),
            "model.qk_rope_head_dim=5 is not allowed: an even number",
        ),
        (dict(MLA, qk_norm="head"), "model.qk_norm='head' is not allowed: 'none' with multi-head"),
        (dict(MLA, n_kv_heads=2), "model.n_kv_heads=2 is not allowed: model.n_heads or unset"),
        (dict(MLA, head_dim=8), "model.head_dim=8 is not allowed: unset or 16 (qk_nope"),
        (dict(MLA, attention_bias="qkv"), "model.attention_bias='qkv' is not allowed: 'none'"),
        (dict(MLA, q_lora_rank=0), "model.q_lora_rank=0 is not allowed: it must be positive"),
        (dict(rope_scaling="yarn"), "model.yarn_factor=1.0 is not allowed: greater than 1"),
        (
            dict(rope_scaling="yarn", yarn_factor=4.0, yarn_beta_fast=1.0),
            "model.yarn_beta_fast=1.0 is not allowed: greater than yarn_beta_slow",
        ),
    ],
)
def test_latent_attention_options_are_refused_in_one_sentence(override, message):
    with pytest.raises(ConfigError) as err:
        small_config(**override)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_counts_equal_a_meta_model_and_the_convention_by_hand():
    cfg = small_config(n_layers=2, **MLA, q_lora_rank=9, max_seq_len=32)
    with torch.device("meta"):
        model = Transformer(cfg)
    c = count(cfg)
    assert c.total_params == sum(p.numel() for p in model.parameters())
    d, H = cfg.d_model, cfg.n_heads
    attention = d * 9 + 9 * H * 16 + d * (12 + 6) + 12 * H * (10 + 7) + H * 7 * d
    experts = cfg.top_k * 3 * d * cfg.expert_hidden
    matmul = 2 * (attention + experts) + cfg.vocab_size * d
    assert c.flops_per_token == 6 * matmul + 3 * 2 * 32 * H * (16 + 7)


def test_the_small_mla_model_trains_a_step_and_its_loss_falls():
    cfg = compose_run(["model=small-mla", "model.n_layers=2", "model.vocab_size=64"]).model
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        logits, aux = model(tokens[:, :-1])
        loss = lm_loss(logits, tokens[:, 1:]) + aux
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
