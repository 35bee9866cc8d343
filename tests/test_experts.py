"""The grouped-GEMM expert path equals a plain per-expert loop, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config

from kernels.grouped_gemm import (
    grouped_mm,
    grouped_mm_reference,
    grouped_mm_supported,
    grouped_mm_wgrad_reference,
)
from kernels.routing import expert_counts, expert_slots
from kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots
from kernels.swiglu import swiglu
from moe_core.model.moe import MoE, Routing


def loop_experts(x_TD, experts_TK, weights_TK, w_gate_up, w_down):
    """What HF OLMoE computes: for every (token, choice), the chosen expert's SwiGLU, weighted."""
    F_ = w_down.shape[-1]
    y = torch.zeros_like(x_TD)
    for e in range(w_gate_up.shape[0]):
        tok, k = torch.where(experts_TK == e)
        if tok.numel() == 0:
            continue
        h = F.linear(x_TD[tok], w_gate_up[e])
        a = F.silu(h[:, :F_]) * h[:, F_:]
        y = y.index_add(0, tok, F.linear(a, w_down[e]) * weights_TK[tok, k, None].to(x_TD.dtype))
    return y


def routing_cases(T: int, E: int, K: int, gen: torch.Generator):
    """Random routing with two experts starved, and all tokens on one expert (K=1)."""
    allowed = torch.tensor([e for e in range(E) if e not in (0, 3)])
    starved = torch.stack(
        [allowed[torch.randperm(len(allowed), generator=gen)[:K]] for _ in range(T)]
    )
    yield "two-empty-experts", starved, K
    yield "all-on-one", torch.full((T, 1), E - 1), 1


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    out = fn()
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * g.to(out.device)).sum().backward()
    return out.detach(), [t.grad.clone() for t in tensors]


def fused_experts(x, experts_TK, weights, w_gate_up, w_down):
    """The production path (``LocalDispatcher``): rows into expert-ordered slots, grouped GEMMs,
    the SwiGLU scaled by the router weights, the plain sum back to tokens."""
    slot_TK, _, offs, n_rows = expert_slots(experts_TK, w_gate_up.shape[0])
    h = grouped_mm(permute_to_slots(x, slot_TK, n_rows), w_gate_up.transpose(-2, -1), offs)
    a = swiglu(h, slot_weights(weights, slot_TK, n_rows))
    return sum_from_slots(grouped_mm(a, w_down.transpose(-2, -1), offs), slot_TK)


def check_expert_path(device: str, dtype: torch.dtype, rtol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    T, D, Fh, E, K = 48, 64, 32, 8, 2
    names = ["y", "dx", "dweights", "dw_gate_up", "dw_down"]
    for name, experts_TK, k in routing_cases(T, E, K, gen):
        x = torch.randn(T, D, generator=gen).to(device, dtype).requires_grad_()
        weights = torch.rand(T, k, generator=gen).to(device).requires_grad_()
        w_gate_up = (torch.randn(E, 2 * Fh, D, generator=gen) * 0.1).to(device, dtype)
        w_down = (torch.randn(E, D, Fh, generator=gen) * 0.1).to(device, dtype)
        leaves = [x, weights, w_gate_up.requires_grad_(), w_down.requires_grad_()]
        experts_TK = experts_TK.to(device)
        assert grouped_mm_supported(x, w_gate_up.transpose(-2, -1)), "the fast path must be tested"

        y_fast, g_fast = _grads(lambda: fused_experts(x, experts_TK, *leaves[1:]), leaves)  # noqa: B023
        y_ref, g_ref = _grads(lambda: loop_experts(x, experts_TK, *leaves[1:]), leaves)  # noqa: B023
        for label, a, b in zip(names, [y_fast, *g_fast], [y_ref, *g_ref], strict=True):
            err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
            assert err < rtol, f"{name}: {label} relative error {err:.2e} >= {rtol}"
        empty = expert_counts(experts_TK, E) == 0
        assert empty.any() and g_fast[2][empty].abs().max() == 0, "an empty expert got gradient"


def test_expert_path_matches_loop_fp32():
    check_expert_path("cpu", torch.float32, rtol=1e-5)


def test_expert_path_matches_loop_bf16_cpu():
    check_expert_path("cpu", torch.bfloat16, rtol=2e-2)


@pytest.mark.gpu
def test_expert_path_matches_loop_bf16_gpu():
    x = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_supported(x, torch.randn(4, 64, 64, device="cuda", dtype=torch.bfloat16))
    check_expert_path("cuda", torch.bfloat16, rtol=2e-2)


def test_grouped_mm_fast_path_equals_reference_with_empty_groups():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, 16, generator=gen)
    w = torch.randn(4, 16, 24, generator=gen)
    offs = torch.tensor([0, 9, 9, 20], dtype=torch.int32)  # groups 0 and 2 empty
    assert grouped_mm_supported(x, w)
    torch.testing.assert_close(grouped_mm(x, w, offs), grouped_mm_reference(x, w, offs))


def test_grouped_mm_falls_back_where_unsupported():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 6, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    offs = torch.tensor([4, 4, 10], dtype=torch.int32)
    assert not grouped_mm_supported(x, w)
    y = grouped_mm(x, w, offs)
    expected = torch.cat([x[:4] @ w[0], x[4:] @ w[2]])
    torch.testing.assert_close(y, expected)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, offs), (x, w))


def test_moe_layer_matches_loop_including_starved_experts():
    cfg = small_config(n_experts=8, top_k=2)
    moe = MoE(cfg)
    torch.manual_seed(0)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.1)
    # Experts 6 and 7 score far below the rest for every (positive) input: they get no tokens.
    with torch.no_grad():
        moe.router.weight[6:] = -moe.router.weight[6:].abs() - 1.0
    x = torch.rand(2, 24, cfg.d_model, requires_grad=True)
    y, _ = moe(x)
    routing: Routing = moe.router(x.reshape(-1, cfg.d_model))
    assert routing.counts_E[6:].sum() == 0 and routing.counts_E.sum() == 2 * 24 * 2
    ref = loop_experts(
        x.reshape(-1, cfg.d_model),
        routing.experts_TK,
        routing.weights_TK,
        moe.experts.w_gate_up,
        moe.experts.w_down,
    ).view_as(x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    params = [x, moe.router.weight, moe.experts.w_gate_up, moe.experts.w_down]
    grads_fast = torch.autograd.grad((y * g).sum(), params)
    grads_ref = torch.autograd.grad((ref * g).sum(), params)
    for a, b in zip(grads_fast, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert grads_fast[2][6:].abs().max() == 0


@pytest.mark.parametrize("stored_transposed", [True, False])
def test_grouped_mm_weight_gradient_arrives_in_the_weights_layout(stored_transposed):
    """Experts store weights [G, N, K] and use them transposed: their gradient must come back
    contiguous in that layout (autograd would otherwise copy it), and equal the reference."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(30, 16, generator=gen, requires_grad=True)
    offs = torch.tensor([7, 7, 30], dtype=torch.int32)
    shape = (3, 24, 16) if stored_transposed else (3, 16, 24)
    w = torch.randn(*shape, generator=gen, requires_grad=True)
    w_GKN = w.transpose(-2, -1) if stored_transposed else w
    arriving = []  # the gradient autograd hands the parameter, before it stores it
    w.register_hook(lambda g: arriving.append(g))
    y = grouped_mm(x, w_GKN, offs)
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    assert arriving[0].is_contiguous(), "the weight gradient arrived transposed (autograd copies)"
    expected_GKN = grouped_mm_wgrad_reference(x.detach(), dy, offs)
    expected = expected_GKN.transpose(-2, -1) if stored_transposed else expected_GKN
    torch.testing.assert_close(w.grad, expected)
    torch.testing.assert_close(
        x.grad, grouped_mm_reference(dy, w_GKN.detach().transpose(-2, -1), offs)
    )
