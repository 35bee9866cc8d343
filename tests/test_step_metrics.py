"""The step's values cross ranks as one typed structure: every field packed, reduced as it says
(sum, maximum, every rank's row, or kept as is) and read back by name, none dropped or
shifted."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from moe_core.train.step_metrics import LOCAL, MAX, PER_RANK, SUM, StepValues

LAYERS, EXPERTS = 3, 4


def values(rank: int) -> StepValues:
    """A step of rank ``rank`` whose every element differs from every other field's and rank's
    (mixed dtypes and shapes, as the trainer fills them)."""
    n = [0]

    def distinct(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        size = 1
        for s in shape:
            size *= s
        start = 1000 * rank + n[0]
        n[0] += size
        return (
            (torch.arange(start, start + size) + 0.5 * (dtype != torch.int64)).to(dtype).view(shape)
        )

    return StepValues(
        ce=distinct(),
        aux=distinct(),
        mtp=distinct(2),
        lb=distinct(),
        z=distinct(),
        routers=distinct(dtype=torch.int64),
        dropped=distinct(),
        stop=distinct(),
        peak_mem_gib=distinct(),
        grad_norm=distinct(),
        router_table=distinct(LAYERS, EXPERTS + 1, dtype=torch.float64),
        expert_bias=distinct(2, 2 * EXPERTS),
        rank_times=distinct(3, dtype=torch.float64),
    )


def test_every_field_says_how_ranks_combine_it():
    assert {f.name: f.metadata["reduce"] for f in fields(StepValues)} == {
        "ce": SUM,
        "aux": SUM,
        "mtp": SUM,
        "lb": SUM,
        "z": SUM,
        "routers": SUM,
        "dropped": SUM,
        "stop": SUM,
        "peak_mem_gib": MAX,
        "grad_norm": LOCAL,
        "router_table": SUM,
        "expert_bias": LOCAL,
        "ep_rows": SUM,
        "ep_tokens": SUM,
        "rank_times": PER_RANK,
        "alloc_retries": SUM,
    }


def test_read_round_trips_every_field_by_name():
    step = values(0)
    host = step.read()
    for f in fields(StepValues):
        sent, got = getattr(step, f.name), getattr(host, f.name)
        assert got.dtype == torch.float64 and got.device.type == "cpu", f.name
        assert torch.equal(got, sent.double()), f.name
    # one rank: the reduction is the identity (a per-rank field gains its one row)
    alone = step.all_reduce(rank=0, world=1).read()
    for f in fields(StepValues):
        want = getattr(host, f.name)
        want = want[None] if f.metadata["reduce"] == PER_RANK else want
        assert torch.equal(getattr(alone, f.name), want), f.name


@pytest.mark.parametrize("world", [2, 3])
def test_one_summed_vector_sums_maximizes_and_keeps_each_field(world):
    """What ``all_reduce`` does across ranks (the sum of every rank's ``pack``), field by field."""
    ranks = [values(r) for r in range(world)]
    summed = sum(v.pack(r, world) for r, v in enumerate(ranks))
    out = ranks[1].unpack(summed, world).read()
    for f in fields(StepValues):
        each = torch.stack([getattr(v, f.name).double() for v in ranks])
        reduce = f.metadata["reduce"]
        want = {SUM: each.sum(0), MAX: each.amax(0), LOCAL: each[1], PER_RANK: each}[reduce]
        assert torch.equal(getattr(out, f.name), want), f.name


def test_a_vector_of_another_layout_is_refused():
    step = values(0)
    flat = step.pack(0, 2)
    with pytest.raises(ValueError, match="holds"):
        step.unpack(torch.cat([flat, flat[:1]]), 2)
