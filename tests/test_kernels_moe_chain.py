"""The slot path end to end (slots -> permute -> grouped GEMMs -> SwiGLU scaled by the router
weights -> sum) computes the MoE experts as a per-expert loop does, forward and every gradient,
padded segments or not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import D, E, T, assert_triton_path, rand_weights, randn, routing

from moe_kernels.grouped_gemm import grouped_mm
from moe_kernels.routing import expert_slots
from moe_kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots
from moe_kernels.swiglu import swiglu

HIDDEN = 24


def slot_path(x_TD, experts_TK, weights_TK, w_gate_up, w_down, align):
    """The layer's path: the router weights scale the SwiGLU rows, the combine is a plain sum."""
    slot_TK, _, offs_E, n_rows = expert_slots(experts_TK, E, align)
    x_MD = permute_to_slots(x_TD, slot_TK, n_rows)
    h_M2F = grouped_mm(x_MD, w_gate_up.transpose(-2, -1), offs_E)
    a_MF = swiglu(h_M2F, slot_weights(weights_TK, slot_TK, n_rows))
    return sum_from_slots(grouped_mm(a_MF, w_down.transpose(-2, -1), offs_E), slot_TK)


def loop_path(x_TD, experts_TK, weights_TK, w_gate_up, w_down):
    """Every (token, choice) through its expert's SwiGLU, weighted, summed: the definition."""
    y_TD = torch.zeros_like(x_TD)
    for e in range(E):
        tok, k = torch.where(experts_TK == e)
        h = F.linear(x_TD[tok], w_gate_up[e])
        a = F.silu(h[:, :HIDDEN]) * h[:, HIDDEN:]
        y_TD = y_TD.index_add(0, tok, F.linear(a, w_down[e]) * weights_TK[tok, k, None])
    return y_TD


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("name", ["two-empty-experts", "all-on-one"])
def test_slot_path_equals_per_expert_loop(name, k, align):
    experts_TK = routing(name, T, E, k)
    x = randn(T, D, seed=1).requires_grad_()
    assert_triton_path(x)
    w = rand_weights(T, k, seed=2).requires_grad_()
    w_gate_up = (randn(E, 2 * HIDDEN, D, seed=3) * 0.2).requires_grad_()
    w_down = (randn(E, D, HIDDEN, seed=4) * 0.2).requires_grad_()
    leaves = (x, w, w_gate_up, w_down)
    dy = randn(T, D, seed=5)

    y_slot = slot_path(x, experts_TK, w, w_gate_up, w_down, align)
    y_loop = loop_path(x, experts_TK, w, w_gate_up, w_down)
    got = [y_slot.detach(), *torch.autograd.grad(y_slot, leaves, dy)]
    ref = [y_loop.detach(), *torch.autograd.grad(y_loop, leaves, dy)]
    for label, a, b in zip(["y", "dx", "dw", "dw_gate_up", "dw_down"], got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, lb=label: f"{lb}: {m}")
    empty_E = torch.bincount(experts_TK.reshape(-1).cpu(), minlength=E) == 0
    assert empty_E.any() and got[3][empty_E].abs().max() == 0, "an empty expert got gradient"
