"""FP8 (E4M3, rowwise scales): the quantizer's exact format (Triton equals the reference bit for
bit; rounding to nearest even, subnormals, saturation, zero and all-equal rows), and the FP8
expert GEMM against the unquantized product and the bf16 path's gradients."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_triton_path

from kernels.fp8 import (
    E4M3_MAX,
    dequantize,
    fp8_grouped_mm,
    quantize_rowwise,
    quantize_rowwise_reference,
)
from kernels.grouped_gemm import grouped_mm


def rows(seed: int, M: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-3, 3, M)[:, None]
    x[1] = 0.0  # a zero row
    x[2] = 0.37  # all equal
    x[3, 5] = 1e4  # one outlier
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [40, 2500], ids=["one-chunk", "three-chunks"])
def test_quantizer_kernel_equals_the_reference_bit_for_bit(K, dtype):
    x = rows(0, 37, K, dtype)
    assert_triton_path(x)
    q, s = quantize_rowwise(x)
    rq, rs = quantize_rowwise_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert s[1] == 1.0 and torch.equal(q[1].float(), torch.zeros(K, device=DEVICE))
    assert torch.all(q[2].float() == E4M3_MAX)  # an all-equal row is its own maximum


def test_rounding_is_to_nearest_even_with_subnormals_and_the_row_maximum_exact():
    # scale 1 (row maximum 448): values land on the E4M3 grid as they are
    values = [448.0, 8.5, 9.5, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 2.0**-9, 0.0, -8.5, 300.0]
    expect = [448.0, 8.0, 10.0, 16.0, 20.0, 0.0, 2.0**-8, 2.0**-9, 0.0, -8.0, 288.0]
    x = torch.tensor([values], device=DEVICE)
    for quantize in (quantize_rowwise, quantize_rowwise_reference):
        q, s = quantize(x)
        assert s.item() == 1.0
        assert q.float()[0].tolist() == expect
    # the row maximum always maps to 448 exactly, whatever its magnitude: nothing saturates
    big = torch.tensor([[1e30, -3e29, 1.0]], device=DEVICE)
    q, s = quantize_rowwise(big)
    assert q.float()[0, 0] == E4M3_MAX and torch.isfinite(dequantize(q, s)).all()


def test_dequantized_rows_are_within_e4m3_precision():
    x = rows(1, 64, 300, torch.float32)
    q, s = quantize_rowwise(x)
    err = (dequantize(q, s) - x).abs()
    # half a unit in the last place of 3 mantissa bits, relative to each value (normals)
    normal = x.abs() >= 2.0**-6 * s[:, None]
    assert torch.all(err[normal] <= x.abs()[normal] * 2.0**-4 + 1e-30)


@pytest.mark.parametrize(
    "sizes", [[30, 0, 51, 17], [0, 98, 0, 0]], ids=["with-an-empty-expert", "all-in-one"]
)
def test_fp8_grouped_mm_tracks_the_bf16_product_and_keeps_its_weight_gradient(sizes):
    gen = torch.Generator().manual_seed(2)
    G, K, N, M = len(sizes), 64, 48, sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(DEVICE, torch.int32)
    x = torch.randn(M, K, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(G, N, K, generator=gen) * 0.1).to(DEVICE, torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, generator=gen).to(DEVICE, torch.bfloat16)
    y8 = fp8_grouped_mm(x, w, offs)
    dx8, dw8 = torch.autograd.grad(y8, (x, w), dy)
    y = grouped_mm(x, w.transpose(-2, -1), offs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y8.dtype == torch.bfloat16 and y8.shape == y.shape and dw8.shape == w.shape
    for got, ref in ((y8, y), (dx8, dx)):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert 0 < rel < 0.05, rel  # quantized (so not equal), within E4M3's precision
    torch.testing.assert_close(dw8, dw)  # the weight gradient stays bf16: the same product
