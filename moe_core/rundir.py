"""Run directories: one run at a time in each, and what an earlier run left is moved aside,
never deleted.

Shared by the trainer (its ``out_dir``) and the pipeline (its run directory); kept to the
standard library so that the CLI and the pipeline import it cheaply.

The lock is ``flock`` on ``.moe.lock`` in the directory: the kernel drops it when its process
ends, however it ends, so a lock left by a dead process is simply taken over (and reported),
while a live holder (another process) is named (pid, host, command, start) in the refusal.
The file itself stays.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from moe_core.errors import RunDirLockedError, RunFileError

SUPERSEDED = "superseded"
LOCK = ".moe.lock"
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _describe(holder: dict) -> str:
    """A lock holder in words: process, host, command, start time."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(holder.get("since", 0)))
    return (
        f"process {holder.get('pid')} on host {holder.get('host')} "
        f"({holder.get('command')}, since {when})"
    )


# Locks this process holds: folder (resolved) -> [its open, flocked file, RunLocks sharing it].
_HELD: dict[str, list[Any]] = {}


class RunLock:
    """An exclusive lock on a run directory for this process, held until every ``RunLock`` of
    the folder in this process is released (or the process ends). Another process is refused;
    another object of the same process (a second ``Trainer`` in a notebook) shares the lock.

    ``previous``: the holder recorded by a lock that was taken over (its process had ended),
    in words; None when the lock was free. ``unsupported``: why the file system could not lock
    (then nothing is held and a second run would not be stopped)."""

    def __init__(self, folder: str | os.PathLike, command: str) -> None:
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.previous: str | None = None
        self.unsupported: str | None = None
        self._created = not self.folder.exists()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise RunFileError(
                f"{self.folder} cannot be a run directory: it (or a folder above it) exists but "
                "is not a folder (a file, or a symlink that loops or leads nowhere); choose "
                "another directory."
            ) from None
        self._key = str(self.folder.resolve())
        self._released = False
        if self._key in _HELD:
            _HELD[self._key][1] += 1
            return
        f = open(self.path, "a+")  # noqa: SIM115 (held open while locked)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(f)
            f.close()
            raise RunDirLockedError(
                f"{self.folder} is in use by another run: {_describe(holder)} holds "
                f"{self.path}; wait for it to end (or stop it), or choose another directory."
            ) from None
        except OSError as err:
            if err.errno not in _UNSUPPORTED:
                f.close()
                raise
            self.unsupported = f"{self.path} cannot be locked on this file system ({err.strerror})"
        else:
            left = _read(f)
            if left:
                self.previous = _describe(left)
            me = {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "command": command,
                "since": time.time(),
            }
            f.seek(0)
            f.truncate()
            f.write(json.dumps(me) + "\n")
            f.flush()
        _HELD[self._key] = [f, 1]

    def release(self) -> None:
        """Let the next run in once no object of this process holds the folder any more (the
        file stays, emptied). A folder this lock created and nothing else used is removed
        again, so a refused start leaves no trace."""
        if self._released:
            return
        self._released = True
        f, holders = _HELD[self._key]
        if holders > 1:
            _HELD[self._key][1] -= 1
            return
        del _HELD[self._key]
        if self.unsupported is None:
            f.seek(0)
            f.truncate()
            f.flush()
        if self._created and [p.name for p in self.folder.iterdir()] == [LOCK]:
            self.path.unlink()
            self.folder.rmdir()
        f.close()  # closing drops the flock


def _read(f) -> dict:
    """The holder a lock file records ({} when empty or unreadable)."""
    f.seek(0)
    try:
        holder = json.loads(f.read() or "{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}


def set_aside(paths: list[Path], why: str = SUPERSEDED) -> int | None:
    """Rename every existing path ``p`` of ``paths`` to ``p.superseded-N`` (``why`` in place of
    ``superseded``; one ``N`` for all, the first free one) and return ``N``; None when none of
    them exists. Nothing is deleted."""
    present = [p for p in paths if p.exists() or p.is_symlink()]
    if not present:
        return None
    n = 1
    while any(p.with_name(f"{p.name}.{why}-{n}").exists() for p in paths):
        n += 1
    for p in present:
        p.rename(p.with_name(f"{p.name}.{why}-{n}"))
    return n
