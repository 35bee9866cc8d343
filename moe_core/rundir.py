"""Run directories: what an earlier run left is moved aside, never deleted.

Shared by the trainer (its ``out_dir``) and the pipeline (its stage folders); kept to the
standard library so that the CLI and the pipeline import it cheaply.
"""

from __future__ import annotations

from pathlib import Path

SUPERSEDED = "superseded"


def set_aside(paths: list[Path]) -> int | None:
    """Rename every existing path ``p`` of ``paths`` to ``p.superseded-N`` (one ``N`` for all, the
    first free one) and return ``N``; None when none of them exists. Nothing is deleted."""
    present = [p for p in paths if p.exists() or p.is_symlink()]
    if not present:
        return None
    n = 1
    while any(p.with_name(f"{p.name}.{SUPERSEDED}-{n}").exists() for p in paths):
        n += 1
    for p in present:
        p.rename(p.with_name(f"{p.name}.{SUPERSEDED}-{n}"))
    return n
