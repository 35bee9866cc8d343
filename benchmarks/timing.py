"""CUDA-event timing shared by the benchmarks: warm-up, then one event pair per run.

The runs are queued back to back and the host waits once at the end (as the peer kit's
Olmo-core benchmark does), so each pair times the GPU in steady state: a run's kernels start
while the host is already launching the next, as in training. Waiting after every run would
add the host's launch latency at each run's start to the GPU time, which distorts short runs
(a single MoE layer) and not long ones (a training step). Every benchmark times the GPU through
this module: one run (``cuda_times_ms``) or the phases of one (``cuda_phase_times_ms``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def cuda_phase_times_ms(
    phases: list[tuple[str, Callable[[], object]]],
    warmup: int,
    iters: int,
    before: Callable[[], object] | None = None,
) -> dict[str, list[float]]:
    """Milliseconds of each phase in each of ``iters`` runs (the phases in order, one event pair
    each), after ``warmup`` untimed runs. ``before`` runs ahead of each timed run, outside the
    events (e.g. an L2 flush)."""
    for _ in range(warmup):
        for _, fn in phases:
            fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        if before is not None:
            before()
        for name, fn in phases:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((name, start, end))
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {name: [] for name, _ in phases}
    for name, start, end in events:
        times[name].append(start.elapsed_time(end))
    return times


def cuda_times_ms(
    step: Callable[[], object],
    warmup: int,
    iters: int,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Milliseconds of each of ``iters`` runs of ``step`` after ``warmup`` untimed ones."""
    return cuda_phase_times_ms([("step", step)], warmup, iters, before)["step"]
