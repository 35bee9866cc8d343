"""moe_core: the training library of the moe_core pretraining pipeline."""

__version__ = "0.1.0"
