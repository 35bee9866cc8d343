"""Stragglers (``train.straggler_share``, ``train.straggler_windows``): the ranks' time spread
reported every ``train.log_every`` steps, a rank persistently slower than the median named once
when the set of stragglers changes. Rank 1 slowed under torchrun: tests/test_parallel.py's dp2
layout."""

from __future__ import annotations

import pytest
from helpers import BASE

from moe_core.compose import compose_run
from moe_core.config import ConfigError
from moe_core.parallel.trace import Trace
from moe_core.train.stragglers import Stragglers


def step(work: list[float], wall: float = 1.0, data: list[float] | None = None) -> list[list]:
    """One step's table: every rank's wall, own work and data seconds."""
    data = data or [0.0] * len(work)
    return [[wall, w, d] for w, d in zip(work, data, strict=True)]


def report(watch: Stragglers, *steps: list[list]) -> tuple[dict | None, str | None]:
    for rows in steps:
        watch.add(rows)
    return watch.close()


def test_a_rank_slower_in_enough_reports_in_a_row_is_named_once():
    watch = Stragglers(world=4, share=0.2, windows=3)
    slow = step([0.5, 0.5, 0.5, 0.8])  # rank 3: 0.3 s more, 30 % of the 1 s step
    record, said = report(watch, slow, slow)
    assert said is None and record is not None
    assert record["steps"] == 2 and record["slowest"] == 3 and record["stragglers"] == 0
    assert record["work_s_min"] == 0.5 and record["work_s_median"] == 0.5
    assert record["work_s_max"] == 0.8 and record["slowest_excess"] == pytest.approx(0.3)
    assert report(watch, slow)[1] is None  # two reports in a row
    record, said = report(watch, slow)  # the third
    assert said is not None and said.startswith("rank 3 is a straggler: its own work took 1.60x")
    assert (
        "(0.80 s against 0.50 s a step, waits for other ranks excluded; the 0.30 s more is "
        "30% of the 1.00 s step) over the last 1 steps; its data wait 0.00 s"
    ) in said
    assert "data-bound" not in said and said.endswith("in 3 reports in a row)")
    assert record is not None and record["stragglers"] == 1 and record["straggler_ranks"] == [3]
    record, said = report(watch, slow)  # still the same set: nothing said again
    assert said is None and record is not None and record["stragglers"] == 1
    record, said = report(watch, step([0.5] * 4))
    assert said == "no straggler any more: rank 3 keeps up"
    assert record is not None and record["stragglers"] == 0 and "straggler_ranks" not in record


def test_a_report_below_the_share_restarts_the_count():
    watch = Stragglers(world=3, share=0.2, windows=2)
    slow, mild = step([0.5, 0.5, 0.8]), step([0.5, 0.5, 0.65])  # 30 % and 15 % of the step
    assert report(watch, slow)[1] is None
    assert report(watch, mild)[1] is None  # under the share: the run of reports breaks
    assert report(watch, slow)[1] is None
    assert report(watch, slow)[1] is not None
    # a window's mean decides: one slow step among fast ones is no straggler's window
    watch = Stragglers(world=3, share=0.2, windows=1)
    assert report(watch, step([0.5, 0.5, 1.5]), *[step([0.5] * 3)] * 9)[1] is None


def test_a_data_bound_straggler_is_told_apart_and_share_0_names_none():
    watch = Stragglers(world=3, share=0.2, windows=1)
    rows = step([0.5, 0.5, 0.9], data=[0.01, 0.01, 0.35])
    record, said = report(watch, rows)
    assert said is not None and "its data wait 0.35 s (median 0.01 s); data-bound" in said
    assert record is not None and record["data_slowest"] == 2
    assert record["data_s_max"] == 0.35 and record["data_s_median"] == 0.01
    quiet = Stragglers(world=3, share=0.0, windows=1)
    record, said = report(quiet, rows)
    assert said is None and record is not None and record["stragglers"] == 0
    assert record["slowest"] == 2  # the spread is still reported


def test_steps_not_measured_yet_and_empty_windows_report_nothing():
    watch = Stragglers(world=2, share=0.2, windows=1)
    assert report(watch, [[0.0] * 3, [0.0] * 3]) == (None, None)  # a run's first step


def test_the_test_hook_slows_only_its_rank_on_the_way_to_its_first_collective(monkeypatch):
    from moe_core.parallel import trace as trace_module

    monkeypatch.setenv("MOE_TEST_SLOW", "1:0.25")
    monkeypatch.setenv("RANK", "0")
    assert trace_module._test_slow() == 0.0
    monkeypatch.setenv("RANK", "1")
    assert trace_module._test_slow() == 0.25
    slept: list[float] = []
    monkeypatch.setattr(trace_module.time, "sleep", slept.append)
    trace = Trace(slow_s=0.25)
    for s in range(2):
        trace.begin_step(s)
        trace.enter("all_to_all (token dispatch)")
        trace.enter("all_reduce (step values)")
    assert slept == [0.25, 0.25]  # once a step, before its first collective


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "train.straggler_share=-0.1",
            "train.straggler_share=-0.1 is not allowed: it must be zero",
        ),
        ("train.straggler_windows=0", "train.straggler_windows=0 is not allowed: it must be posit"),
    ],
)
def test_bad_straggler_options_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        compose_run([*BASE, override])
