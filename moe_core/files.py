"""File helpers every part writes and checks files with (token shards, checkpoints, exports,
stage manifests): atomic writes, the permissions of a new file, deterministic JSON, sha256, and
the one rule for a path that a manifest, index or metadata file names."""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TMP_MARK = ".tmp-"


def inside(
    folder: str | Path,
    relative: Any,
    named_by: str | Path,
    error: type[Exception] = ValueError,
    within: str | Path | None = None,
) -> Path:
    """``folder / relative`` once it is checked to name a file inside ``folder``: a relative
    path that stays there once resolved (no ``..`` out, no symlink leading out). A manifest,
    index or metadata file (``named_by``) could otherwise make a reader open any file; anything
    else is refused with ``error`` in one sentence. ``within``: a folder above ``folder`` that
    symlinks may lead into (a Hugging Face hub snapshot's files link into its repo's blobs)."""
    root = Path(folder)
    bound = Path(within) if within is not None else root
    if not plain_relative(relative) or not _resolves_inside(root / relative, bound):
        raise error(
            f"{named_by} names {relative!r}, which is not allowed: only a relative path to a "
            f"file inside {root} (no .., no absolute path, no symlink leading out) is read."
        )
    return root / relative


def plain_relative(relative: Any) -> bool:
    """Whether ``relative`` is a relative path that names something below its folder as
    written (no ``..``, not absolute, not empty), before any symlink is followed."""
    if not isinstance(relative, str) or relative.strip() in ("", ".") or "\0" in relative:
        return False
    return not Path(relative).is_absolute() and ".." not in Path(relative).parts


def _resolves_inside(path: Path, bound: Path) -> bool:
    try:
        top = bound.resolve()
        resolved = path.resolve()
    except (OSError, RuntimeError):  # a symlink loop (RuntimeError before Python 3.13)
        return False
    return resolved != top and resolved.is_relative_to(top)


def temporary_name(path: Path) -> Path:
    """The name ``path`` is written under before it is renamed into place: beside it, marked as
    a temporary, and by the writing process (so a rerun can tell a killed writer's)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")


def is_stale_temporary(path: Path) -> bool:
    """Whether ``path`` is a ``temporary_name`` of a process that is no longer running (one
    that was killed, or whose disk filled up before it could clean up)."""
    head, mark, pid = path.name.rpartition(TMP_MARK)
    if not (mark and head.startswith(".") and pid.isdigit()):
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):
        return False  # another user's live process, or no pid at all: not ours to judge
    return False


def remove_stale_temporaries(folder: Path, names: Iterable[str]) -> None:
    """Drop what killed writers of ``names`` left in ``folder`` (files, or whole folders)."""
    for name in names:
        for p in folder.glob(f".{glob.escape(name)}{TMP_MARK}*"):
            if not is_stale_temporary(p):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()


def atomic_write(path: Path, data: bytes, sync: bool = True) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one; a
    write that fails (a full disk) removes its partial temporary, which would hold the space."""
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def user_mode(directory: bool) -> int:
    """The permissions a new file (or folder) gets under the user's umask: what a file made
    through a temporary name (created private) is given before it is renamed into place."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if directory else 0o666) & ~mask


def remove_temporaries(folder: Path) -> None:
    """Drop what an interrupted ``atomic_write`` left in ``folder`` under a temporary name
    (never a finished file)."""
    for p in folder.glob(f".*{TMP_MARK}*"):
        if p.is_file():
            p.unlink()


def json_bytes(obj: Any) -> bytes:
    """Deterministic JSON: the same content always gives the same bytes."""
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def sha256_hex(data: bytes) -> str:
    """The sha256 of ``data`` as hex, the form every manifest records."""
    return hashlib.sha256(data).hexdigest()


def file_sha256(path: str | Path) -> str:
    """The sha256 of a file as hex, read in 4 MiB pieces (checkpoint shards are large)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
