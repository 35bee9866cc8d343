"""The hang watchdog: a step that takes far longer than the recent ones is a hang, named and
ended, so the launcher relaunches from the newest checkpoint instead of waiting for the
scheduler's time limit.

A thread on every rank watches the step in progress. Its limit is ``train.hang_factor`` times
the median of the last steps, never below ``train.hang_min_s``, and ``train.hang_first_s`` until
``WARM_STEPS`` steps have finished (compilation and warm-up). Past it, each rank writes where it
stands (``parallel.trace``: the last collective it entered, with layer, micro-batch, group and
bytes; its router's expert counts of the step where the device answers) to
``<out_dir>/hangs/step_<N>/rank_<r>.json`` and a line to its log. Rank 0 then waits
``REPORT_WAIT_S`` for the others' files and names the ranks behind, those that entered fewest
collectives in the step (a rank stuck in its own work never reaches the collective the others
wait in), or that wrote nothing, in one sentence: on its log, in ``hangs/latest.txt`` (the
pipeline puts it in the relaunch's reason and the tracking run) and in the step's folder; the
other ranks wait for it (the launcher stops every rank once one exits). Every rank then exits
with ``HANG_EXIT``. Files there older than the watchdog are an earlier attempt's (a relaunch that
hung at the same step) and are ignored.

Beside its report each rank dumps torch's flight recorder (``train.flight_recorder``: the last
collectives of every process group, with their sizes) to ``step_<N>/flight_recorder/rank_<r>``
(a pickle). NCCL's records hold each collective's state and group, which ``python -m
torch.distributed.flight_recorder.fr_trace <folder> -p rank_`` matches across ranks; gloo's (the
CPU's) list the collectives only, which its analyzer does not read (torch 2.13).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from moe_core.config import TrainConfig
from moe_core.files import atomic_write, json_bytes
from moe_core.parallel.trace import TRACE, Trace

# The flight recorder's buffer size: its name since torch 2.12-ish, and before (NCCL's only)
FR_SIZE = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
FR_FOLDER = "flight_recorder"
HANG_EXIT = 75  # the exit status of a rank the watchdog ended (EX_TEMPFAIL: try again)
WARM_STEPS = 3  # steps after which the recent steps set the limit
RECENT_STEPS = 20  # how many recent steps the median is over
REPORT_WAIT_S = 10.0  # rank 0 waits this long for the other ranks' reports
SUMMARY_GRACE_S = 10.0  # and the others this much longer for its sentence before they exit
POLL_S = 0.5
LATEST = "latest.txt"


def _fr_dump() -> Callable[[], bytes] | None:
    """torch's dump of this process's flight record (pickled), under its current or old name."""
    from torch._C import _distributed_c10d as c10d

    return getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)


def keep_flight_record(entries: int) -> None:
    """Turn torch's flight recorder on for ``entries`` collectives per process group: before
    any group is made (the recorder reads its size then); a size the environment sets wins."""
    from torch._C import _distributed_c10d as c10d

    if entries and not any(name in os.environ for name in FR_SIZE):
        os.environ[FR_SIZE[0] if hasattr(c10d, "_dump_fr_trace") else FR_SIZE[1]] = str(entries)


def dump_flight_record(folder: Path, rank: int) -> str:
    """This rank's flight record as ``folder/flight_recorder/rank_<rank>``: the file, or why
    there is none (the report must come out whatever torch does)."""
    dump = _fr_dump()
    if dump is None:
        return "none: this torch has no flight recorder"
    if not any(name in os.environ for name in FR_SIZE):
        return "none: train.flight_recorder=0"
    try:
        data = dump()
    except Exception as err:
        return f"none: {err}"
    path = folder / FR_FOLDER / f"rank_{rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, data)
    return str(path)


def hangs_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "hangs"


def hang_since(out_dir: str | Path, since: float) -> str | None:
    """The sentence of a hang reported in ``out_dir`` at or after ``since`` (a ``time.time()``),
    for the launcher's reason to relaunch; None if there was none."""
    latest = hangs_dir(out_dir) / LATEST
    try:
        if latest.stat().st_mtime >= since:
            return latest.read_text().strip()
    except OSError:
        return None
    return None


class Watchdog:
    """Watches ``watch(step)`` blocks on a thread; ``counts()`` gives the rank's router counts
    for the report (None when they cannot be read)."""

    def __init__(
        self,
        cfg: TrainConfig,
        out_dir: str | Path,
        rank: int,
        world: int,
        counts: Callable[[], dict[str, list[float]] | None] = lambda: None,
        trace: Trace = TRACE,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.cfg, self.dir, self.rank, self.world = cfg, hangs_dir(out_dir), rank, world
        self.counts, self.trace, self._exit = counts, trace, exit
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        self._current: tuple[int, float] | None = None  # (step, when it began)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Files in a step's folder older than this are an earlier attempt's (a relaunch that
        # hangs at the same step again), never this hang's: every rank starts before any fires.
        self.since = time.time()

    @property
    def enabled(self) -> bool:
        return self.cfg.hang_factor > 0

    def limit_s(self) -> float:
        """How long the step in progress may take."""
        if len(self.recent) < WARM_STEPS:
            return self.cfg.hang_first_s
        return max(self.cfg.hang_min_s, self.cfg.hang_factor * statistics.median(self.recent))

    @contextmanager
    def watch(self, step: int) -> Iterator[None]:
        """The block is step ``step``: timed, and watched while it runs."""
        self.trace.begin_step(step)
        if not self.enabled:
            yield
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hang-watchdog", daemon=True)
            self._thread.start()
        began = time.monotonic()
        self._current = (step, began)
        try:
            yield
        finally:
            self._current = None
        self.recent.append(time.monotonic() - began)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            current = self._current
            if current is None:
                continue
            step, began = current
            elapsed, limit = time.monotonic() - began, self.limit_s()
            if elapsed > limit:
                self.fire(step, elapsed, limit)
                return

    # ---- the report --------------------------------------------------------------------

    def report(self, step: int, elapsed: float, limit: float) -> dict[str, Any]:
        last = self.trace.last
        mine = last if last is not None and last.step == step else None
        try:
            counts = self.counts()
        except Exception as err:  # the report must come out whatever the device does
            counts = {"unreadable": [str(err)]}  # type: ignore[dict-item]
        return {
            "rank": self.rank,
            "step": step,
            "elapsed_s": round(elapsed, 3),
            "limit_s": round(limit, 3),
            "entered": self.trace.seq if mine is not None else 0,
            "last": None if mine is None else mine.as_dict(),
            "where": "no collective yet in this step" if mine is None else mine.describe(),
            "router_counts": counts,
        }

    def fire(self, step: int, elapsed: float, limit: float) -> None:
        """Write this rank's report (and on rank 0 the sentence naming the ranks behind), then
        end the process: also when the files cannot be written (a full disk), since a watchdog
        that died there would leave the hang running until the scheduler's time limit."""
        folder = self.dir / f"step_{step}"
        mine = self.report(step, elapsed, limit)
        print(
            f"hang watchdog: rank {self.rank} has been in step {step} for {elapsed:.1f} s (limit "
            f"{limit:.1f} s); it last entered {mine['where']}",
            file=sys.stderr,
            flush=True,
        )
        summary = folder / "summary.txt"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            mine["flight_recorder"] = dump_flight_record(folder, self.rank)
            atomic_write(folder / f"rank_{self.rank}.json", json_bytes(mine))
            if self.rank == 0:
                reports = collect(folder, self.world, REPORT_WAIT_S, self.since)
                sentence = name_lagging(reports, step, self.world)
                print(sentence, file=sys.stderr, flush=True)
                atomic_write(self.dir / LATEST, (sentence + "\n").encode())
                atomic_write(summary, (sentence + "\n").encode())
        except OSError as err:
            print(
                f"hang watchdog: rank {self.rank} could not write its hang report in {folder} "
                f"({err}); it exits all the same",
                file=sys.stderr,
                flush=True,
            )
        if self.rank != 0:
            # the launcher stops every rank once one exits: stay until rank 0 has said it
            deadline = time.monotonic() + REPORT_WAIT_S + SUMMARY_GRACE_S
            while not _written_since(summary, self.since) and time.monotonic() < deadline:
                time.sleep(0.05)
        self._exit(HANG_EXIT)


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False


def collect(
    folder: Path, world: int, wait_s: float, since: float = 0.0
) -> dict[int, dict[str, Any]]:
    """The ranks' reports in ``folder`` written at or after ``since`` (a ``time.time()``),
    waiting up to ``wait_s`` for all ``world`` of them."""
    deadline = time.monotonic() + wait_s
    reports: dict[int, dict[str, Any]] = {}
    while True:
        for r in range(world):
            path = folder / f"rank_{r}.json"
            if r not in reports and _written_since(path, since):
                with contextlib.suppress(OSError, ValueError):  # unreadable: that rank is silent
                    reports[r] = json.loads(path.read_text())
        if len(reports) == world or time.monotonic() > deadline:
            return reports
        time.sleep(POLL_S)


def _waiting(reports: dict[int, dict[str, Any]], behind: list[int]) -> str:
    """Where the ranks ahead wait: "the others wait in X" when they all wait in one place,
    else each place with its ranks, those nearest the ranks behind first (they wait on them
    directly, such as their expert-parallel group in its token dispatch)."""
    places: dict[str, list[int]] = {}
    ahead = sorted((rep["entered"], r) for r, rep in reports.items() if r not in behind)
    for _, r in ahead:
        places.setdefault(reports[r]["where"], []).append(r)
    if len(places) == 1:
        return f"the others wait in {next(iter(places))}"
    said = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))} "
        f"{'wait' if len(ranks) > 1 else 'waits'} in {where}"
        for where, ranks in places.items()
    ]
    return ", ".join(said[:-1]) + " and " + said[-1]


def name_lagging(reports: dict[int, dict[str, Any]], step: int, world: int) -> str:
    """One sentence: which ranks are behind at ``step`` and where everyone stands."""
    silent = [r for r in range(world) if r not in reports]
    fewest = min((rep["entered"] for rep in reports.values()), default=0)
    most = max((rep["entered"] for rep in reports.values()), default=0)
    behind = sorted(r for r, rep in reports.items() if rep["entered"] == fewest and most > fewest)
    parts = []
    if behind:
        where = reports[behind[0]]["where"]
        ranks = ", ".join(map(str, behind))
        parts.append(
            f"rank{'s' if len(behind) > 1 else ''} {ranks} fell behind (last entered {where}) "
            f"while {_waiting(reports, behind)}"
        )
    if silent:
        parts.append(
            f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} "
            "wrote no report (dead, or stuck where its watchdog cannot run)"
        )
    if not parts:
        where = next(iter(reports.values()))["where"] if reports else "unknown"
        parts.append(
            f"every rank stands at the same place ({where}): a collective or the "
            "device itself hangs"
        )
    elapsed = max((rep["elapsed_s"] for rep in reports.values()), default=0.0)
    return (
        f"hang at step {step} after {elapsed:.0f} s: {'; '.join(parts)}; every rank exits "
        f"({HANG_EXIT}) so the launcher relaunches from the newest checkpoint"
    )
