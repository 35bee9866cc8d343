"""FP8 parts of a built model, applied from outside (``precision.fp8_parts``).

``apply_fp8`` swaps the chosen ``nn.Linear`` modules for ``FP8Linear``
(``moe_kernels.fp8.fp8_linear``: forward and input gradient in FP8 with rowwise scales, weight
gradient in bf16). The routed experts take their FP8 op from the model's ``Kernels``
(``fp8_experts``), not from here. The swapped module keeps the same ``weight`` parameter, so
parameter names, checkpoints, optimizer buckets and conversion are unchanged.

``attach_fp8_caches`` gives the FP8 GEMMs' weights a ``moe_kernels.fp8_cache`` (with
``precision.fp8_weight_cache``): their FP8 copies, made once per optimizer step
(``parallel.optimizer``) and read by every micro-batch, 2 bytes and a little more per weight
(``plan.memory`` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from moe_core.config import ConfigError
from moe_core.model.attention import Attention, LatentAttention
from moe_core.model.moe import Experts, SwiGLU
from moe_core.model.transformer import Transformer
from moe_kernels.fp8 import fp8_linear
from moe_kernels.fp8_cache import attach_cache, cached_operands


class FP8Linear(nn.Linear):
    """``nn.Linear`` without bias whose matmul is ``fp8_linear`` (``tensor_cores``: on the GPU's
    FP8 tensor cores, else the dequantized product, as on CPU; ``fast_accum``: which of its
    products accumulate fast there, ``precision.fp8_fast_accum``)."""

    tensor_cores: bool = False
    fast_accum: str = "none"

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, tensor_cores: bool, fast_accum: str = "none"
    ) -> FP8Linear:
        if linear.bias is not None:
            raise ConfigError("FP8 projections are built for linears without bias.")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = linear.in_features, linear.out_features
        out.weight = linear.weight  # the same parameter object
        out.register_parameter("bias", None)
        out.tensor_cores, out.fast_accum = tensor_cores, fast_accum
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cached = cached_operands(self.weight, x.dtype)
        return fp8_linear(x, self.weight, self.tensor_cores, cached, self.fast_accum)


def _linears(model: nn.Module, part: str) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear that ``part`` names."""
    if part == "attention":
        owners = (Attention, LatentAttention)
        names = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj")
        names += ("kv_b_proj",)
    elif part == "dense":
        owners, names = SwiGLU, ("w_gate", "w_up", "w_down")
    elif part == "lm_head":
        owners, names = Transformer, ("lm_head",)
    else:
        return []
    return [
        (m, n)
        for m in model.modules()
        if isinstance(m, owners)
        for n in names
        if isinstance(getattr(m, n, None), nn.Linear)
    ]


def apply_fp8(
    model: nn.Module, parts: Sequence[str], device: torch.device, fast_accum: str = "none"
) -> None:
    """Run the projections that ``parts`` names of ``model`` in FP8 (``precision.fp8_parts``), in
    place (FP8 experts are the model's ``Kernels``, ``fp8_experts``: not switched here), before the
    model is compiled or its gradients are bucketed. On a GPU (Hopper or newer:
    ``parallelize.choose_kernels`` has refused others) the projections take FP8 tensor cores, whose
    GEMMs need both dimensions of each weight divisible by 16: ``RunConfig`` refuses
    other shapes at load, on any device (``config.fp8_linear_shapes`` lists what this swaps).
    ``fast_accum``: ``precision.fp8_fast_accum``."""
    tensor_cores = device.type == "cuda"
    for part in parts:
        for parent, name in _linears(model, part):
            linear = getattr(parent, name)
            setattr(parent, name, FP8Linear.from_linear(linear, tensor_cores, fast_accum))


def attach_fp8_caches(
    model: nn.Module, parts: Sequence[str], scaling: str, compiled: bool
) -> list[nn.Parameter]:
    """Give the weights of ``model``'s rowwise FP8 GEMMs an FP8 cache (module doc) and return
    them: the routed experts' two stacks where ``parts`` names "experts", and every
    ``FP8Linear``'s weight unless the blocks are ``compiled`` (a compiled graph quantizes its
    weights itself: the cache would cost memory and a pass per step for nothing). None with
    MX scaling (its GEMMs are emulated)."""
    if scaling != "rowwise":
        return []
    params: list[nn.Parameter] = []
    for m in model.modules():
        if isinstance(m, Experts) and "experts" in parts:
            params += [m.w_gate_up, m.w_down]
        elif isinstance(m, FP8Linear) and not compiled:
            params.append(m.weight)
    for p in params:
        attach_cache(p)
    return params
