"""Activation recompute changes memory, not results: same loss, same gradients, stats once."""

from __future__ import annotations

import pytest
import torch
from helpers import small_config

from moe_core.model import build_model, lm_loss
from moe_core.parallel.recompute import apply_recompute


def run(mode: str):
    cfg = small_config(n_layers=2, expert_bias=True)
    model = build_model(cfg, seed=3)
    apply_recompute(model, mode)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(1))
    logits, aux = model(tokens[:, :-1])
    loss = lm_loss(logits, tokens[:, 1:]) + aux
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    counts = [m.router.stat_counts_E.clone() for m in (b.moe for b in model.layers.values())]
    return loss.detach(), grads, counts


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_recompute_matches_no_recompute(mode, monkeypatch):
    calls = {"silu": 0}
    real_silu = torch.nn.functional.silu

    def counting_silu(x, *args, **kwargs):
        calls["silu"] += 1
        return real_silu(x, *args, **kwargs)

    monkeypatch.setattr("moe_core.model.moe.F.silu", counting_silu)
    loss0, grads0, counts0 = run("none")
    plain_calls = calls["silu"]
    loss1, grads1, counts1 = run(mode)
    assert calls["silu"] - plain_calls == 2 * plain_calls, "the activation must be recomputed"
    assert torch.equal(loss0, loss1)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-6, atol=1e-7, msg=name)
    for c0, c1 in zip(counts0, counts1, strict=True):
        assert torch.equal(c0, c1), "recompute must not count routing twice"
        assert int(c1.sum()) == 2 * 16 * 2


@pytest.mark.parametrize("mode", ["block", "selective"])
def test_recompute_of_latent_attention_matches_no_recompute(mode, monkeypatch):
    """With multi-head latent attention, selective recompute runs its key-value expansion and
    core again in backward (``LatentAttention.attend``: two calls a block instead of one), for
    the same loss and gradients."""
    from moe_core.model.attention import LatentAttention

    calls = {"attend": 0}
    real_attend = LatentAttention.attend

    def counting_attend(self, *args):
        calls["attend"] += 1
        return real_attend(self, *args)

    monkeypatch.setattr(LatentAttention, "attend", counting_attend)
    mla = dict(n_kv_heads=None, qk_norm="none", kv_lora_rank=16, q_lora_rank=24)
    mla |= dict(qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12)
    results = []
    for recompute in ("none", mode):
        calls["attend"] = 0
        cfg = small_config(n_layers=2, expert_bias=True, **mla)
        model = build_model(cfg, seed=3)
        apply_recompute(model, recompute)
        tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
        logits, aux = model(tokens[:, :-1])
        loss = lm_loss(logits, tokens[:, 1:]) + aux
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
        results[-1] += (calls["attend"],)
    (loss0, grads0, calls0), (loss1, grads1, calls1) = results
    assert (calls0, calls1) == (2, 4)  # two blocks; recomputed once more each in backward
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=1e-6, atol=1e-7, msg=name)
