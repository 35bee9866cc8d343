"""Small model configs shared by tests."""

from __future__ import annotations

from moe_core.config import ModelConfig


def small_config(**overrides) -> ModelConfig:
    base = dict(
        name="test",
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        n_experts=8,
        top_k=2,
        expert_hidden=32,
        max_seq_len=64,
    )
    base.update(overrides)
    return ModelConfig(**base)
