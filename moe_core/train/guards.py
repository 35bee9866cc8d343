"""Training guards: skip steps whose loss or gradient is not finite, flag loss spikes, and stop
when too many steps in a row had to be skipped."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


class TrainingHaltedError(RuntimeError):
    """Raised after a final checkpoint when training cannot continue."""


@dataclass
class Verdict:
    skip: bool
    spike: bool


class Guards:
    def __init__(self, max_consecutive_skips: int, spike_sigma: float, spike_window: int) -> None:
        self.max_consecutive_skips = max_consecutive_skips
        self.spike_sigma, self.spike_window = spike_sigma, spike_window
        self.window: deque[float] = deque(maxlen=spike_window)
        self.skipped_total = 0
        self.consecutive_skips = 0

    def check(self, loss: float, grad_norm: float) -> Verdict:
        """Judge a step before the optimizer applies it (values agreed across ranks)."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.skipped_total += 1
            self.consecutive_skips += 1
            return Verdict(skip=True, spike=False)
        self.consecutive_skips = 0
        spike = False
        if len(self.window) >= min(10, self.spike_window):
            mean = sum(self.window) / len(self.window)
            std = math.sqrt(sum((x - mean) ** 2 for x in self.window) / len(self.window))
            spike = loss > mean + self.spike_sigma * std
        self.window.append(loss)
        return Verdict(skip=False, spike=spike)

    @property
    def exhausted(self) -> bool:
        return self.consecutive_skips >= self.max_consecutive_skips

    def state_dict(self) -> dict:
        return {
            "window": list(self.window),
            "skipped_total": self.skipped_total,
            "consecutive_skips": self.consecutive_skips,
        }

    def load_state_dict(self, state: dict) -> None:
        self.window = deque(state.get("window", []), maxlen=self.spike_window)
        self.skipped_total = state.get("skipped_total", 0)
        self.consecutive_skips = state.get("consecutive_skips", 0)
