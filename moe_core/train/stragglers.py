"""Stragglers: the per-rank spread of step and data time, and the rank persistently slower
than the others, named once.

In synchronous training every rank's wall time per step is the same: the fast ranks wait for
the slow one at the next collective. What tells them apart is what a rank did *not* spend
waiting: its step time less its waits where ranks meet (``parallel.trace``'s ``blocked``), its
own work. Each rank measures, per step, its wall time, that work time and its data wait (the
time it waited for its micro-batches from the loader), and sends the previous step's three
numbers in the step's one all-reduce (``StepValues.rank_times``, one slot per rank): no
collective and no host read is added. Every ``train.log_every`` steps rank 0 takes the means
over the steps since the last report (``Stragglers.close``) into ``metrics.jsonl`` as the
``ranks`` record (MLflow charts it as ``ranks.*``).

A rank is a straggler when its work time exceeds the median over ranks by more than
``train.straggler_share`` of the step (the median wall time: what its lateness costs every rank)
in ``train.straggler_windows`` consecutive reports; rank 0 says so in one warning line when the
set of stragglers changes (not at every report), and the record counts them. Measured against
the step rather than the median work, as a rank's host work can be a sliver of a GPU-bound step:
rank 0's logging alone would then be "1.5x the median". It is data-bound when its data wait,
above the median's, explains at least half of its excess.

Host-side by design: a rank whose host is slow (its data, its CPU, its process) is named; under
CUDA a rank whose GPU is slow is not, as every host waits alike for the devices (the step's read
and the dispatch's size exchange); collectives outside ``parallel.trace`` (context
parallelism's) count as work.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

STEP, WORK, DATA = 0, 1, 2  # a rank's row of ``StepValues.rank_times``


@dataclass
class Window:
    """Per-rank sums over the steps since the last report."""

    steps: int = 0
    step_s: list[float] = field(default_factory=list)
    work_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)


class Stragglers:
    """Rank 0's view of every rank's times: ``add`` each step's table, ``close`` a report."""

    def __init__(self, world: int, share: float, windows: int) -> None:
        self.world, self.share, self.windows = world, share, windows
        self.window = Window()
        self.streak = [0] * world  # consecutive reports each rank was slow in
        self.named: frozenset[int] = frozenset()  # the stragglers last said

    def add(self, rows: list[list[float]]) -> None:
        """One step's ``[world][step s, work s, data s]`` (all zeros: no step measured yet, as
        in a run's or a resume's first step)."""
        if not any(any(r) for r in rows):
            return
        w = self.window
        if not w.steps:
            w.step_s, w.work_s, w.data_s = ([0.0] * self.world for _ in range(3))
        w.steps += 1
        for r, row in enumerate(rows):
            w.step_s[r] += row[STEP]
            w.work_s[r] += row[WORK]
            w.data_s[r] += row[DATA]

    def close(self) -> tuple[dict[str, Any] | None, str | None]:
        """The report over the steps added since the last one (None without any) and the
        warning line when the set of stragglers changed (None otherwise)."""
        w, self.window = self.window, Window()
        if not w.steps:
            return None, None
        n = w.steps
        step = [s / n for s in w.step_s]
        work = [s / n for s in w.work_s]
        data = [s / n for s in w.data_s]
        median, data_median = statistics.median(work), statistics.median(data)
        step_median = statistics.median(step)
        for r in range(self.world):
            slow = self.share > 0 and work[r] - median > self.share * step_median
            self.streak[r] = self.streak[r] + 1 if slow else 0
        now = frozenset(r for r in range(self.world) if self.streak[r] >= self.windows)
        slowest = max(range(self.world), key=work.__getitem__)
        data_slowest = max(range(self.world), key=data.__getitem__)
        record = {
            "steps": n,
            "step_s": step_median,
            "work_s_min": min(work),
            "work_s_median": median,
            "work_s_max": work[slowest],
            "slowest": slowest,
            # the slowest rank's work above the median, as a share of the step
            "slowest_excess": (work[slowest] - median) / step_median if step_median > 0 else 0.0,
            "data_s_median": data_median,
            "data_s_max": data[data_slowest],
            "data_slowest": data_slowest,
            "stragglers": len(now),
        }
        if now:
            record["straggler_ranks"] = sorted(now)
        said = None
        if now != self.named:
            said = self._sentence(now, work, data, step_median, n)
            self.named = now
        return record, said

    def _sentence(
        self, now: frozenset[int], work: list[float], data: list[float], step: float, n: int
    ) -> str:
        """The warning line: the stragglers (or that there are none any more)."""
        if not now:
            gone = ", ".join(map(str, sorted(self.named)))
            many = len(self.named) > 1
            who, verb = ("ranks", "keep") if many else ("rank", "keeps")
            return f"no straggler any more: {who} {gone} {verb} up"
        median, data_median = statistics.median(work), statistics.median(data)
        parts = []
        for r in sorted(now):
            excess, data_excess = work[r] - median, data[r] - data_median
            bound = "; data-bound: its data wait explains it" if data_excess >= excess / 2 else ""
            parts.append(
                f"rank {r} is a straggler: its own work took {work[r] / max(median, 1e-9):.2f}x "
                f"the median ({work[r]:.2f} s against {median:.2f} s a step, waits for other "
                f"ranks excluded; the {excess:.2f} s more is {excess / step:.0%} of the "
                f"{step:.2f} s step) over the last {n} steps; its data wait {data[r]:.2f} s "
                f"(median {data_median:.2f} s){bound}"
            )
        more = f"more than {self.share:.0%} of the step in {self.windows} reports in a row"
        return "; ".join(parts) + f" ({more})"
