"""Fused SwiGLU: Triton equals the PyTorch reference forward and backward, and the reference
backward is the derivative of the reference forward."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_matches, assert_triton_path, output_and_grad, randn

from kernels import swiglu_triton
from kernels._triton import references_only, use_triton
from kernels.swiglu import swiglu, swiglu_reference, swiglu_reference_backward

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
    assert_matches(dh, swiglu_reference_backward(h, da))


def test_swiglu_reference_backward_is_its_derivative():
    h = randn(M, 2 * F, dtype=torch.float64, seed=5).requires_grad_()
    da = randn(M, F, dtype=torch.float64, seed=6)
    (dh,) = torch.autograd.grad((swiglu_reference(h) * da).sum(), h)
    torch.testing.assert_close(swiglu_reference_backward(h.detach(), da), dh)
    # and the reference is the model's formula: gate first, up second
    gate, up = h.detach().chunk(2, dim=1)
    torch.testing.assert_close(swiglu_reference(h.detach()), torch.nn.functional.silu(gate) * up)


def test_swiglu_rejects_odd_width():
    with pytest.raises(ValueError):
        swiglu(torch.zeros(4, 7, device=DEVICE))


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
