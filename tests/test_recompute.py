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
