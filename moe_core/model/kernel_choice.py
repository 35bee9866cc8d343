"""``Kernels``: which kernel path each module of one model takes, one frozen value per model.

``parallel.parallelize.choose_kernels`` resolves it once from the run's config (the device, the
libraries installed) and ``transformer.apply_kernels`` hands it to the modules that act on it;
each holds it as a plain attribute and passes its fields into the ``moe_kernels`` functions as
arguments (``grouped_mm(..., backend=)``, ``expert_mlp(..., fused=)``). No process-wide switch:
two models in one process never see each other's choice. A frozen dataclass of strings and
bools is a constant to ``torch.compile`` (guarded like any attribute), never a tensor.

The type lives here, in the model, and ``moe_kernels`` takes plain arguments: the ops stay a flat
library that knows nothing of a run, while the choices grouped here (the attention core,
gathering token rows, FP8 experts) are the model's own and only its modules act on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moe_kernels.fp8 import fast_accum_flags
from moe_kernels.grouped_gemm import check_backend


@dataclass(frozen=True)
class Kernels:
    """One model's kernel choice (the defaults: a CPU run, or a model nobody configured)."""

    # The experts' grouped GEMMs on CUDA (``parallel.expert_gemm``): QuACK where it runs
    # ("auto"), torch's, or QuACK by name.
    gemm: Literal["auto", "torch", "quack"] = "auto"
    # The attention core (``parallel.attention`` resolved for the device): SDPA,
    # FlashAttention 4 (bf16/fp16 CUDA tensors only; elsewhere SDPA) or FlexAttention.
    attention: Literal["sdpa", "flash4", "flex"] = "sdpa"
    # The gate+up GEMM reads token rows by index where QuACK runs (``parallel.gather_rows``).
    gather_rows: bool = False
    # Routed experts in FP8 (``"experts" in precision.fp8_parts``), with these scales.
    fp8_experts: bool = False
    fp8_scaling: Literal["rowwise", "mx"] = "rowwise"
    # Which FP8 products accumulate fast on the tensor cores (``precision.fp8_fast_accum``).
    fp8_fast_accum: Literal["none", "forward", "all"] = "none"
    # The bf16 experts' MLP fused into QuACK's epilogues where QuACK runs; off only to measure
    # the unfused path (benchmarks).
    fused_mlp: bool = True

    def __post_init__(self) -> None:
        check_backend(self.gemm)
        if self.attention not in ("sdpa", "flash4", "flex"):
            raise ValueError(f"attention {self.attention!r}: 'sdpa', 'flash4' or 'flex'")
        if self.fp8_scaling not in ("rowwise", "mx"):
            raise ValueError(f"fp8_scaling {self.fp8_scaling!r}: 'rowwise' or 'mx'")
        fast_accum_flags(self.fp8_fast_accum)
