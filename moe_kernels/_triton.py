"""Whether an op runs its Triton kernel or its PyTorch reference: one rule for every op here.

The rule: Triton for CUDA tensors; for CPU tensors only inside ``interpret_on_cpu()`` (the
kernel tests: Triton's interpreter, which needs ``TRITON_INTERPRET=1`` set before triton is
imported); the PyTorch reference otherwise (CPU training stays fast), where triton is not
installed, for empty inputs, inside ``references_only()``, or while ``torch.compile`` traces
(Inductor writes its own fused kernels from the reference's ops).
This module imports no kernel, so ``moe_kernels`` loads on a machine without a GPU or triton.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
_interpreting = False
_references_only = False


@contextlib.contextmanager
def interpret_on_cpu() -> Iterator[None]:
    """Inside: ops on CPU tensors run their Triton kernels in Triton's interpreter."""
    global _interpreting
    if not (HAS_TRITON and INTERPRET):
        raise RuntimeError("interpret_on_cpu needs triton and TRITON_INTERPRET=1 set before import")
    previous, _interpreting = _interpreting, True
    try:
        yield
    finally:
        _interpreting = previous


@contextlib.contextmanager
def references_only() -> Iterator[None]:
    """Inside: every op runs its PyTorch reference, on the GPU too (the unfused model that the
    fused one is checked against)."""
    global _references_only
    previous, _references_only = _references_only, True
    try:
        yield
    finally:
        _references_only = previous


def in_references_only() -> bool:
    """Whether ``references_only()`` is in force (fusions outside Triton, such as the gathered
    grouped GEMM, honour it too)."""
    return _references_only


def use_triton(*tensors: torch.Tensor) -> bool:
    """True where an op on these tensors takes its Triton kernel: by the first one's device;
    never for empty tensors (no zero-size grids: the reference handles them), inside
    ``references_only()`` or while ``torch.compile`` traces."""
    if _references_only or not HAS_TRITON or any(t.numel() == 0 for t in tensors):
        return False
    if torch.compiler.is_compiling():
        return False
    device = tensors[0].device.type
    return device == "cuda" or (_interpreting and device == "cpu")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
