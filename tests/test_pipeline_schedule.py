"""Pipeline schedules: complete, dependency-respecting, deadlock-free, memory-bounded."""

from __future__ import annotations

import pytest

from moe_core.config import ParallelConfig
from moe_core.parallel.pipeline import Action, chunk_layers, rank_chunks, schedule


def simulate(cfg: ParallelConfig, n_mb: int) -> int:
    """Run every rank's action list, an action only once its inputs exist; returns the steps."""
    n_chunks = cfg.pp * cfg.virtual_stages
    lists = [schedule(cfg, r, n_mb) for r in range(cfg.pp)]
    pos = [0] * cfg.pp
    done: set[Action] = set()
    steps = 0
    while any(p < len(lst) for p, lst in zip(pos, lists, strict=True)):
        progressed = False
        for r in range(cfg.pp):
            if pos[r] == len(lists[r]):
                continue
            a = lists[r][pos[r]]
            if a.kind == "F":
                ready = a.chunk == 0 or Action("F", a.mb, a.chunk - 1) in done
            else:
                ready = Action("F", a.mb, a.chunk) in done and (
                    a.chunk == n_chunks - 1 or Action("B", a.mb, a.chunk + 1) in done
                )
            if ready:
                done.add(a)
                pos[r] += 1
                progressed = True
        assert progressed, f"deadlock at positions {pos}"
        steps += 1
    return steps


@pytest.mark.parametrize("pp", [2, 3, 4])
@pytest.mark.parametrize("v", [1, 2, 3])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_schedules_are_complete_and_deadlock_free(pp, v, groups):
    kind = "1f1b" if v == 1 else "interleaved_1f1b"
    cfg = ParallelConfig(pp=pp, pp_schedule=kind, virtual_stages=v)
    n_mb = pp * groups
    for r in range(pp):
        actions = schedule(cfg, r, n_mb)
        expected = {
            Action(k, mb, c) for k in "FB" for mb in range(n_mb) for c in rank_chunks(cfg, r)
        }
        assert len(actions) == len(expected) and set(actions) == expected
        for a in actions:
            if a.kind == "B":
                assert actions.index(Action("F", a.mb, a.chunk)) < actions.index(a)
    simulate(cfg, n_mb)


@pytest.mark.parametrize("pp, n_mb", [(2, 4), (4, 8), (4, 3)])
def test_1f1b_keeps_at_most_pp_minus_rank_micro_batches_in_flight(pp, n_mb):
    cfg = ParallelConfig(pp=pp)
    for r in range(pp):
        live = peak = 0
        for a in schedule(cfg, r, n_mb):
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        assert peak <= min(pp - r, n_mb)


def test_interleaving_shortens_the_pipeline_bubble():
    """With the same work split finer, the simulated critical path in chunk-steps gets shorter
    relative to the work per rank (the point of interleaving)."""
    pp, n_mb = 4, 8
    plain = simulate(ParallelConfig(pp=pp), n_mb) / (2 * n_mb)
    inter = simulate(ParallelConfig(pp=pp, pp_schedule="interleaved_1f1b", virtual_stages=2), n_mb)
    assert inter / (2 * n_mb * 2) < plain


def test_chunks_split_whole_blocks_in_order():
    assert [list(chunk_layers(8, 4, c)) for c in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    cfg = ParallelConfig(pp=2, pp_schedule="interleaved_1f1b", virtual_stages=2)
    assert rank_chunks(cfg, 0) == [0, 2] and rank_chunks(cfg, 1) == [1, 3]
