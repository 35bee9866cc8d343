"""The grouped-GEMM expert path equals a plain per-expert loop, forward and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import small_config
from kernel_cases import ROUTING_NAMES, drop_assignments, routing

from moe_core.model.kernel_choice import Kernels
from moe_core.model.moe import MoE, Routing
from moe_kernels.grouped_gemm import (
    gathered_grouped_mm,
    grouped_mm,
    grouped_mm_reference,
    grouped_mm_supported,
    grouped_mm_wgrad_reference,
)
from moe_kernels.routing import expert_counts, expert_slots
from moe_kernels.slot_permute import permute_to_slots, slot_tokens, slot_weights, sum_from_slots
from moe_kernels.swiglu import swiglu


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


def _gathered_and_permuted(experts_TK, n_experts: int, align: int, drops: str):
    """The gathered op and permute + grouped GEMM on one routing (fp32, CPU): outputs, the
    gradients of x and w for one upstream gradient (random on every row, padding included),
    the valid-row mask, and the shapes each path saved for backward."""
    T, experts_TK = experts_TK.shape[0], experts_TK.cpu()
    if drops != "none":
        experts_TK = drop_assignments(experts_TK, drops)
    slots = expert_slots(experts_TK, n_experts, align)
    idx_M = slot_tokens(slots.slot_TK, slots.n_rows)
    mapped = None if drops == "none" else False  # dropped slots leave rows unmapped
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, 40, generator=gen, requires_grad=True)
    w_GNK = torch.randn(n_experts, 24, 40, generator=gen, requires_grad=True)  # stored [G, N, K]
    g = torch.randn(slots.n_rows, 24, generator=gen)
    paths = {
        "gathered": lambda: gathered_grouped_mm(
            x, idx_M, w_GNK.transpose(-2, -1), slots.offs_E, slots.slot_TK, every_row_mapped=mapped
        ),
        "permuted": lambda: grouped_mm(
            permute_to_slots(x, slots.slot_TK, slots.n_rows, every_row_mapped=mapped),
            w_GNK.transpose(-2, -1),
            slots.offs_E,
        ),
    }
    results = {}
    for name, fn in paths.items():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(tuple(t.shape)) or t, lambda t: t
        ):
            y = fn()
        results[name] = (y, *torch.autograd.grad(y, (x, w_GNK), g), saved)
    valid_M = torch.zeros(slots.n_rows, dtype=torch.bool)
    valid_M[slots.slot_TK[slots.slot_TK >= 0]] = True
    return results, valid_M, slots


@pytest.mark.parametrize("align", [1, 4])
@pytest.mark.parametrize("drops", ["none", "mixed", "all"])
@pytest.mark.parametrize("routing_name", ROUTING_NAMES)
def test_gathered_grouped_mm_equals_permute_then_grouped_mm(routing_name, drops, align):
    """Gathered rows (``idx_M``) give the permuted path's output and both gradients, on empty
    experts, every token on one expert, repeated choices, dropped slots and padding rows (the
    upstream gradient is random there too: padding adds nothing to dw), and keep no [M, D] row
    copy for backward where the permuted path keeps one."""
    results, valid_M, slots = _gathered_and_permuted(
        routing(routing_name, 37, 12, 3), 12, align, drops
    )
    (y, dx, dw, saved), (y_ref, dx_ref, dw_ref, saved_ref) = (
        results["gathered"],
        results["permuted"],
    )
    for label, got, ref in [("y", y, y_ref), ("dx", dx, dx_ref), ("dw", dw, dw_ref)]:
        torch.testing.assert_close(got, ref, msg=label)
    assert (~valid_M).any() == (drops != "none" or align > 1), "the case lacks its padding rows"
    assert torch.equal(y[~valid_M], torch.zeros_like(y[~valid_M])), "a padding row is not zero"
    empty_E = slots.counts_E == 0
    assert torch.equal(dw[empty_E], torch.zeros_like(dw[empty_E])), "an empty expert has dw"
    rows_MD = (slots.n_rows, 40)
    assert rows_MD in saved_ref and rows_MD not in saved, saved


def test_local_dispatcher_gathers_rows_exactly_when_asked_and_quack_runs(monkeypatch):
    """Unless asked for (``parallel.gather_rows``), and off QuACK (here: no GPU), the layer
    permutes, as before. Asked for and where the gathered GEMM runs (forced here, through its
    CPU reference) the layer takes it and gives the same output and gradients; FP8 experts never
    gather (they quantize the rows in the permute, ``Experts.routed``)."""
    from moe_core.model import moe as moe_module

    cfg = small_config(n_experts=8, top_k=2)
    layer = MoE(cfg)
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.rand(2, 12, cfg.d_model, requires_grad=True)
    params = [x, layer.router.weight, layer.experts.w_gate_up, layer.experts.w_down]
    assert not layer.experts.gathers_rows(x.reshape(-1, cfg.d_model))
    monkeypatch.setattr(moe_module, "gathers_in_gemm", lambda x_TD, backend: True)
    assert not layer.experts.gathers_rows(x.reshape(-1, cfg.d_model)), "off unless asked for"
    layer.experts.kernels = Kernels(gather_rows=True)
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return gathered_grouped_mm(*args, **kwargs)

    monkeypatch.setattr(moe_module, "gathered_grouped_mm", counted)
    results = []
    for gathers in (False, True):
        monkeypatch.setattr(moe_module, "gathers_in_gemm", lambda x_TD, backend, on=gathers: on)
        y, _ = layer(x)
        results.append((y, *torch.autograd.grad(y.square().sum(), params)))
        assert len(calls) == int(gathers)
    for got, ref in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, ref)
    layer.experts.kernels = Kernels(gather_rows=True, fp8_experts=True)
    assert not layer.experts.gathers_rows(x.reshape(-1, cfg.d_model))


def test_gathers_in_gemm_only_where_quack_runs_and_not_in_references_only(monkeypatch):
    """The gathered GEMM runs in QuACK exactly where QuACK's products run, on rows it can read
    (unit stride, 16-byte aligned), and never inside ``references_only()`` (the unfused model)."""
    from moe_kernels import grouped_gemm as gg
    from moe_kernels._triton import references_only

    x_TD = torch.randn(8, 16)
    assert not gg.gathers_in_gemm(x_TD)  # no QuACK here
    monkeypatch.setattr(gg, "_quack_runs", lambda x, backend: True)
    assert gg.gathers_in_gemm(x_TD)
    assert not gg.gathers_in_gemm(x_TD[:, 1:]), "a row start off 16 bytes"
    assert not gg.gathers_in_gemm(x_TD.t()), "rows with a non-unit stride"
    with references_only():
        assert not gg.gathers_in_gemm(x_TD)
