"""The MoE decoder (plain modules; parallelism is applied from outside)."""

from moe_core.model.transformer import Transformer, build_model, lm_loss

__all__ = ["Transformer", "build_model", "lm_loss"]
