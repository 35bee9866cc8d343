"""Token corpora other tools wrote, read in place with ``TokenDataset``'s interface.

``FORMATS`` maps ``data.format`` to the dataset class that reads it:

- ``moe``: our shards and manifest (``moe tokenize``), ``dataset.TokenDataset``.
- ``dolma``: Dolma's and Olmo-core's numpy token files: flat arrays of ``uint16``/``uint32``
  token ids with the end-of-text id after every document, named ``*.npy``. Olmo-core and Dolma
  write them as raw memory maps without a header (their dtype is then ``data.token_dtype``, or,
  unset, the smaller of the two that holds the vocabulary: Olmo-core's rule, which would take
  ``uint8`` for 256 ids or fewer, a dtype not read here); a file
  ``np.save`` wrote (a ``.npy`` header) says its own dtype. A ``NAME.csv.gz`` beside ``NAME.npy``
  (Dolma's metadata: one ``start,end,...`` row per document) is checked to cover the file.
- ``megatron``: Megatron-Core indexed datasets, ``PREFIX.idx`` (header ``MMIDIDX``, version 1,
  dtype code, sequence and document counts, then the int32 sequence lengths, int64 byte
  pointers and int64 document indices) beside ``PREFIX.bin`` (the tokens). Its documents
  carry the end-of-text id only where the corpus was preprocessed with one appended.

Each external corpus is one token stream: its files in sorted order, each read whole. The
validation split is its tail: the last ``data.validation_fraction`` of the tokens (0: none, and
held-out evaluation is refused by ``check_validation_fits``). Files are opened read-only and
nothing is written beside them; their sha256 are recorded in the run's own folder when a run
starts and checked when it resumes (``check_recorded``).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from moe_core.config import ConfigError, DataConfig, check_tokenizer_fits, fail
from moe_core.data.dataset import TokenDataset, TokenStream
from moe_core.data.errors import DataError
from moe_core.data.manifest import read_manifest
from moe_core.data.shards import SPLITS, npy_layout
from moe_core.data.tokenizer import (
    TOKEN_DTYPES,
    TOKENIZER_FILES,
    gpt2_tokenizer,
    hf_tokenizer,
    load_tokenizer,
)
from moe_core.files import atomic_write, file_sha256, json_bytes

NPY_MAGIC = b"\x93NUMPY"
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, documents
# Megatron-Core's dtype codes; the float ones (6, 7) cannot hold token ids.
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
COUNT_CHUNK = 1 << 24  # tokens compared at a time when end-of-text ids are counted
CHECKSUMS = "data-checksums.json"  # in the run's folder, never in the corpus


def default_dtype(vocab_size: int) -> str:
    """The dtype a headerless token file of this vocabulary is read as (Olmo-core's choice
    above 256 ids)."""
    return TOKEN_DTYPES[0] if vocab_size <= 1 << 16 else TOKEN_DTYPES[1]


def _check_holds(dtype: np.dtype, vocab_size: int, where: str) -> None:
    """Refuse token files whose dtype cannot hold the vocabulary's ids: they were written for a
    smaller tokenizer (or are read with the wrong dtype)."""
    top = np.iinfo(dtype).max
    if top < vocab_size - 1:
        raise DataError(
            f"{where} holds {dtype} tokens, which is not allowed with a vocabulary of "
            f"{vocab_size} ids ({dtype} reaches {top}): the corpus was tokenized with a smaller "
            "tokenizer; set data.tokenizer to the one it was written with."
        )


class ExternalDataset(TokenStream):
    """The ``seq_len + 1``-token instances of one split of a corpus another tool wrote.

    Subclasses find the files (``_open``: paths, dtypes, byte offsets, token counts, checked);
    reading, splitting and refusing out-of-vocabulary ids are shared, and behave as
    ``TokenDataset``'s."""

    format = ""

    def __init__(
        self,
        path: str | Path,
        split: str,
        seq_len: int,
        *,
        vocab_size: int,
        validation_fraction: float = 0.0,
        eos_id: int | None = None,
        token_dtype: str | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ValueError(f"split={split!r} is not allowed: one of {', '.join(SPLITS)}.")
        if seq_len <= 0:
            raise ValueError(f"seq_len={seq_len} is not allowed: it must be positive.")
        self.root = Path(os.path.abspath(path))  # names in the identity are relative to it
        self.split, self.seq_len, self.instance_tokens = split, seq_len, seq_len + 1
        self.vocab_size, self.eos_id, self.token_dtype = vocab_size, eos_id, token_dtype
        self.paths: list[Path] = []
        self.dtypes: list[np.dtype] = []
        self.offsets: list[int] = []  # bytes before the first token of each file
        self.sidecars: list[Path] = []  # index and metadata files, checksummed with the tokens
        sizes = self._open()
        stream = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        total = int(stream[-1])
        cut = total - int(total * validation_fraction)
        self.first = 0 if split == "train" else cut  # this split's first token in the stream
        self.starts = stream - self.first  # each file's first token, counted from the split's
        self._end = cut if split == "train" else total
        self._arrays: list[np.ndarray | None] = [None] * len(self.paths)
        self._identity: str | None = None

    def _open(self) -> list[int]:
        """Find and check the files as far as their headers and sizes go (every rank opens
        them at every start, so nothing here reads a whole index or metadata file)."""
        raise NotImplementedError

    def check_documents(self) -> int | None:
        """The documents of the corpus (both splits), once every index or metadata row is
        checked against the tokens; None where a file has neither and no end-of-text id is
        known. Reads them whole: run with the checksums (``check_recorded``) and ``moe data``."""
        raise NotImplementedError

    @property
    def tokens(self) -> int:
        return self._end - self.first

    @property
    def identity(self) -> str:
        """What a loader's saved state names this data by: the format, each file's name, dtype
        and size, and where the split starts (the contents are checked by ``check_recorded``).
        Computed once: the loader's state is taken every step."""
        if self._identity is None:
            files = [
                [p.relative_to(self.root).as_posix(), str(d), p.stat().st_size]
                for p, d in zip(self.paths, self.dtypes, strict=True)
            ]
            text = json.dumps([self.format, files, self.first, self._end], separators=(",", ":"))
            self._identity = hashlib.sha256(text.encode()).hexdigest()
        return self._identity

    def _part(self, k: int) -> np.ndarray:
        array = self._arrays[k]
        n = int(self.starts[k + 1] - self.starts[k])
        if array is None and n == 0:  # an empty file cannot be memory-mapped
            array = np.zeros(0, dtype=self.dtypes[k])
        if array is None:
            array = np.memmap(
                self.paths[k], dtype=self.dtypes[k], mode="r", offset=self.offsets[k], shape=(n,)
            )
            self._arrays[k] = array
        return array

    def _refuse(self, token: int, path: Path) -> None:
        raise DataError(
            f"token id {token} in {path} is not allowed: the vocabulary has ids 0 to "
            f"{self.vocab_size - 1}, so the file is damaged or was tokenized with another "
            "tokenizer (set data.tokenizer to the one it was written with)."
        )

    def files(self) -> list[Path]:
        """Every file this corpus is read from: the tokens and their index or metadata."""
        return sorted({*self.paths, *self.sidecars})


class DolmaDataset(ExternalDataset):
    """Dolma / Olmo-core numpy token files (``*.npy``, raw or with a header) under a folder, or
    those a glob pattern names."""

    format = "dolma"

    def _open(self) -> list[int]:
        pattern = str(self.root)
        if self.root.is_dir():
            found = sorted(p for p in self.root.rglob("*.npy") if p.is_file())
        elif any(c in pattern for c in "*?["):
            found = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
            # "DIR/**" also names Dolma's metadata (NAME.csv.gz), never a token file
            found = [p for p in found if p.is_file() and p.suffix == ".npy"]
            magic = min(pattern.index(c) for c in "*?[" if c in pattern)
            self.root = Path(os.path.dirname(pattern[:magic]))
        else:
            raise DataError(
                f"data.dir={pattern!r} is not allowed for data.format=dolma: it must be a folder "
                "of .npy token files or a glob pattern naming them, and it is neither."
            )
        if not found:
            raise DataError(
                f"{pattern} holds no .npy token files, which data.format=dolma reads: point "
                "data.dir at the folder Dolma or Olmo-core wrote them into."
            )
        sizes = []
        for path in found:
            sizes.append(self._open_file(path))
        return sizes

    def _open_file(self, path: Path) -> int:
        with open(path, "rb") as f:
            head = f.read(len(NPY_MAGIC))
        size = path.stat().st_size
        if head == NPY_MAGIC:
            try:
                dtype, tokens, offset = npy_layout(path)
            except (ValueError, OSError) as err:
                raise DataError(
                    f"{path} has a .npy header that cannot be read ({err}): it is damaged."
                ) from None
            if dtype.kind != "u" or size != offset + tokens * dtype.itemsize:
                raise DataError(
                    f"{path} is not allowed: it holds {size} bytes as an array of {tokens} "
                    f"{dtype}, and token files are complete arrays of unsigned integers "
                    "(uint16 or uint32), so it is damaged or not a token file."
                )
        else:
            dtype = np.dtype(self.token_dtype or default_dtype(self.vocab_size))
            offset = 0
            if size % dtype.itemsize:
                raise DataError(
                    f"{path} holds {size} bytes, which is not allowed for {dtype} tokens (a "
                    f"multiple of {dtype.itemsize}): it is truncated, or data.token_dtype is "
                    "not the dtype it was written in."
                )
            tokens = size // dtype.itemsize
        _check_holds(dtype, self.vocab_size, str(path))
        self.paths.append(path)
        self.dtypes.append(dtype)
        self.offsets.append(offset)
        metadata = path.with_name(path.name.removesuffix(".npy") + ".csv.gz")
        if metadata.is_file():
            self.sidecars.append(metadata)
        if tokens and self.eos_id is not None:  # one token read: catches most wrong dtypes
            with open(path, "rb") as f:
                f.seek(offset + (tokens - 1) * dtype.itemsize)
                last = int(np.frombuffer(f.read(dtype.itemsize), dtype=dtype)[0])
            if last != self.eos_id:
                raise DataError(
                    f"{path} ends in token {last}, not the end-of-text id {self.eos_id} that "
                    f"ends every document of a Dolma token file: it is truncated, was written "
                    f"with another tokenizer, or is not {dtype} (set data.token_dtype)."
                )
        return tokens

    def check_documents(self) -> int | None:
        total: int | None = 0
        for k, path in enumerate(self.paths):
            tokens = int(self.starts[k + 1] - self.starts[k])
            metadata = path.with_name(path.name.removesuffix(".npy") + ".csv.gz")
            if metadata in self.sidecars:
                found: int | None = self._check_metadata(metadata, path, tokens)
            elif self.eos_id is not None:
                array = self._part(k)  # in chunks: a file may not fit in memory
                found = sum(
                    int(np.count_nonzero(array[i : i + COUNT_CHUNK] == self.eos_id))
                    for i in range(0, tokens, COUNT_CHUNK)
                )
            else:
                found = None
            total = None if total is None or found is None else total + found
        return total

    @staticmethod
    def _check_metadata(metadata: Path, path: Path, tokens: int) -> int:
        """The documents ``metadata`` (Dolma's ``start,end,...`` rows) counts, once its rows
        are checked to cover ``path``'s tokens in order."""
        end = 0
        rows = 0
        try:
            with gzip.open(metadata, "rt") as f:
                for rows, line in enumerate(f, 1):
                    start_text, end_text, *_ = line.split(",", 2)
                    start, stop = int(start_text), int(end_text)
                    if start != end or stop <= start:
                        raise ValueError(f"row {rows} spans {start} to {stop} after {end}")
                    end = stop
        except (OSError, EOFError, ValueError, zlib.error) as err:  # zlib: a damaged stream
            raise DataError(
                f"{metadata} is not allowed: it is not Dolma metadata of consecutive documents "
                f"({err}); remove it to read {path.name} without document counts."
            ) from None
        if end != tokens:
            raise DataError(
                f"{metadata} ends its documents at token {end}, but {path} holds {tokens} "
                f"{'tokens' if tokens != 1 else 'token'} of the dtype it is read as: the file "
                "is truncated or data.token_dtype is not the dtype it was written in."
            )
        return rows


class MegatronDataset(ExternalDataset):
    """Megatron-Core indexed datasets: every ``PREFIX.idx`` + ``PREFIX.bin`` in a folder, or
    the one pair a prefix names."""

    format = "megatron"

    def _open(self) -> list[int]:
        if self.root.is_dir():
            indices = sorted(self.root.glob("*.idx"))
        else:
            indices = [self.root.with_name(self.root.name + ".idx")]
            self.root = self.root.parent
            if not indices[0].is_file():
                raise DataError(
                    f"{indices[0]} is missing: data.dir for data.format=megatron is a folder of "
                    ".idx/.bin pairs or the prefix of one pair (PREFIX.idx and PREFIX.bin)."
                )
        if not indices:
            raise DataError(
                f"{self.root} holds no .idx files, which data.format=megatron reads: point "
                "data.dir at the folder of Megatron's .idx/.bin pairs."
            )
        return [self._open_pair(idx) for idx in indices]

    def _open_pair(self, idx: Path) -> int:
        damaged = f"{idx} is not a Megatron-Core index that can be read"
        size = idx.stat().st_size
        with open(idx, "rb") as f:
            head = f.read(MEGATRON_HEAD.size)
        if len(head) < MEGATRON_HEAD.size:
            raise DataError(f"{damaged}: it holds {size} bytes, fewer than its header's.")
        magic, version, code, sequences, documents = MEGATRON_HEAD.unpack(head)
        if magic != MEGATRON_MAGIC or version != 1:
            raise DataError(
                f"{damaged}: it starts with {magic!r} version {version}, not {MEGATRON_MAGIC!r} "
                "version 1."
            )
        if code not in MEGATRON_DTYPES:
            raise DataError(
                f"{damaged}: its dtype code {code} is not one of the integer codes "
                f"{sorted(MEGATRON_DTYPES)} (token ids are integers)."
            )
        dtype = np.dtype(MEGATRON_DTYPES[code])
        expected = MEGATRON_HEAD.size + sequences * (4 + 8) + documents * 8
        if size != expected:
            extra = " (per-sequence modes: a multimodal index, which is not read)" * (
                size == expected + sequences
            )
            raise DataError(
                f"{damaged}: it holds {size} bytes, not the {expected} its header's "
                f"{sequences} sequences and {documents} document indices take{extra}."
            )
        lengths, pointers, doc_index = self._arrays_of(idx, sequences, documents)
        if documents < 1 or doc_index[0] != 0 or doc_index[-1] != sequences:
            raise DataError(
                f"{damaged}: its document indices do not run from 0 up to its {sequences} "
                "sequences."
            )
        _check_holds(dtype, self.vocab_size, str(idx))
        bin_path = idx.with_suffix(".bin")
        if not bin_path.is_file():
            raise DataError(f"{bin_path} is missing: {idx} indexes tokens in it.")
        # The last sequence's pointer and length give the .bin's size; that every pointer is
        # the running sum of the lengths is checked row by row in check_documents.
        want = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if sequences else 0
        found = bin_path.stat().st_size
        if found != want:
            raise DataError(
                f"{bin_path} holds {found} bytes, not the {want} that {idx} indexes "
                f"({'truncated' if found < want else 'grown'}): rewrite the pair."
            )
        self.paths.append(bin_path)
        self.dtypes.append(dtype)
        self.offsets.append(0)
        self.sidecars.append(idx)
        return want // dtype.itemsize

    @staticmethod
    def _arrays_of(idx: Path, sequences: int, documents: int) -> tuple[np.ndarray, ...]:
        """The index's lengths, pointers and document indices, memory-mapped (read as used)."""
        at = MEGATRON_HEAD.size
        whole = np.memmap(idx, dtype=np.uint8, mode="r")
        lengths = whole[at : at + 4 * sequences].view(np.int32)
        pointers = whole[at + 4 * sequences : at + 12 * sequences].view(np.int64)
        doc_index = whole[at + 12 * sequences : at + 12 * sequences + 8 * documents].view(np.int64)
        return lengths, pointers, doc_index

    def check_documents(self) -> int | None:
        total = 0
        for idx, dtype in zip(self.sidecars, self.dtypes, strict=True):
            damaged = f"{idx} is not a Megatron-Core index that can be read"
            with open(idx, "rb") as f:
                _, _, _, sequences, documents = MEGATRON_HEAD.unpack(f.read(MEGATRON_HEAD.size))
            lengths, pointers, doc_index = self._arrays_of(idx, sequences, documents)
            lengths = lengths.astype(np.int64)
            ends = np.cumsum(lengths) * dtype.itemsize
            if (lengths < 0).any() or not np.array_equal(pointers, ends - lengths * dtype.itemsize):
                raise DataError(
                    f"{damaged}: its sequence pointers are not the running sum of its sequence "
                    "lengths (a damaged index, or one that reads its .bin out of order)."
                )
            if (np.diff(doc_index) < 0).any():
                raise DataError(f"{damaged}: its document indices go back.")
            total += documents - 1
        return total


FORMATS: dict[str, type] = {
    "moe": TokenDataset,
    "dolma": DolmaDataset,
    "megatron": MegatronDataset,
}


def open_dataset(
    fmt: str,
    path: str | Path,
    split: str,
    seq_len: int,
    *,
    vocab_size: int | None = None,
    validation_fraction: float = 0.0,
    eos_id: int | None = None,
    token_dtype: str | None = None,
) -> Any:
    """The dataset of ``fmt`` over ``path``; an external format needs the run's vocabulary
    (it has no tokenizer of its own)."""
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r} is not allowed: one of {', '.join(FORMATS)}.")
    if fmt == "moe":
        return TokenDataset(path, split, seq_len)
    assert vocab_size is not None
    return FORMATS[fmt](
        path,
        split,
        seq_len,
        vocab_size=vocab_size,
        validation_fraction=validation_fraction,
        eos_id=eos_id,
        token_dtype=token_dtype,
    )


@dataclass
class Vocabulary:
    """The ids an external corpus is checked against (it carries no tokenizer of its own)."""

    size: int
    eos_id: int | None
    tokenizer: Tokenizer | None  # decodes samples; None: ids are shown
    source: str  # where the size comes from, in words
    # The tokenizer's files by name, as an export writes them beside the weights (none with
    # data.tokenizer=bpe and no folder of ours: only the size is known).
    files: dict[str, bytes] = field(default_factory=dict)


def run_vocabulary(data: DataConfig, model_vocab_size: int) -> Vocabulary:
    """The run's vocabulary for an external corpus: ``data.tokenizer``'s (``gpt2`` or a Hugging
    Face name or folder, loaded here), or with ``bpe`` (a BPE exists only where ``moe tokenize``
    trained one) ``model.vocab_size``; a tokenizer larger than the model is refused."""
    if data.tokenizer == "bpe":
        return Vocabulary(model_vocab_size, None, None, "model.vocab_size")
    built = gpt2_tokenizer() if data.tokenizer == "gpt2" else hf_tokenizer(data.tokenizer)
    check_tokenizer_fits(data, built.vocab_size, model_vocab_size)
    return Vocabulary(
        built.vocab_size, built.eos_id, built.tokenizer, repr(data.tokenizer), built.files
    )


def mixture_vocabulary(data: DataConfig, model_vocab_size: int) -> Vocabulary:
    """A mixture's vocabulary: the tokenizer its first source in our format was written with
    (its manifest's size and end-of-text id, its files), which ``data.tokenizer`` may name
    again but not contradict; without such a source, ``run_vocabulary``'s."""
    ours = next((s for s in data.sources if s.format == "moe"), None)
    if ours is None:
        return run_vocabulary(data, model_vocab_size)
    manifest = read_manifest(ours.dir)
    tok = manifest.tokenizer
    where = f"data source {ours.name!r} ({ours.dir})"
    check_tokenizer_fits(data, tok["vocab_size"], model_vocab_size, manifest=where)
    if data.tokenizer != "bpe":
        built = gpt2_tokenizer() if data.tokenizer == "gpt2" else hf_tokenizer(data.tokenizer)
        if built.sha256 != tok["sha256"]:
            fail(
                "data.tokenizer",
                data.tokenizer,
                f"'bpe' (unset, to take theirs) or the tokenizer the moe-format sources were "
                f"written with: {where} records another (sha256 {tok['sha256'][:16]}..., this "
                f"one {built.sha256[:16]}...), and the same ids must mean the same text in every "
                "source",
            )
    files = {
        name: (manifest.data_dir / name).read_bytes()
        for name in TOKENIZER_FILES
        if (manifest.data_dir / name).is_file()
    }
    try:
        tokenizer: Tokenizer | None = load_tokenizer(manifest.data_dir)
    except Exception:  # tokenizers raises a bare Exception for a damaged file: ids are shown
        tokenizer = None
    said = f"{where}'s tokenizer"
    return Vocabulary(tok["vocab_size"], tok.get("eos_id"), tokenizer, said, files)


def sources_vocabulary(data: DataConfig, model_vocab_size: int) -> Vocabulary | None:
    """What a mixture's sources of other tools are read with (``mixture_vocabulary``); None
    when every source is ours (each carries its own)."""
    if all(s.format == "moe" for s in data.sources):
        return None
    return mixture_vocabulary(data, model_vocab_size)


def open_source(data: DataConfig, split: str, seq_len: int, vocab: Vocabulary | None) -> Any:
    """The dataset ``data`` (one source: ``format``, ``dir``) names, for ``split``."""
    assert data.dir is not None
    if data.format == "moe":
        return TokenDataset(data.dir, split, seq_len)
    assert vocab is not None
    return open_dataset(
        data.format,
        data.dir,
        split,
        seq_len,
        vocab_size=vocab.size,
        validation_fraction=data.validation_fraction,
        eos_id=vocab.eos_id,
        token_dtype=data.token_dtype,
    )


def source_tokens(data: DataConfig, seq_len: int, model_vocab_size: int) -> dict[str, int | None]:
    """Each mixture source's train split tokens, read from its folder's manifest or files
    (None for a folder that cannot be read yet, or another tool's tokens whose vocabulary
    cannot be had): what ``moe plan`` and the plan page show the epochs by."""
    try:
        vocab = sources_vocabulary(data, model_vocab_size)
    except (ConfigError, DataError, OSError):
        vocab = None
    out: dict[str, int | None] = {}
    for s in data.sources:
        out[s.name] = None
        if s.format != "moe" and vocab is None:
            continue
        with contextlib.suppress(DataError, OSError):
            out[s.name] = open_source(data.of_source(s), "train", seq_len, vocab).tokens
    return out


def checksums_record(source: str | None = None) -> str:
    """The file in the run's folder that holds a corpus's checksums: the one folder's, or a
    mixture's source ``source``'s (names are letters, digits and ``._-``)."""
    return CHECKSUMS if source is None else f"data-checksums-{source}.json"


def check_recorded(
    dataset: ExternalDataset, run_dir: str | Path, *, resuming: bool, source: str | None = None
) -> str:
    """Hash every file of ``dataset``: a new run records them in ``run_dir`` (never beside the
    corpus; ``checksums_record(source)``), a ``resuming`` one checks them against that record
    and refuses a file whose bytes changed since, by name. Returns what was done, in words."""
    record = Path(run_dir) / checksums_record(source)
    dataset.check_documents()  # every index or metadata row, while every byte is read anyway
    found = {}  # by the name below the corpus's folder: a corpus moved whole still verifies
    for path in dataset.files():
        name = path.relative_to(dataset.root).as_posix()
        found[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    if not (resuming and record.is_file()):
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        atomic_write(record, json_bytes({"format": dataset.format, "files": found}))
        return f"recorded the sha256 of {len(found)} files in {record}"
    try:
        saved = json.loads(record.read_text())["files"]
        if not isinstance(saved, dict):
            raise TypeError(saved)
    except (ValueError, KeyError, TypeError):
        raise DataError(
            f"{record} is not a checksum record this run wrote: remove it to record the corpus "
            "again (after checking the corpus is the one the run started on)."
        ) from None
    for name in sorted(set(saved) | set(found)):
        if saved.get(name) != found.get(name):
            what = "is new" if name not in saved else "is gone" if name not in found else "changed"
            raise DataError(
                f"{dataset.root / name} {what} since this run recorded its corpus in {record}: "
                "the run would continue on other data; restore the corpus, or start a new run "
                "(another out_dir)."
            )
    return f"verified the sha256 of {len(found)} files against {record}"
