"""The weighted combine baseline (benchmarks/baselines/weighted_combine.py) and the argsort path
(benchmarks/baselines/argsort_permute.py): Triton equals the reference forward and backward,
its backward kernel writes every row, and the slot path equals the argsort path."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    SLOT_DTYPES,
    D,
    E,
    T,
    assert_matches,
    assert_triton_path,
    dropped_slot_case,
    padding_mask,
    rand_weights,
    randn,
    round_trips,
    routing,
    slot_case,
)

from benchmarks.baselines import weighted_combine_triton
from benchmarks.baselines.argsort_permute import combine_rows, expert_order, permute_rows
from benchmarks.baselines.weighted_combine import (
    combine_from_slots,
    combine_from_slots_reference_backward,
)
from moe_kernels.routing import expert_slots_reference
from moe_kernels.slot_permute import combine_from_slots_reference, permute_to_slots


@pytest.mark.parametrize("dtype", SLOT_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pattern", "align"), [("none", 1), ("none", 8), ("mixed", 8)])
def test_weighted_combine_autograd_equals_reference(pattern, align, dtype):
    """Permute, then the weighted combine: outputs and every gradient equal the references,
    with padding and with dropped assignments (which get no weight gradient)."""
    k = 4
    if pattern == "none":
        slot_TK, n_rows, x_TD = slot_case("with-repeats", k, align, dtype)
        mapped = None
    else:
        slot_TK, n_rows, mapped, x_TD = dropped_slot_case(
            "with-repeats", k, pattern, align, False, dtype
        )
    assert_triton_path(x_TD)
    got, ref = round_trips(combine_from_slots, slot_TK, n_rows, x_TD, k, dtype, mapped)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert got[3].dtype == torch.float32
    assert (got[3][slot_TK < 0] == 0).all(), "a dropped assignment's weight gets no gradient"


@pytest.mark.parametrize(("pattern", "align"), [("none", 8), ("mixed", 1)])
def test_combine_kernels_write_every_row(pattern, align):
    """NaN-poisoned outputs, many token blocks, a ragged D chunk: every output row, row
    gradient and weight gradient is written (unmapped rows and dropped weights as zeros; NaN
    weights on dropped assignments are never read) and equals the reference."""
    k = 4
    if pattern == "none":
        slot_TK, n_rows, _ = slot_case("two-empty-experts", k, align, torch.float32)
        mapped = None
    else:
        slot_TK, n_rows, mapped, _ = dropped_slot_case(
            "with-repeats", k, pattern, align, False, torch.float32
        )
    assert_triton_path(slot_TK)
    drop_TK = slot_TK < 0
    unmapped = padding_mask(slot_TK.clamp_min(-1), n_rows + 1)[:n_rows]
    assert bool(unmapped.any())
    w_TK = rand_weights(T, k, seed=6)
    w_nan_TK = torch.where(drop_TK, float("nan"), w_TK)
    g_MD, dy_TD = randn(n_rows, D, seed=5), randn(T, D, seed=7)
    y_TD = torch.full((T, D), float("nan"), device=DEVICE)
    weighted_combine_triton.combine_forward(
        g_MD, slot_TK, w_nan_TK, out_dtype=torch.float32, out=y_TD, block_t=8, block_d=16
    )
    assert_matches(y_TD, combine_from_slots_reference(g_MD, slot_TK, w_TK))
    dy_MD = torch.full((n_rows, D), float("nan"), device=DEVICE)
    dw_TK = torch.full((T, k), float("nan"), device=DEVICE)
    weighted_combine_triton.combine_backward(
        dy_TD,
        g_MD,
        slot_TK,
        w_nan_TK,
        n_rows,
        zero_unmapped=not mapped,
        out_rows=dy_MD,
        out_dw=dw_TK,
        block_t=8,
        block_d=16,
    )
    ref_MD, ref_w = combine_from_slots_reference_backward(dy_TD, g_MD, slot_TK, w_TK, n_rows)
    assert_matches(dy_MD, ref_MD)
    assert_matches(dw_TK, ref_w)
    assert (dy_MD[unmapped] == 0).all() and (dw_TK[drop_TK] == 0).all()


def test_combine_without_weight_gradient_keeps_no_rows_and_matches():
    slot_TK, n_rows, _ = slot_case("with-repeats", 8, 8, torch.float32)
    y_MD = randn(n_rows, D, seed=8).requires_grad_()
    w_TK = rand_weights(T, 8)  # no gradient wanted
    assert_triton_path(y_MD)
    out = combine_from_slots(y_MD, slot_TK, w_TK)
    assert out.grad_fn.saved_tensors[0] is None  # type: ignore[union-attr]
    dy_TD = randn(T, D, seed=9)
    out.backward(dy_TD)
    ref_MD, _ = combine_from_slots_reference_backward(dy_TD, None, slot_TK, w_TK, n_rows)
    assert_matches(y_MD.grad, ref_MD)


def test_combine_backward_never_writes_outside_its_buffer():
    slot_TK = torch.arange(6, device=DEVICE).view(3, 2)
    dy_rows = torch.full((8, 4), float("nan"), device=DEVICE)
    weighted_combine_triton.combine_backward(
        randn(3, 4, seed=20), None, slot_TK, rand_weights(3, 2), 5, out_rows=dy_rows[:5]
    )
    assert dy_rows[5:].isnan().all() and not dy_rows[:5].isnan().any()


def test_combine_reference_backward_is_the_derivative_of_its_forward():
    """fp64, with dropped assignments."""
    k = 2
    slot_TK, n_rows, _, _ = dropped_slot_case("with-repeats", k, "mixed", 8, False, torch.float64)
    y_MD = randn(n_rows, D, dtype=torch.float64, seed=12).requires_grad_()
    w_TK = rand_weights(T, k).double().requires_grad_()
    dy_TD = randn(T, D, dtype=torch.float64, seed=13)
    out = combine_from_slots_reference(y_MD, slot_TK, w_TK)
    dy_MD, dw_TK = torch.autograd.grad((out * dy_TD).sum(), (y_MD, w_TK))
    ref_MD, ref_w = combine_from_slots_reference_backward(
        dy_TD, y_MD.detach(), slot_TK, w_TK, n_rows
    )
    torch.testing.assert_close(ref_MD, dy_MD)
    torch.testing.assert_close(ref_w, dw_TK)


def test_slot_path_matches_the_argsort_path():
    """With align=1 the slot permute and the weighted combine equal the argsort baseline's
    permute_rows / combine_rows."""
    experts_TK = routing("two-empty-experts", T, E, 2)
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, 1)
    x_TD, w_TK = randn(T, D, seed=14), rand_weights(T, 2)
    order_M = expert_order(experts_TK)
    assert torch.equal(permute_to_slots(x_TD, slot_TK, n_rows), permute_rows(x_TD, order_M, 2))
    y_MD = randn(n_rows, D, seed=15)
    assert_matches(combine_from_slots(y_MD, slot_TK, w_TK), combine_rows(y_MD, order_M, w_TK))
