"""Checkpoint formats: our model folder, training checkpoints and the Hugging Face families
(``families``), and ``load_model``, which loads any of them for inference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_core.convert.load import load_model

__all__ = ["load_model"]


def __getattr__(name: str) -> Any:
    """``load_model`` imported on first use: importing any ``convert`` module stays light."""
    if name == "load_model":
        from moe_core.convert.load import load_model

        return load_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
