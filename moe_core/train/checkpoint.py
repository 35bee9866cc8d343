"""Sharded, atomic, resharding checkpoints on ``torch.distributed.checkpoint`` (DCP).

What is saved: the ZeRO-1 optimizer's master weights and Adam moments (fp32, or bf16 under
``precision.optimizer=bf16``; either loads into either, converted), router buffers (the
expert bias), and the trainer's state (step, guard counters, config). Model weights are the
masters cast to the model dtype, so they are not stored twice. Each rank writes only what it
owns: for every parameter, the contiguous range of its flattened *global* tensor that its shard
covers, under the key ``opt/<name>/<kind>/<start>``. Loading in any layout reads the saved
ranges that overlap what the loading rank owns, so a checkpoint written with ``ep=2, dp=2``
loads into ``ep=1`` or ``pp=2`` (resharding on load).

Publishing: DCP writes into ``.tmp-step_N``; each rank hashes the files it wrote itself (DCP
names them ``__<rank>_N.distcp``; in the background for an async save) and leaves their sizes
and sha256 in ``.sha256-<rank>.json`` beside them, so no rank reads another's bytes (at 512
ranks rank 0 would read the whole checkpoint); rank 0 then adds ``manifest.json`` (step,
layout, every file's size and sha256: the ranks' records, and its own hash of any file without
one, such as DCP's ``.metadata``) and renames the folder to ``step_N``. A folder without a
verifying manifest is never resumed from: resume picks the newest ``step_N`` whose manifest
verifies and reports the ones that do not.

Every manifest names the run that wrote it (``run_id``: new for a run that starts fresh, taken
over from the checkpoint a run resumes from). Retention deletes only checkpoints of this run
that verify and are older than its newest valid one: never another run's, never one that does
not verify (it is reported instead), never a newer one. A folder already at ``step_N``'s name is
moved aside (``step_N.replaced-K``), not deleted.

What each checkpoint costs the run (``SaveCost``, rank 0's host clocks) goes to ``on_cost`` once
it is published: how long the training loop was blocked for it (the whole save when
synchronous; under ``train.async_checkpoint`` the staging call plus its collection, that is
waiting for the background write and publishing it, counted apart, and said apart when the next
save had to wait for it), how long from the save's start until it
was published (the manifest written, the folder renamed and retention applied) and its bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import shutil
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from time import monotonic, sleep
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from moe_core.ckpt import dcp_read
from moe_core.ckpt.dcp_read import inner_error
from moe_core.ckpt.dcp_read import quiet as _quiet
from moe_core.ckpt.format import (
    MANIFEST,
    buffer_key,
    parse_key,
    run_id_of,
    state_key,
    step_dir_name,
    step_of,
    trainer_state,
    verify,
)
from moe_core.config import ModelConfig
from moe_core.config_dict import from_dict
from moe_core.errors import CheckpointError, RunFileError
from moe_core.files import atomic_write, file_sha256, json_bytes
from moe_core.model.transformer import parameter_shapes, shape_mismatch
from moe_core.parallel.mesh import Mesh
from moe_core.parallel.optimizer import STATE_KEYS, ShardedAdamW

# How torch's stream writer reports a write that came out short (the disk filled up).
_SHORT_WRITE = "unexpected pos"
# Publishing waits this long for a rank's record of its files' hashes (written once the rank's
# own write is done, so about when rank 0's is) before hashing that rank's files itself.
RECORD_WAIT_S = 600.0
# A run that fails while a background save is pending publishes it only if its write finishes
# within this (and the other ranks' records come within it): never a wait on dead ranks.
SALVAGE_WAIT_S = 60.0
PIN_MIN_BYTES = 1 << 20  # a background save's host buffers are pinned from this size on
WAIT_SHOWN_S = 0.5  # a checkpoint line splits its stall from this much waiting for the write on


def _record_name(rank: int) -> str:
    return f".sha256-{rank}.json"


@dataclass
class Owned:
    """A range this rank owns: elements ``[start, start + length)`` of the flattened global
    tensor ``name``, held at ``[local, local + length)`` of the rank's master shard ``index``."""

    name: str
    start: int
    length: int
    index: int
    local: int


def owned_ranges(opt: ShardedAdamW) -> list[Owned]:
    out: list[Owned] = []
    for i, b in enumerate(opt.buckets):
        lo = b.shard.start
        hi = min(b.shard.stop, b.numel)
        for name, p, off, base in zip(b.names, b.params, b.offsets, b.global_starts, strict=True):
            a, z = max(lo, off), min(hi, off + p.numel())
            if a < z:
                out.append(Owned(name, base + a - off, z - a, i, a - lo))
    return out


def new_run_id() -> str:
    """A fresh run id (random: two runs never share one)."""
    return secrets.token_hex(8)


def check_fits(
    path: Path,
    saved: dict[tuple[str, str], list[tuple[int, int, str]]],
    shapes: dict[str, tuple[int, ...]],
) -> None:
    """Refuse, in one sentence, a checkpoint written for another model: the model its config
    describes must have ``shapes``, and its saved ranges (``saved``: (name, kind) -> ranges)
    must cover each parameter and each moment kept exactly once over."""
    config = trainer_state(path).get("config", {}).get("model", {})
    problem = shape_mismatch(parameter_shapes(from_dict(ModelConfig, config, "model.")), shapes)
    if problem is None:
        for (name, kind), ranges in saved.items():
            held = sum(length for _, length, _ in ranges)
            numel = math.prod(shapes.get(name, (0,)))
            if name in shapes and held != numel:
                problem = f"{name}'s {kind} holds {held} values there, {numel} here"
                break
    if problem is not None:
        raise CheckpointError(
            f"checkpoint {path} was written for another model ({problem}): resume it with "
            "the model settings it was written with, or train into a new out_dir."
        )


@dataclass(frozen=True)
class SaveCost:
    """What one published checkpoint cost, by host clocks on rank 0 (see the module's
    docstring). ``stall_s <= durable_s`` always: the loop's blocked time lies within it."""

    step: int
    stall_s: float  # the training loop blocked for this checkpoint
    durable_s: float  # from the save's start until published under ``step_N``
    bytes: int  # the published folder's files, manifest included
    background: bool  # written by ``train.async_checkpoint``
    # Of ``stall_s`` under ``train.async_checkpoint``: the loop waiting for the background
    # write and publishing it, and whether the next save was what waited (the write outlasted
    # the interval between checkpoints); the rest is the save call (gathering and host copy).
    wait_s: float = 0.0
    next_save_waited: bool = False

    @property
    def write_gbps(self) -> float:
        """The folder's bytes over the time to publish it (GB/s)."""
        return self.bytes / max(self.durable_s, 1e-9) / 1e9

    def record(self) -> dict[str, Any]:
        """The line ``checkpoints.jsonl`` holds for it (beside its ``step``)."""
        return {
            "checkpoint/stall_s": self.stall_s,
            "checkpoint/durable_s": self.durable_s,
            "checkpoint/bytes": self.bytes,
            "checkpoint/write_gbps": self.write_gbps,
            "checkpoint/async": self.background,
            "checkpoint/wait_s": self.wait_s,
        }

    def line(self) -> str:
        """The trainer's one line for it."""
        size = (
            f"{self.bytes / 2**30:.1f} GiB"
            if self.bytes >= 2**30
            else f"{self.bytes / 2**20:.1f} MiB"
        )
        split = ""
        if self.background and self.wait_s >= WAIT_SHOWN_S:
            split = (
                f" ({self.stall_s - self.wait_s:.2f} s to copy it, {self.wait_s:.2f} s waiting "
                + (
                    "for the write at the next checkpoint: it outlasted train.checkpoint_every's "
                    "steps, so raise that or write to faster storage)"
                    if self.next_save_waited
                    else "for the write)"
                )
            )
        return (
            f"checkpoint step {self.step}: {size}, blocked training "
            f"{self.stall_s:.2f} s{split}, durable after {self.durable_s:.1f} s "
            f"({self.write_gbps:.3g} GB/s)"
        )


class HostCopy(AsyncStager):
    """Where a background save copies the state before training goes on (``dcp.async_save``'s
    stager): a host buffer per entry, made at the first save that holds it and refilled by each
    later one (``Checkpointer.save`` waits for the previous write first), registered as pinned
    on a GPU so the copy runs at the host link's rate. DCP's default makes a fresh pageable copy
    per save: 29.5 s of OLMoE-1B-7B's loop on one H200 for 41.5 GB
    (``benchmarks/checkpoint_stall.py``); its ``DefaultStager`` keeps one but copies each
    tensor's whole storage, which for a master shard viewing its bucket's weights (fp32 or
    pure-bf16 weights) is every data-parallel rank's shard. Each buffer is its own allocation,
    pinned in place (torch's pinned allocator rounds sizes up to a power of two) from
    ``PIN_MIN_BYTES`` on: smaller ones gain nothing and may share a page with other memory."""

    _synchronize_after_execute = False  # ``stage`` returns once the copy is done

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, like: torch.Tensor) -> torch.Tensor:
        host = torch.empty(like.shape, dtype=like.dtype)
        if self.device.type == "cuda" and host.nbytes >= PIN_MIN_BYTES:
            from torch.cuda._pin_memory_utils import pin_memory, unpin_memory

            pin_memory(host.data_ptr(), host.nbytes)
            # unpinned when freed, never after the CUDA context is gone (at exit)
            weakref.finalize(host.untyped_storage(), unpin_memory, host.data_ptr()).atexit = False
        return host

    def stage(self, state_dict: dict) -> dict:
        """``state_dict`` with each tensor's elements copied into its host buffer."""
        gpu = self.device.type == "cuda"
        buffers: dict[str, torch.Tensor] = {}
        staged = dict(state_dict)
        for key, value in state_dict.items():
            if not isinstance(value, torch.Tensor):
                continue
            host = self._buffers.get(key)
            if host is None or host.shape != value.shape or host.dtype != value.dtype:
                host = self._buffer(value)
            host.copy_(value.detach(), non_blocking=gpu)
            buffers[key] = staged[key] = host
        if gpu:
            torch.cuda.synchronize(self.device)
        self._buffers = buffers  # entries no longer saved are freed
        return staged

    def synchronize_staging(self) -> None:
        """Nothing to wait for: ``stage`` returns once the copy is done."""

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self._buffers.values())

    def close(self) -> None:
        self._buffers = {}


class Checkpointer:
    """Saves, publishes, prunes and finds checkpoints under ``root``.

    ``run_id`` names the run in every manifest it writes (a new one when None); a run that
    resumes takes over the id of its checkpoint (``adopt``). ``report`` receives warnings;
    ``on_cost`` (rank 0) each published checkpoint's ``SaveCost``."""

    def __init__(
        self,
        root: Path,
        mesh: Mesh,
        keep_last: int,
        keep_every: int,
        use_async: bool,
        run_id: str | None = None,
        report: Callable[[str], None] = print,
        on_cost: Callable[[SaveCost], None] | None = None,
    ) -> None:
        self.root, self.mesh = root, mesh
        self.keep_last, self.keep_every, self.use_async = keep_last, keep_every, use_async
        self.run_id = run_id or new_run_id()
        self.report, self.on_cost = report, on_cost
        self._hashed: set[str] = set()  # checkpoints whose every file's sha256 was checked here
        self.is_main = mesh.rank == 0
        self.no_dist = not mesh.distributed
        # Background saves talk over their own gloo group, never the training group.
        self.group = dist.new_group(backend="gloo") if mesh.distributed else None
        # a background save: its future, step, folder, manifest fields, bytes, when its save
        # started and how long that call blocked the loop (host clock)
        self._pending: tuple[Future, int, Path, dict, int, float, float] | None = None
        self._published_bytes = 0  # the folder ``_publish`` last published (rank 0)
        self._hasher: ThreadPoolExecutor | None = None  # hashes a background save's files
        self._hashing: Future | None = None  # ... the pending one's, once it is written
        self._stager: HostCopy | None = None  # background saves' host copy (``_staging``)
        if self.is_main:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)  # a save that never completed
        if mesh.distributed:
            dist.barrier()

    # ---- saving ---------------------------------------------------------------------------

    def state_dict(
        self, opt: ShardedAdamW, buffers: dict[str, torch.Tensor], trainer: dict
    ) -> dict:
        state: dict[str, Any] = {"trainer": json.dumps(trainer), "adam_step": opt.step_count}
        for o in owned_ranges(opt):
            shards = opt.shards(o.index)
            for kind in STATE_KEYS:
                state[state_key(o.name, kind, o.start)] = shards[kind][o.local : o.local + o.length]
        for name, t in buffers.items():
            state[buffer_key(name)] = t
        return state

    def save(
        self,
        step: int,
        state: dict,
        layout: dict,
        planner=None,
        file_per_entry: bool = False,
        started: float | None = None,
    ) -> None:
        """Write ``state`` as checkpoint ``step``; synchronous unless configured async.

        ``planner``: a DCP save planner (the init stage's computes entries lazily).
        ``file_per_entry``: one file per entry, so the writer holds one entry at a time (DCP's
        writer keeps every tensor of a file until the file is closed). ``started``: when the
        caller began this save (``time.perf_counter``; the state it gathered counts), else now.
        """
        started = time.perf_counter() if started is None else started
        waited = self.wait(next_save=True)  # the previous save's cost, not this one's
        tmp = self.root / f".tmp-{step_dir_name(step)}"
        meta = {"step": step, "layout": layout}
        if self.use_async:
            needed = _bytes(state)
            with _quiet(), self._writing(step, tmp, needed):
                fut = dcp.async_save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.group,
                    no_dist=self.no_dist,
                    planner=planner,
                    async_stager=self._staging(),
                )
            self._hashing = self._then_hash(fut, tmp)
            blocked = time.perf_counter() - started - waited
            self._pending = (fut, step, tmp, meta, needed, started, blocked)
        else:
            writer = None
            if file_per_entry:
                writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False)
            with _quiet(), self._writing(step, tmp, _bytes(state)):
                dcp.save(
                    state,
                    checkpoint_id=str(tmp),
                    process_group=self.group,
                    no_dist=self.no_dist,
                    planner=planner,
                    storage_writer=writer,
                )
                self._hash_own(tmp)
                self._publish(step, tmp, meta)
            took = time.perf_counter() - started
            self._cost(SaveCost(step, took, took, self._published_bytes, background=False))

    def _staging(self) -> HostCopy:
        """The host copy background saves stage into, made at the first."""
        if self._stager is None:
            self._stager = HostCopy(self.mesh.device)
        return self._stager

    def staged_bytes(self) -> int:
        """The bytes of the host copy kept for background saves (what ``moe plan`` counts)."""
        return 0 if self._stager is None else self._stager.nbytes

    def close(self) -> None:
        """Finish a background save and free the host copy (the run's end)."""
        self.wait()
        self.free_host_copy()

    def salvage(self, wait_s: float = SALVAGE_WAIT_S) -> None:
        """On a run's error: publish the background save still pending if its write (every
        rank's: DCP's coordinator gathers them) completes within ``wait_s``, else leave its
        unfinished folder for the next start to remove. A failing run so keeps a checkpoint
        it had fully written instead of falling back to the one before."""
        if self._pending is None:
            return
        fut, step, tmp, meta, _, started, blocked = self._pending
        hashing, self._pending, self._hashing = self._hashing, None, None
        try:
            with _quiet():
                fut.result(timeout=wait_s)
            if hashing is not None:
                hashing.result(timeout=wait_s)
            self._publish(step, tmp, meta, record_wait_s=wait_s)
        except (Exception, CheckpointException) as err:  # the run's own error is the one raised
            self.report(f"the background checkpoint of step {step} was not published ({err})")
            return
        now = time.perf_counter()
        self._cost(SaveCost(step, blocked, now - started, self._published_bytes, True))

    def free_host_copy(self) -> None:
        """Drop the host copy (a ``fit`` that leaves on an error): a background write still
        running keeps the buffers it reads until it is done; a later save makes a new copy."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def _cost(self, cost: SaveCost) -> None:
        if self.is_main and self.on_cost is not None:
            self.on_cost(cost)

    @contextlib.contextmanager
    def _writing(self, step: int, tmp: Path, needed: int = 0) -> Iterator[None]:
        """A write that fails with an OSError (disk full, no permission), or on a full disk
        whatever torch raised, becomes one sentence naming the path, once the unfinished
        folder is removed (it would hold the space). ``needed``: the bytes this rank writes."""
        try:
            yield
        except BaseException as err:
            failure = inner_error(err, OSError)
            # Never an interrupt (DCP's CheckpointException is a BaseException too).
            if failure is None and isinstance(err, (Exception, CheckpointException)):
                failure = self._full_disk(err, tmp, needed)
            if not isinstance(failure, OSError):
                raise
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            raise RunFileError(
                f"checkpoint step {step} could not be written ({failure.strerror or failure}: "
                f"{failure.filename or tmp}); its unfinished folder {tmp.name} was removed and "
                f"the checkpoints already in {self.root} are untouched: free space (or fix the "
                "permission) and resume."
            ) from None

    def _full_disk(self, err: BaseException, tmp: Path, needed: int) -> OSError | None:
        """ENOSPC when the disk ``tmp`` is on is full: torch's writer reports a write that found
        no room as a RuntimeError (``unexpected pos``, inside DCP's CheckpointException) whose
        errno is lost. So a short write, or less free space than the rest of the checkpoint
        needs, says what it was."""
        short = _SHORT_WRITE in str(err) or _SHORT_WRITE in str(inner_error(err, RuntimeError))
        try:
            free = shutil.disk_usage(tmp if tmp.exists() else self.root).free
            written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file())
        except OSError:
            return None
        if not short and free >= needed - written:
            return None
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp))

    def poll(self) -> None:
        """Publish a finished background save without waiting for an unfinished one (on rank
        0: nor for another rank's record of its files)."""
        if self._pending is None or not self._pending[0].done():
            return
        if self._hashing is not None and not self._hashing.done():
            return
        tmp = self._pending[2]
        if self.is_main and len(list(tmp.glob(_record_name("*")))) < self.mesh.cfg.world_size:
            return
        self.wait()

    def _then_hash(self, write: Future, tmp: Path) -> Future:
        """A future of hashing this rank's files once ``write`` (a background DCP save) is done,
        also in the background (a failed write is reported by ``write`` itself)."""
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-hash")
        hasher, done = self._hasher, Future()

        def hash_after(f: Future) -> None:
            try:
                if f.exception() is None:
                    self._hash_own(tmp)
            except BaseException as err:  # the loop sees it when it collects the save
                done.set_exception(err)
            else:
                done.set_result(None)

        write.add_done_callback(lambda f: hasher.submit(hash_after, f))
        return done

    def _hash_own(self, tmp: Path) -> None:
        """The sizes and sha256 of the files this rank wrote into ``tmp``, recorded beside
        them for rank 0's manifest (each rank reads only its own bytes)."""
        rank = self.mesh.rank
        own = {
            f.name: {"bytes": f.stat().st_size, "sha256": file_sha256(f)}
            for f in sorted(tmp.glob(f"__{rank}_*"))
            if f.is_file()
        }
        # a rank later than RECORD_WAIT_S finds the folder published without its record
        with contextlib.suppress(FileNotFoundError):
            atomic_write(tmp / _record_name(rank), json_bytes(own), sync=False)

    def _records(self, tmp: Path, wait_s: float | None = None) -> dict[str, dict]:
        """Every rank's record of its files (rank 0, publishing), the record files removed; a
        rank whose record does not come within ``wait_s`` (default ``RECORD_WAIT_S``) has its
        files hashed here."""
        found: dict[str, dict] = {}
        deadline = monotonic() + (RECORD_WAIT_S if wait_s is None else wait_s)
        for rank in range(self.mesh.cfg.world_size):
            path = tmp / _record_name(rank)
            while not path.is_file() and monotonic() < deadline:
                sleep(0.05)
            with contextlib.suppress(OSError, ValueError):
                found.update(json.loads(path.read_text()))
        for path in tmp.glob(_record_name("*")):
            path.unlink()
        return found

    def wait(self, next_save: bool = False) -> float:
        """Finish and publish the background save, if any; the seconds that took (the loop's
        blocked time, counted in that checkpoint's ``SaveCost``). ``next_save``: the next
        checkpoint's save is the one waiting."""
        if self._pending is None:
            return 0.0
        began = time.perf_counter()
        fut, step, tmp, meta, needed, started, blocked = self._pending
        hashing, self._pending, self._hashing = self._hashing, None, None
        with self._writing(step, tmp, needed):
            fut.result()
            if hashing is not None:  # this rank's record is written (or why not is raised)
                hashing.result()
            self._publish(step, tmp, meta)
        now = time.perf_counter()
        took = now - began
        cost = SaveCost(
            step, blocked + took, now - started, self._published_bytes, True, took, next_save
        )
        self._cost(cost)
        return now - began

    def _publish(
        self, step: int, tmp: Path, meta: dict, record_wait_s: float | None = None
    ) -> None:
        if self.is_main:
            records, files = self._records(tmp, record_wait_s), {}
            for f in sorted(tmp.rglob("*")):
                if not f.is_file():
                    continue
                name, size = str(f.relative_to(tmp)), f.stat().st_size
                known = records.get(name)
                if known is None or known.get("bytes") != size:  # no record, or a stale one
                    known = {"bytes": size, "sha256": file_sha256(f)}
                files[name] = known
            manifest = {
                **meta,
                "run_id": self.run_id,
                "created": time.time(),
                "files": files,
                "format": 1,
            }
            text = json.dumps(manifest, indent=1)
            (tmp / (MANIFEST + ".tmp")).write_text(text)
            self._published_bytes = sum(f["bytes"] for f in files.values()) + len(text.encode())
            (tmp / (MANIFEST + ".tmp")).rename(tmp / MANIFEST)
            final = self.root / step_dir_name(step)
            if final.exists():
                n = 1
                while final.with_name(f"{final.name}.replaced-{n}").exists():
                    n += 1
                final.rename(final.with_name(f"{final.name}.replaced-{n}"))
                self.report(f"{final} already existed: moved to {final.name}.replaced-{n}")
            tmp.rename(final)
            self._hashed.add(final.name)
            self._prune()

    def adopt(self, path: Path) -> None:
        """Continue the run that wrote ``path`` (its checkpoints become this run's to prune)."""
        self.run_id = run_id_of(path) or self.run_id

    def _valid(self, path: Path) -> bool:
        """Whether ``path`` verifies: sizes for checkpoints hashed by this process already,
        every sha256 (once per process) for the others."""
        if path.name in self._hashed:
            return verify(path, checksums=False) is None
        if verify(path) is None:
            self._hashed.add(path.name)
            return True
        return False

    def _prune(self) -> None:
        """Delete this run's valid checkpoints older than its newest valid one that retention
        does not keep (the ``keep_last`` newest valid ones, every ``keep_every``-th step).
        Another run's checkpoints and ones that do not verify are never touched."""
        mine = [
            s
            for s in sorted(self.published(), reverse=True)
            if run_id_of(self.root / step_dir_name(s)) == self.run_id
        ]
        valid = [s for s in mine if self._valid(self.root / step_dir_name(s))]
        if not valid:
            return
        keep = set(valid[: self.keep_last]) if self.keep_last > 0 else set(valid)
        if self.keep_every > 0:
            keep |= {s for s in valid if s % self.keep_every == 0}
        for s in valid:
            if s not in keep and s < valid[0]:
                shutil.rmtree(self.root / step_dir_name(s), ignore_errors=True)
                self._hashed.discard(step_dir_name(s))

    # ---- finding and loading --------------------------------------------------------------

    def published(self) -> list[int]:
        if not self.root.is_dir():
            return []
        return [s for p in self.root.iterdir() if (s := step_of(p.name)) is not None]

    def newest_valid(self, report=print) -> Path | None:
        """The newest checkpoint whose manifest verifies (collective): every rank hashes its
        share of each candidate's files (rank 0 alone would read the whole checkpoint), and
        rank 0 reports the candidates that do not verify."""
        if not self.mesh.distributed:
            found = newest_verified(self.root, report)
            if found is not None:
                self._hashed.add(found.name)
            return found
        listing: list[Any] = [sorted(self.published(), reverse=True) if self.is_main else []]
        dist.broadcast_object_list(listing, src=0, group=self.group)
        share = (self.mesh.rank, self.mesh.cfg.world_size)
        for step in listing[0]:
            path = self.root / step_dir_name(step)
            problems: list[str | None] = [None] * self.mesh.cfg.world_size
            dist.all_gather_object(problems, verify(path, share=share), group=self.group)
            problem = next((p for p in problems if p is not None), None)
            if problem is None:
                self._hashed.add(path.name)
                return path
            if self.is_main:
                report(f"skipping checkpoint {path.name}: {problem}")
        return None

    def load(
        self,
        path: Path,
        opt: ShardedAdamW,
        buffers: dict[str, torch.Tensor],
        shapes: dict[str, tuple[int, ...]] | None = None,
    ) -> dict:
        """Fill ``opt`` (and the model, through it) and ``buffers`` from ``path``; return the
        trainer state. Works whatever layout wrote the checkpoint. ``shapes`` (the model's full
        parameter shapes) refuses a checkpoint of another model before anything is loaded."""
        metadata = dcp_read.read_metadata(path).state_dict_metadata
        saved: dict[tuple[str, str], list[tuple[int, int, str]]] = {}
        dtypes: dict[str, torch.dtype] = {}  # as saved: fp32, or bf16 from the pure-bf16 preset
        for key, md in metadata.items():
            parsed = parse_key(key)
            if parsed is not None and parsed[1] is not None:  # a range of optimizer state
                name, kind, start = parsed
                saved.setdefault((name, kind), []).append((start, md.size[0], key))
                dtypes[key] = md.properties.dtype
        if shapes is not None:
            check_fits(path, saved, shapes)
        owned = owned_ranges(opt)
        request: dict[str, Any] = {"trainer": "", "adam_step": 0}
        for o in owned:
            for kind in STATE_KEYS:
                for start, length, key in saved.get((o.name, kind), []):
                    if start < o.start + o.length and o.start < start + length:
                        request.setdefault(key, torch.empty(length, dtype=dtypes[key]))
        missing = [o.name for o in owned if (o.name, "param") not in saved]
        if missing:
            raise ValueError(
                f"checkpoint {path.name} has no weights for {missing[0]} (another model?)"
            )
        for name, t in buffers.items():
            request[buffer_key(name)] = torch.empty_like(t, device="cpu")
        dcp_read.load(request, path, process_group=self.group, no_dist=self.no_dist)

        shards = [opt.shards(i, allocate=True) for i in range(len(opt.buckets))]
        for o in owned:
            for kind in STATE_KEYS:
                dst = shards[o.index][kind][o.local : o.local + o.length]
                for start, length, key in saved.get((o.name, kind), []):  # no moments: fresh
                    a, z = max(start, o.start), min(start + length, o.start + o.length)
                    if a < z:
                        src = request[key][a - start : z - start]
                        dst[a - o.start : z - o.start].copy_(src)
        opt.set_step(int(request["adam_step"]))
        opt.publish_weights()
        for name, t in buffers.items():
            t.copy_(request[buffer_key(name)])
        return json.loads(request["trainer"])


def _bytes(state: dict) -> int:
    """The bytes a state dict's tensors take on disk (what a save of it writes, near enough)."""
    return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))


def newest_verified(root: Path, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest ``step_*`` folder under ``root`` whose manifest verifies; each newer one that
    does not is reported."""
    steps = [s for p in root.glob("step_*") if (s := step_of(p.name)) is not None]
    for step in sorted(steps, reverse=True):
        path = root / step_dir_name(step)
        problem = verify(path)
        if problem is None:
            return path
        if report is not None:
            report(f"skipping checkpoint {path.name}: {problem}")
    return None


def router_buffers(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Persistent buffers (the routers' expert bias) by global name."""
    out: dict[str, torch.Tensor] = {}
    for m in modules:
        for name, buf in m.named_buffers():
            if name.endswith("expert_bias"):
                out[name] = buf
    return out
