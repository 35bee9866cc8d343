"""The MoE decoder (plain modules; parallelism is applied from outside)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_core.model.transformer import Transformer, build_model, lm_loss

__all__ = ["Transformer", "build_model", "lm_loss"]


def __getattr__(name: str) -> Any:
    """The model's classes imported on first use: ``moe_core.model.flops`` (``moe info``)
    counts a model without importing torch."""
    if name in __all__:
        from moe_core.model import transformer

        return getattr(transformer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
