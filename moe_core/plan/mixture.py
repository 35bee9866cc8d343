"""A mixture's plan: each source's share of the run, the tokens that gives it and how many
epochs of it ``train.steps`` imply. The sources' sizes (their train splits' tokens) come from
the caller (``moe plan`` reads them): the planner reads no data. ``planner.js``'s
``mixtureRows`` mirrors ``mixture_plan`` for the page."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rich.table import Table

from moe_core.config import RunConfig


@dataclass(frozen=True)
class SourcePlan:
    """One source of ``data.sources`` over the whole run."""

    name: str
    share: float  # of the run's instances
    drawn: int  # instances the run draws from it (the loader's within one of this)
    tokens: int  # the run trains on from it (train.seq_len per instance)
    instances: int | None  # its train split's instances of seq_len + 1 tokens (None: unread)

    @property
    def epochs(self) -> float | None:
        """Passes over the source the run makes (above 1: it repeats); None when its size is
        unknown or it holds no instance."""
        return self.drawn / self.instances if self.instances else None


def mixture_plan(run: RunConfig, source_tokens: dict[str, int | None]) -> list[SourcePlan]:
    """Each source's share, draws and size (``source_tokens``: its train split's tokens by
    name, None where unknown)."""
    t = run.train
    slots = t.steps * t.global_batch_size
    out = []
    for s, share in zip(run.data.sources, run.source_shares, strict=True):
        drawn = math.floor(slots * share + 0.5)  # half up, as the page's Math.round
        tokens = source_tokens.get(s.name)
        instances = None if tokens is None else tokens // (t.seq_len + 1)
        out.append(SourcePlan(s.name, share, drawn, drawn * t.seq_len, instances))
    return out


def mixture_table(rows: list[SourcePlan]) -> Table:
    """What ``moe plan`` prints for a mixture: a row per source."""
    t = Table(title="data mixture", show_header=True)
    for column in ("source", "share", "tokens trained on", "epochs"):
        t.add_column(column, justify="left" if column == "source" else "right")
    for r in rows:
        t.add_row(r.name, f"{r.share:.1%}", f"{r.tokens:,}", epochs_text(r.epochs, r.instances))
    return t


def epochs_text(epochs: float | None, instances: int | None) -> str:
    """A source's epochs as the table and the page say them."""
    if instances is None:
        return "unknown (not readable)"
    if epochs is None:
        return "none: it holds no whole sequence"
    return f"{epochs:.2f}" + (" (repeats)" if epochs > 1 else "")
