"""A training step's device work replayed as CUDA graphs (``parallel.cuda_graph``).

Two graphs, replayed in the order they were captured: ``compute`` (every micro-batch's forward
and backward, the gradient reduction, the gradient norm) and ``update`` (the optimizer). The
step's single host read starts between them and is waited for after ``update`` is queued; the
guards' verdict reaches ``update`` as a device flag (a skipped step's update changes nothing).
Replaying removes the CPU's launch work, which dominates when expert
parallelism runs many small kernels per layer; the graphs hold no host read, so capture needs a
step that has none (the rowwise dispatcher, or no expert parallelism).

How: the first ``warmup`` calls of ``compute`` run eagerly (blocks compile, optimizer state is
allocated, autograd makes its per-parameter nodes) on this object's own stream, the stream the
graphs are captured and replayed on (autograd runs a parameter's gradient node on the stream it
was made on). Then ``compute`` is captured with the step's token batches copied into static
inputs, and ``update`` after it, sharing its memory pool and reading the gradients and norm
that ``compute`` leaves in place (so once ``compute`` is a graph, the update never runs
eagerly). What the graphs capture is fixed: the learning rate, step count and router
statistics are device tensors updated in place, and batches keep their shapes. Capture uses
the thread-local error mode: the data prefetch thread keeps running.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


class StepGraphs:
    def __init__(self, device: torch.device, warmup: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.stream = torch.cuda.Stream(device)
        self.warmup = warmup
        self.compute_calls = self.update_calls = 0
        self.compute_graph: torch.cuda.CUDAGraph | None = None
        self.update_graph: torch.cuda.CUDAGraph | None = None
        self._inputs: list[torch.Tensor] = []
        self._outputs: tuple[torch.Tensor, ...] = ()

    @property
    def captured(self) -> bool:
        return self.compute_graph is not None and self.update_graph is not None

    def compute(
        self,
        fn: Callable[[list[torch.Tensor]], tuple[torch.Tensor, ...]],
        batches: list[torch.Tensor],
    ) -> tuple[torch.Tensor, ...]:
        """``fn(batches)``: eagerly while warming up, then as the captured graph on static
        copies of the batches (outputs are the graph's: valid until the next call)."""
        self.compute_calls += 1
        with self._on_stream():
            if self.compute_calls <= self.warmup:
                return fn(batches)
            if self.compute_graph is None:
                self._inputs = [b.clone() for b in batches]
                self.compute_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    self.compute_graph, stream=self.stream, capture_error_mode="thread_local"
                ):
                    self._outputs = fn(self._inputs)
            else:
                for static, b in zip(self._inputs, batches, strict=True):
                    static.copy_(b, non_blocking=True)
            self.compute_graph.replay()
            return self._outputs

    def update(self, fn: Callable[[], None], prepare: Callable[[], None]) -> None:
        """``fn()`` (the optimizer step): eagerly until ``compute`` is a graph, then captured
        once (``prepare()`` first, eagerly: state the step would allocate) and replayed. Never
        eagerly after ``compute`` is captured: the update reads the gradients that graph left,
        which an eager update would release."""
        self.update_calls += 1
        with self._on_stream():
            if self.compute_graph is None:
                fn()
                return
            if self.update_graph is None:
                prepare()
                self.update_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(
                    self.update_graph,
                    pool=self.compute_graph.pool(),
                    stream=self.stream,
                    capture_error_mode="thread_local",
                ):
                    fn()
            self.update_graph.replay()

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        """Run on the graphs' stream, ordered after and before the caller's stream's work."""
        caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)
