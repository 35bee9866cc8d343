"""FP8 copies of a weight kept from one optimizer step to the next (``moe_kernels.fp8``).

Every FP8 GEMM quantizes its weight the same way each time: by rows over K for the forward,
``quantize_columnwise`` for the input gradient. Between two optimizer steps the weight does not
change, so every micro-batch of a step would quantize the same bytes again. ``FP8Weight`` holds
those two operands (values and fp32 scales, the exact bytes the per-call quantizers give);
``FP8WeightCache`` keeps one weight's, tagged with the weight's version, and hands them out only
while the weight is still that version.

The tag is (address, ``tensor._version``, dtype, shape) of the parameter. Torch bumps
``_version`` on every in-place op through the parameter (``load_state_dict``, ``copy_`` under
``no_grad``, ``init``'s fills), which makes a cache stale; writes it cannot see (a Triton kernel,
a collective into the flat buffer the parameter views, ``p.data`` ops) must be followed by
``weights_written`` (the optimizer does, ``moe_core.parallel.optimizer``). Buffers are allocated
once and refilled in place, so a captured CUDA graph keeps reading the right addresses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_kernels.fp8_format import E4M3
from moe_kernels.fp8_quantize import quantize_columnwise, quantize_rowwise


@dataclass(frozen=True, eq=False)
class FP8Weight:
    """The FP8 operands of one weight ``w`` [G, N, K] (a dense [N, K] as G = 1): ``rows`` =
    ``quantize_rowwise`` over K (values [G, N, K], scales [G, N]), the forward's; ``cols`` =
    ``quantize_columnwise`` (values [G, K, N], scales [G, K]), the input gradient's."""

    rows: tuple[torch.Tensor, torch.Tensor]
    cols: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def empty(cls, G: int, N: int, K: int, device: torch.device) -> FP8Weight:
        f32 = torch.float32
        return cls(
            rows=(
                torch.empty(G, N, K, dtype=E4M3, device=device),
                torch.empty(G, N, dtype=f32, device=device),
            ),
            cols=(
                torch.empty(G, K, N, dtype=E4M3, device=device),
                torch.empty(G, K, dtype=f32, device=device),
            ),
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """The weight's [G, N, K]."""
        G, N, K = self.rows[0].shape
        return G, N, K

    def rows_2d(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` as ``quantize_rowwise`` of ``w.reshape(G * N, K)`` gives them."""
        G, N, K = self.shape
        return self.rows[0].view(G * N, K), self.rows[1].view(G * N)

    def check(self, w: torch.Tensor, name: str) -> None:
        """Refuse operands of another shape than ``w`` ([G, N, K], or [N, K] as G = 1)."""
        shape = tuple(w.shape) if w.ndim == 3 else (1, *w.shape)
        if self.shape != shape:
            raise ValueError(
                f"the cached FP8 operands of {name} are for a weight of shape {self.shape}, "
                f"not {tuple(w.shape)}"
            )


def as_3d(w: torch.Tensor) -> torch.Tensor:
    """``w`` as [G, N, K]: an expert stack as it is, a dense [N, K] as one group."""
    if w.ndim not in (2, 3):
        raise ValueError(f"an FP8 weight is [N, K] or [G, N, K], got {tuple(w.shape)}")
    return w if w.ndim == 3 else w[None]


def quantize_columns_into(w: torch.Tensor, into: FP8Weight) -> None:
    """``into.cols`` := ``quantize_columnwise(w)`` (after ``rows`` came from the optimizer's
    fused pass: the columnwise scales reduce over N, which its row blocks never see whole)."""
    quantize_columnwise(as_3d(w.detach()), out=into.cols)


def quantize_weight(w: torch.Tensor, into: FP8Weight | None = None) -> FP8Weight:
    """Both operands of ``w`` ([N, K] or [G, N, K]), written into ``into`` when given: the bytes
    of the per-call quantizers, one pass each."""
    w3 = as_3d(w.detach())
    G, N, K = w3.shape
    if into is None:
        into = FP8Weight.empty(G, N, K, w.device)
    into.check(w, "this weight")
    quantize_rowwise(w3.reshape(G * N, K), out=into.rows_2d())
    quantize_columns_into(w3, into)
    return into


def weights_written(params: list[torch.Tensor]) -> None:
    """Mark ``params`` changed where torch could not see it (module doc): their caches go stale."""
    if params:
        torch.autograd.graph.increment_version(params)


def _tag(w: torch.Tensor) -> tuple:
    return (w.data_ptr(), w._version, w.dtype, tuple(w.shape))


class FP8WeightCache:
    """One weight's ``FP8Weight``, valid for the version of the weight it was filled from.
    ``fills`` counts the quantizations of the weight it made or was told of (tests, benchmarks)."""

    def __init__(self) -> None:
        self.operands: FP8Weight | None = None
        self.fills = 0
        self._tag: tuple | None = None

    def current(self, w: torch.Tensor) -> FP8Weight | None:
        """The operands if they are ``w``'s as it is now, else None."""
        if self.operands is None or self._tag != _tag(w):
            return None
        return self.operands

    def get(self, w: torch.Tensor) -> FP8Weight:
        """``w``'s operands, quantized now (in place, one pass) if the cache is stale."""
        return self.current(w) or self.refill(w)

    def refill(self, w: torch.Tensor) -> FP8Weight:
        """Quantize ``w`` into the cache (its buffers allocated the first time) and tag it."""
        with torch.no_grad():
            self.operands = quantize_weight(w, self._buffers(w))
        self.filled(w)
        return self.operands

    def buffers(self, w: torch.Tensor) -> FP8Weight:
        """The cache's buffers for a pass that writes them itself (the optimizer's fused update),
        filled from ``w`` first where they were not ``w``'s (a pass that changes nothing, a
        skipped step, then leaves them right)."""
        if self.current(w) is None:
            self.refill(w)
        assert self.operands is not None
        return self.operands

    def filled(self, w: torch.Tensor) -> None:
        """The operands now hold ``w``'s bytes as it is: tag them with its version."""
        self.fills += 1
        self._tag = _tag(w)

    def _buffers(self, w: torch.Tensor) -> FP8Weight | None:
        """The existing buffers where they fit ``w`` (None: allocate)."""
        w3 = as_3d(w)
        if self.operands is None or self.operands.shape != tuple(w3.shape):
            return None
        if self.operands.rows[0].device != w.device:
            return None
        return self.operands


def cache_of(p: torch.Tensor) -> FP8WeightCache | None:
    """The FP8 cache attached to parameter ``p`` (``attach_cache``), if any."""
    return getattr(p, "fp8_cache", None)


def cached_operands(p: torch.Tensor, dtype: torch.dtype) -> FP8Weight | None:
    """The FP8 operands of parameter ``p`` for a GEMM that runs in ``dtype``: from its cache,
    refilled first if stale (one pass, at the step's first use), or None where ``p`` has no
    cache, runs cast to another dtype, or inside ``torch.compile`` (whose graphs quantize the
    weight themselves: a version check does not trace)."""
    cache = cache_of(p)
    if cache is None or p.dtype != dtype or torch.compiler.is_compiling():
        return None
    return cache.get(p)


def attach_cache(p: torch.Tensor) -> FP8WeightCache:
    """Give parameter ``p`` an FP8 cache (once; the same one after)."""
    cache = cache_of(p)
    if cache is None:
        cache = FP8WeightCache()
        p.fp8_cache = cache  # type: ignore[attr-defined]
    return cache
