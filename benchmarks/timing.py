"""CUDA-event timing shared by the benchmarks: warm-up, then one event pair per run."""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_times_ms(step: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Milliseconds of ``iters`` runs of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return times
