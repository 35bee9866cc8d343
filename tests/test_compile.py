"""``parallel.compile``: compiled blocks and loss compute what the eager model computes."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from moe_core.config import ModelConfig
from moe_core.model import build_model
from moe_core.model.eager import seal
from moe_core.model.moe import router_stats_paused
from moe_core.parallel.compile import apply_compile, loss_function


def _loss_and_grads(compiled: bool) -> tuple[float, list[torch.Tensor], list[torch.Tensor]]:
    cfg = ModelConfig(
        vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_experts=4, top_k=2, expert_hidden=16
    )
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    model = build_model(cfg, seed=0)
    if compiled:
        apply_compile(model)
    logits, aux = model(tokens[:, :-1])
    loss = loss_function(compiled)(logits, tokens[:, 1:]) + aux
    loss.backward()
    counts = [b.moe.router.stat_counts_E.clone() for b in model.layers.values()]
    with router_stats_paused():  # the flag is read inside the compiled graph: it must hold
        model(tokens[:, :-1])
    paused = [b.moe.router.stat_counts_E for b in model.layers.values()]
    assert all(torch.equal(a, b) for a, b in zip(counts, paused, strict=True))
    return loss.item(), [p.grad for p in model.parameters()], counts


def test_block_graph_breaks_only_at_token_dispatch():
    cfg = ModelConfig(
        vocab_size=128, d_model=32, n_layers=1, n_heads=4, n_experts=4, top_k=2, expert_hidden=16
    )
    model = build_model(cfg, seed=0)
    h = torch.randn(2, 16, 32)
    seal()  # what apply_compile does first (the model's compile boundaries, model.eager)
    explained = torch._dynamo.explain(model.layers["0"])(
        h, torch.zeros(()), model.rope(16, h.device)
    )
    assert explained.break_reasons, "the token dispatcher must stay eager (a graph break)"
    for reason in explained.break_reasons:
        assert "_dispatch" in reason.reason, reason.reason


@pytest.mark.slow
def test_compiled_model_matches_eager():
    torch._dynamo.reset()
    loss, grads, counts = _loss_and_grads(compiled=False)
    loss_c, grads_c, counts_c = _loss_and_grads(compiled=True)
    assert abs(loss - loss_c) < 1e-5
    for g, g_c in zip(grads, grads_c, strict=True):
        torch.testing.assert_close(g_c, g, rtol=1e-4, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(counts, counts_c, strict=True))
