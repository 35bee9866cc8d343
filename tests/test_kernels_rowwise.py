"""put_rows and gather_rows (the rowwise dispatcher's moves between ranks' buffers): the Triton
kernels equal the PyTorch references on buffers of several "ranks" held by one process (which
the kernels address through the same pointer table as peers' memory): rows land at their place
on every visited rank, rows past the capacity are not written anywhere, gathered rows are summed
in rank order, one or two payloads in one pass."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_matches, assert_triton_path, randn

from moe_kernels import rowwise_triton
from moe_kernels.rowwise import PeerRows, gather_rows_reference, put_rows, put_rows_reference

T, CAPACITY = 37, 29


def send_plan(P: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [T, P] send slot map (rank-major, token order, -1 where a token skips a rank; some
    tokens visit no rank) and each rank's base (where this source's rows start there, less
    their start in the send order): the last rank's rows run past the capacity."""
    gen = torch.Generator().manual_seed(seed)
    visits_TP = torch.rand(T, P, generator=gen) < 0.6
    visits_TP[:3] = False
    counts_P = visits_TP.sum(0)
    start_P = counts_P.cumsum(0) - counts_P
    rank_TP = visits_TP.long().cumsum(0) - 1 + start_P
    slot_TP = torch.where(visits_TP, rank_TP, -1)
    before_P = torch.randint(0, CAPACITY - 5, (P,), generator=gen)
    before_P[-1] = CAPACITY - 4  # its rows overflow
    return slot_TP.to(DEVICE), (before_P - start_P).to(DEVICE)


def buffers(P: int, width: int, dtype: torch.dtype, seed: int) -> PeerRows:
    views = [randn(CAPACITY + 1, width, dtype=dtype, seed=seed + p) for p in range(P)]
    ptrs = torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=DEVICE)
    return PeerRows(views, ptrs)


def copy(buf: PeerRows) -> PeerRows:
    """The same contents in new memory (for the reference, which takes no pointer table)."""
    views = [v.clone() for v in buf.views]
    return PeerRows(views, torch.tensor([v.data_ptr() for v in views], device=DEVICE))


PAYLOADS = {
    "tokens": [(40, torch.bfloat16)],
    "tokens+routing": [(40, torch.bfloat16), (6, torch.float32)],
    "fp32-wide": [(1100, torch.float32)],
}
# FP8 token rows as bytes with their routing rows one scale wider (the rowwise dispatcher's
# fp8_rows): moved, never summed
PUT_PAYLOADS = {**PAYLOADS, "fp8-rows+routing": [(40, torch.uint8), (7, torch.float32)]}


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("payload", list(PUT_PAYLOADS))
def test_put_rows_writes_each_row_at_its_place_on_every_visited_rank_and_nothing_past_capacity(
    P, payload
):
    slot_TP, base_P = send_plan(P, seed=P)
    shapes = PUT_PAYLOADS[payload]
    rows = [randn(T, w, dtype=dt, seed=10 + i) for i, (w, dt) in enumerate(shapes)]
    assert_triton_path(rows[0])
    got = [buffers(P, w, dt, seed=100 * i) for i, (w, dt) in enumerate(shapes)]
    before = [[v.clone() for v in b.views] for b in got]
    ref = [copy(b) for b in got]
    put_rows(rows, got, slot_TP, base_P)
    put_rows_reference(rows, ref, slot_TP, base_P)
    for b_got, b_ref, b_before in zip(got, ref, before, strict=True):
        for p in range(P):
            # the reference writes what goes nowhere into the spare row; the kernel writes nothing
            assert torch.equal(b_got.views[p][:CAPACITY], b_ref.views[p][:CAPACITY])
            assert torch.equal(b_got.views[p][CAPACITY], b_before[p][CAPACITY])
    # every row of the last rank's overflowing segment stays as it was
    last, dest_T = P - 1, slot_TP[:, P - 1] + base_P[P - 1]
    written = dest_T[(slot_TP[:, last] >= 0) & (dest_T < CAPACITY)]
    untouched = torch.ones(CAPACITY, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    kept = got[0].views[last][:CAPACITY][untouched]
    assert torch.equal(kept, before[0][last][:CAPACITY][untouched])


@pytest.mark.parametrize("P", [1, 3])
@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_gather_rows_sums_each_tokens_rows_over_the_ranks_it_visits(P, payload):
    slot_TP, base_P = send_plan(P, seed=7 + P)
    bufs = [buffers(P, w, dt, seed=50 * i) for i, (w, dt) in enumerate(PAYLOADS[payload])]
    assert_triton_path(bufs[0].views[0])
    got = rowwise_triton.gather_rows(bufs, slot_TP, base_P)
    ref = gather_rows_reference(bufs, slot_TP, base_P)
    for g, r in zip(got, ref, strict=True):
        assert_matches(g, r)
    assert torch.equal(got[0][:3], torch.zeros_like(got[0][:3]))  # tokens that visit no rank


def test_put_then_gather_returns_each_row_times_the_ranks_that_kept_it():
    P = 3
    slot_TP, base_P = send_plan(P, seed=3)
    x_TD = randn(T, 40, dtype=torch.float32, seed=4)
    bufs = [buffers(P, 40, torch.float32, seed=9)]
    put_rows([x_TD], bufs, slot_TP, base_P)
    (back_TD,) = rowwise_triton.gather_rows(bufs, slot_TP, base_P)
    dest_TP = slot_TP + base_P
    kept_T = ((slot_TP >= 0) & (dest_TP < CAPACITY)).sum(1, keepdim=True)
    assert_matches(back_TD, x_TD * kept_T)
