"""CUDA-event timing shared by the benchmarks: warm-up, then one event pair per run.

The runs are queued back to back and the host waits once at the end (as the peer kit's
Olmo-core benchmark does), so each pair times the GPU in steady state: a run's kernels start
while the host is already launching the next, as in training. Waiting after every run would
add the host's launch latency at each run's start to the GPU time, which distorts short runs
(a single MoE layer) and not long ones (a training step).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_times_ms(step: Callable[[], None], warmup: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` runs of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]
