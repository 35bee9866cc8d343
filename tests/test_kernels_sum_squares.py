"""The gradient norm's read-bound pass (``moe_kernels.sum_squares``): the Triton kernel against an
fp64 sum, over tensors whose sizes are no multiple of a program's run, in bf16 and fp32."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_triton_path, randn

from moe_kernels import sum_squares_triton
from moe_kernels.sum_squares import sum_squares, sum_squares_reference

# Small runs on purpose (the interpreter costs about half a millisecond per program).
BLOCK, ITERS = 64, 2


def _exact(tensors: list[torch.Tensor]) -> torch.Tensor:
    return sum(t.double().square().sum() for t in tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sum_squares_kernel_counts_every_element_once(dtype):
    """Three tensors: one shorter than a program's run, one a partial last run, one a 2-D
    tensor of whole runs; every element counts once, in fp32 (no bf16 rounding of the sum)."""
    run = BLOCK * ITERS
    tensors = [
        randn(5, dtype=dtype, seed=1),
        randn(3 * run + 17, dtype=dtype, seed=2) * 3,
        randn(4, run // 2, dtype=dtype, seed=3),
    ]
    assert_triton_path(tensors[0])
    got = sum_squares_triton.sum_squares(tensors, block=BLOCK, iters=ITERS)
    assert got.dtype == torch.float32 and got.dim() == 0
    torch.testing.assert_close(got.double().cpu(), _exact(tensors).cpu(), rtol=1e-6, atol=0)
    # A lost run of the middle tensor (its squares are ~9 each) would show far beyond rtol.
    without_last_run = tensors[1][: 3 * run]
    assert abs(got.item() - _exact([tensors[0], without_last_run, tensors[2]]).item()) > 1.0


def test_sum_squares_takes_the_kernel_where_it_can_and_the_reference_elsewhere():
    """The selection: contiguous tensors in fp32 take the kernel (equal to it bit for bit);
    a non-contiguous one and fp64 accumulation take the reference; empty tensors add zero."""
    a, b = randn(300, seed=4), randn(20, 30, seed=5)
    empty = randn(0, seed=6)
    kernel = sum_squares_triton.sum_squares([a, b])
    assert torch.equal(sum_squares([a, empty, b]), kernel)
    strided = b.t()
    assert not strided.is_contiguous()
    torch.testing.assert_close(
        sum_squares([a, strided]), sum_squares_reference([a, strided], torch.float32)
    )
    if DEVICE == "cpu":
        got = sum_squares([a, b], torch.float64)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, _exact([a, b]), rtol=1e-12, atol=0)
    assert sum_squares([empty]).item() == 0.0
    with pytest.raises(ValueError, match="at least one tensor"):
        sum_squares([])
