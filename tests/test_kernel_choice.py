"""The kernel choice is one frozen value per model (``moe_core.model.kernel_choice.Kernels``):
resolved once from a run's config, handed to the modules that act on it, and never shared
through the process."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import small_config

from moe_core.compose import compose_run
from moe_core.model import build_model
from moe_core.model.attention import Attention
from moe_core.model.kernel_choice import Kernels
from moe_core.model.moe import Experts
from moe_core.model.transformer import apply_kernels
from moe_core.parallel.parallelize import choose_kernels


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens)[0]


def test_two_models_in_one_process_keep_their_own_choice():
    """FP8 experts for one model leave the other (built from the same weights) exactly as a
    model nobody configured; each module holds its own model's value."""
    cfg = small_config()
    fp8, plain, fresh = (build_model(cfg, seed=5) for _ in range(3))
    apply_kernels(fp8, Kernels(fp8_experts=True))
    apply_kernels(plain, Kernels(gemm="torch", fused_mlp=False))
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    y_fp8, y_plain, y_fresh = (logits(m, tokens) for m in (fp8, plain, fresh))
    assert torch.equal(y_plain, y_fresh)
    assert not torch.equal(y_fp8, y_fresh)
    for model, want in ((fp8, Kernels(fp8_experts=True)), (fresh, Kernels())):
        held = [m.kernels for m in model.modules() if isinstance(m, (Attention, Experts))]
        assert held and all(k == want for k in held)


def test_a_kernel_choice_is_frozen_and_checked():
    k = Kernels()
    with pytest.raises(dataclasses.FrozenInstanceError):
        k.gemm = "torch"  # type: ignore[misc]
    with pytest.raises(ValueError, match="grouped GEMM backend 'cutlass'"):
        Kernels(gemm="cutlass")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention 'xformers'"):
        Kernels(attention="xformers")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fp8_scaling 'blockwise'"):
        Kernels(fp8_scaling="blockwise")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="fast_accum='fp32'"):
        Kernels(fp8_fast_accum="fp32")  # type: ignore[arg-type]


def test_choose_kernels_resolves_the_run_config_once_for_the_device():
    cpu = torch.device("cpu")
    run = compose_run(["model=tiny", "precision=pure-bf16", "parallel.expert_gemm=torch"])
    assert choose_kernels(run.parallel, run.precision, cpu) == Kernels(gemm="torch")
    run = compose_run(["model=tiny", "precision=fp8"])
    assert choose_kernels(run.parallel, run.precision, cpu) == Kernels(fp8_experts=True)
    run = compose_run(["model=tiny", "precision=mxfp8"])
    assert choose_kernels(run.parallel, run.precision, cpu) == Kernels(
        fp8_experts=True, fp8_scaling="mx"
    )
    run = compose_run(["model=tiny", "precision=fp8", "precision.fp8_fast_accum=forward"])
    assert choose_kernels(run.parallel, run.precision, cpu) == Kernels(
        fp8_experts=True, fp8_fast_accum="forward"
    )
