"""Where a conversion reads and writes, checked before anything is read or written (and before
torch is imported, so ``moe convert`` answers a wrong folder at once)."""

from __future__ import annotations

from pathlib import Path

from moe_core.config import ConfigError
from moe_core.files import is_stale_temporary


def existing_source(src: str | Path) -> Path:
    """``src`` (a training checkpoint or a run's model folder) when it exists; else one
    sentence saying what to name."""
    src = Path(src)
    if not src.exists():
        raise ConfigError(
            f"{src} does not exist: name a training checkpoint (a step_N folder) or the model "
            "folder a run saved beside its checkpoints."
        )
    return src


def refuse_existing(out: Path, overwrite: bool) -> None:
    """Refuse to write into ``out`` when it holds anything (but temporaries of a killed
    convert), unless ``overwrite``."""
    if overwrite or not (out.exists() or out.is_symlink()):
        return
    # What a killed convert left is removed by the rerun, not counted as the user's files.
    if not out.is_dir() or any(not is_stale_temporary(p) for p in out.iterdir()):
        raise FileExistsError(
            f"{out} already exists and is not empty: pass --overwrite (overwrite=True) to "
            "replace it, or choose another folder."
        )


def refuse_overlap(src: Path, out: Path, tokenizer_dir: Path | None = None) -> None:
    """Refuse an ``out`` that is ``src``, holds it or lies inside it, or the same with the
    ``checkpoints`` folder of the run ``src`` belongs to (the one it lies in, or its sibling
    for a run's model folder) or the tokenizer folder read: writing there replaces what is
    being read, and ``--overwrite`` would delete the whole run (or data set)."""
    s, o = src.resolve(), out.resolve()
    checkpoints = s.parent if s.parent.name == "checkpoints" else s.parent / "checkpoints"
    guarded = [("SRC", s)] + ([("the run's checkpoints", checkpoints)] * checkpoints.is_dir())
    if tokenizer_dir is not None:
        guarded.append(("the tokenizer folder", tokenizer_dir.resolve()))
    for what, folder in guarded:
        how = "is" if o == folder else "holds" if folder.is_relative_to(o) else "lies inside"
        if folder.is_relative_to(o) or o.is_relative_to(folder):
            raise ConfigError(
                f"OUT {out} {how} {what} {folder}: writing there would replace (with "
                f"--overwrite delete) what is being converted; choose an OUT outside {folder}."
            )
