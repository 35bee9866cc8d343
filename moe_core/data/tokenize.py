"""Corpus -> token shards + ``manifest.json``: the data stage behind ``moe tokenize``.

Documents are read in a fixed order and handed out in units of ``data.unit_documents`` to the
workers of a Dask cluster (``engine``), which tokenize them (each followed by EOS), split them
between ``train`` and ``validation`` by index and write them (``units``); the units' tokens are
then cut into shards of exactly ``data.shard_tokens`` tokens (the last of a split holds the
rest), by the workers too. The output is a pure function of the settings, whatever the workers:
``job.json`` (written before any shard) pins them, a rerun keeps the finished units and shards
and does the rest, and the manifest comes last.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from moe_core.config import ConfigError, DataConfig, check_tokenizer_fits
from moe_core.data.engine import Engine, done, open_engine
from moe_core.data.errors import DataError
from moe_core.data.manifest import FORMAT, MANIFEST, build_manifest, verify_data_dir
from moe_core.data.shards import SPLITS, Cutter, ShardJob, ShardRecord, write_shard
from moe_core.data.sources import Source, WithoutText, open_source
from moe_core.data.tokenizer import TOKENIZER_JSON, BuiltTokenizer, build_tokenizer
from moe_core.data.units import UNITS, Routing, UnitRecord, encode_unit, finished_units
from moe_core.files import TMP_MARK, atomic_write, file_sha256, json_bytes, remove_temporaries

JOB = "job.json"
# The longest run of non-space characters the BPE trainer sees: longer runs (a multi-megabyte
# line of base64 or DNA) are cut into pieces of this length for training only, since the trainer
# slows down with the square of a word's length; the shards keep every text as it is.
MAX_TRAINING_RUN = 1000
_LONG_RUN = re.compile(rf"\S{{{MAX_TRAINING_RUN + 1},}}")


def job_spec(cfg: DataConfig, source: Source) -> dict[str, Any]:
    """Every setting the shards depend on (the tokenizer by request; its hash comes later)."""
    tokenizer: dict[str, Any] = {"name": cfg.tokenizer}
    if cfg.tokenizer == "bpe":
        tokenizer.update(bpe_vocab_size=cfg.bpe_vocab_size, bpe_train_chars=cfg.bpe_train_chars)
    return {
        "format": FORMAT,
        "source": source.description,
        "text_field": cfg.text_field,
        "max_documents": cfg.max_documents,
        "tokenizer": tokenizer,
        "shard_tokens": cfg.shard_tokens,
        "validation": {"fraction": cfg.validation_fraction, "seed": cfg.seed},
    }


def validation_phase(seed: int) -> float:
    """A number in [0, 1) fixed by the seed: where the evenly spaced held-out documents fall."""
    return float(np.random.default_rng(seed).random())


def is_validation(index: int, fraction: float, phase: float) -> bool:
    """Document ``index`` is held out when ``index * fraction + phase`` crosses an integer."""
    return math.floor((index + 1) * fraction + phase) > math.floor(index * fraction + phase)


@dataclass(frozen=True)
class TokenizeProgress:
    """Where a tokenize call stands: documents read (of ``total`` when the source knows it),
    tokens written and their rate since encoding began, shards so far."""

    documents: int
    total: int | None
    tokens: int
    tokens_per_s: float
    shards: int

    def text(self) -> str:
        of = f" of {self.total:,}" if self.total is not None else ""
        return (
            f"{self.documents:,}{of} documents, {self.tokens:,} tokens "
            f"({self.tokens_per_s:,.0f} tokens/s), {self.shards} shards"
        )


@dataclass
class TokenizeStats:
    """Counters of one tokenize call, for the progress bar, the summary and benchmarks."""

    tokens: int = 0  # encoded by this call (not those of units already on disk)
    shards_reused: int = 0
    tokenizer_seconds: float = 0.0  # building (for bpe: training) the tokenizer
    engine_seconds: float = 0.0  # starting (and stopping) the local cluster, or connecting
    tokenize_seconds: float = 0.0  # from the first unit read to the last shard written
    driver_cpu_seconds: float = 0.0  # this process's CPU time in that phase (all of it, alone)
    engine: str = ""  # where the units ran


def tokenize_corpus(
    cfg: DataConfig,
    out_dir: str | Path,
    *,
    model_vocab_size: int | None = None,
    show_progress: bool = True,
    console: Console | None = None,
    on_progress: Callable[[TokenizeProgress], None] | None = None,
    stats: TokenizeStats | None = None,
) -> Path:
    """Tokenize the configured corpus into ``out_dir``; return it once ``manifest.json`` is there.

    ``model_vocab_size`` refuses a tokenizer with more ids than the model can embed. Nothing that
    is already in ``out_dir`` is deleted: a directory made with other settings is refused.
    ``on_progress`` is called after each encoded batch (a pipeline logs it; the terminal has
    the bar of ``show_progress``). ``stats``, when given, is filled in as the call goes.
    """
    start = time.perf_counter()
    console = console or Console(stderr=True)
    out = Path(out_dir)
    source = open_source(cfg)
    _refuse_own_files(source, out)
    spec = job_spec(cfg, source)
    job = _existing_job(out, spec)
    if job is not None and model_vocab_size is not None:
        check_tokenizer_fits(cfg, job["tokenizer"]["vocab_size"], model_vocab_size)
    if job is not None and _complete(out, console if show_progress else None):
        return out

    run = stats if stats is not None else TokenizeStats()
    # The engine first: a cluster that cannot be reached is named before anything is written.
    clock = {"open": time.perf_counter()}
    with open_engine(cfg) as engine:
        run.engine_seconds = time.perf_counter() - clock["open"]
        run.engine = engine.where
        phase = validation_phase(cfg.seed)
        tick = time.perf_counter()
        built = _tokenizer(cfg, out, job, source, phase)
        run.tokenizer_seconds = time.perf_counter() - tick if job is None else 0.0
        if model_vocab_size is not None:
            check_tokenizer_fits(cfg, built.vocab_size, model_vocab_size)
        created = not out.exists()
        if job is None:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write(out / JOB, json_bytes({"spec": spec, "tokenizer": built.info()}))
        for name, data in built.files.items():
            if not (out / name).is_file() or (out / name).read_bytes() != data:
                atomic_write(out / name, data)
        remove_temporaries(out)

        units = out / UNITS
        units.mkdir(exist_ok=True)
        remove_temporaries(units)
        routing = Routing(built.sha256, built.eos_id, built.dtype, cfg.validation_fraction, phase)
        without_text = WithoutText()
        # The bar on a terminal only: elsewhere rich shows just its last frame (a caller's
        # on_progress gives such a reader lines as it goes).
        show_bar = show_progress and console.is_terminal
        with _Progress(show_bar, console, source.total) as (bar, task):

            def report(documents: int, shards: int) -> None:
                rate = run.tokens / max(time.perf_counter() - clock["first unit"], 1e-9)
                status = f"{run.tokens:,} tokens  {rate:,.0f} tok/s  {shards} shards"
                bar.update(task, completed=documents, status=status)
                if on_progress is not None:
                    on_progress(TokenizeProgress(documents, source.total, run.tokens, rate, shards))

            work = _Work(out, routing, engine, cfg.shard_tokens, run, report)
            for unit, first, texts in _units(source, cfg.unit_documents, without_text):
                if "first unit" not in clock:
                    clock["first unit"], clock["cpu"] = time.perf_counter(), time.process_time()
                work.add(unit, first, texts)
            records = work.finish()
            clock["done"] = time.perf_counter()
        run.tokenize_seconds = clock["done"] - clock.get("first unit", clock["done"])
        run.driver_cpu_seconds = time.process_time() - clock.get("cpu", time.process_time())
    run.engine_seconds += time.perf_counter() - clock["done"]  # stopping the local cluster
    end = work.end
    total_tokens = sum(r.tokens for split in records.values() for r in split)
    if total_tokens == 0:
        shutil.rmtree(units)
        if job is None:  # nothing but what this call wrote: leave no half-made directory
            for name in (JOB, *built.files):
                (out / name).unlink()
            if created and not any(out.iterdir()):
                out.rmdir()
        raise DataError(
            f"the corpus ({_describe_source(spec)}) holds no text in data.text_field="
            f"{cfg.text_field!r}: give a corpus whose documents have text."
        )
    splits = {s: (work.cutters[s].documents, records[s]) for s in SPLITS}
    manifest = build_manifest(spec, built.info(), end, splits)
    if without_text.count:
        manifest["documents_without_text"] = {
            "count": without_text.count,
            "first": without_text.first,
        }
        console.print(
            f"[yellow]warning:[/] {without_text_sentence(manifest, cfg.text_field)}",
            highlight=False,
            soft_wrap=True,
        )
    atomic_write(out / MANIFEST, json_bytes(manifest))
    shutil.rmtree(units)  # the shards hold every token now
    if show_progress:
        _summary(console, out, manifest, run, time.perf_counter() - start)
    return out


# --------------------------------------------------------------------------------------------
# the directory and its job


def _complete(out: Path, console: Console | None) -> bool:
    """Whether ``out`` already holds the finished, verified output (else it gets repaired)."""
    if not (out / MANIFEST).is_file():
        return False
    try:
        manifest = verify_data_dir(out)
    except DataError as err:
        if console is not None:
            console.print(f"repairing {out}: {err}", highlight=False, soft_wrap=True)
        return False
    if console is not None:
        shards = sum(len(manifest.shards(s)) for s in SPLITS)
        console.print(
            f"{out} is complete and verified: {manifest.total_tokens:,} tokens in {shards} shards",
            highlight=False,
            soft_wrap=True,
        )
    return True


def _refuse_own_files(source: Source, out: Path) -> None:
    """Refuse a corpus that names files in ``out`` (a ``data.path`` glob reaching into
    ``data.dir``): this stage's own output would be tokenized as documents."""
    here = out.resolve()
    for f in source.description.get("files", []):
        if Path(f["name"]).resolve().is_relative_to(here):
            raise ConfigError(
                f"data.dir={str(out)!r} is not allowed: data.path={source.description['path']!r} "
                f"names {f['name']} in it, so moe tokenize's own output would be read as "
                "documents; write the shards outside the corpus or narrow data.path."
            )


def _existing_job(out: Path, spec: dict[str, Any]) -> dict[str, Any] | None:
    """The job already in ``out`` (same settings, or a one-sentence refusal), None if empty."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"data.dir={str(out)!r} is not allowed: it is a file, not a folder.")
    if not out.is_dir():
        return None
    job_file = out / JOB
    if not job_file.is_file():
        foreign = sorted(p.name for p in out.iterdir() if TMP_MARK not in p.name)
        if foreign:
            raise _foreign(out, foreign[0])
        return None
    job = _read_json(job_file)
    if not isinstance(job, dict) or not isinstance(job.get("spec"), dict):
        raise _foreign(out, JOB)  # another tool's job.json
    old = job["spec"]
    if old != spec:
        raise ConfigError(
            f"data.dir={str(out)!r} is not allowed: it holds shards made with "
            f"{_difference(old, spec)}; choose another data.dir, or delete that folder to start "
            "over."
        )
    return job


def _foreign(out: Path, name: str) -> ConfigError:
    return ConfigError(
        f"data.dir={str(out)!r} is not allowed: it holds files that moe tokenize did not write "
        f"(such as {name}); give a new or empty folder."
    )


def _read_json(path: Path) -> Any:
    import json

    try:
        content = json.loads(path.read_text())
    except ValueError as err:
        raise DataError(
            f"{path} is not valid JSON ({err}): delete its folder to start over."
        ) from None
    return content


def _describe_tokenizer(spec: dict[str, Any]) -> str:
    tok = spec.get("tokenizer", {})
    if tok.get("name") == "bpe":
        return f"data.tokenizer='bpe' of {tok.get('bpe_vocab_size')} tokens"
    return f"data.tokenizer={tok.get('name')!r}"


def _describe_source(spec: dict[str, Any]) -> str:
    src = spec.get("source", {})
    if src.get("kind") == "files":
        return f"data.path={src.get('path')!r}"
    if src.get("kind") == "hub":
        return f"data.hub={src.get('name')!r}"
    return f"the built-in {src.get('name')} corpus"


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("tokenizer") != new["tokenizer"]:
        return f"another tokenizer ({_describe_tokenizer(old)}, not {_describe_tokenizer(new)})"
    if old.get("source") != new["source"]:
        before, now = _describe_source(old), _describe_source(new)
        if before == now:
            return f"other contents of {now} (its files changed since)"
        return f"another corpus ({before}, not {now})"
    labels = {
        "text_field": "data.text_field",
        "max_documents": "data.max_documents",
        "shard_tokens": "data.shard_tokens",
        "validation": "data.validation_fraction/data.seed",
        "format": "the shard format",
    }
    for key, label in labels.items():
        if old.get(key) != new[key]:
            return f"{label} {old.get(key)!r}, not {new[key]!r}"
    return "other settings"


def _tokenizer(
    cfg: DataConfig, out: Path, job: dict[str, Any] | None, source: Source, phase: float
) -> BuiltTokenizer:
    """The job's tokenizer from ``out`` when there is one, else a new one."""
    if job is not None and (out / TOKENIZER_JSON).is_file():
        recorded = job["tokenizer"]
        found = file_sha256(out / TOKENIZER_JSON)
        if found != recorded["sha256"]:
            raise DataError(
                f"{out / TOKENIZER_JSON} is another tokenizer (sha256 {found[:16]}..., not the "
                f"{recorded['sha256'][:16]}... in {JOB}): restore it, or delete {out} to start "
                "over."
            )
        from tokenizers import Tokenizer

        files = {name: (out / name).read_bytes() for name in recorded["files"]}
        tokenizer = Tokenizer.from_str(files[TOKENIZER_JSON].decode())
        return BuiltTokenizer(tokenizer, recorded["eos_id"], files)
    chars = 0

    def training() -> Iterator[str]:
        nonlocal chars
        for text in _training_texts(source, cfg, phase):
            chars += len(text)
            yield text

    built = build_tokenizer(cfg, training())
    if cfg.tokenizer == "bpe" and chars == 0:
        raise DataError(
            f"the corpus ({_describe_source({'source': source.description})}) holds no training "
            f"text in data.text_field={cfg.text_field!r}: give a corpus whose documents have text."
        )
    if job is not None and built.sha256 != job["tokenizer"]["sha256"]:
        raise DataError(
            f"the rebuilt tokenizer differs from the one in {out / JOB} (sha256 "
            f"{built.sha256[:16]}..., not {job['tokenizer']['sha256'][:16]}...): delete {out} "
            "to start over."
        )
    return built


def _training_texts(source: Source, cfg: DataConfig, phase: float) -> Iterator[str]:
    """The first ``bpe_train_chars`` characters of training documents (never validation)."""
    left = cfg.bpe_train_chars
    for index, text in source.documents():
        if not text or is_validation(index, cfg.validation_fraction, phase):
            continue
        yield _cut_long_runs(text[:left])
        left -= min(left, len(text))
        if left == 0:
            return


def _cut_long_runs(text: str) -> str:
    """``text`` with each run of more than ``MAX_TRAINING_RUN`` non-space characters split by
    spaces into pieces of that length (what the BPE trainer sees)."""
    if len(text) <= MAX_TRAINING_RUN:
        return text

    def cut(m: re.Match[str]) -> str:
        run = m.group()
        return " ".join(run[i : i + MAX_TRAINING_RUN] for i in range(0, len(run), MAX_TRAINING_RUN))

    return _LONG_RUN.sub(cut, text)


# --------------------------------------------------------------------------------------------
# reading, tokenizing, routing


def without_text_sentence(manifest: dict[str, Any], text_field: str) -> str:
    """What the manifest records of documents left out for lack of text, in one sentence."""
    info = manifest["documents_without_text"]
    return (
        f"{info['count']:,} of {manifest['documents']:,} documents have no data.text_field="
        f"{text_field!r} (missing or null; the first is document {info['first']}) and were left "
        "out of the shards"
    )


def _units(
    source: Source, size: int, without_text: WithoutText
) -> Iterator[tuple[int, int, list[str]]]:
    """``(unit, first document, texts)``: the corpus in consecutive ranges of ``size``."""
    texts: list[str] = []
    first = 0
    for index, text in source.documents(0, without_text):
        texts.append(text)
        if len(texts) == size:
            yield first // size, first, texts
            texts, first = [], index + 1
    if texts:
        yield first // size, first, texts


def _result(future: Any, what: str) -> Any:
    """``future``'s result; a task that took down every worker that ran it (Dask gives up after
    a few with ``KilledWorker``) is one sentence instead of Dask's traceback."""
    try:
        return future.result()
    except Exception as err:
        if type(err).__name__ != "KilledWorker":
            raise
        raise DataError(
            f"the tokenize task of {what} ended every Dask worker that ran it (killed, or out "
            "of memory: a very long document?); the units and shards already written are kept: "
            "rerun moe tokenize with more memory per worker (fewer data.workers) to go on."
        ) from None


class _Work:
    """The driver's side of a run: units submitted in order (a few ahead per worker, a unit
    already on disk not again), their records fed in order to each split's ``Cutter``, and each
    shard submitted as soon as the units it takes from are done."""

    def __init__(
        self,
        out: Path,
        routing: Routing,
        engine: Engine,
        shard_tokens: int,
        run: TokenizeStats,
        report: Callable[[int, int], None],
    ) -> None:
        self.out, self.routing, self.engine, self.run, self.report = (
            out,
            routing,
            engine,
            run,
            report,
        )
        self.finished = finished_units(out, routing.dtype)
        self.cutters = {s: Cutter(s, shard_tokens) for s in SPLITS}
        self.shards: dict[str, list[tuple[Any, str]]] = {s: [] for s in SPLITS}
        self.window: deque[tuple[Any, bool, str]] = deque()  # (future, fresh, what it is)
        self.end = 0  # documents whose unit is done

    def add(self, unit: int, first: int, texts: list[str]) -> None:
        old = self.finished.get(unit)
        what = f"unit {unit} (documents {first} to {first + len(texts) - 1})"
        if old is not None and old.first == first and len(old.lengths) == len(texts):
            self.window.append((done(lambda: old), False, what))
        else:
            args = (str(self.out), self.routing, unit, first, texts)
            self.window.append((self.engine.submit(encode_unit, *args), True, what))
        while self.window and (len(self.window) > self.engine.slots or self.window[0][0].done()):
            self._take()

    def _take(self) -> None:
        future, fresh, what = self.window.popleft()
        record: UnitRecord = _result(future, what)
        if fresh:
            self.run.tokens += record.tokens
        lengths = np.array(record.lengths, dtype=np.int64)
        docs = record.first + np.arange(len(lengths))
        held = self.routing.held_out(record.first, len(lengths))
        for split, mine, start in (("train", ~held, 0), ("validation", held, record.train_tokens)):
            self._submit(self.cutters[split].add(record.file, start, docs[mine], lengths[mine]))
        self.end = record.first + len(lengths)
        self.report(self.end, sum(len(s) for s in self.shards.values()))

    def _submit(self, jobs: list[ShardJob]) -> None:
        for job in jobs:
            args = (str(self.out), job, self.routing.dtype)
            what = f"shard {job.split}-{job.index:05d}"
            self.shards[job.split].append((self.engine.submit(write_shard, *args), what))

    def finish(self) -> dict[str, list[ShardRecord]]:
        """Every shard's record, per split in order, once all are written."""
        while self.window:
            self._take()
        for cutter in self.cutters.values():
            self._submit(cutter.finish())
        self.report(self.end, sum(len(s) for s in self.shards.values()))
        written = {s: [_result(f, what) for f, what in fs] for s, fs in self.shards.items()}
        self.run.shards_reused = sum(reused for s in written.values() for _, reused in s)
        return {s: [record for record, _ in w] for s, w in written.items()}


# --------------------------------------------------------------------------------------------
# progress and summary


class _Quiet:
    def update(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Progress:
    """A rich progress bar (documents, tokens, tokens/s, shards), or nothing when quiet."""

    def __init__(self, show: bool, console: Console, total: int | None) -> None:
        self.show, self.console, self.total = show, console, total

    def __enter__(self) -> tuple[Any, Any]:
        if not self.show:
            return _Quiet(), None
        columns = [TextColumn("[bold]tokenize")]
        if self.total is not None:
            columns.append(BarColumn())
        columns += [
            TextColumn("{task.completed:,} docs"),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
        ]
        self.bar = Progress(*columns, console=self.console)
        self.bar.start()
        return self.bar, self.bar.add_task("tokenize", total=self.total, status="")

    def __exit__(self, *exc: object) -> None:
        if self.show:
            self.bar.stop()


def _summary(
    console: Console, out: Path, manifest: dict[str, Any], run: TokenizeStats, seconds: float
) -> None:
    splits = manifest["splits"]
    shards = sum(len(s["shards"]) for s in splits.values())
    size = sum((out / sh["file"]).stat().st_size for s in splits.values() for sh in s["shards"])
    rate = run.tokens / max(run.tokenize_seconds, 1e-9)
    ready = f", tokenizer ready in {run.tokenizer_seconds:.1f} s" if run.tokenizer_seconds else ""
    reused = f"; {run.shards_reused} of them were already on disk" if run.shards_reused else ""
    console.print(
        f"tokenized {manifest['documents']:,} documents into {manifest['total_tokens']:,} tokens "
        f"(train {splits['train']['tokens']:,} in {splits['train']['documents']:,} documents, "
        f"validation {splits['validation']['tokens']:,} in "
        f"{splits['validation']['documents']:,}), {shards} shards of {manifest['dtype']}, "
        f"{size / 1e6:,.1f} MB, in {seconds:.1f} s ({rate:,.0f} tokens/s tokenizing on "
        f"{run.engine}"
        f"{ready}){reused}: {out}",
        highlight=False,
        soft_wrap=True,
    )
