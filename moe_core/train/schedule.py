"""Learning-rate schedules as a multiplier of the peak rate, and the multi-token-prediction
loss weight, by optimizer step."""

from __future__ import annotations

import math

from moe_core.config import ModelConfig, TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to 1, then ``cosine`` down to ``min_lr_ratio`` at the last step,
    ``wsd`` (hold, then linear decay over the final ``decay_fraction``) or ``constant``."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    floor = cfg.min_lr_ratio
    last = max(cfg.steps - 1, 1)
    if cfg.schedule == "cosine":
        span = max(last - cfg.warmup_steps, 1)
        progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    decay_start = max(cfg.warmup_steps, round(cfg.steps * (1.0 - cfg.decay_fraction)))
    if step < decay_start:
        return 1.0
    progress = min((step - decay_start) / max(last - decay_start, 1), 1.0)
    return 1.0 - (1.0 - floor) * progress


def mtp_weight(step: int, model: ModelConfig, train: TrainConfig) -> float:
    """The MTP loss weight at ``step``: ``model.mtp_loss_weight`` until the fraction
    ``model.mtp_late_start`` of ``train.steps``, ``model.mtp_loss_weight_late`` from there on
    (DeepSeek-V3's constant-then-lower schedule); 0 without MTP."""
    if not model.mtp_depth:
        return 0.0
    if step < model.mtp_late_start * train.steps:
        return model.mtp_loss_weight
    return model.mtp_loss_weight_late
