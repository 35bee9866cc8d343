"""permute_to_slots, combine_from_slots and sum_from_slots: Triton equals the PyTorch reference,
forward and backward, on every routing shape; outputs are fully written; padding rows are zero;
weights applied at the rows (``slot_weights``) then summed equal the weighted combine."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    ROUTING_NAMES,
    D,
    E,
    T,
    assert_matches,
    assert_triton_path,
    drop_assignments,
    permute_combine_round_trip,
    rand_weights,
    randn,
    routing,
    valid_rows,
)

from kernels import slot_permute_triton
from kernels.routing import expert_slots_reference
from kernels.slot_permute import (
    combine_from_slots,
    combine_from_slots_reference,
    combine_from_slots_reference_backward,
    permute_to_slots,
    permute_to_slots_reference,
    permute_to_slots_reference_backward,
    slot_weights,
    sum_from_slots,
)

DTYPES = [torch.float32, torch.bfloat16]


def padding_mask(slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
    used = torch.zeros(n_rows, dtype=torch.bool, device=slot_TK.device)
    used[slot_TK.reshape(-1)] = True
    return ~used


def setup(name: str, k: int, align: int, dtype: torch.dtype, seed: int = 0):
    experts_TK = routing(name, T, E, k, seed)
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, align)
    return slot_TK, n_rows, randn(T, D, dtype=dtype, seed=seed + 1)


def round_trips(combine, slot_TK, n_rows, x_TD, k, dtype, mapped=None):
    """(ours, reference): permute, perturb the rows, ``combine`` with random weights, backward;
    each (x_MD, y_TD, dx_TD, dw_TK) as ``permute_combine_round_trip`` gives them."""
    w_TK = rand_weights(T, k, seed=2)
    g_MD = randn(n_rows, D, dtype=dtype, seed=3)  # perturbs the expert rows between the ops
    dy_TD = randn(T, D, dtype=dtype, seed=4)
    args = (x_TD, slot_TK, n_rows, w_TK, g_MD, dy_TD)
    got = permute_combine_round_trip(permute_to_slots, combine, *args, every_row_mapped=mapped)
    references = (permute_to_slots_reference, combine_from_slots_reference)
    return got, permute_combine_round_trip(*references, *args)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("name", ROUTING_NAMES)
def test_permute_and_combine_autograd_equal_reference(name, k, align, dtype):
    """The whole round trip through the public ops: forward outputs and every gradient."""
    slot_TK, n_rows, x_TD = setup(name, k, align, dtype)
    assert_triton_path(x_TD)
    got, ref = round_trips(combine_from_slots, slot_TK, n_rows, x_TD, k, dtype)
    assert torch.equal(got[0], ref[0]), "permute is a copy: bitwise equal"
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert got[2].dtype == dtype and got[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("align", [1, 8])
def test_kernels_write_every_row_on_many_blocks(align, dtype):
    """Outputs poisoned with NaN first: every row comes back written (padding rows as zeros),
    with blocks small enough for several token blocks and a ragged last D chunk."""
    slot_TK, n_rows, x_TD = setup("two-empty-experts", 2, align, dtype)
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
    slot_permute_triton.gather_rows(g_MD, slot_TK, None, out_dtype=dtype, out=dx_TD, **blocks)
    assert_matches(dx_TD, permute_to_slots_reference_backward(g_MD, slot_TK))

    w_TK = rand_weights(T, 2, seed=6)
    y_TD = torch.full((T, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.gather_rows(g_MD, slot_TK, w_TK, out_dtype=dtype, out=y_TD, **blocks)
    assert_matches(y_TD, combine_from_slots_reference(g_MD, slot_TK, w_TK))

    dy_TD = randn(T, D, dtype=dtype, seed=7)
    dy_MD = torch.full((n_rows, D), nan, dtype=dtype, device=DEVICE)
    dw_TK = torch.full((T, 2), nan, device=DEVICE)
    slot_permute_triton.combine_backward(
        dy_TD, g_MD, slot_TK, w_TK, n_rows, out_rows=dy_MD, out_dw=dw_TK, **blocks
    )
    ref_MD, ref_w = combine_from_slots_reference_backward(dy_TD, g_MD, slot_TK, w_TK, n_rows)
    assert_matches(dy_MD, ref_MD)
    assert_matches(dw_TK, ref_w)
    assert (dy_MD[pad] == 0).all()


def test_combine_without_weight_gradient_keeps_no_rows_and_matches():
    slot_TK, n_rows, _ = setup("with-repeats", 8, 8, torch.float32)
    y_MD = randn(n_rows, D, seed=8).requires_grad_()
    w_TK = rand_weights(T, 8)  # no gradient wanted
    assert_triton_path(y_MD)
    out = combine_from_slots(y_MD, slot_TK, w_TK)
    assert out.grad_fn.saved_tensors[0] is None  # type: ignore[union-attr]
    dy_TD = randn(T, D, seed=9)
    out.backward(dy_TD)
    ref_MD, _ = combine_from_slots_reference_backward(dy_TD, None, slot_TK, w_TK, n_rows)
    assert_matches(y_MD.grad, ref_MD)


@pytest.mark.parametrize("pattern", ["none", "mixed"])
def test_reference_backwards_are_the_derivatives_of_the_reference_forwards(pattern):
    """The hand-written reference backward passes equal autograd through the references (fp64),
    with and without dropped assignments."""
    k = 2
    if pattern == "none":
        slot_TK, n_rows, _ = setup("with-repeats", k, 8, torch.float64)
    else:
        slot_TK, n_rows, _, _ = setup_dropped("with-repeats", k, pattern, 8, False, torch.float64)
    x_TD = randn(T, D, dtype=torch.float64, seed=10).requires_grad_()
    g_MD = randn(n_rows, D, dtype=torch.float64, seed=11)
    (dx_TD,) = torch.autograd.grad(
        (permute_to_slots_reference(x_TD, slot_TK, n_rows) * g_MD).sum(), x_TD
    )
    torch.testing.assert_close(permute_to_slots_reference_backward(g_MD, slot_TK), dx_TD)

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


def test_combine_from_slots_matches_the_argsort_path():
    """With align=1 the slot path equals the existing order-based permute_rows/combine_rows."""
    from kernels.permute import combine_rows, expert_order, permute_rows

    experts_TK = routing("two-empty-experts", T, E, 2)
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, 1)
    x_TD, w_TK = randn(T, D, seed=14), rand_weights(T, 2)
    order_M = expert_order(experts_TK)
    assert torch.equal(permute_to_slots(x_TD, slot_TK, n_rows), permute_rows(x_TD, order_M, 2))
    y_MD = randn(n_rows, D, seed=15)
    assert_matches(combine_from_slots(y_MD, slot_TK, w_TK), combine_rows(y_MD, order_M, w_TK))


def test_empty_batch_passes_through():
    """No tokens (an expert-parallel rank may receive none): empty outputs, padding zero."""
    from kernels.routing import expert_slots

    experts_TK = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    slot_TK, counts_E, offs_E, n_rows = expert_slots(experts_TK, E, 8)
    assert counts_E.sum() == 0 and int(offs_E[-1]) == n_rows
    x = torch.empty(0, D, device=DEVICE, requires_grad=True)
    x_MD = permute_to_slots(x, slot_TK, n_rows)
    assert x_MD.shape == (n_rows, D) and (x_MD == 0).all()
    w = torch.empty(0, 2, device=DEVICE, requires_grad=True)
    y = combine_from_slots(x_MD, slot_TK, w)
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
    dy_rows = torch.full((8, 4), float("nan"), device=DEVICE)
    slot_permute_triton.combine_backward(
        x_TD, None, slot_TK, rand_weights(3, 2), 5, out_rows=dy_rows[:5]
    )
    assert dy_rows[5:].isnan().all() and not dy_rows[:5].isnan().any()


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


def setup_dropped(name: str, k: int, pattern: str, align: int, exact: bool, dtype, seed=0):
    """(slot_TK, n_rows, every_row_mapped, x_TD): the flag as a caller would set it."""
    experts_TK = drop_assignments(routing(name, T, E, k, seed), pattern, seed=seed + 1)
    n_rows = valid_rows(experts_TK, E, align) if exact else None
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, align, n_rows)
    mapped = exact and align == 1  # only then does every row hold a kept assignment
    return slot_TK, n_rows, mapped, randn(T, D, dtype=dtype, seed=seed + 2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pattern", "align", "exact"), DROP_CASES, ids=DROP_IDS)
@pytest.mark.parametrize("name", ["two-empty-experts", "with-repeats"])
def test_dropped_assignments_autograd_equal_reference(name, pattern, align, exact, dtype):
    """Round trip with dropped slots: outputs and gradients equal the reference; dropped
    assignments move no row, add nothing, and get zero gradient (tokens with every choice
    dropped come back zero with zero gradient)."""
    k = 4
    slot_TK, n_rows, mapped, x_TD = setup_dropped(name, k, pattern, align, exact, dtype)
    assert_triton_path(x_TD)
    drop_TK = slot_TK < 0
    got, ref = round_trips(combine_from_slots, slot_TK, n_rows, x_TD, k, dtype, mapped)
    assert torch.equal(got[0], ref[0]), "permute is a copy: bitwise equal"
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert (got[3][drop_TK] == 0).all(), "a dropped assignment's weight gets no gradient"
    all_dropped_T = drop_TK.all(1)
    assert (got[1][all_dropped_T] == 0).all() and (got[2][all_dropped_T] == 0).all()
    if pattern == "mixed":
        assert bool(all_dropped_T.any()) and not bool(all_dropped_T.all())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("pattern", "align", "exact"), DROP_CASES, ids=DROP_IDS)
def test_kernels_with_dropped_assignments_write_every_row(pattern, align, exact, dtype):
    """NaN-poisoned outputs, many token blocks, a ragged D chunk: every element is written
    (unmapped rows as zeros, dropped weight gradients as zeros) and equals the reference;
    NaN weights on dropped assignments change nothing (they are never read)."""
    k = 4
    slot_TK, n_rows, mapped, x_TD = setup_dropped("with-repeats", k, pattern, align, exact, dtype)
    assert_triton_path(x_TD)
    drop_TK = slot_TK < 0
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
    slot_permute_triton.gather_rows(g_MD, slot_TK, None, out_dtype=dtype, out=dx_TD, **blocks)
    assert_matches(dx_TD, permute_to_slots_reference_backward(g_MD, slot_TK))

    w_TK = rand_weights(T, k, seed=6)
    w_nan_TK = torch.where(drop_TK, nan, w_TK)
    y_TD = torch.full((T, D), nan, dtype=dtype, device=DEVICE)
    slot_permute_triton.gather_rows(g_MD, slot_TK, w_nan_TK, out_dtype=dtype, out=y_TD, **blocks)
    assert_matches(y_TD, combine_from_slots_reference(g_MD, slot_TK, w_TK))

    dy_TD = randn(T, D, dtype=dtype, seed=7)
    dy_MD = torch.full((n_rows, D), nan, dtype=dtype, device=DEVICE)
    dw_TK = torch.full((T, k), nan, device=DEVICE)
    slot_permute_triton.combine_backward(
        dy_TD,
        g_MD,
        slot_TK,
        w_nan_TK,
        n_rows,
        zero_unmapped=not mapped,
        out_rows=dy_MD,
        out_dw=dw_TK,
        **blocks,
    )
    ref_MD, ref_w = combine_from_slots_reference_backward(dy_TD, g_MD, slot_TK, w_TK, n_rows)
    assert_matches(dy_MD, ref_MD)
    assert_matches(dw_TK, ref_w)
    assert (dy_MD[unmapped] == 0).all() and (dw_TK[drop_TK] == 0).all()


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


def weighted_rows_then_sum(y_MD, slot_TK, w_TK, **flags):
    """The MoE layer's combine: each expert row scaled by its assignment's weight (in the
    layer this happens inside the SwiGLU), then the plain sum over the K slots."""
    w_M = slot_weights(w_TK, slot_TK, y_MD.shape[0])
    return sum_from_slots((y_MD.float() * w_M[:, None]).to(y_MD.dtype), slot_TK, **flags)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("pattern", "align", "exact"), [("none", 1, False), ("none", 8, False), *DROP_CASES[:4]]
)
def test_weights_at_the_rows_then_sum_equals_the_weighted_combine(pattern, align, exact, dtype):
    """``slot_weights`` + ``sum_from_slots`` compute the weighted combine: forward and every
    gradient (the weights' through the row scale), with padding and dropped assignments."""
    k = 4
    if pattern == "none":
        slot_TK, n_rows, x_TD = setup("with-repeats", k, align, dtype)
        mapped = None
    else:
        slot_TK, n_rows, mapped, x_TD = setup_dropped(
            "with-repeats", k, pattern, align, exact, dtype
        )
    assert_triton_path(x_TD)
    got, ref = round_trips(weighted_rows_then_sum, slot_TK, n_rows, x_TD, k, dtype, mapped)
    for a, b in zip(got[1:], ref[1:], strict=True):
        assert_matches(a, b)
    assert (got[3][slot_TK < 0] == 0).all(), "a dropped assignment's weight gets no gradient"


def test_sum_from_slots_keeps_only_the_slot_map_and_its_backward_is_the_permute():
    slot_TK, n_rows, _ = setup("two-empty-experts", 2, 8, torch.float32)
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
