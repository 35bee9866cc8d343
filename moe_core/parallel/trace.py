"""Where this rank stands: the last collective it entered, for the hang watchdog
(``train.watchdog``).

Every place that starts a collective or a point-to-point message records one ``Entry`` first:
what it is, the module it serves (``layers.3.moe``), the process group and the bytes, with the
step and micro-batch the trainer is in. Recording is a few host-side assignments, with no GPU
work and no host sync, so it stays on in every run. Under CUDA the host runs ahead of the GPU:
an entry says where the host got to (where it waits, when it waits), which is where a hang shows
first; NCCL's flight recorder (``TORCH_NCCL_TRACE_BUFFER_SIZE``) has the GPU's side.

The one trace of a process is ``TRACE`` (a trainer runs one per process, as a process has one
rank). ``MOE_TEST_STALL`` is a test hook, not an option: ``rank:step:seconds:marker`` makes that
rank sleep on its way to its first token dispatch of that step, once (the marker file records
that it did), so tests can hang a rank where real hangs happen: the others wait in the dispatch,
it has not reached it.

``blocked()`` times the host's waits at places where ranks meet (a collective that blocks the
host, the wait for an asynchronous one, the step's host read): their sum, ``blocked_s``, is what
the straggler report (``train.stragglers``) takes off a rank's step time, leaving the time the
rank spent on its own work (the rank others wait for waits least). ``MOE_TEST_SLOW``, the other
test hook, ``rank:seconds``, makes that rank sleep on its way to the first collective of every
step (inside the step's timed span): a straggler the others wait for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DISPATCH = "all_to_all (token dispatch)"


@dataclass(frozen=True)
class Entry:
    seq: int  # entries since the step began (a rank behind the others has fewer)
    step: int
    micro_batch: int | None
    what: str  # e.g. "all_to_all (token dispatch)"
    where: str  # the module it serves, e.g. "layers.3.moe" ("" for the step's own)
    group: str  # e.g. "ep", "dp", "pp 0->1"
    nbytes: int
    at: float  # time.monotonic() when it was entered

    def describe(self) -> str:
        """The entry in words: 'all_to_all (token dispatch) of layers.3.moe, micro-batch 0'."""
        of = f" of {self.where}" if self.where else ""
        mb = f", micro-batch {self.micro_batch}" if self.micro_batch is not None else ""
        group = f" over {self.group}" if self.group else ""
        return f"{self.what}{of}{group}{mb} ({self.nbytes:,} bytes)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Trace:
    """The step, micro-batch and last entry of this process (set by the trainer and the
    collectives' callers)."""

    def __init__(self, hook: Callable[[Entry], None] | None = None, slow_s: float = 0.0) -> None:
        self.step, self.micro_batch, self.seq = -1, None, 0
        self.last: Entry | None = None
        self.blocked_s = 0.0  # host seconds spent waiting where ranks meet, ever (``blocked``)
        self._hook, self._slow_s = hook, slow_s

    def begin_step(self, step: int) -> None:
        self.step, self.micro_batch, self.seq = step, None, 0

    @contextmanager
    def blocked(self) -> Iterator[None]:
        """The block waits for other ranks (or the device): its time counts in ``blocked_s``."""
        began = time.perf_counter()
        try:
            yield
        finally:
            self.blocked_s += time.perf_counter() - began

    def enter(self, what: str, where: str = "", group: str = "", nbytes: int = 0) -> None:
        """Record the collective about to start (call it right before)."""
        entry = Entry(
            self.seq + 1, self.step, self.micro_batch, what, where, group, nbytes, time.monotonic()
        )
        if self._hook is not None:  # the test hook stalls on the way, before the collective
            self._hook(entry)
        if self._slow_s and entry.seq == 1:  # MOE_TEST_SLOW: this rank's own work takes longer
            time.sleep(self._slow_s)
        self.seq, self.last = entry.seq, entry


def _test_stall() -> Callable[[Entry], None] | None:
    """The ``MOE_TEST_STALL`` hook (module doc), or None when it is not set."""
    spec = os.environ.get("MOE_TEST_STALL")
    if not spec:
        return None
    rank, step, seconds, marker = spec.split(":", 3)

    def stall(entry: Entry) -> None:
        mine = os.environ.get("RANK", "0") == rank and entry.step == int(step)
        if mine and entry.what == DISPATCH and not Path(marker).exists():
            Path(marker).write_text("stalled\n")
            time.sleep(float(seconds))

    return stall


def _test_slow() -> float:
    """The ``MOE_TEST_SLOW`` hook (module doc): this rank's sleep per step, 0 when not set."""
    spec = os.environ.get("MOE_TEST_SLOW")
    if not spec:
        return 0.0
    rank, seconds = spec.split(":", 1)
    return float(seconds) if os.environ.get("RANK", "0") == rank else 0.0


TRACE = Trace(_test_stall(), _test_slow())
