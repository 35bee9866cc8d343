"""What every benchmark's JSON says about where it ran, and how it is written.

``stamp`` is the date, the GPU, the torch version and the commit (the tree that ran, which the
caller passes: ``--commit``); ``save`` writes the report, indented, where ``--out`` says (nothing
when it is empty). torch is imported when a stamp is made, not with this module: the scripts
that only launch others import it no earlier than they did.
"""

from __future__ import annotations

import json
from datetime import date
from pathlib import Path


def stamp(commit: str, gpu: str | None = None) -> dict[str, str]:
    """The run's date, GPU (this process's current CUDA device unless given), torch, commit."""
    import torch

    return {
        "date": str(date.today()),
        "gpu": torch.cuda.get_device_name() if gpu is None else gpu,
        "torch": torch.__version__,
        "commit": commit,
    }


def save(report: dict, out: str | Path | None) -> None:
    """Write ``report`` as indented JSON to ``out`` (its folder made; nothing when empty)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
