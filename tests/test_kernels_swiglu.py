"""Fused SwiGLU, plain and row-weighted: Triton equals the PyTorch reference forward and
backward, and the reference backward is the derivative of the reference forward."""

from __future__ import annotations

import contextlib

import pytest
import torch
from kernel_cases import (
    DEVICE,
    assert_matches,
    assert_triton_path,
    output_and_grad,
    rand_weights,
    randn,
)

from moe_kernels import swiglu_triton
from moe_kernels._triton import references_only, use_triton
from moe_kernels.swiglu import (
    swiglu,
    swiglu_grads,
    swiglu_reference,
    swiglu_reference_backward,
    swiglu_values,
)

M, F = 33, 20  # neither a power of two nor a block multiple


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_autograd_equals_reference(dtype):
    h = randn(M, 2 * F, dtype=dtype, seed=1)
    da = randn(M, F, dtype=dtype, seed=2)
    assert_triton_path(h)
    a_got, dh_got = output_and_grad(swiglu, h, da)
    a_ref, dh_ref = output_and_grad(swiglu_reference, h, da)
    assert_matches(a_got, a_ref)
    assert_matches(dh_got, dh_ref)
    assert a_got.shape == (M, F) and dh_got.dtype == dtype


def _weighted_output_and_grads(fn, h, w, da):
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    a = fn(h, w)
    a.backward(da)
    return a.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_row_weighted_swiglu_equals_reference_and_the_scaled_plain_one(dtype):
    """Weights in [0.1, 1) and one zero (a padding row): a = w * swiglu(h), dh scaled by w, and
    dw the row sum of da * swiglu(h) in fp32."""
    h = randn(M, 2 * F, dtype=dtype, seed=1)
    da = randn(M, F, dtype=dtype, seed=2)
    w = rand_weights(M, 1, seed=3)[:, 0]
    w[5] = 0.0
    assert_triton_path(h)
    got = _weighted_output_and_grads(swiglu, h, w, da)
    ref = _weighted_output_and_grads(swiglu_reference, h, w, da)
    for g, r in zip(got, ref, strict=True):
        assert_matches(g, r)
    assert got[2].dtype == torch.float32 and got[1][5].abs().max() == 0
    # the definition: the plain SwiGLU, scaled per row (computed in fp64)
    h64, w64, da64 = h.double(), w.double(), da.double()
    a_plain = swiglu_reference(h64)
    torch.testing.assert_close(got[0].double(), a_plain * w64[:, None], **_tol(dtype))
    torch.testing.assert_close(got[2].double(), (da64 * a_plain).sum(1), **_tol(dtype, 40))


def _tol(dtype: torch.dtype, terms: int = 1) -> dict:
    return (
        {"rtol": 1e-5, "atol": 1e-5 * terms}
        if dtype == torch.float32
        else {"rtol": 2e-2, "atol": 2e-2 * terms}
    )


def test_row_weighted_swiglu_sums_its_weight_gradient_over_column_blocks():
    """F wider than one column block: the per-block partial sums add up to the row sum."""
    h = randn(M, 2 * F, dtype=torch.float32, seed=7)
    da = randn(M, F, dtype=torch.float32, seed=8)
    w = rand_weights(M, 1, seed=9)[:, 0]
    dh, dw, _ = swiglu_triton.swiglu_backward(h, da, w, block_m=8, block_f=8)
    ref_dh, ref_dw = swiglu_reference_backward(h, da, w)
    assert_matches(dh, ref_dh)
    assert_matches(dw, ref_dw)


@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_grads_write_the_forward_output_again_bit_for_bit(dtype, weighted):
    """``swiglu_grads(..., activation=True)`` (what the FP8 expert MLP uses instead of keeping
    the activation) returns the forward's exact bytes with the same gradients, on the Triton
    path over several column blocks and on the reference path."""
    h = randn(M, 2 * F, dtype=dtype, seed=11)
    da = randn(M, F, dtype=dtype, seed=12)
    w = rand_weights(M, 1, seed=13)[:, 0] if weighted else None
    assert_triton_path(h)
    dh, dw, a = swiglu_triton.swiglu_backward(h, da, w, activation=True, block_m=8, block_f=8)
    assert torch.equal(a, swiglu_triton.swiglu_forward(h, w))
    assert_matches(dh, swiglu_reference_backward(h, da, w)[0])
    for refs in (False, True):
        with references_only() if refs else contextlib.nullcontext():
            dh, dw, a = swiglu_grads(h, da, w, activation=True)
            assert torch.equal(a, swiglu_values(h, w))
            ref_dh, ref_dw = swiglu_reference_backward(h, da, w)
            assert_matches(dh, ref_dh)
            assert (dw is None) == (w is None)
            if w is not None:
                assert_matches(dw, ref_dw)
    assert swiglu_grads(h, da, w)[2] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_swiglu_kernels_write_every_element_on_many_blocks(dtype):
    """NaN-poisoned outputs, blocks of 8 x 8: five row blocks and a ragged third column block;
    the input is a column slice of a wider buffer (row stride != 2F)."""
    h = randn(M, 2 * F + 6, dtype=dtype, seed=3)[:, 3 : 3 + 2 * F]
    da = randn(M, F, dtype=dtype, seed=4)
    blocks = dict(block_m=8, block_f=8)
    a = torch.full((M, F), float("nan"), dtype=dtype, device=DEVICE)
    swiglu_triton.swiglu_forward(h, out=a, **blocks)
    assert_matches(a, swiglu_reference(h))
    dh = torch.full((M, 2 * F), float("nan"), dtype=dtype, device=DEVICE)
    swiglu_triton.swiglu_backward(h, da, out=dh, **blocks)
    assert_matches(dh, swiglu_reference_backward(h, da)[0])


def test_swiglu_reference_backward_is_its_derivative():
    h = randn(M, 2 * F, dtype=torch.float64, seed=5).requires_grad_()
    da = randn(M, F, dtype=torch.float64, seed=6)
    (dh,) = torch.autograd.grad((swiglu_reference(h) * da).sum(), h)
    torch.testing.assert_close(swiglu_reference_backward(h.detach(), da)[0], dh)
    w = rand_weights(M, 1, seed=7)[:, 0].double().requires_grad_()
    dh, dw = torch.autograd.grad((swiglu_reference(h, w) * da).sum(), (h, w))
    ref_dh, ref_dw = swiglu_reference_backward(h.detach(), da, w.detach())
    torch.testing.assert_close(ref_dh, dh)
    torch.testing.assert_close(ref_dw, dw)
    # and the reference is the model's formula: gate first, up second
    gate, up = h.detach().chunk(2, dim=1)
    torch.testing.assert_close(swiglu_reference(h.detach()), torch.nn.functional.silu(gate) * up)


def test_swiglu_rejects_odd_width_and_a_misshapen_weight():
    with pytest.raises(ValueError):
        swiglu(torch.zeros(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="weight_M must be"):
        swiglu(torch.zeros(4, 8, device=DEVICE), torch.ones(3, device=DEVICE))


def test_references_only_switches_every_op_to_its_reference(monkeypatch):
    h = randn(M, 2 * F, dtype=torch.float32, seed=3)
    assert_triton_path(h)
    calls = []
    monkeypatch.setattr(swiglu_triton, "swiglu_forward", lambda *a: calls.append(a))
    with references_only():
        assert not use_triton(h)
        torch.testing.assert_close(swiglu(h), swiglu_reference(h))
    assert not calls, "a Triton kernel ran inside references_only()"
    assert use_triton(h)
