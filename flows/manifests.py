"""Stage manifests: what a stage consumed (a hash of its config and of its inputs' manifests)
and what it produced (checksums), so a rerun skips a stage whose outputs still verify, redoes one
whose outputs are missing or corrupt, and redoes everything downstream of a changed input.

``KEY_VERSION`` says how a manifest's key was computed: a manifest from before it (version 1,
the field absent) is accepted when its key is the one the old computation gives for the current
config (``flows.migrate``), and is then rewritten with the current key."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from flows.layout import RunLayout
from moe_core.files import file_sha256, plain_relative

# 2: keys hash the config as it is laid out now (1: precision at its keys from before the
# precision section, ``flows.migrate.old_stage_keys``).
KEY_VERSION = 2


# Options added after key version 2, each with what means "as before" (a value, or the value
# computed from its section): a key hashes one only when it is set otherwise, so adding an
# option does not make every existing run folder's stages run again.
ADDED_SINCE: dict[str, Any] = {
    "model.head_dim": lambda m: m["d_model"] // m["n_heads"],
    "model.qk_norm": "projection",
    "model.rotary_fraction": 1.0,
    "model.attention_bias": "none",
    "model.n_dense_layers": 0,
    "model.dense_hidden": None,
    "model.n_expert_groups": 1,
    "model.top_k_groups": 1,
    "model.routed_scale": 1.0,
    "model.tie_embeddings": False,
    "model.aux_loss_reduction": "sum",
    "model.kv_lora_rank": None,
    "model.q_lora_rank": None,
    "model.qk_rope_head_dim": None,
    "model.qk_nope_head_dim": None,
    "model.v_head_dim": None,
    "model.rope_scaling": "none",
    "model.yarn_factor": 1.0,
    "model.yarn_original_max_seq_len": 4096,
    "model.yarn_beta_fast": 32.0,
    "model.yarn_beta_slow": 1.0,
    "model.yarn_mscale": 1.0,
    "model.yarn_mscale_all_dim": 0.0,
    "model.mtp_depth": 0,
    "model.mtp_loss_weight": 0.3,
    "model.mtp_loss_weight_late": 0.1,
    "model.mtp_late_start": 10 / 14.8,
    "data.sources": [],
    "data.format": "moe",
    "data.token_dtype": None,
    "train.document_mask": False,
    "parallel.cp": 1,
    "parallel.backend": "auto",
}

# Train options that do not change what training computes (the hang watchdog's limits and
# flight recorder, the straggler report's): no key hashes them, so changing one redoes no stage.
NOT_IN_TRAIN_KEY = (
    "hang_factor",
    "hang_min_s",
    "hang_first_s",
    "flight_recorder",
    "straggler_share",
    "straggler_windows",
)


def train_section(value: dict[str, Any]) -> dict[str, Any]:
    """``to_dict`` of the train section as the train stage's key hashes it."""
    return {k: v for k, v in keyed("train", value).items() if k not in NOT_IN_TRAIN_KEY}


# Precision options that change no value the train stage computes: no train key hashes them.
NOT_IN_PRECISION_KEY = ("fp8_weight_cache",)


def precision_section(value: dict[str, Any]) -> dict[str, Any]:
    """``to_dict`` of the precision section as the train stage's key hashes it."""
    return {k: v for k, v in value.items() if k not in NOT_IN_PRECISION_KEY}


# Data options the token shards do not depend on (where they go; where and in what pieces the
# work runs): no tokenize key hashes them, so moving a run onto a cluster redoes no stage.
NOT_IN_TOKENIZE_KEY = ("dir", "scheduler", "unit_documents")


def keyed(section: str, value: dict[str, Any]) -> dict[str, Any]:
    """``value`` (``to_dict`` of config section ``section``) without the options of
    ``ADDED_SINCE`` that hold their as-before value: what a stage key hashes of that section."""
    out = dict(value)
    for added, as_before in ADDED_SINCE.items():
        where, key = added.split(".")
        if where == section and key in out:
            before = as_before(value) if callable(as_before) else as_before
            if out[key] == before:
                del out[key]
    return out


def folder_fingerprint(folder: Path) -> dict[str, Any]:
    """What a stage key holds of a folder it reads but does not own (a checkpoint to start
    from): its resolved path and each file's name, size and modification time (hashing a
    model's weights on every pipeline run would take minutes); a folder that is not there is
    said so, for the stage to refuse when it runs."""
    if not folder.is_dir():
        return {"path": str(folder), "missing": True}
    return files_fingerprint(folder, sorted(p for p in folder.iterdir() if p.is_file()))


def files_fingerprint(root: Path, files: list[Path]) -> dict[str, Any]:
    """``files`` (below ``root``) by name relative to it, size and modification time."""
    return {
        "path": str(root.resolve()),
        "files": [
            [p.relative_to(root).as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files
        ],
    }


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
    return RunLayout(run_dir).manifest(stage)


def read(run_dir: Path, stage: str) -> dict[str, Any] | None:
    path = manifest_path(run_dir, stage)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _store(run_dir: Path, stage: str, record: dict[str, Any]) -> None:
    path = manifest_path(run_dir, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)


def write(run_dir: Path, stage: str, key: str, files: dict, summary: dict) -> dict[str, Any]:
    """Atomically record a finished stage."""
    record = {"stage": stage, "key": key, "key_version": KEY_VERSION, "files": files}
    record |= {"summary": summary, "at": time.time()}
    _store(run_dir, stage, record)
    return record


def current(record: dict[str, Any]) -> bool:
    """Whether a manifest's key was computed the way keys are computed now."""
    return record.get("key_version", 1) == KEY_VERSION


def rekey(run_dir: Path, stage: str, record: dict[str, Any], key: str) -> dict[str, Any]:
    """Atomically rewrite a manifest accepted under its old key with the current ``key`` (its
    files, summary and time kept; the old key kept as ``old_key``)."""
    record = {**record, "key": key, "key_version": KEY_VERSION, "old_key": record.get("key")}
    _store(run_dir, stage, record)
    return record


NO_MANIFEST = "no manifest"
KEY_CHANGED = "its inputs or config changed"


def verify(
    run_dir: Path, stage: str, key: str, old_key: str | None = None
) -> tuple[dict[str, Any] | None, str]:
    """(the manifest, "") if the stage is done for ``key`` (or, for a manifest written before
    ``KEY_VERSION``, for ``old_key``) and its files are intact, else (None, why it must run)."""
    record = read(run_dir, stage)
    if not isinstance(record, dict):
        return None, NO_MANIFEST
    # Any version holding the current key is this config's (a stage whose key did not change);
    # only one from before KEY_VERSION may hold the old one.
    accepted = (key,) if current(record) or old_key is None else (key, old_key)  # any JSON
    if record.get("key") not in accepted:
        return None, KEY_CHANGED
    files = record.get("files")
    if not isinstance(files, dict) or not all(isinstance(i, dict) for i in files.values()):
        return None, "its manifest does not list its files"
    if not isinstance(record.get("summary"), dict):  # what a skipped stage reports from
        return None, "its manifest holds no summary"
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
