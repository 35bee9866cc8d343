"""The families' block options on the GPU (issue 37): a model with each family's options, in
fp32, compiled (the trainer's blocks) computes what it computes eagerly, forward and gradients
(the dense leading block and the MoE blocks are two compiled graphs)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import small_config

from moe_core.model import build_model
from moe_core.parallel.compile import apply_compile

pytestmark = pytest.mark.gpu

FAMILIES = {
    "qwen3": dict(n_heads=4, head_dim=128, n_kv_heads=2, qk_norm="head", normalize_top_k=True),
    "mixtral": dict(qk_norm="none", normalize_top_k=True, n_experts=8, top_k=2),
    "glm": dict(
        head_dim=64, qk_norm="none", rotary_fraction=0.5, attention_bias="qkv", router="sigmoid",
        normalize_top_k=True, expert_bias=True, n_shared_experts=1, n_dense_layers=1,
        dense_hidden=384, n_expert_groups=4, top_k_groups=2, routed_scale=2.5,
    ),
    "tied": dict(tie_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_compiled_family_block_equals_its_eager_self(family):
    sizes = dict(vocab_size=1024, d_model=256, n_layers=3, n_experts=16, top_k=4)
    cfg = small_config(**{**sizes, **FAMILIES[family]}, expert_hidden=128, max_seq_len=512)
    eager = build_model(cfg, "cuda", seed=0)
    with torch.no_grad():  # decisive routing: rounding must not flip an expert choice
        for name, p in eager.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0.0, 1.0)
    compiled = copy.deepcopy(eager)
    apply_compile(compiled)
    tokens = torch.randint(0, 1024, (2, 256), device="cuda")
    results = []
    for model in (eager, compiled):
        logits, aux = model(tokens)
        loss = logits.float().logsumexp(-1).mean() + aux
        grads = torch.autograd.grad(loss, list(model.parameters()))
        results.append((logits, *grads))
    # fp32: Inductor's fused norms and RoPE sum in another order, so each tensor is held to a
    # relative error of its norm (a wrong option is off by far more)
    names = ["logits", *(n for n, _ in eager.named_parameters())]
    for name, got, ref in zip(names, results[1], results[0], strict=True):
        error = (got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)
        assert error < 2e-3, (name, float(error))
