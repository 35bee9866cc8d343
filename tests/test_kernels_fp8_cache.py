"""FP8 copies of a weight made once per step (``moe_kernels.fp8_cache``): the fused AdamW update's
rowwise copy and the cache's operands are the per-call quantizers' bytes, in Triton (the
interpreter on CPU) and in the references; the GEMMs given them compute the same bits."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_triton_path, randn

from moe_kernels import adamw_triton
from moe_kernels._triton import references_only
from moe_kernels.adamw import adamw_step_
from moe_kernels.fp8 import fp8_expert_mlp, fp8_linear
from moe_kernels.fp8_cache import FP8WeightCache, quantize_weight
from moe_kernels.fp8_quantize import quantize_columnwise, quantize_rowwise

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def state(G: int, N: int, K: int, master: torch.dtype, seed: int) -> list[torch.Tensor]:
    n = G * N * K
    p, g = randn(n, dtype=master, seed=seed), randn(n, dtype=master, seed=seed + 1)
    m = randn(n, dtype=master, seed=seed + 2) * 0.1
    v = randn(n, dtype=master, seed=seed + 3).square() * 0.01
    return [p, g, m, v]


@pytest.mark.parametrize("path", ["triton", "reference"])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16], ids=["fp32-master", "bf16"])
@pytest.mark.parametrize("block_k", [0, 16], ids=["whole-rows", "row-chunks"])
@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
def test_fused_update_writes_the_rowwise_copy_of_the_new_weight(path, master, block_k, applied):
    """The update with ``rows`` leaves parameter, moments and bf16 weights bit-equal to the plain
    update, and ``rows`` the bytes of ``quantize_rowwise`` of the weight it wrote (``out`` from
    an fp32 master, else the bf16 parameter itself); a skipped step writes no row either."""
    if path == "reference" and block_k:
        pytest.skip("row chunks are the kernel's blocking")
    G, N, K = 2, 5, 40  # rows of 40: whole, or chunks of 16 read back
    lr, step = torch.tensor(1e-2, device=DEVICE), torch.tensor(3.0, device=DEVICE)
    apply = torch.tensor(applied, device=DEVICE)
    fused, plain = state(G, N, K, master, 1), state(G, N, K, master, 1)
    out = out_plain = None
    if master == torch.float32:
        out = torch.full((G * N * K,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        out_plain = out.clone()
    q = torch.zeros(G * N, K, dtype=torch.float8_e4m3fn, device=DEVICE)
    s = torch.full((G * N,), -1.0, device=DEVICE)
    args = (lr, step, None, *HYPER.values())
    if path == "triton":
        assert_triton_path(fused[0])
        adamw_triton.adamw_rows_step_(*fused, *args, out, apply, (q, s), block_k=block_k)
        adamw_triton.adamw_step_(*plain, *args, out=out_plain, apply=apply)
    else:
        with references_only():
            adamw_step_(*fused, *args[:2], out=out, apply=apply, rows=(q, s), **HYPER)
            adamw_step_(*plain, *args[:2], out=out_plain, apply=apply, **HYPER)
    for name, a, b in zip(["p", "g", "m", "v"], fused, plain, strict=True):
        assert torch.equal(a, b), name
    if out is not None and applied:
        assert torch.equal(out, out_plain)
    if out is not None and not applied:
        assert out.isnan().all() and out_plain.isnan().all()
    if not applied:
        assert (q.view(torch.uint8) == 0).all() and (s == -1).all(), "a skipped step wrote rows"
        return
    weight = (fused[0] if out is None else out).view(G * N, K)
    want_q, want_s = quantize_rowwise(weight)
    assert same_bytes(q, want_q) and torch.equal(s, want_s)
    assert q.float().abs().max() == 448  # each row's largest value lands on E4M3's maximum


@pytest.mark.parametrize("path", ["triton", "reference"])
def test_cached_operands_are_the_per_call_quantizers_bytes_written_in_place(path):
    G, N, K = 3, 24, 40
    w = randn(G, N, K, dtype=torch.bfloat16, seed=7)
    ctx = references_only() if path == "reference" else torch.no_grad()
    with ctx:
        if path == "triton":
            assert_triton_path(w)
        ops = quantize_weight(w)
        rows_q, rows_s = quantize_rowwise(w.reshape(G * N, K))
        cols_q, cols_s = quantize_columnwise(w)
        assert same_bytes(ops.rows[0].view(G * N, K), rows_q)
        assert torch.equal(ops.rows[1].view(G * N), rows_s)
        assert same_bytes(ops.cols[0], cols_q) and torch.equal(ops.cols[1], cols_s)
        # refilled in place for another weight: the same buffers, the new weight's bytes
        addresses = [t.data_ptr() for t in (*ops.rows, *ops.cols)]
        w2 = randn(G, N, K, dtype=torch.bfloat16, seed=8)
        again = quantize_weight(w2, ops)
        assert [t.data_ptr() for t in (*again.rows, *again.cols)] == addresses
        assert same_bytes(again.cols[0], quantize_columnwise(w2)[0])


def test_the_gemms_given_cached_operands_compute_the_same_bits():
    """``fp8_expert_mlp`` and ``fp8_linear`` with the cache's operands: outputs and every
    gradient bit-equal to quantizing the weights in the call."""
    G, D, F, M = 3, 32, 16, 20
    x = randn(M, D, dtype=torch.bfloat16, seed=1)
    w_gu = randn(G, 2 * F, D, dtype=torch.bfloat16, seed=2) * 0.1
    w_d = randn(G, D, F, dtype=torch.bfloat16, seed=3) * 0.1
    offs = torch.tensor([5, 5, M], dtype=torch.int32, device=DEVICE)
    dy = randn(M, D, dtype=torch.bfloat16, seed=4)

    def run(cached: bool):
        xs, a, b = (t.clone().requires_grad_() for t in (x, w_gu, w_d))
        ops = (quantize_weight(a), quantize_weight(b)) if cached else (None, None)
        y = fp8_expert_mlp(xs, a, b, offs, cached=ops)
        y.backward(dy)
        lin_w = b[0].detach().clone().requires_grad_()  # [D, F]: a dense weight
        z = fp8_linear(y.detach()[:, :F], lin_w, False, quantize_weight(lin_w) if cached else None)
        z.backward(dy)
        return [y, xs.grad, a.grad, b.grad, z, lin_w.grad]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="cached FP8 operands of w_down"):
        fp8_expert_mlp(x, w_gu, w_d, offs, cached=(None, quantize_weight(w_gu)))


def test_a_cache_is_stale_once_its_weight_changes_in_place():
    w = torch.nn.Parameter(randn(2, 16, 32, dtype=torch.bfloat16, seed=5))
    cache = FP8WeightCache()
    ops = cache.get(w)
    assert cache.current(w) is ops and cache.fills == 1
    assert cache.get(w) is ops and cache.fills == 1  # a second micro-batch: no quantization
    with torch.no_grad():
        w.mul_(2)  # an in-place write (a checkpoint's load_state_dict does the same)
    assert cache.current(w) is None
    fresh = cache.get(w)
    assert cache.fills == 2 and same_bytes(fresh.cols[0], quantize_columnwise(w.detach())[0])


@pytest.mark.gpu
@pytest.mark.parametrize("K", [2048, 4096], ids=["one-pass", "two-pass"])
@pytest.mark.parametrize("master", [torch.float32, torch.bfloat16], ids=["fp32-master", "bf16"])
def test_fused_update_on_cuda_is_the_plain_update_and_the_quantizer(K, master):
    """On the GPU (the conversion instruction, ``tl.debug_barrier`` between a row's stores and
    loads): weights and moments bit-equal to the plain kernel, rows to ``quantize_rowwise``."""
    G, N = 4, 512
    lr, step = torch.tensor(1e-3, device="cuda"), torch.tensor(5.0, device="cuda")
    scale = torch.tensor(0.7, device="cuda")
    fused, plain = state(G, N, K, master, 11), state(G, N, K, master, 11)
    fused = [t.cuda() for t in fused]
    plain = [t.cuda() for t in plain]
    out = out_plain = None
    if master == torch.float32:
        out = torch.empty(G * N * K, dtype=torch.bfloat16, device="cuda")
        out_plain = torch.empty_like(out)
    q = torch.empty(G * N, K, dtype=torch.float8_e4m3fn, device="cuda")
    s = torch.empty(G * N, device="cuda")
    adamw_step_(*fused, lr, step, scale, out=out, rows=(q, s), **HYPER)
    adamw_step_(*plain, lr, step, scale, out=out_plain, **HYPER)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a, b)
    if out is not None:
        assert torch.equal(out, out_plain)
    want_q, want_s = quantize_rowwise((fused[0] if out is None else out).view(G * N, K))
    assert same_bytes(q, want_q) and torch.equal(s, want_s)
