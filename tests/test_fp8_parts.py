"""precision.fp8_parts beyond the experts: the attention projections, the dense (shared-expert)
MLP and the LM head swapped for ``FP8Linear`` from outside, with every parameter kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_core.compose import compose_run
from moe_core.config import ConfigError
from moe_core.model import Transformer
from moe_core.model.attention import Attention
from moe_core.model.fp8 import FP8Linear, apply_fp8
from moe_core.model.moe import Experts, SwiGLU


def tiny_model(shared: int = 1) -> Transformer:
    cfg = compose_run(["model=tiny", f"model.n_shared_experts={shared}"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    return model.to(torch.bfloat16)


def loss(model: Transformer, tokens: torch.Tensor) -> torch.Tensor:
    logits, aux = model(tokens)
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten()) + aux


@pytest.mark.parametrize(
    "parts",
    [["attention"], ["dense"], ["lm_head"], ["experts", "attention", "dense", "lm_head"]],
    ids=lambda p: "+".join(p),
)
def test_fp8_parts_swap_exactly_the_named_linears_and_keep_every_parameter(parts):
    model = tiny_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator())
    before = loss(model, tokens)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    apply_fp8(model, parts, "rowwise", torch.device("cpu"))
    expected = {
        "attention": {
            f"layers.{i}.attn.{n}"
            for i in model.layers
            for n in ("q_proj", "k_proj", "v_proj", "o_proj")
        },
        "dense": {
            f"layers.{i}.moe.shared.{n}" for i in model.layers for n in ("w_gate", "w_up", "w_down")
        },
        "lm_head": {"lm_head"},
        "experts": set(),
    }
    swapped = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert swapped == set().union(*(expected[p] for p in parts))
    assert all(not m.tensor_cores for m in model.modules() if isinstance(m, FP8Linear))
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert all(m.fp8 == ("experts" in parts) for m in experts)
    # the same parameter objects under the same names: optimizer, buckets, checkpoints unchanged
    after = dict(model.named_parameters())
    assert list(after) == list(params) and all(after[n] is params[n] for n in params)
    assert list(model.state_dict()) == keys
    got = loss(model, tokens)
    got.backward()
    assert got.item() != before.item() and abs(got.item() - before.item()) < 0.01 * before.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_experts_only_swaps_no_linear():
    model = tiny_model(shared=0)
    apply_fp8(model, ["experts"], "rowwise", torch.device("cpu"))
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert all(m.fp8 for m in model.modules() if isinstance(m, Experts))
    assert any(isinstance(m, Attention) for m in model.modules())
    assert not any(isinstance(m, SwiGLU) for m in model.modules())


def test_a_projection_the_fp8_gemm_cannot_take_is_refused_before_the_gpu_runs():
    # on a GPU both dimensions of an FP8 GEMM must divide by 16: a d_model of 120 does not;
    # refused while the model is built, before any GPU work
    cfg = compose_run(["model=tiny", "model.d_model=120"]).model
    model = Transformer(cfg)
    with pytest.raises(ConfigError) as err:
        apply_fp8(model, ["attention"], "rowwise", torch.device("cuda"))
    assert str(err.value) == (
        "precision.fp8_parts names 'attention', whose q_proj is [120, 120]: FP8 GEMMs need both "
        "dimensions divisible by 16; leave the part out."
    )
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
