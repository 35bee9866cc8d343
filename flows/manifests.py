"""Stage manifests: what a stage consumed (a hash of its config and of its inputs' manifests)
and what it produced (checksums), so a rerun skips a stage whose outputs still verify, redoes one
whose outputs are missing or corrupt, and redoes everything downstream of a changed input."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from moe_core.files import file_sha256, plain_relative

STAGES = ("tokenize", "init", "train", "convert", "evaluate")


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def checksums(root: Path, paths: list[Path]) -> dict[str, dict[str, Any]]:
    """Size and sha256 of every file under ``paths`` (files or folders), relative to ``root``."""
    out: dict[str, dict[str, Any]] = {}
    for p in paths:
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            out[str(f.relative_to(root))] = {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
    return out


def manifest_path(run_dir: Path, stage: str) -> Path:
    return run_dir / "stages" / f"{stage}.json"


def read(run_dir: Path, stage: str) -> dict[str, Any] | None:
    path = manifest_path(run_dir, stage)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(run_dir: Path, stage: str, key: str, files: dict, summary: dict) -> dict[str, Any]:
    """Atomically record a finished stage."""
    record = {"stage": stage, "key": key, "files": files, "summary": summary, "at": time.time()}
    path = manifest_path(run_dir, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return record


def verify(run_dir: Path, stage: str, key: str) -> tuple[dict[str, Any] | None, str]:
    """(the manifest, "") if the stage is done for ``key`` and its files are intact, else
    (None, why it must run)."""
    record = read(run_dir, stage)
    if not isinstance(record, dict):
        return None, "no manifest"
    if record.get("key") != key:
        return None, "its inputs or config changed"
    files = record.get("files")
    if not isinstance(files, dict) or not all(isinstance(i, dict) for i in files.values()):
        return None, "its manifest does not list its files"
    for rel, info in files.items():
        # A manifest naming a file elsewhere is not this stage's: it runs again. Checked as
        # written, not resolved: a run's data or checkpoint folder may be a link to another disk.
        if not plain_relative(rel):
            return None, f"its manifest names {rel!r}, a path outside the run folder"
        f = run_dir / rel
        if not f.is_file():
            return None, f"{rel} is missing"
        if f.stat().st_size != info.get("bytes") or file_sha256(f) != info.get("sha256"):
            return None, f"{rel} does not match its checksum"
    return record, ""
