"""The checkpoint format: folder names, state keys, the manifest and the one rule that says
whether a checkpoint verifies. Training writes it (``train.checkpoint``), export and evaluation
read it (``convert.checkpoint``); both import it from here, so neither imports the other for it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from moe_core.ckpt import dcp_read
from moe_core.files import file_sha256, plain_relative

MANIFEST = "manifest.json"
# Eight digits at least: every folder so far keeps its name, a step past 99,999,999 gets more.
_STEP_DIR = re.compile(r"step_(\d{8,})")
# The key format of every checkpoint: a range of a parameter's optimizer state (the master
# weights are ``param``) from flat offset ``start``, and a non-trained buffer.
_KEY = re.compile(r"opt/(.+)/(param|exp_avg|exp_avg_sq)/(\d+)")
_BUFFER_KEY = re.compile(r"buf/(.+)")


def step_dir_name(step: int) -> str:
    """The folder name of checkpoint ``step`` (the one spelling every part uses)."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step a checkpoint folder's name says, or None for any other name (a zero-padded
    spelling other than ``step_dir_name``'s would name a step twice)."""
    m = _STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m and step_dir_name(int(m.group(1))) == name else None


def state_key(name: str, kind: str, start: int) -> str:
    """The key of ``name``'s optimizer state ``kind`` (param, exp_avg, exp_avg_sq) from flat
    offset ``start``."""
    return f"opt/{name}/{kind}/{start}"


def buffer_key(name: str) -> str:
    return f"buf/{name}"


def parse_key(key: str) -> tuple[str, str, int] | tuple[str, None, None] | None:
    """``(name, kind, start)`` for an optimizer-state key, ``(name, None, None)`` for a buffer,
    None for anything else."""
    if m := _KEY.fullmatch(key):
        return m.group(1), m.group(2), int(m.group(3))
    if m := _BUFFER_KEY.fullmatch(key):
        return m.group(1), None, None
    return None


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest as a dict, or None when it is missing or unreadable."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def run_id_of(path: Path) -> str | None:
    """The id of the run that wrote checkpoint ``path`` (None: unreadable, or written before
    checkpoints carried run ids)."""
    manifest = read_manifest(path)
    run = None if manifest is None else manifest.get("run_id")
    return run if isinstance(run, str) else None


def trainer_state(path: str | Path) -> dict[str, Any]:
    """The trainer state a checkpoint holds (step, guards, config, loader), read alone."""
    request = {"trainer": ""}
    dcp_read.load(request, path, no_dist=True)
    return json.loads(request["trainer"])


def verify(path: Path, checksums: bool = True, share: tuple[int, int] = (0, 1)) -> str | None:
    """None if the checkpoint verifies, else why not (one sentence): the one rule resume,
    retention and convert apply. Its manifest must list every file in the folder (a file it
    does not list is never checked), each with its size and sha256, and, in a ``step_N``
    folder, say step N (a renamed folder would be resumed and pruned as another step).

    ``checksums=False`` checks the files' presence and sizes only (for checkpoints this process
    wrote and hashed itself). ``share=(i, n)``: hash only every n-th listed file from the i-th
    (n ranks verifying one checkpoint together, each reading 1/n of its bytes)."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        return f"{path.name} has no {MANIFEST}"
    try:
        meta = json.loads(manifest.read_text())
        files, step = meta["files"], meta["step"]
        if not isinstance(files, dict) or not isinstance(step, int):
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return f"{path.name}/{MANIFEST} is unreadable"
    named = step_of(path.name)
    if named is not None and step != named:
        return f"{path.name}/{MANIFEST} says step {step}, not the {named} its folder name says"
    if not files:
        return f"{path.name}/{MANIFEST} lists no files"
    on_disk = {
        f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file() or f.is_symlink()
    }
    unlisted = sorted(on_disk - set(files) - {MANIFEST})
    if unlisted:
        return f"{path.name}/{unlisted[0]} is not listed in its {MANIFEST}"
    mine, ranks = share
    for k, (rel, info) in enumerate(sorted(files.items())):
        if not plain_relative(rel) or not isinstance(info, dict):
            return f"{path.name}/{MANIFEST} is unreadable"
        f = path / rel
        if not f.is_file():
            return f"{path.name}/{rel} is missing"
        if f.stat().st_size != info.get("bytes"):
            return (
                f"{path.name}/{rel} has {f.stat().st_size} bytes, "
                f"the manifest says {info.get('bytes')}"
            )
        if checksums and k % ranks == mine and file_sha256(f) != info.get("sha256"):
            return f"{path.name}/{rel} does not match its sha256"
    return None
