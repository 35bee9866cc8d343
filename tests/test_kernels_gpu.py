"""The kernels at OLMoE-1B-7B sizes on a GPU (T=16384 tokens, top-8 of 64 experts, d 2048,
expert hidden 1024, bf16): equal to the references (the FP8 quantizers byte for byte),
deterministic, free of host syncs, and capturable in a CUDA graph. Run with ``pytest -m gpu``
on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from helpers import no_host_sync
from kernel_cases import assert_matches, output_and_grad, permute_combine_round_trip

from benchmarks.baselines import weighted_combine_triton
from benchmarks.baselines.router_topk import topk_softmax, topk_softmax_reference
from benchmarks.baselines.weighted_combine import (
    combine_from_slots,
    combine_from_slots_reference_backward,
)
from moe_kernels import slot_permute_triton
from moe_kernels.fp8 import (
    _scaled_mm,
    fp8_grouped_mm,
    quantize_columnwise,
    quantize_columnwise_reference,
)
from moe_kernels.grouped_gemm import grouped_mm
from moe_kernels.routing import expert_slots, expert_slots_reference
from moe_kernels.slot_permute import (
    combine_from_slots_reference,
    permute_to_slots,
    permute_to_slots_reference,
    permute_to_slots_reference_backward,
)
from moe_kernels.swiglu import swiglu, swiglu_reference

pytestmark = pytest.mark.gpu

T, K, E, D, F = 16384, 8, 64, 2048, 1024
BF16 = torch.bfloat16


def olmoe_routing(skewed: bool, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts_TK, weights_TK) from random router logits; ``skewed`` tilts them so a few
    experts take most tokens and several get none."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    if skewed:
        logits = logits + torch.linspace(-12.0, 4.0, E, device="cuda")
    probs = torch.softmax(logits, -1)
    weights, experts = torch.topk(probs, K, dim=-1)
    return experts, weights


def bf16_randn(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", generator=gen).to(BF16)


@pytest.mark.parametrize("align", [1, 16])
@pytest.mark.parametrize("skewed", [False, True], ids=["uniform", "skewed"])
def test_expert_slots_gpu_equal_reference(skewed, align):
    experts_TK, _ = olmoe_routing(skewed)
    got, ref = expert_slots(experts_TK, E, align), expert_slots_reference(experts_TK, E, align)
    for a, b in zip(got[:3], ref[:3], strict=True):
        assert torch.equal(a, b)
    assert got.n_rows == ref.n_rows
    if skewed:
        assert (ref.counts_E == 0).any()


@pytest.mark.parametrize("align", [1, 16])
def test_permute_and_combine_gpu_equal_reference(align):
    experts_TK, weights_TK = olmoe_routing(skewed=False)
    slot_TK, _, _, n_rows = expert_slots(experts_TK, E, align)
    x_TD, g_MD, dy_TD = (
        bf16_randn(T, D, seed=1),
        bf16_randn(n_rows, D, seed=2),
        bf16_randn(T, D, seed=3),
    )
    args = (x_TD, slot_TK, n_rows, weights_TK, g_MD, dy_TD)
    got = permute_combine_round_trip(permute_to_slots, combine_from_slots, *args)
    references = (permute_to_slots_reference, combine_from_slots_reference)
    ref = permute_combine_round_trip(*references, *args)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)


# Expert parallelism over 2 ranks: this rank holds experts [0, 32) of 64 and receives about
# every token of both ranks (top-8 of 64 leaves a token without an expert here with p ~ 0.2 %);
# choices that live on the other rank are dropped (-1).
EP, E_LOCAL = 2, E // 2


def receiver_routing(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(local_ids_RK with -1 for the other rank's experts, weights_RK, kept assignments) for
    R = 2 * T received tokens, every one with at least one kept choice."""
    experts_a, weights_a = olmoe_routing(skewed=False, seed=seed)
    experts_b, weights_b = olmoe_routing(skewed=True, seed=seed + 1)
    experts_RK, weights_RK = torch.cat([experts_a, experts_b]), torch.cat([weights_a, weights_b])
    here_R = (experts_RK < E_LOCAL).any(1)  # the tokens that visit this rank
    experts_RK, weights_RK = experts_RK[here_R], weights_RK[here_R]
    local_RK = torch.where(experts_RK < E_LOCAL, experts_RK, -1)
    return local_RK, weights_RK, int((local_RK >= 0).sum())


def padded_rows(local_RK: torch.Tensor, align: int) -> int:
    """The exact buffer a receiver sizes: kept assignments, each expert's segment padded."""
    counts_E = torch.bincount(local_RK[local_RK >= 0], minlength=E_LOCAL)
    return int(((counts_E + align - 1) // align * align).sum())


@pytest.mark.parametrize("align", [1, 16])
def test_expert_slots_with_dropped_assignments_gpu_equal_reference(align):
    local_RK, _, kept = receiver_routing()
    assert 0 < kept < local_RK.numel()
    n_rows = padded_rows(local_RK, align)
    for rows in (None, n_rows):
        got = expert_slots(local_RK, E_LOCAL, align, rows)
        ref = expert_slots_reference(local_RK, E_LOCAL, align, rows)
        for a, b in zip(got[:3], ref[:3], strict=True):
            assert torch.equal(a, b)
        assert got.n_rows == ref.n_rows
        assert int((got.slot_TK < 0).sum()) == local_RK.numel() - kept
    if align == 1:
        assert n_rows == kept


@pytest.mark.parametrize("align", [1, 16])
def test_permute_and_combine_with_dropped_assignments_gpu(align):
    """The receiver's path at full size: every output element written (NaN-poisoned), equal to
    the references; with align=1 the buffer is exactly the kept rows (no zero-fill pass)."""
    local_RK, weights_RK, kept = receiver_routing(seed=3)
    R, K_ = local_RK.shape
    n_rows = padded_rows(local_RK, align)
    slot_RK, _, _, _ = expert_slots(local_RK, E_LOCAL, align, n_rows)
    mapped = align == 1
    assert (n_rows == kept) == mapped
    x_RD, dy_RD = bf16_randn(R, D, seed=4), bf16_randn(R, D, seed=5)
    y_MD = bf16_randn(n_rows, D, seed=6)
    nan = float("nan")

    x_MD = torch.full((n_rows, D), nan, dtype=BF16, device="cuda")
    slot_permute_triton.scatter_rows(x_RD, slot_RK, n_rows, zero_unmapped=not mapped, out=x_MD)
    assert torch.equal(x_MD, permute_to_slots_reference(x_RD, slot_RK, n_rows))

    dx_RD = torch.full((R, D), nan, dtype=BF16, device="cuda")
    slot_permute_triton.gather_rows(y_MD, slot_RK, out_dtype=BF16, out=dx_RD)
    assert_matches(dx_RD, permute_to_slots_reference_backward(y_MD, slot_RK))

    w_nan_RK = torch.where(slot_RK < 0, nan, weights_RK)  # never read for dropped slots
    out_RD = torch.full((R, D), nan, dtype=BF16, device="cuda")
    weighted_combine_triton.combine_forward(y_MD, slot_RK, w_nan_RK, out_dtype=BF16, out=out_RD)
    assert_matches(out_RD, combine_from_slots_reference(y_MD, slot_RK, weights_RK))

    dy_MD = torch.full((n_rows, D), nan, dtype=BF16, device="cuda")
    dw_RK = torch.full((R, K_), nan, device="cuda")
    weighted_combine_triton.combine_backward(
        dy_RD,
        y_MD,
        slot_RK,
        w_nan_RK,
        n_rows,
        zero_unmapped=not mapped,
        out_rows=dy_MD,
        out_dw=dw_RK,
    )
    ref_MD, ref_w = combine_from_slots_reference_backward(dy_RD, y_MD, slot_RK, weights_RK, n_rows)
    assert_matches(dy_MD, ref_MD)
    assert_matches(dw_RK, ref_w)
    assert (dw_RK[slot_RK < 0] == 0).all()


def test_send_buffer_slot_map_and_rank_sum_gpu():
    """The sender's path: a [T, P] slot map (ranks as experts, -1 where a token does not visit
    a rank) builds the send buffer, and summing the returned rows over ranks (weights 1) is
    the reference's, forward and backward, and bitwise repeatable."""
    experts_TK, _ = olmoe_routing(skewed=True, seed=7)
    rank_TK = experts_TK // E_LOCAL
    visits_TP = torch.zeros(T, EP, dtype=torch.bool, device="cuda")
    visits_TP.scatter_(1, rank_TK, True)
    ids_TP = torch.where(visits_TP, torch.arange(EP, device="cuda"), -1)
    n_send = int(visits_TP.sum())
    slot_TP, counts_P, _, _ = expert_slots(ids_TP, EP, n_rows=n_send)
    ref = expert_slots_reference(ids_TP, EP, n_rows=n_send)
    assert torch.equal(slot_TP, ref.slot_TK) and torch.equal(counts_P, visits_TP.sum(0))
    x_TD, dy_TD = bf16_randn(T, D, seed=8), bf16_randn(T, D, seed=9)
    ones_TP = torch.ones(T, EP, device="cuda")

    def run(permute, combine, **flag):
        x = x_TD.clone().requires_grad_()
        x_SD = permute(x, slot_TP, n_send, **flag)
        y_TD = combine(x_SD * 0.5, slot_TP, ones_TP, **flag)
        (dx_TD,) = torch.autograd.grad(y_TD, x, dy_TD)
        return x_SD.detach(), y_TD.detach(), dx_TD

    got = run(permute_to_slots, combine_from_slots, every_row_mapped=True)
    ref = run(permute_to_slots_reference, combine_from_slots_reference)
    assert torch.equal(got[0], ref[0])
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    again = run(permute_to_slots, combine_from_slots, every_row_mapped=True)
    assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True))


def test_swiglu_gpu_equal_reference():
    h = bf16_randn(T * K, 2 * F, seed=4)
    da = bf16_randn(T * K, F, seed=5)
    a_got, dh_got = output_and_grad(swiglu, h, da)
    a_ref, dh_ref = output_and_grad(swiglu_reference, h, da)
    assert_matches(a_got, a_ref)
    assert_matches(dh_got, dh_ref)


def test_topk_softmax_gpu_equal_reference():
    gen = torch.Generator(device="cuda").manual_seed(6)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    w, ex, p = topk_softmax(logits, K, None, True)
    w_ref, ex_ref, p_ref = topk_softmax_reference(logits, K, None, True)
    torch.testing.assert_close(p, p_ref)
    # exp differs by an ulp between the kernel and torch, which may swap two (near-)tied
    # experts: require the chosen probabilities to be the reference's, and almost all ids equal
    torch.testing.assert_close(p_ref.gather(1, ex), p_ref.gather(1, ex_ref), rtol=0, atol=1e-6)
    assert (ex == ex_ref).float().mean() > 0.999
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)


def test_backward_is_bitwise_deterministic_gpu():
    experts_TK, weights_TK = olmoe_routing(skewed=True)
    slot_TK, _, _, n_rows = expert_slots(experts_TK, E, 16)
    x_TD, dy_TD = bf16_randn(T, D, seed=7), bf16_randn(T, D, seed=8)

    def grads():
        x = x_TD.clone().requires_grad_()
        w = weights_TK.clone().requires_grad_()
        y = combine_from_slots(permute_to_slots(x, slot_TK, n_rows), slot_TK, w)
        return torch.autograd.grad(y, (x, w), dy_TD)

    first, second = grads(), grads()
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_permute_past_int32_offsets_gpu():
    """n_rows * D > 2**31: the row offsets must be computed in int64."""
    n_tokens, k, dim = 32768, 8, 8200
    gen = torch.Generator(device="cuda").manual_seed(9)
    experts_TK = torch.randint(0, E, (n_tokens, k), device="cuda", generator=gen)
    slot_TK, _, _, n_rows = expert_slots(experts_TK, E)
    assert n_rows * dim > 2**31
    x_TD = torch.randn(n_tokens, dim, device="cuda", generator=gen).to(BF16)
    x_MD = permute_to_slots(x_TD, slot_TK, n_rows)
    last = slot_TK.reshape(-1).argmax()  # the assignment in the last row
    torch.testing.assert_close(x_MD[-1], x_TD[last // k], rtol=0, atol=0)
    assert torch.equal(x_MD, permute_to_slots_reference(x_TD, slot_TK, n_rows))
    del x_MD
    dx_TD = combine_from_slots(
        permute_to_slots_reference(x_TD, slot_TK, n_rows),
        slot_TK,
        torch.ones(n_tokens, k, device="cuda"),
    )
    torch.testing.assert_close(dx_TD.float(), k * x_TD.float(), rtol=1e-2, atol=1e-2)


def moe_experts(x_TD, logits_TE, w_gate_up, w_down, align):
    """Router top-k -> slots -> permute -> gate/up GEMM -> SwiGLU -> down GEMM -> combine."""
    weights_TK, experts_TK, _ = topk_softmax(logits_TE, K)
    slot_TK, _, offs_E, n_rows = expert_slots(experts_TK, E, align)
    x_MD = permute_to_slots(x_TD, slot_TK, n_rows)
    h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offs_E)
    y_MD = grouped_mm(swiglu(h_M2F), w_down.transpose(-2, -1), offs_E)
    return combine_from_slots(y_MD, slot_TK, weights_TK)


def test_moe_path_without_host_sync_and_in_a_cuda_graph_gpu():
    x_TD = bf16_randn(T, D, seed=10).requires_grad_()
    logits_TE = torch.randn(T, E, device="cuda").requires_grad_()
    w_gate_up = (bf16_randn(E, 2 * F, D, seed=11) * 0.02).requires_grad_()
    w_down = (bf16_randn(E, D, F, seed=12) * 0.02).requires_grad_()
    leaves = (x_TD, logits_TE, w_gate_up, w_down)

    y = moe_experts(*leaves, align=16)  # warm-up: kernels compiled, library handles created
    torch.autograd.grad(y.float().square().mean(), leaves)
    with no_host_sync():
        y = moe_experts(*leaves, align=16)
        grads = torch.autograd.grad(y.float().square().mean(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)

    with torch.no_grad():
        eager = moe_experts(*leaves, align=16)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe_experts(*leaves, align=16)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe_experts(*leaves, align=16)
        graph.replay()
        torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager)  # the library GEMM need not be bitwise stable


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_fp8_weight_quantized_over_n_and_the_input_gradient_gpu(which):
    """The columnwise quantizer equals the rowwise quantization of the transposed copy byte for
    byte at the expert weights' sizes, and FP8 experts' input gradient is bit for bit the one
    that copy gave (skewed routing: empty and overloaded experts)."""
    N, Kw = (2 * F, D) if which == "gate_up" else (D, F)
    w_ENK = bf16_randn(E, N, Kw, seed=20) * 0.02
    w_ENK[:, :, 0] = 0.0  # a zero column in every expert
    w_ENK[:, 5, 1] = 30.0  # an outlier
    q, s = quantize_columnwise(w_ENK)
    rq, rs = quantize_columnwise_reference(w_ENK)
    assert q.shape == (E, Kw, N) and torch.equal(s, rs)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))

    experts_TK, _ = olmoe_routing(skewed=True)
    offs_E = torch.bincount(experts_TK.flatten(), minlength=E).cumsum(0).to(torch.int32)
    x_MK = bf16_randn(T * K, Kw, seed=21).requires_grad_()
    dy_MN = bf16_randn(T * K, N, seed=22)
    (dx,) = torch.autograd.grad(fp8_grouped_mm(x_MK, w_ENK, offs_E), (x_MK,), dy_MN)
    before = _scaled_mm(dy_MN, w_ENK.transpose(-2, -1).contiguous(), offs_E, BF16)
    assert torch.isfinite(dx).all() and torch.equal(dx, before)
