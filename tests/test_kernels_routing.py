"""expert_slots: the Triton kernels equal the reference, and the map is the documented layout."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import (
    DEVICE,
    ROUTING_NAMES,
    E,
    T,
    assert_triton_path,
    drop_assignments,
    routing,
    valid_rows,
)

from moe_kernels import routing_triton
from moe_kernels.routing import expert_slots, expert_slots_reference, slot_rows


def check_layout(
    experts_TK: torch.Tensor, n_experts: int, align: int, slots, n_rows: int | None = None
) -> None:
    """Each expert's kept assignments fill the first counts_E rows of its aligned segment, in
    token order; dropped ones (id < 0) get slot -1; padding rows get no assignment; the segments
    tile all n_rows rows (the static bound unless the caller gave ``n_rows``)."""
    slot_TK, counts_E, offs_E, got_rows = slots
    flat_M, slot_M = experts_TK.reshape(-1).cpu(), slot_TK.reshape(-1).cpu()
    counts_E, offs_E = counts_E.cpu(), offs_E.cpu().long()
    assert slot_TK.dtype == torch.int64 and counts_E.dtype == torch.int64
    assert offs_E.dtype == torch.int64 and slots.offs_E.dtype == torch.int32
    kept_M = flat_M >= 0
    assert torch.equal(slot_M[~kept_M], torch.full_like(slot_M[~kept_M], -1))
    assert torch.equal(counts_E, torch.bincount(flat_M[kept_M], minlength=n_experts))
    starts_E = torch.cat([torch.zeros(1, dtype=torch.int64), offs_E[:-1]])
    seg_E = offs_E - starts_E
    assert (starts_E % align == 0).all() and (seg_E % align == 0).all()
    assert (seg_E >= counts_E).all() and (seg_E - counts_E < align)[:-1].all()
    expected_rows = slot_rows(flat_M.numel(), n_experts, align) if n_rows is None else n_rows
    assert int(offs_E[-1]) == got_rows == expected_rows
    real_rows = []
    for e in range(n_experts):
        mine = (flat_M == e).nonzero().squeeze(1)  # assignment ids in token order
        expected = torch.arange(int(starts_E[e]), int(starts_E[e] + counts_E[e]))
        assert torch.equal(slot_M[mine], expected), f"expert {e}: not stable or not packed"
        real_rows.append(expected)
    # A bijection of the kept assignments onto the non-padding rows:
    kept_slots = slot_M[kept_M]
    assert torch.equal(torch.sort(kept_slots).values, torch.sort(torch.cat(real_rows)).values)
    assert kept_slots.unique().numel() == kept_slots.numel()


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("name", ROUTING_NAMES)
def test_expert_slots_triton_equals_reference_and_layout(name: str, k: int, align: int):
    experts_TK = routing(name, T, E, k)
    assert_triton_path(experts_TK)
    ref = expert_slots_reference(experts_TK, E, align)
    check_layout(experts_TK, E, align, ref)
    for block in (None, 16):  # the default (one block here) and many blocks with a ragged end
        slot_TK, counts_E, offs_E = routing_triton.expert_slots(
            experts_TK, E, align, ref.n_rows, block_a=block
        )
        assert torch.equal(slot_TK, ref.slot_TK), f"block {block}"
        assert torch.equal(counts_E, ref.counts_E) and torch.equal(offs_E, ref.offs_E)
    got = expert_slots(experts_TK, E, align)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3], strict=True))
    assert got.n_rows == ref.n_rows


@pytest.mark.parametrize("exact", [False, True], ids=["bound-rows", "exact-rows"])
@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("pattern", ["mixed", "all"])
@pytest.mark.parametrize("name", ["two-empty-experts", "with-repeats"])
def test_expert_slots_with_dropped_assignments(name: str, pattern: str, align: int, exact: bool):
    """Ids < 0 get slot -1 and are not counted; kept ones keep the layout. With ``n_rows`` the
    exact padded count of kept assignments, the buffer and the last segment end there."""
    k = 4
    experts_TK = drop_assignments(routing(name, T, E, k), pattern, seed=1)
    assert_triton_path(experts_TK)
    n_rows = valid_rows(experts_TK, E, align) if exact else None
    if pattern == "mixed":
        kept_T = (experts_TK >= 0).sum(1).cpu()
        assert (kept_T == k).any() and (kept_T == 0).any() and ((kept_T > 0) & (kept_T < k)).any()
    ref = expert_slots_reference(experts_TK, E, align, n_rows)
    check_layout(experts_TK, E, align, ref, n_rows)
    if exact and align == 1:
        assert ref.n_rows == int((experts_TK >= 0).sum()), "no padding rows at all"
    for block in (None, 16):
        slot_TK, counts_E, offs_E = routing_triton.expert_slots(
            experts_TK, E, align, ref.n_rows, block_a=block
        )
        assert torch.equal(slot_TK, ref.slot_TK), f"block {block}"
        assert torch.equal(counts_E, ref.counts_E) and torch.equal(offs_E, ref.offs_E)
    got = expert_slots(experts_TK, E, align, n_rows)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], ref[:3], strict=True))
    assert got.n_rows == ref.n_rows


def test_expert_slots_without_drops_ignores_an_equal_row_override():
    """An ``n_rows`` equal to the static bound changes nothing for an all-kept routing."""
    experts_TK = routing("two-empty-experts", T, E, 2)
    default = expert_slots(experts_TK, E, 8)
    given = expert_slots(experts_TK, E, 8, n_rows=default.n_rows)
    assert all(torch.equal(a, b) for a, b in zip(default[:3], given[:3], strict=True))


def test_expert_slots_reference_refuses_too_few_rows():
    experts_TK = routing("with-repeats", T, E, 2).cpu()
    with pytest.raises(ValueError, match="cannot hold"):
        expert_slots_reference(experts_TK, E, 1, n_rows=T * 2 - 1)
    with pytest.raises(ValueError, match=">= 0"):
        expert_slots_reference(experts_TK, E, 1, n_rows=-1)


def test_expert_slots_align_one_is_the_stable_argsort_layout():
    experts_TK = routing("with-repeats", T, E, 2)
    slot_TK, _, offs_E, n_rows = expert_slots(experts_TK, E)
    order_M = torch.argsort(experts_TK.reshape(-1), stable=True)
    assert n_rows == T * 2 and int(offs_E[-1]) == n_rows
    assert torch.equal(slot_TK.reshape(-1)[order_M], torch.arange(n_rows, device=DEVICE))


def test_expert_slots_many_experts_and_blocks():
    """200 experts (a 256-wide one-hot tile) and a scan that takes more than one chunk."""
    gen = torch.Generator().manual_seed(5)
    n_experts = 200
    experts_TK = torch.randint(0, n_experts, (150, 4), generator=gen).to(DEVICE)
    ref = expert_slots_reference(experts_TK, n_experts, 16)
    slot_TK, counts_E, offs_E = routing_triton.expert_slots(
        experts_TK, n_experts, 16, ref.n_rows, block_a=16
    )
    assert torch.equal(slot_TK, ref.slot_TK)
    assert torch.equal(counts_E, ref.counts_E) and torch.equal(offs_E, ref.offs_E)


def test_slot_rows_is_a_tight_static_bound():
    assert slot_rows(131072, 64, 1) == 131072
    assert slot_rows(131072, 64, 16) == 131072 + 64 * 15
    # all experts one short of a multiple: every segment pads by align - 1
    counts = torch.full((8,), 9)
    assert int(((counts + 7) // 8 * 8).sum()) == slot_rows(72, 8, 8) == 128
    with pytest.raises(ValueError):
        slot_rows(10, 2, 0)
