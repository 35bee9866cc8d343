"""The next step's input, produced on a background thread while the current step runs.

``prepare(step)`` starts producing step ``step``'s item on one worker thread; ``take(step)``
returns it (producing it on the spot if nobody asked ahead). One worker, one item ahead, steps in
order: a stateful source (a token loader) is read by exactly one thread, in the order it would
be read without prefetching, so what a step receives never depends on the timing. CPU tensors
come back in pinned memory where a GPU is the destination, so ``to(device, non_blocking=True)``
overlaps the copy with the GPU's work.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


def pinned(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` in page-locked memory when it is headed for a GPU (else as it is)."""
    return t.pin_memory() if device.type == "cuda" else t


class Prefetcher(Generic[T]):
    """Items ``produce(step)`` for consecutive steps, each made one step ahead on a thread."""

    def __init__(self, produce: Callable[[int], T]) -> None:
        self.produce = produce
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefetch")
        self._pending: tuple[int, Future[T]] | None = None

    def prepare(self, step: int) -> None:
        """Start producing ``step``'s item in the background (the step after the last one)."""
        if self._pending is None:
            self._pending = (step, self._pool.submit(self.produce, step))

    def take(self, step: int) -> T:
        """``step``'s item, prepared or made now; an error in ``produce`` is raised here."""
        self.prepare(step)
        assert self._pending is not None
        prepared, future = self._pending
        self._pending = None
        if prepared != step:
            raise RuntimeError(f"step {step} asked for, but step {prepared} was prepared")
        return future.result()

    def close(self) -> None:
        """Drop what is pending (waiting for a running ``produce`` to return) and stop."""
        self._pending = None
        self._pool.shutdown(wait=True, cancel_futures=True)
