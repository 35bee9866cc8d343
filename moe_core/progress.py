"""A long step's progress for whoever watches it: a bar on a terminal, and a plain line every
few seconds where no terminal shows one (a pipeline's log, ``moe eval score > log``), so a step of
minutes never looks stuck."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable


class LineProgress:
    """``name``'s progress: ``say`` gets a line (``name: text``) at most every ``every_s``
    seconds, the first and the last always; a bar is drawn on stderr while it is a terminal
    (``bar``: force it on or off). ``say=None``: the bar alone (a command on a terminal)."""

    def __init__(
        self,
        name: str,
        say: Callable[[str], None] | None,
        every_s: float = 10.0,
        bar: bool | None = None,
    ) -> None:
        self.name, self.say, self.every_s = name, say, every_s
        self.show_bar = sys.stderr.isatty() if bar is None else bar
        self.last, self.pending = -math.inf, None
        self.lines: list[str] = []  # what was said, for whoever asks

    def __enter__(self) -> LineProgress:
        if self.show_bar:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn(f"[bold]{self.name}"),
                BarColumn(),
                TextColumn("{task.description}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
            )
            self.bar.start()
            self.task = self.bar.add_task("", total=None)
        return self

    def update(
        self, text: str, done: int | None = None, total: int | None = None, force: bool = False
    ) -> None:
        """Show ``text`` (``done`` of ``total`` on the bar); ``force`` says it now (a phase's
        end)."""
        if self.show_bar:
            self.bar.update(self.task, completed=done or 0, total=total, description=text)
        now = time.monotonic()
        if force or now - self.last >= self.every_s:
            self._say(text)
            self.last = now
        else:
            self.pending = text

    def _say(self, text: str) -> None:
        if self.say is not None:
            self.say(f"{self.name}: {text}")
        self.lines.append(text)
        self.pending = None

    def __exit__(self, *exc: object) -> None:
        if self.show_bar:
            self.bar.stop()
        if self.pending is not None and exc[0] is None:
            self._say(self.pending)
