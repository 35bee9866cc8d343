"""The kernel tests' fp32 tolerance: loose enough for a long sum added in another order, tight
enough that one wrong or missing term fails."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import assert_matches, fp32_atol

N, L = 4096, 2048  # 4096 dot products of length 2048, like a weight gradient over d_model


def dot_products() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(terms_NL fp32, fp32 sums in one order, fp32 sums in another): products of normals,
    so some sums cancel to near zero while the largest are O(100)."""
    gen = torch.Generator().manual_seed(0)
    terms_NL = torch.randn(N, L, generator=gen) * torch.randn(N, L, generator=gen)
    forward = terms_NL.sum(1)
    # Another order: 16 interleaved partial sums, then those summed in reverse.
    blocked = terms_NL.view(N, L // 16, 16).sum(1).flip(1).cumsum(1)[:, -1]
    return terms_NL, forward, blocked


def test_a_reordered_long_sum_passes():
    _, forward, blocked = dot_products()
    assert not torch.equal(forward, blocked), "the orders should round differently"
    worst = (forward - blocked).abs().max().item()
    assert worst > 1e-6, f"the test needs visible rounding differences, got {worst:.1e}"
    assert_matches(blocked, forward)
    # A fixed 1e-5 fails here (as it failed on the GPU for weight gradients); the scaled
    # tolerance leaves room above the observed difference.
    with pytest.raises(AssertionError):
        torch.testing.assert_close(blocked, forward, rtol=1e-5, atol=1e-5)
    assert fp32_atol(forward) > 3 * worst


def test_one_dropped_term_fails():
    terms_NL, forward, _ = dot_products()
    # Leave out one typical (median-sized) term of one sum.
    row = int(forward.abs().argmin())
    col = int(terms_NL[row].abs().argsort()[L // 2])
    assert terms_NL[row, col].abs() > 0.1
    wrong = forward.clone()
    wrong[row] -= terms_NL[row, col]
    with pytest.raises(AssertionError):
        assert_matches(wrong, forward)


def test_one_swapped_output_fails():
    _, forward, _ = dot_products()
    wrong = forward.clone()
    wrong[[0, 1]] = wrong[[1, 0]]
    with pytest.raises(AssertionError):
        assert_matches(wrong, forward)
