"""Fused softmax router top-k: Triton equals the PyTorch reference (experts exactly, weights,
probabilities and the logits' gradient closely), with and without bias and renormalization."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, E, T, assert_triton_path, randn

from benchmarks.baselines import router_topk_triton
from benchmarks.baselines.router_topk import (
    topk_softmax,
    topk_softmax_reference,
    topk_softmax_reference_backward,
)


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
@pytest.mark.parametrize("biased", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k", [1, 2, 8])
def test_topk_softmax_equals_reference(k, biased, normalize):
    logits = randn(T, E, seed=k) * 2
    bias = randn(E, seed=100) * 0.05 if biased else None
    assert_triton_path(logits)
    g_w, g_p = randn(T, k, seed=7), randn(T, E, seed=8)
    outs = []
    for fn in (topk_softmax, topk_softmax_reference):
        x = logits.clone().requires_grad_()
        w, experts, p = fn(x, k, bias, normalize)
        ((w * g_w).sum() + (p * g_p).sum()).backward()
        outs.append((w.detach(), experts, p.detach(), x.grad))
    (w, ex, p, dl), (w_ref, ex_ref, p_ref, dl_ref) = outs
    assert ex.dtype == torch.int64 and torch.equal(ex, ex_ref)
    for got, ref in ((w, w_ref), (p, p_ref), (dl, dl_ref)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    if biased:  # the bias moved the choice for some token, else the test proves nothing
        assert not torch.equal(ex, topk_softmax_reference(logits, k)[1])


def test_topk_softmax_kernel_on_many_blocks_writes_everything():
    n_tokens, n_experts, k = 70, 40, 4  # two 64-token blocks; 40 experts in a 64-wide tile
    logits = randn(n_tokens, n_experts, seed=9)
    w, ex, p = router_topk_triton.topk_softmax_forward(logits, k, None, True)
    w_ref, ex_ref, p_ref = topk_softmax_reference(logits, k, None, True)
    assert torch.equal(ex, ex_ref)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(p, p_ref)
    dp, dw = randn(n_tokens, n_experts, seed=10), randn(n_tokens, k, seed=11)
    dl = router_topk_triton.topk_softmax_backward(p_ref, ex_ref, dp, dw, True)
    torch.testing.assert_close(dl, topk_softmax_reference_backward(p_ref, ex_ref, dp, dw, True))


@pytest.mark.parametrize("normalize", [False, True], ids=["raw", "normalized"])
def test_topk_softmax_reference_backward_is_its_derivative(normalize):
    logits = randn(T, E, dtype=torch.float64, seed=12).requires_grad_()
    w, ex, p = topk_softmax_reference(logits, 3, None, normalize)
    g_w, g_p = randn(T, 3, dtype=torch.float64, seed=13), randn(T, E, dtype=torch.float64, seed=14)
    (dl,) = torch.autograd.grad((w * g_w).sum() + (p * g_p).sum(), logits)
    ref = topk_softmax_reference_backward(p.detach(), ex, g_p, g_w, normalize)
    torch.testing.assert_close(ref, dl)


def test_topk_softmax_rejects_non_fp32_logits():
    with pytest.raises(TypeError):
        topk_softmax(torch.zeros(2, 4, device=DEVICE, dtype=torch.bfloat16), 2)
