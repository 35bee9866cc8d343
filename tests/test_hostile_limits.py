"""Issue 35, the second hostile pass: sizes that cannot be real, runs larger than the machine and
data that does not fit the run are refused in one sentence before anything large is built."""

from __future__ import annotations

import dataclasses

import pytest

from moe_core.compose import DEFAULT_CONFIG_DIR, compose_run
from moe_core.config import ModelConfig
from moe_core.model.flops import ModelCounts, count
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, Router
from moe_core.model.norm import RMSNorm
from moe_core.model.transformer import Transformer

MODELS = sorted(p.stem for p in (DEFAULT_CONFIG_DIR / "model").glob("*.yaml"))


def meta_count(cfg: ModelConfig, seq_len: int) -> ModelCounts:
    """The counts read off a meta-device model (what ``count`` did before its closed form)."""
    with on_meta():
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    embedding = model.embed.weight.numel()
    active = total - experts * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    not_matmul = embedding + sum(
        p.numel() for m in model.modules() if isinstance(m, RMSNorm | Router) for p in m.parameters()
    )
    flops = 6 * (active - not_matmul) + 6 * cfg.n_layers * seq_len * cfg.d_model
    return ModelCounts(total, active, active - not_matmul, experts, embedding, flops)


@pytest.mark.parametrize("name", MODELS)
def test_closed_form_counts_equal_the_meta_model_of_each_named_model(name):
    m = compose_run([f"model={name}"]).model
    assert count(m, 128) == meta_count(m, 128)


@pytest.mark.parametrize(
    "changes",
    [
        {"n_kv_heads": 1, "n_shared_experts": 2},
        {"n_experts": 3, "top_k": 3, "n_layers": 1, "vocab_size": 7},
        {"d_model": 96, "n_heads": 3, "n_kv_heads": 3, "expert_hidden": 40},
    ],
)
def test_closed_form_counts_equal_the_meta_model_of_odd_shapes(changes):
    base = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_experts=8, top_k=2, expert_hidden=32)
    m = dataclasses.replace(base, **changes)
    assert count(m, 32) == meta_count(m, 32)
