"""permute_to_slots, slot_weights and sum_from_slots (the MoE layer's dispatch and combine):
Triton equals the PyTorch reference, forward and backward, on every routing shape, and the
weights applied at the rows then summed equal the weighted combine's reference; outputs are
fully written; padding rows are zero."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    ROUTING_NAMES,
    SLOT_DTYPES,
    D,
    E,
    T,
    assert_matches,
    assert_triton_path,
    drop_assignments,
    dropped_slot_case,
    padding_mask,
    rand_weights,
    randn,
    round_trips,
    routing,
    slot_case,
)

from moe_kernels import slot_permute_triton
from moe_kernels.routing import expert_slots_reference
from moe_kernels.slot_permute import (
    permute_to_slots,
    permute_to_slots_reference,
    permute_to_slots_reference_backward,
    slot_weights,
    sum_from_slots,
)


def weighted_rows_then_sum(y_MD, slot_TK, w_TK, **flags):
    """The MoE layer's combine: each expert row scaled by its assignment's weight (in the
    layer this happens inside the SwiGLU), then the plain sum over the K slots."""
    w_M = slot_weights(w_TK, slot_TK, y_MD.shape[0])
    return sum_from_slots((y_MD.float() * w_M[:, None]).to(y_MD.dtype), slot_TK, **flags)


@pytest.mark.parametrize("dtype", SLOT_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("name", ROUTING_NAMES)
def test_permute_and_combine_autograd_equal_reference(name, k, align, dtype):
    """The whole round trip through the public ops (the router weights at the rows, then the
    plain sum, as the layer combines) against the references (the weighted combine): forward
    outputs and every gradient, the weights' through the row scale."""
    slot_TK, n_rows, x_TD = slot_case(name, k, align, dtype)
    assert_triton_path(x_TD)
    got, ref = round_trips(weighted_rows_then_sum, slot_TK, n_rows, x_TD, k, dtype)
    assert torch.equal(got[0], ref[0]), "permute is a copy: bitwise equal"
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert got[2].dtype == dtype and got[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", SLOT_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("align", [1, 8])
def test_kernels_write_every_row_on_many_blocks(align, dtype):
    """Outputs poisoned with NaN first: every row comes back written (padding rows as zeros),
    with blocks small enough for several token blocks and a ragged last D chunk."""
    slot_TK, n_rows, x_TD = slot_case("two-empty-experts", 2, align, dtype)
    assert_triton_path(x_TD)
    pad = padding_mask(slot_TK, n_rows)
    assert bool(pad.any()) == (align > 1)
    blocks = dict(block_t=8, block_d=16)  # T=37 -> 5 token blocks; D=40 -> chunks 16, 16, 8
    nan = float("nan")

    x_MD = torch.full((n_rows, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.scatter_rows(x_TD, slot_TK, n_rows, out=x_MD, **blocks)
    assert torch.equal(x_MD, permute_to_slots_reference(x_TD, slot_TK, n_rows))
    assert (x_MD[pad] == 0).all()

    g_MD = randn(n_rows, D, dtype=dtype, seed=5)
    dx_TD = torch.full((T, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.gather_rows(g_MD, slot_TK, out_dtype=dtype, out=dx_TD, **blocks)
    assert_matches(dx_TD, permute_to_slots_reference_backward(g_MD, slot_TK))


@pytest.mark.parametrize("pattern", ["none", "mixed"])
def test_permute_reference_backward_is_the_derivative_of_its_forward(pattern):
    """The hand-written reference backward of the permute equals autograd through its reference
    (fp64), with and without dropped assignments."""
    k = 2
    if pattern == "none":
        slot_TK, n_rows, _ = slot_case("with-repeats", k, 8, torch.float64)
    else:
        slot_TK, n_rows, _, _ = dropped_slot_case(
            "with-repeats", k, pattern, 8, False, torch.float64
        )
    x_TD = randn(T, D, dtype=torch.float64, seed=10).requires_grad_()
    g_MD = randn(n_rows, D, dtype=torch.float64, seed=11)
    (dx_TD,) = torch.autograd.grad(
        (permute_to_slots_reference(x_TD, slot_TK, n_rows) * g_MD).sum(), x_TD
    )
    torch.testing.assert_close(permute_to_slots_reference_backward(g_MD, slot_TK), dx_TD)


def test_empty_batch_passes_through():
    """No tokens (an expert-parallel rank may receive none): empty outputs, padding zero."""
    from moe_kernels.routing import expert_slots

    experts_TK = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    slot_TK, counts_E, offs_E, n_rows = expert_slots(experts_TK, E, 8)
    assert counts_E.sum() == 0 and int(offs_E[-1]) == n_rows
    x = torch.empty(0, D, device=DEVICE, requires_grad=True)
    x_MD = permute_to_slots(x, slot_TK, n_rows)
    assert x_MD.shape == (n_rows, D) and (x_MD == 0).all()
    w = torch.empty(0, 2, device=DEVICE, requires_grad=True)
    y = weighted_rows_then_sum(x_MD, slot_TK, w)
    assert y.shape == (0, D)
    y.sum().backward()
    assert x.grad.shape == (0, D) and w.grad.shape == (0, 2)


def test_a_slot_map_that_overruns_its_buffer_never_writes_outside_it():
    """Slots past ``n_rows`` are a caller's bug: the reference raises; the kernels mask every
    row access to the buffer, so they cannot corrupt memory (here: the NaN rows after it)."""
    slot_TK = torch.arange(6, device=DEVICE).view(3, 2)
    x_TD = randn(3, 4, seed=20)
    with pytest.raises(IndexError):
        permute_to_slots_reference(x_TD.cpu(), slot_TK.cpu(), 5)
    big = torch.full((8, 4), float("nan"), device=DEVICE)
    slot_permute_triton.scatter_rows(x_TD, slot_TK, 5, out=big[:5])
    assert torch.equal(big[:5], x_TD.repeat_interleave(2, 0)[:5])
    assert big[5:].isnan().all()


def test_every_row_mapped_cannot_hold_more_rows_than_assignments():
    slot_TK = torch.arange(6, device=DEVICE).view(3, 2)
    with pytest.raises(ValueError, match="cannot map every one"):
        permute_to_slots(torch.ones(3, 4, device=DEVICE), slot_TK, 7, every_row_mapped=True)
    with pytest.raises(ValueError, match=">= 0"):
        permute_to_slots(torch.ones(3, 4, device=DEVICE), slot_TK, -1)


# Dropped assignments (slot -1): every kind of token row (all kept, some dropped, all dropped)
# and the all-dropped routing; the buffer sized by the static bound (unmapped rows at the end
# of the last segment) or exactly to the kept assignments (no unmapped row when align=1).
DROP_CASES = [
    (pattern, align, exact)
    for pattern in ("mixed", "all")
    for align in (1, 8)
    for exact in (False, True)
]
DROP_IDS = [f"{p}-align{a}-{'exact' if e else 'bound'}" for p, a, e in DROP_CASES]


@pytest.mark.parametrize("dtype", SLOT_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pattern", "align", "exact"), DROP_CASES, ids=DROP_IDS)
@pytest.mark.parametrize("name", ["two-empty-experts", "with-repeats"])
def test_dropped_assignments_autograd_equal_reference(name, pattern, align, exact, dtype):
    """Round trip with dropped slots: outputs and gradients equal the reference; dropped
    assignments move no row, add nothing, and get zero gradient (tokens with every choice
    dropped come back zero with zero gradient)."""
    k = 4
    slot_TK, n_rows, mapped, x_TD = dropped_slot_case(name, k, pattern, align, exact, dtype)
    assert_triton_path(x_TD)
    drop_TK = slot_TK < 0
    got, ref = round_trips(weighted_rows_then_sum, slot_TK, n_rows, x_TD, k, dtype, mapped)
    assert torch.equal(got[0], ref[0]), "permute is a copy: bitwise equal"
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert (got[3][drop_TK] == 0).all(), "a dropped assignment's weight gets no gradient"
    all_dropped_T = drop_TK.all(1)
    assert (got[1][all_dropped_T] == 0).all() and (got[2][all_dropped_T] == 0).all()
    if pattern == "mixed":
        assert bool(all_dropped_T.any()) and not bool(all_dropped_T.all())


@pytest.mark.parametrize("dtype", SLOT_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pattern", "align", "exact"), DROP_CASES, ids=DROP_IDS)
def test_kernels_with_dropped_assignments_write_every_row(pattern, align, exact, dtype):
    """NaN-poisoned outputs, many token blocks, a ragged D chunk: every element is written
    (unmapped rows as zeros) and equals the reference."""
    k = 4
    slot_TK, n_rows, mapped, x_TD = dropped_slot_case(
        "with-repeats", k, pattern, align, exact, dtype
    )
    assert_triton_path(x_TD)
    unmapped = padding_mask(slot_TK.clamp_min(-1), n_rows + 1)[:n_rows]  # row n_rows: spare
    if mapped:
        assert not unmapped.any()
    blocks = dict(block_t=8, block_d=16, zero_unmapped=not mapped)
    nan = float("nan")

    x_MD = torch.full((n_rows, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.scatter_rows(x_TD, slot_TK, n_rows, out=x_MD, **blocks)
    assert torch.equal(x_MD, permute_to_slots_reference(x_TD, slot_TK, n_rows))
    assert (x_MD[unmapped] == 0).all()

    del blocks["zero_unmapped"]
    g_MD = randn(n_rows, D, dtype=dtype, seed=5)
    dx_TD = torch.full((T, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.gather_rows(g_MD, slot_TK, out_dtype=dtype, out=dx_TD, **blocks)
    assert_matches(dx_TD, permute_to_slots_reference_backward(g_MD, slot_TK))


def test_dropped_assignments_into_a_full_size_buffer_need_the_flag():
    """Dropped slots into exactly T * K rows leave the last rows unmapped: with
    ``every_row_mapped=False`` they come back zero, as in the reference."""
    experts_TK = drop_assignments(routing("with-repeats", T, E, 2), "mixed")
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, 1)
    assert n_rows == slot_TK.numel() and bool((slot_TK < 0).any())
    x_TD = randn(T, D, seed=16)
    got = permute_to_slots(x_TD, slot_TK, n_rows, every_row_mapped=False)
    assert torch.equal(got, permute_to_slots_reference(x_TD, slot_TK, n_rows))
    tail = int((slot_TK >= 0).sum())
    assert (got[tail:] == 0).all()


def test_sum_from_slots_keeps_only_the_slot_map_and_its_backward_is_the_permute():
    slot_TK, n_rows, _ = slot_case("two-empty-experts", 2, 8, torch.float32)
    y_MD = randn(n_rows, D, seed=10).requires_grad_()
    assert_triton_path(y_MD)
    out = sum_from_slots(y_MD, slot_TK)
    assert [t.shape for t in out.grad_fn.saved_tensors] == [slot_TK.shape]  # type: ignore[union-attr]
    assert_matches(out, permute_to_slots_reference_backward(y_MD.detach(), slot_TK))
    dy_TD = randn(T, D, seed=11)
    out.backward(dy_TD)
    assert torch.equal(y_MD.grad, permute_to_slots_reference(dy_TD, slot_TK, n_rows))


def test_slot_weights_places_each_weight_at_its_slot_and_zero_elsewhere():
    experts_TK = drop_assignments(routing("with-repeats", T, E, 2), "mixed")
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, 8)
    w_TK = rand_weights(T, 2, seed=12).requires_grad_()
    w_M = slot_weights(w_TK, slot_TK, n_rows)
    kept = slot_TK >= 0
    assert torch.equal(w_M[slot_TK[kept]], w_TK.detach()[kept])
    assert int((w_M != 0).sum()) == int(kept.sum())
    g_M = randn(n_rows, seed=13)
    w_M.backward(g_M)
    assert torch.equal(w_TK.grad, torch.where(kept, g_M[slot_TK.clamp_min(0)], 0.0))
