"""precision.fp8_parts beyond the experts: the attention projections, the dense (shared-expert)
MLP and the LM head swapped for ``FP8Linear`` from outside, with every parameter kept."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moe_core.compose import DEFAULT_CONFIG_DIR, compose_run
from moe_core.config import FP8_PARTS, ConfigError, fp8_linear_shapes
from moe_core.model import Transformer, build_model
from moe_core.model.attention import Attention
from moe_core.model.fp8 import FP8Linear, apply_fp8
from moe_core.model.kernel_choice import Kernels
from moe_core.model.moe import Experts, SwiGLU
from moe_core.model.transformer import apply_kernels


def tiny_model(shared: int = 1) -> Transformer:
    cfg = compose_run(["model=tiny", f"model.n_shared_experts={shared}"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    model.init_weights(seed=3)
    return model.to(torch.bfloat16)


def to_fp8(model: Transformer, parts: list[str]) -> None:
    """``precision.fp8_parts=parts`` as ``parallelize`` applies it: FP8 experts through the
    model's ``Kernels``, the other parts' linears swapped by ``apply_fp8``."""
    apply_kernels(model, Kernels(fp8_experts="experts" in parts))
    apply_fp8(model, parts, torch.device("cpu"))


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
    to_fp8(model, parts)
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
    assert all(m.kernels.fp8_experts == ("experts" in parts) for m in experts)
    # the same parameter objects under the same names: optimizer, buckets, checkpoints unchanged
    after = dict(model.named_parameters())
    assert list(after) == list(params) and all(after[n] is params[n] for n in params)
    assert list(model.state_dict()) == keys
    got = loss(model, tokens)
    got.backward()
    assert got.item() != before.item() and abs(got.item() - before.item()) < 0.01 * before.item()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_fp8_parts_keep_the_model_causal():
    """Every part quantized (scales per token row, never over the sequence): changing the
    tokens from position 20 on leaves every logit before it as it was."""
    model = tiny_model()
    to_fp8(model, ["experts", "attention", "dense", "lm_head"])
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 32), generator=gen)
    changed = tokens.clone()
    changed[:, 20:] = torch.randint(0, model.cfg.vocab_size, (2, 12), generator=gen)
    with torch.no_grad():
        before, after = model(tokens)[0], model(changed)[0]
    assert torch.equal(before[:, :20], after[:, :20])
    assert not torch.equal(before[:, 20:], after[:, 20:])


def test_dense_without_shared_experts_is_refused_at_load():
    with pytest.raises(ConfigError) as err:
        compose_run([*FP8, "precision.fp8_parts=[experts,dense]"])
    assert str(err.value) == (
        "precision.fp8_parts=['experts', 'dense'] is not allowed: a list without 'dense' when "
        "model.n_shared_experts=0 and model.n_dense_layers=0 ('dense' is the shared expert's and "
        "the dense blocks' SwiGLU, which this model does not have)."
    )
    run = compose_run([*FP8, "model.n_shared_experts=1", "precision.fp8_parts=[dense]"])
    assert run.precision.fp8_parts == ["dense"]


def test_experts_only_swaps_no_linear():
    model = tiny_model(shared=0)
    to_fp8(model, ["experts"])
    assert not any(isinstance(m, FP8Linear) for m in model.modules())
    assert all(m.kernels.fp8_experts for m in model.modules() if isinstance(m, Experts))
    assert any(isinstance(m, Attention) for m in model.modules())
    assert not any(isinstance(m, SwiGLU) for m in model.modules())


PRESETS = sorted(path.stem for path in (DEFAULT_CONFIG_DIR / "model").glob("*.yaml"))
# beside the presets: shared experts at tiny's size, and one whose every size the FP8 GEMMs
# refuse (odd vocabulary, grouped-query heads of 30, a shared expert of 2 x 100)
OTHERS = {
    "tiny-shared": ["model=tiny", "model.n_shared_experts=2"],
    "odd-sizes": [
        *["model=tiny", "model.vocab_size=1001", "model.d_model=120", "model.n_heads=4"],
        *["model.n_kv_heads=2", "model.expert_hidden=100", "model.n_shared_experts=2"],
    ],
}
MODELS = {name: [f"model={name}"] for name in PRESETS} | OTHERS


def swapped_shapes(model: nn.Module, part: str) -> set[tuple[str, str, int, int]]:
    """(part, projection, out, in) of every linear ``apply_fp8`` swaps for ``part``."""
    apply_fp8(model, [part], torch.device("cpu"))
    return {
        (part, name.rsplit(".", 1)[-1], *m.weight.shape)
        for name, m in model.named_modules()
        if isinstance(m, FP8Linear)
    }


@pytest.mark.parametrize("model_name", list(MODELS))
def test_the_config_lists_exactly_the_shapes_apply_fp8_swaps(model_name):
    # the config refuses FP8 shapes from fp8_linear_shapes before any model exists; a model
    # change it misses (a new projection, another hidden size) fails here
    assert {"tiny", "small-64e", "olmoe-1b-7b"} <= set(PRESETS)
    cfg = compose_run(MODELS[model_name]).model
    for part in FP8_PARTS:
        listed = fp8_linear_shapes(cfg, [part])
        assert len(listed) == len(set(listed))  # each projection once: every layer is alike
        if part == "attention" and cfg.attention_bias != "none":
            continue  # refused by the config (GLM's biases): no FP8 projection has a bias
        model = build_model(cfg, "meta")  # sizes only: no memory, any preset
        assert set(listed) == swapped_shapes(model, part), part
    every = fp8_linear_shapes(cfg, FP8_PARTS)
    assert every == [s for part in FP8_PARTS for s in fp8_linear_shapes(cfg, [part])]
    dense_swiglus = cfg.n_shared_experts > 0 or cfg.n_dense_layers > 0
    assert any(part == "dense" for part, *_ in every) == dense_swiglus


FP8 = ["model=tiny", "precision=fp8"]


@pytest.mark.parametrize(
    "sizes, part, message",
    [
        (
            ["model.vocab_size=4090"],
            "lm_head",
            "precision.fp8_parts=['experts', 'lm_head'] is not allowed: part 'lm_head' runs "
            "lm_head, a [4090, 128] weight, as an FP8 GEMM, which needs both dimensions "
            "divisible by 16; leave 'lm_head' out (or choose model sizes that divide by 16).",
        ),
        (
            ["model.d_model=120"],
            "attention",
            "precision.fp8_parts=['experts', 'attention'] is not allowed: part 'attention' runs "
            "q_proj, a [120, 120] weight, as an FP8 GEMM, which needs both dimensions "
            "divisible by 16; leave 'attention' out (or choose model sizes that divide by 16).",
        ),
        (
            ["model.n_shared_experts=1", "model.expert_hidden=200"],
            "dense",
            "precision.fp8_parts=['experts', 'dense'] is not allowed: part 'dense' runs "
            "w_gate, a [200, 128] weight, as an FP8 GEMM, which needs both dimensions "
            "divisible by 16; leave 'dense' out (or choose model sizes that divide by 16).",
        ),
    ],
    ids=["lm_head", "attention", "dense"],
)
def test_an_fp8_part_the_fp8_gemm_cannot_take_is_refused_at_load(sizes, part, message):
    # refused on this CPU config as on a GPU one: when the config loads, before any model
    with pytest.raises(ConfigError) as err:
        compose_run([*FP8, *sizes, f"precision.fp8_parts=[experts,{part}]"])
    assert str(err.value) == message
    # the same sizes without the part load
    run = compose_run([*FP8, *sizes])
    assert run.precision.fp8_parts == ["experts"]


@pytest.mark.parametrize("fast_accum", ["forward", "all"])
def test_fast_accumulation_reaches_every_fp8_gemm_of_a_model(fast_accum, monkeypatch):
    # precision.fp8_fast_accum as parallelize applies it (the experts' Kernels, apply_fp8's
    # linears), with torch's FP8 GEMMs stood in for on the CPU: every FP8 product of the
    # forward takes fast accumulation, and the backward's input gradients only under "all"
    from kernel_cases import recording_fp8_gemms

    model = tiny_model()
    apply_kernels(model, Kernels(fp8_experts=True, fp8_fast_accum=fast_accum))
    apply_fp8(model, ["attention", "lm_head"], torch.device("cpu"), fast_accum)
    linears = [m for m in model.modules() if isinstance(m, FP8Linear)]
    assert linears and all(m.fast_accum == fast_accum for m in linears)
    for m in linears:
        m.tensor_cores = True  # the GPU's path, through the stand-in
    calls = recording_fp8_gemms(monkeypatch)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 16), generator=torch.Generator())
    value = loss(model, tokens)
    forward_calls = len(calls)
    value.backward()
    # per layer 4 attention projections and 2 expert products, and the LM head
    assert forward_calls == 6 * len(model.layers) + 1
    assert calls[:forward_calls] == [True] * forward_calls
    assert calls[forward_calls:] == [fast_accum == "all"] * forward_calls


def test_fast_accumulation_needs_rowwise_fp8_parts():
    with pytest.raises(ConfigError, match=r"precision\.fp8_fast_accum='forward'"):
        compose_run(["model=tiny", "precision=pure-bf16", "precision.fp8_fast_accum=forward"])
    with pytest.raises(ConfigError, match=r"precision\.fp8_fast_accum='all'"):
        compose_run(["model=tiny", "precision=mxfp8", "precision.fp8_fast_accum=all"])
    run = compose_run(["model=tiny", "precision=fp8", "precision.fp8_fast_accum=all"])
    assert run.precision.fp8_fast_accum == "all"
