"""FP8 (E4M3, rowwise scales and MXFP8's 32-value blocks with E8M0 scales): the quantizers'
exact format (Triton equals the reference bit for bit; rounding to nearest even, subnormals,
saturation, zero and all-equal rows, columns or blocks, the E8M0 encoding), and the FP8 expert
GEMM against the unquantized product and the bf16 path's gradients."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_triton_path

from moe_kernels.fp8 import (
    E4M3_MAX,
    _scaled_mm,
    dequantize,
    dequantize_mx,
    fp8_expert_mlp,
    fp8_grouped_mm,
    fp8_linear,
    quantize_columnwise,
    quantize_columnwise_reference,
    quantize_mx,
    quantize_mx_reference,
    quantize_rowwise,
    quantize_rowwise_reference,
    scaled_mm_supported,
)
from moe_kernels.grouped_gemm import grouped_mm
from moe_kernels.swiglu import swiglu, swiglu_reference


def assert_within_e4m3(*pairs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Each FP8 result differs from its bf16 reference (it was quantized) by less than E4M3's
    precision: relative error (of the whole tensor) in (0, 5 %)."""
    for got, ref in pairs:
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert 0 < rel < 0.05, rel


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


def test_quantizers_give_the_same_bytes_in_every_block_configuration():
    """The block sizes ``benchmarks/fp8_quantize.py`` sweeps change the schedule, never the
    bytes: rows and columns past one block and no multiple of it."""
    from moe_kernels import fp8_triton

    x = rows(1, 37, 300, torch.bfloat16)
    w = expert_weights(2, 2, 75, 70, torch.bfloat16)
    assert_triton_path(x)
    rq, rs = quantize_rowwise_reference(x)
    for bm, bk, warps in ((1, 64, 4), (8, 128, 8), (2, 512, 4)):
        q, s = fp8_triton.quantize_rowwise(x, block_m=bm, block_k=bk, num_warps=warps)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    cq, cs = quantize_columnwise_reference(w)
    for bn, bk, warps in ((32, 16, 4), (128, 64, 8), (16, 128, 4)):
        q, s = fp8_triton.quantize_columnwise(w, block_n=bn, block_k=bk, num_warps=warps)
        assert torch.equal(q.view(torch.uint8), cq.view(torch.uint8)) and torch.equal(s, cs)


def expert_weights(seed: int, G: int, N: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """[G, N, K] with columns (the values quantized together) spanning 1e-3..1e3, a zero
    column, an all-equal one and an outlier in each expert."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(G, N, K, generator=gen) * torch.logspace(-3, 3, K)
    w[:, :, 1] = 0.0
    w[:, :, 2] = -0.37
    w[:, 7, 3] = 1e4
    return w.to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3])
def test_columnwise_quantizer_kernel_equals_the_transposed_copy_bit_for_bit(G, dtype):
    # N and K past one block and no multiple of it (tiles of 64 x 64)
    N, K = 131, 70
    w = expert_weights(4, G, N, K, dtype)
    if dtype == torch.float32:  # saturation's edge: a column of huge values and one of tiny
        w[-1, :, 4] = torch.linspace(-1.0, 1.0, N) * 3e38
        w[-1, :, 5] = torch.linspace(-1.0, 1.0, N) * 1e-36
    assert_triton_path(w)
    q, s = quantize_columnwise(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (G, K, N) and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (G, K)
    rq, rs = quantize_rowwise_reference(w.transpose(-2, -1).contiguous().view(G * K, N))
    assert torch.equal(s.view(G * K), rs)
    assert torch.equal(q.view(torch.uint8).view(G * K, N), rq.view(torch.uint8))
    ref_q, ref_s = quantize_columnwise_reference(w)  # the reference is that same definition
    assert torch.equal(ref_q.view(torch.uint8), q.view(torch.uint8)) and torch.equal(ref_s, s)
    zero = torch.zeros(G, N, dtype=torch.uint8, device=DEVICE)
    assert torch.all(s[:, 1] == 1.0) and torch.equal(q[:, 1].view(torch.uint8), zero)  # +0
    assert torch.all(q[:, 2].float() == -E4M3_MAX)  # an all-equal column is its own maximum
    assert torch.all(q[:, 3, 7].float() == E4M3_MAX)  # the outlier maps to 448 exactly
    assert torch.all(q.float().abs() <= E4M3_MAX)
    w_view = w.transpose(-2, -1).contiguous().transpose(-2, -1)  # the same weight, K strided
    q_view, s_view = quantize_columnwise(w_view)
    assert torch.equal(q_view.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_view, s)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [64, 2112], ids=["one-chunk", "three-chunks"])
def test_mx_quantizer_kernel_equals_the_reference_bit_for_bit(K, dtype):
    x = rows(3, 37, K, dtype)
    if dtype == torch.float32:  # (Triton's interpreter flushes bf16 subnormals as it loads)
        x[4, :32] = 2.0**-130  # a block whose scale would be below E8M0's 2^-127
    assert_triton_path(x)
    q, s = quantize_mx(x)
    rq, rs = quantize_mx_reference(x)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (37, K // 32)
    assert torch.equal(s.view(torch.uint8), rs.view(torch.uint8))
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.all(s[1].view(torch.uint8) == 0)  # a zero block: 2^-127, its values +0
    assert torch.equal(q[1].view(torch.uint8), torch.zeros(K, dtype=torch.uint8, device=DEVICE))


def test_mx_scales_are_powers_of_two_rounded_up_so_nothing_saturates():
    # blocks whose maximum is 448 * 2^k (exactly a power of two times 448), just above it,
    # an all-equal block, and one with a negative maximum
    x = torch.zeros(1, 4 * 32, device=DEVICE)
    x[0, 0], x[0, 1] = 448.0, 1.0  # ratio 1: exponent 0, byte 127, values as they are
    x[0, 32] = 448.0 * 2.0**-3 * 1.01  # ratio just above 2^-3: exponent -2, byte 125
    x[0, 64:96] = 0.37  # ratio 0.37 / 448 = 2^-10.24: exponent -10, byte 117
    x[0, 96], x[0, 97] = -900.0, 3.0  # ratio 2^1.006: exponent 2, byte 129
    for quantize in (quantize_mx, quantize_mx_reference):
        q, s = quantize(x)
        assert s.view(torch.uint8)[0].tolist() == [127, 125, 117, 129]
        assert q.float()[0, 0] == 448.0 and q.float()[0, 1] == 1.0
        assert q.float()[0, 96] == -224.0 and q.float()[0, 97] == 0.75
        assert torch.all(q.float()[0, 64:96] == 384.0)  # 378.88 on a grid of 32 there
        back = dequantize_mx(q, s)
        assert torch.all(back.abs().amax(dim=1) <= 900.0)
        assert torch.all(q.float().abs() <= E4M3_MAX)


@pytest.mark.parametrize(
    "sizes", [[30, 0, 51, 17], [0, 98, 0, 0]], ids=["with-an-empty-expert", "all-in-one"]
)
@pytest.mark.parametrize("scaling", ["rowwise", "mx"])
def test_fp8_grouped_mm_tracks_the_bf16_product_and_keeps_its_weight_gradient(sizes, scaling):
    gen = torch.Generator().manual_seed(2)
    G, K, N, M = len(sizes), 64, 96, sum(sizes)  # MX blocks: K and N multiples of 32
    offs = torch.tensor(sizes).cumsum(0).to(DEVICE, torch.int32)
    x = torch.randn(M, K, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(G, N, K, generator=gen) * 0.1).to(DEVICE, torch.bfloat16).requires_grad_()
    dy = torch.randn(M, N, generator=gen).to(DEVICE, torch.bfloat16)
    y8 = fp8_grouped_mm(x, w, offs, scaling)
    dx8, dw8 = torch.autograd.grad(y8, (x, w), dy)
    y = grouped_mm(x, w.transpose(-2, -1), offs)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y8.dtype == torch.bfloat16 and y8.shape == y.shape and dw8.shape == w.shape
    assert_within_e4m3((y8, y), (dx8, dx))
    torch.testing.assert_close(dw8, dw)  # the weight gradient stays bf16: the same product


def test_fp8_input_gradient_is_byte_identical_to_the_transposed_copy_path():
    # dx once took w[g]^T as a contiguous copy quantized by rows; it now takes the columnwise
    # quantizer's output: the same bytes, so the same gradient, bit for bit (N and K multiples
    # of 16, as _scaled_grouped_mm needs on the GPU; ragged blocks are the quantizer test's)
    gen = torch.Generator().manual_seed(5)
    sizes, N, K = [19, 0, 40], 48, 80
    offs = torch.tensor(sizes).cumsum(0).to(DEVICE, torch.int32)
    x = torch.randn(sum(sizes), K, generator=gen).to(DEVICE, torch.bfloat16).requires_grad_()
    w = expert_weights(6, len(sizes), N, K, torch.bfloat16).requires_grad_()
    dy = torch.randn(sum(sizes), N, generator=gen).to(DEVICE, torch.bfloat16)
    assert_triton_path(w)
    (dx,) = torch.autograd.grad(fp8_grouped_mm(x, w, offs), (x,), dy)
    before = _scaled_mm(dy, w.detach().transpose(-2, -1).contiguous(), offs, torch.bfloat16)
    assert dx.dtype == torch.bfloat16 and torch.equal(dx, before)
    assert dx[:19].abs().sum() > 0 and dx[19:].abs().sum() > 0


@pytest.mark.parametrize(
    "sizes", [[30, 0, 51, 17], [0, 98, 0, 0]], ids=["with-an-empty-expert", "all-in-one"]
)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("scaling", ["rowwise", "mx"])
def test_fp8_expert_mlp_equals_its_composition_and_keeps_no_activation(sizes, weighted, scaling):
    """One op (``fp8_expert_mlp``) against ``fp8_grouped_mm``, the SwiGLU, ``fp8_grouped_mm``:
    the same output and gradients (x, both weights, the router weights) bit for bit, while
    autograd keeps no [M, F] tensor for backward (the SwiGLU output is written again there)."""
    gen = torch.Generator().manual_seed(3)
    G, D, F, M = len(sizes), 64, 32, sum(sizes)  # MX blocks: D and F multiples of 32
    offs = torch.tensor(sizes).cumsum(0).to(DEVICE, torch.int32)

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) * scale
        return t.to(DEVICE, torch.bfloat16).requires_grad_()

    x, w_gu, w_d = leaf(M, D), leaf(G, 2 * F, D, scale=0.1), leaf(G, D, F, scale=0.1)
    weight = torch.rand(M, generator=gen).to(DEVICE).requires_grad_() if weighted else None
    dy = torch.randn(M, D, generator=gen).to(DEVICE, torch.bfloat16)
    leaves = [t for t in (x, w_gu, w_d, weight) if t is not None]
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_expert_mlp(x, w_gu, w_d, offs, weight, scaling)
    got = (y, *torch.autograd.grad(y, leaves, dy))
    assert (M, F) not in shapes and (M, 2 * F) in shapes
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = fp8_grouped_mm(x, w_gu, offs, scaling)
        y = fp8_grouped_mm(swiglu(h, weight), w_d, offs, scaling)
    assert (M, F) in shapes, "the composition keeps the SwiGLU output"
    ref = (y, *torch.autograd.grad(y, leaves, dy))
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g, r)
    assert got[0].abs().sum() > 0 and all(g.abs().sum() > 0 for g in got[1:])


def test_fp8_expert_mlp_refuses_a_bad_scaling_offsets_or_shapes():
    x, w_gu, w_d = torch.zeros(4, 32), torch.zeros(2, 64, 32), torch.zeros(2, 32, 32)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="scaling='blockwise' is not allowed"):
        fp8_expert_mlp(x, w_gu, w_d, offs, scaling="blockwise")
    with pytest.raises(TypeError, match="int32"):
        fp8_expert_mlp(x, w_gu, w_d, offs.long())
    with pytest.raises(ValueError, match=r"w_down \(2, 32, 16\) \[G, D, F\]"):
        fp8_expert_mlp(x, w_gu, torch.zeros(2, 32, 16), offs)
    with pytest.raises(ValueError, match="weight_M must be"):
        fp8_expert_mlp(x, w_gu, w_d, offs, torch.ones(3))


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_quantizer_equals_the_two_kernels_bit_for_bit(dtype, weighted):
    """The one-pass SwiGLU + rowwise quantization gives the bytes of the SwiGLU kernel's output
    quantized by the rowwise kernel, its definition (each of those equals its reference in its
    own tests); F not a power of two, a zero row, several row blocks."""
    from moe_kernels import fp8_triton, swiglu_triton

    h = rows(4, 37, 2 * 20, dtype)
    h[6] = 0.0
    w = torch.rand(37, generator=torch.Generator().manual_seed(5)).to(DEVICE) if weighted else None
    assert_triton_path(h)
    q, s = fp8_triton.swiglu_quantize_rowwise(h, w)
    rq, rs = quantize_rowwise(swiglu_triton.swiglu_forward(h, w))
    assert q.shape == (37, 20) and torch.equal(s, rs) and s[6] == 1.0
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


@pytest.mark.parametrize("wide", [False, True], ids=["one-pass", "wider-than-one-program"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_backward_quantizes_dh_bit_for_bit(dtype, weighted, wide, monkeypatch):
    """``swiglu_grads(quantize_into=...)`` fills the buffers with ``quantize_rowwise(dh)`` of the
    dh it returns, and changes nothing else it returns: in the backward's own pass where a row
    fits one program, else by the rowwise quantizer after it; a zero row, F no power of two."""
    from moe_kernels import swiglu_triton
    from moe_kernels.swiglu import swiglu_grads

    if wide:
        monkeypatch.setattr(swiglu_triton, "QUANTIZE_MAX_F", 16)
    h, da = rows(6, 37, 2 * 20, dtype), rows(7, 37, 20, dtype)
    da[6] = 0.0
    w = torch.rand(37, generator=torch.Generator().manual_seed(8)).to(DEVICE) if weighted else None
    assert_triton_path(h)
    q = torch.empty(37, 40, dtype=torch.float8_e4m3fn, device=DEVICE)
    s = torch.empty(37, dtype=torch.float32, device=DEVICE)
    dh, dw, a = swiglu_grads(h, da, w, activation=True, quantize_into=(q, s))
    ref_dh, ref_dw, ref_a = swiglu_grads(h, da, w, activation=True)
    assert torch.equal(dh, ref_dh) and torch.equal(a, ref_a)
    assert (dw is None and ref_dw is None) or torch.equal(dw, ref_dw)
    rq, rs = quantize_rowwise_reference(dh)
    assert torch.equal(s, rs) and s[6] == 1.0
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))


def linear_operands(seed: int, lead: tuple[int, ...], N: int = 48, K: int = 80):
    """bf16 x [*lead, K] (requiring grad), w [N, K], dy [*lead, N]; N and K multiples of 16 (as
    ``torch._scaled_mm`` needs on the GPU)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, K, generator=gen) * 3).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(N, K, generator=gen) * 0.05).to(DEVICE, torch.bfloat16).requires_grad_()
    dy = torch.randn(*lead, N, generator=gen).to(DEVICE, torch.bfloat16)
    return x, w, dy


@pytest.mark.parametrize("lead", [(37,), (2, 19)], ids=["tokens", "batch-seq"])
def test_fp8_linear_tracks_the_bf16_linear_and_keeps_its_weight_gradient(lead):
    x, w, dy = linear_operands(7, lead)
    assert_triton_path(x)
    y8 = fp8_linear(x, w, scaled_mm_supported(x))
    dx8, dw8 = torch.autograd.grad(y8, (x, w), dy)
    y = torch.nn.functional.linear(x, w)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert y8.dtype == dx8.dtype == dw8.dtype == torch.bfloat16
    assert y8.shape == y.shape and dx8.shape == x.shape and dw8.shape == w.shape
    assert_within_e4m3((y8, y), (dx8, dx))
    torch.testing.assert_close(dw8, dw)  # the weight gradient stays bf16: the same product


def test_fp8_linear_multiplies_operands_quantized_along_the_contraction():
    """The forward contracts over K with x and w quantized by rows (over K); the input gradient
    contracts over N with dy by rows and w by columns (over N). The dequantized products of
    exactly those operands give its outputs (bit for bit on CPU; on the GPU up to the FP8
    GEMM's fp32 summation order and one bf16 rounding)."""
    x, w, dy = linear_operands(8, (45,))
    y8 = fp8_linear(x, w, scaled_mm_supported(x))
    (dx8,) = torch.autograd.grad(y8, (x,), dy)
    xd, wd = x.detach(), w.detach()
    y_ref = (
        dequantize(*quantize_rowwise_reference(xd))
        @ dequantize(*quantize_rowwise_reference(wd)).t()
    )
    qw_1KN, sw_1K = quantize_columnwise_reference(wd[None])
    dx_ref = dequantize(*quantize_rowwise_reference(dy)) @ dequantize(qw_1KN[0], sw_1K[0]).t()
    exact = DEVICE == "cpu"
    for got, ref in ((y8, y_ref), (dx8, dx_ref)):
        ref = ref.to(torch.bfloat16)
        if exact:
            assert torch.equal(got, ref)
        else:
            torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-3)
    # quantizing w over K in backward too (the forward's operand) would give another gradient
    wrong = dequantize(*quantize_rowwise_reference(dy)) @ dequantize(
        *quantize_rowwise_reference(wd)
    )
    assert not torch.allclose(dx8.float(), wrong, rtol=1e-3, atol=0)


def test_fp8_linear_under_torch_compile_is_the_eager_function():
    """Traced by ``torch.compile`` the quantizers are the references (``moe_kernels._triton``'s
    rule: Inductor writes its own kernels from them), which equal the Triton kernels byte for
    byte, so the compiled op gives the eager one's output and gradients."""
    x, w, dy = linear_operands(9, (2, 24))
    tensor_cores = scaled_mm_supported(x)

    def f(x, w):
        return fp8_linear(x, w, tensor_cores)

    got = f(x, w)
    grads = torch.autograd.grad(got, (x, w), dy)
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    again = compiled(x, w)
    grads_again = torch.autograd.grad(again, (x, w), dy)
    assert torch.equal(again, got)
    for a, b in zip(grads_again, grads, strict=True):
        assert torch.equal(a, b)


def test_fp8_linear_refuses_mismatched_shapes():
    x, w, _ = linear_operands(10, (5,))
    with pytest.raises(ValueError, match=r"fp8_linear takes x \[\.\.\., K\] and w \[N, K\]"):
        fp8_linear(x, w.t(), False)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "sizes", [[300, 0, 517, 1290, 7], [0, 2048, 0, 0, 0]], ids=["uneven", "all-in-one"]
)
def test_quacks_fp8_gemm_is_torchs_scaled_grouped_mm(sizes):
    # the same E4M3 operands and scales: QuACK's GEMM with the scales in its epilogue against
    # torch's kernel, equal up to the order of the two scale products (one bf16 rounding);
    # rows past the last group (padding) are left alone by both
    pytest.importorskip("quack")
    from moe_kernels.grouped_gemm_quack import fp8_scaled_mm

    gen = torch.Generator().manual_seed(9)
    G, N, K, M = len(sizes), 384, 256, sum(sizes) + 64
    offs = torch.tensor(sizes).cumsum(0).to("cuda", torch.int32)
    x = (torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, M)[:, None]).to("cuda")
    w = (torch.randn(G * N, K, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    qa, sa = quantize_rowwise(x.bfloat16())
    qb, sb = quantize_rowwise(w)
    qb, sb = qb.view(G, N, K), sb.view(G, N)
    ref = torch._scaled_grouped_mm(qa, qb.mT, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    got = fp8_scaled_mm(qa, sa, qb, sb, offs, torch.bfloat16)
    end = sum(sizes)
    assert got.shape == ref.shape and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[:end], ref[:end], rtol=2**-7, atol=1e-6)
    assert got[:end].abs().amax() > 0


@pytest.mark.gpu
def test_fp8_expert_mlp_on_quacks_gemm_is_the_mlp_on_torchs():
    # parallel.expert_gemm=quack takes QuACK's bf16 weight gradients (the FP8 products stay on
    # torch's kernel): the same function as torch's kernels, output and gradients
    pytest.importorskip("quack")
    gen = torch.Generator().manual_seed(4)
    sizes, D, F = [700, 0, 1300, 48], 256, 128
    offs = torch.tensor(sizes).cumsum(0).to("cuda", torch.int32)
    x = torch.randn(sum(sizes), D, generator=gen).to("cuda", torch.bfloat16)
    w_gate_up = (torch.randn(len(sizes), 2 * F, D, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    w_down = (torch.randn(len(sizes), D, F, generator=gen) * 0.05).to("cuda", torch.bfloat16)
    weight = torch.rand(sum(sizes), generator=gen).to("cuda")
    dy = torch.randn(sum(sizes), D, generator=gen).to("cuda", torch.bfloat16)
    outs = {}
    for backend in ("torch", "quack"):
        leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down, weight)]
        y = fp8_expert_mlp(*leaves[:3], offs, leaves[3], backend=backend)
        outs[backend] = (y, *torch.autograd.grad(y, leaves, dy))
    for got, ref in zip(outs["quack"], outs["torch"], strict=True):
        rel = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
        assert rel < 1e-2, rel


@pytest.mark.parametrize(
    "sizes", [[30, 0, 51, 17], [0, 98, 0, 0]], ids=["with-an-empty-expert", "all-in-one"]
)
def test_quacks_fp8_gemm_is_the_scaled_product_on_the_stand_in(sizes):
    # the benchmark's QuACK candidate (grouped_gemm_quack.fp8_scaled_mm) on QuACK's CPU
    # stand-in (tests/fake_quack.py): the E4M3 operands reach QuACK's GEMM in the layouts it
    # takes (the weight k-major, a row of column scales per expert, the row scales a column)
    # and give the dequantized product that torch's kernel computes, rows past the groups
    # left alone
    from moe_kernels import fp8
    from tests import fake_quack

    gen = torch.Generator().manual_seed(9)
    G, N, K, M = len(sizes), 40, 64, sum(sizes) + 5
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, generator=gen) * torch.logspace(-2, 2, M)[:, None]
    qa, sa = quantize_rowwise(x.bfloat16())
    qb, sb = quantize_rowwise((torch.randn(G * N, K, generator=gen) * 0.05).bfloat16())
    qb, sb = qb.view(G, N, K), sb.view(G, N)
    with fake_quack.installed():
        from moe_kernels import grouped_gemm_quack

        got = grouped_gemm_quack.fp8_scaled_mm(qa, sa, qb, sb, offs, torch.bfloat16)
    ref = fp8._quantized_mm(qa, sa, qb, sb, offs, torch.bfloat16)
    end = sum(sizes)
    assert got.shape == (M, N) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got[:end], ref[:end], rtol=2**-7, atol=1e-6)
    assert got[:end].abs().amax() > 0


@pytest.mark.parametrize(
    "sizes", [[30, 0, 51, 17], [0, 98, 0, 0]], ids=["with-an-empty-expert", "all-in-one"]
)
def test_fp8_products_never_take_quacks_fp8_gemm(sizes, monkeypatch):
    # QuACK's FP8 GEMM ran at half of torch's (RESULTS.md, issues 41 and 42): with QuACK
    # present (its CPU stand-in, tests/fake_quack.py, taken as runnable here) and
    # parallel.expert_gemm=quack, the bf16 weight gradients go through QuACK and the four FP8
    # products do not, and the function is torch's backend's in output and every gradient
    from moe_kernels import grouped_gemm
    from tests import fake_quack

    gen = torch.Generator().manual_seed(11)
    G, D, F, M = len(sizes), 64, 48, sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(M, D, generator=gen).bfloat16()
    w_gate_up = (torch.randn(G, 2 * F, D, generator=gen) * 0.1).bfloat16()
    w_down = (torch.randn(G, D, F, generator=gen) * 0.1).bfloat16()
    weight, dy = torch.rand(M, generator=gen), torch.randn(M, D, generator=gen).bfloat16()
    outs, fp8_calls, wgrad_calls = {}, [], []
    with fake_quack.installed():
        from moe_kernels import grouped_gemm_quack

        monkeypatch.setattr(grouped_gemm, "_quack_runs", lambda x, backend: backend != "torch")
        monkeypatch.setattr(grouped_gemm_quack, "fp8_scaled_mm", lambda *a: fp8_calls.append(1))
        real = grouped_gemm_quack.grouped_wgrad
        monkeypatch.setattr(
            grouped_gemm_quack,
            "grouped_wgrad",
            lambda *a, **k: wgrad_calls.append(1) or real(*a, **k),
        )
        for backend in ("torch", "quack"):
            leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down, weight)]
            y = fp8_expert_mlp(*leaves[:3], offs, leaves[3], backend=backend)
            outs[backend] = (y, *torch.autograd.grad(y, leaves, dy))
    assert fp8_calls == [] and len(wgrad_calls) == 2  # the two weight gradients, under quack
    for got, ref in zip(outs["quack"], outs["torch"], strict=True):
        torch.testing.assert_close(got, ref, rtol=2**-7, atol=1e-5)


FAST = {"none": (False, False), "forward": (True, False), "all": (True, True)}


@pytest.mark.parametrize("fast_accum", list(FAST))
def test_fast_accumulation_reaches_the_forward_or_every_fp8_product(fast_accum, monkeypatch):
    # torch's FP8 GEMMs stood in for by the dequantized products they compute, recording
    # use_fast_accum: "forward" reaches the forward's products only, "all" the input
    # gradients' too, "none" neither, in the experts' MLP, one grouped GEMM and the dense
    # linear; the weight gradients are bf16 (no FP8 call) and the values are the CPU path's
    from kernel_cases import recording_fp8_gemms

    gen = torch.Generator().manual_seed(5)
    sizes, D, F = [30, 0, 51, 17], 64, 48
    G, M = len(sizes), sum(sizes)
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    x = torch.randn(M, D, generator=gen).bfloat16()
    w_gate_up = (torch.randn(G, 2 * F, D, generator=gen) * 0.1).bfloat16()
    w_down = (torch.randn(G, D, F, generator=gen) * 0.1).bfloat16()
    weight, dy = torch.rand(M, generator=gen), torch.randn(M, D, generator=gen).bfloat16()

    def mlp(**kw):
        leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down, weight)]
        y = fp8_expert_mlp(*leaves[:3], offs, leaves[3], **kw)
        return (y, *torch.autograd.grad(y, leaves, dy))

    def one_gemm(**kw):
        leaves = [t.clone().requires_grad_() for t in (x, w_down.transpose(1, 2).contiguous())]
        y = fp8_grouped_mm(*leaves, offs, **kw)
        return (y, *torch.autograd.grad(y, leaves, torch.ones_like(y)))

    def linear(tensor_cores: bool, **kw):
        leaves = [t.clone().requires_grad_() for t in (x, w_gate_up[0])]
        y = fp8_linear(*leaves, tensor_cores, **kw)
        return (y, *torch.autograd.grad(y, leaves, torch.ones_like(y)))

    expected = (mlp(), one_gemm(), linear(False))
    calls = recording_fp8_gemms(monkeypatch)
    got = (mlp(fast_accum=fast_accum), one_gemm(fast_accum=fast_accum))
    got += (linear(True, fast_accum=fast_accum),)
    fwd, grad = FAST[fast_accum]
    # the MLP's two forward products and two input gradients, then one GEMM's, the linear's
    assert calls == [fwd, fwd, grad, grad, fwd, grad, fwd, grad]
    for outs, refs in zip(got, expected, strict=True):
        for a, b in zip(outs, refs, strict=True):
            assert torch.equal(a, b)
    for call in (lambda: mlp(fast_accum="fastest"), lambda: linear(True, fast_accum="yes")):
        with pytest.raises(ValueError, match="'none', 'forward' or 'all'"):
            call()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1024, 2048])
def test_fast_accumulation_adds_little_to_the_fp8_error_on_the_gpu(rows):
    # on Hopper the fast accumulator keeps fewer bits than fp32: the experts' MLP at
    # OLMoE-1B-7B's widths with every FP8 product accumulating fast ("all") stays within 1.2x
    # the error of fp32 promotion ("none") against the fp32 MLP, in output and input gradient
    # (relative Frobenius norms), and the output is not the same bytes (the flag took effect)
    gen = torch.Generator(device="cuda").manual_seed(0)
    G, D, F = 8, 2048, 1024
    offs = torch.full((G,), rows, device="cuda").cumsum(0).to(torch.int32)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    x, dy = randn(G * rows, D), randn(G * rows, D)
    w_gate_up, w_down = randn(G, 2 * F, D, scale=0.02), randn(G, D, F, scale=0.02)

    def run(fast_accum: str):
        leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down)]
        y = fp8_expert_mlp(*leaves, offs, fast_accum=fast_accum)
        return y.float(), torch.autograd.grad(y, leaves[0], dy)[0].float()

    x32 = x.float().requires_grad_()
    h = torch.bmm(x32.view(G, rows, D), w_gate_up.float().transpose(1, 2))
    y32 = torch.bmm(swiglu_reference(h.view(G * rows, 2 * F)).view(G, rows, F),
                    w_down.float().transpose(1, 2)).view(G * rows, D)  # fmt: skip
    dx32 = torch.autograd.grad(y32, x32, dy.float())[0]

    def errors(got):
        return [((g - r).norm() / r.norm()).item() for g, r in zip(got, (y32, dx32), strict=True)]

    promoted, fast = run("none"), run("all")
    assert not torch.equal(promoted[0], fast[0])
    for e_fast, e_promoted in zip(errors(fast), errors(promoted), strict=True):
        assert e_fast <= 1.2 * e_promoted, (e_fast, e_promoted)
