"""The benchmarked model shape, from the config classes rather than restated per script."""

from __future__ import annotations

import functools

from moe_core.compose import compose_run
from moe_core.config import ModelConfig


@functools.cache
def olmoe(*overrides: str) -> ModelConfig:
    """OLMoE-1B-7B: ``conf/model/olmoe-1b-7b.yaml`` as the config loader composes it, with any
    ``model.*`` overrides (e.g. ``model.n_experts=128``) over it."""
    return compose_run(["model=olmoe-1b-7b", *overrides]).model
