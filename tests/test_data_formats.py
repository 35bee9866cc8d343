"""Corpora other tools wrote (Dolma/Olmo-core numpy token files, Megatron-Core indexed
datasets), read in place token for token: files written here from each format's published
layout and, where its package imports, by the format's own writer; refusals of damaged files;
loader resume; the checksum record; ``moe data``."""

from __future__ import annotations

import gzip
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
from helpers import BASE, write_token_dir

from moe_core.cli import main
from moe_core.compose import compose_run
from moe_core.config import ConfigError
from moe_core.data.errors import DataError
from moe_core.data.formats import (
    CHECKSUMS,
    FORMATS,
    DolmaDataset,
    MegatronDataset,
    check_recorded,
    open_dataset,
)
from moe_core.data.loader import TokenLoader
from moe_core.data.tokenizer import gpt2_tokenizer

EOS = 0
VOCAB = 300


def documents(n: int, seed: int = 0, top: int = VOCAB) -> list[np.ndarray]:
    """``n`` documents of 3 to 40 ids in ``[1, top)``, each ending in EOS."""
    rng = np.random.default_rng(seed)
    return [np.append(rng.integers(1, top, rng.integers(2, 40)), EOS) for _ in range(n)]


# ---- writers from the published layouts -------------------------------------------------


def write_dolma(
    path: Path, docs: list[np.ndarray], dtype: str = "uint16", *, metadata: bool = True
) -> Path:
    """A Dolma/Olmo-core token file: the raw ids (no header) and, optionally, ``NAME.csv.gz``
    with one ``start,end,id,src,loc`` row per document."""
    path.parent.mkdir(parents=True, exist_ok=True)
    np.concatenate(docs).astype(dtype).tofile(path)
    if metadata:
        ends = np.cumsum([len(d) for d in docs])
        with gzip.open(path.with_name(path.stem + ".csv.gz"), "wt") as f:
            for i, end in enumerate(ends):
                f.write(f"{end - len(docs[i])},{end},doc-{i},{path.name},{i}\n")
    return path


def write_megatron(prefix: Path, docs: list[np.ndarray], dtype: str = "uint16") -> Path:
    """A Megatron-Core ``PREFIX.bin`` (the ids) and ``PREFIX.idx``: magic, version 1, dtype
    code, sequence and document counts, int32 lengths, int64 byte pointers, int64 document
    indices (one sequence per document)."""
    codes = {"uint8": 1, "int8": 2, "int16": 3, "int32": 4, "int64": 5, "uint16": 8}
    prefix.parent.mkdir(parents=True, exist_ok=True)
    tokens = np.concatenate(docs).astype(dtype)
    tokens.tofile(prefix.with_name(prefix.name + ".bin"))
    lengths = np.array([len(d) for d in docs], np.int32)
    pointers = (np.cumsum(lengths, dtype=np.int64) - lengths) * tokens.itemsize
    doc_index = np.arange(len(docs) + 1, dtype=np.int64)
    head = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, codes[dtype], len(docs), len(doc_index))
    idx = prefix.with_name(prefix.name + ".idx")
    idx.write_bytes(head + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes())
    return idx


def stream(dataset) -> np.ndarray:
    return dataset.read(0, dataset.tokens)


@pytest.fixture
def dolma_dir(tmp_path):
    """Two raw uint16 files with metadata and one ``np.save`` file (a header) without."""
    root = tmp_path / "dolma"
    a, b, c = documents(20, 1), documents(15, 2), documents(5, 3)
    write_dolma(root / "part-0-00000.npy", a)
    write_dolma(root / "sub" / "part-1-00000.npy", b)
    np.save(root / "part-2-00000.npy", np.concatenate(c).astype(np.uint32))
    return root, np.concatenate([*a, *c, *b])  # sorted by path: part-0, part-2, sub/part-1


def test_dolma_files_read_back_token_for_token_across_file_boundaries(dolma_dir):
    root, expected = dolma_dir
    ds = DolmaDataset(root, "train", 7, vocab_size=VOCAB, eos_id=EOS)
    assert ds.tokens == len(expected) and len(ds) == len(expected) // 8
    assert np.array_equal(stream(ds), expected)
    assert [str(d) for d in ds.dtypes] == ["uint16", "uint32", "uint16"]
    assert ds.check_documents() == 40  # 35 metadata rows, and 5 end-of-text ids counted
    batch_BT = ds.batch(np.array([len(ds) - 1, 0, 3]))
    assert batch_BT.dtype == np.int64 and batch_BT.shape == (3, 8)
    assert np.array_equal(batch_BT[0], expected[(len(ds) - 1) * 8 : len(ds) * 8])
    assert FORMATS["dolma"] is DolmaDataset and FORMATS["megatron"] is MegatronDataset


def test_the_validation_split_is_the_tail_and_the_splits_partition_the_stream(dolma_dir):
    root, expected = dolma_dir
    train, held_out = (
        open_dataset("dolma", root, s, 3, vocab_size=VOCAB, validation_fraction=0.25)
        for s in ("train", "validation")
    )
    assert held_out.tokens == int(len(expected) * 0.25) > 0
    assert np.array_equal(np.concatenate([stream(train), stream(held_out)]), expected)
    assert train.identity != held_out.identity
    assert np.array_equal(held_out[0], expected[train.tokens : train.tokens + 4])


def test_a_glob_reads_only_the_files_it_names(dolma_dir):
    root, _ = dolma_dir
    ds = DolmaDataset(f"{root}/part-0-*.npy", "train", 3, vocab_size=VOCAB)
    assert [p.name for p in ds.paths] == ["part-0-00000.npy"] and ds.root == root
    # "DIR/**" also names the metadata beside each file: never read as tokens
    ds = DolmaDataset(f"{root}/**", "train", 3, vocab_size=VOCAB)
    assert [p.name for p in ds.paths] == [
        "part-0-00000.npy",
        "part-2-00000.npy",
        "part-1-00000.npy",
    ]
    assert len(ds.sidecars) == 2


def test_megatron_pairs_read_back_token_for_token(tmp_path):
    a, b = documents(30, 4), documents(12, 5)
    write_megatron(tmp_path / "mg" / "a_text_document", a, "uint16")
    write_megatron(tmp_path / "mg" / "b_text_document", b, "int32")
    ds = MegatronDataset(tmp_path / "mg", "train", 5, vocab_size=VOCAB)
    assert np.array_equal(stream(ds), np.concatenate([*a, *b])) and ds.check_documents() == 42
    one = MegatronDataset(tmp_path / "mg" / "b_text_document", "train", 5, vocab_size=VOCAB)
    assert np.array_equal(stream(one), np.concatenate(b))
    assert [p.name for p in one.files()] == ["b_text_document.bin", "b_text_document.idx"]


def damage(idx: Path, at: int, data: bytes) -> None:
    raw = bytearray(idx.read_bytes())
    raw[at : at + len(data)] = data
    idx.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("how", "sentence"),
    [
        ("magic", "not a Megatron-Core index that can be read: it starts with b'NOTANIDX\\x00'"),
        ("float", "its dtype code 6 is not one of the integer codes"),
        ("short idx", "holds 40 bytes, not the"),
        ("pointer", "its sequence pointers are not the running sum of its sequence lengths"),
        ("short bin", "holds 20 bytes, not the"),
        ("no bin", "is missing: "),
        ("no pair", "holds no .idx files, which data.format=megatron reads"),
    ],
)
def test_damaged_megatron_files_are_refused_in_one_sentence_naming_the_file(
    tmp_path, how, sentence
):
    idx = write_megatron(tmp_path / "mg" / "c", documents(6, 6))
    bin_path = idx.with_suffix(".bin")
    if how == "magic":
        damage(idx, 0, b"NOTANIDX\x00")
    elif how == "float":
        damage(idx, 17, b"\x06")
    elif how == "short idx":
        idx.write_bytes(idx.read_bytes()[:40])
    elif how == "pointer":
        damage(idx, 34 + 6 * 4 + 8, struct.pack("<q", 3))
    elif how == "short bin":
        bin_path.write_bytes(bin_path.read_bytes()[:20])
    elif how == "no bin":
        bin_path.unlink()
    else:
        idx.unlink()
        bin_path.unlink()
    with pytest.raises(DataError) as err:  # at open, or (every row) with the checksums
        MegatronDataset(tmp_path / "mg", "train", 3, vocab_size=VOCAB).check_documents()
    text = str(err.value)
    assert sentence in text and "\n" not in text and text.count(". ") == 0
    assert str(tmp_path / "mg") in text


def test_wrong_dtype_or_vocabulary_and_bad_ids_are_refused(tmp_path):
    docs = documents(8, 7)
    path = write_dolma(tmp_path / "d" / "x.npy", docs, "uint32")
    wrong = DolmaDataset(tmp_path / "d", "train", 3, vocab_size=VOCAB)  # as uint16: 2x tokens
    with pytest.raises(DataError, match=r"ends its documents at token .* data.token_dtype"):
        wrong.check_documents()  # and so check_recorded, before any step
    ok = DolmaDataset(tmp_path / "d", "train", 3, vocab_size=VOCAB, token_dtype="uint32")
    assert np.array_equal(stream(ok), np.concatenate(docs))
    metadata = path.with_name("x.csv.gz")
    raw = bytearray(metadata.read_bytes())
    raw[20:40] = bytes(b ^ 0x5A for b in raw[20:40])  # damaged inside its deflate stream
    metadata.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"x.csv.gz is not allowed: it is not Dolma metadata"):
        ok.check_documents()
    metadata.unlink()
    with pytest.raises(DataError, match="ends in token 0, not the end-of-text id 7 "):
        DolmaDataset(tmp_path / "d", "train", 3, vocab_size=VOCAB, eos_id=7)
    with open(path, "ab") as f:
        f.write(b"\x01")
    with pytest.raises(DataError, match=r"holds \d+ bytes, which is not allowed for uint16"):
        DolmaDataset(tmp_path / "d", "train", 3, vocab_size=VOCAB)
    write_dolma(tmp_path / "e" / "y.npy", docs, "uint16")
    with pytest.raises(DataError, match="holds uint16 tokens, which is not allowed with a vocab"):
        DolmaDataset(tmp_path / "e", "train", 3, vocab_size=100_000, token_dtype="uint16")
    small = DolmaDataset(tmp_path / "e", "train", 3, vocab_size=50)
    with pytest.raises(DataError) as err:
        small.batch(np.arange(len(small)))
    assert f"in {tmp_path / 'e' / 'y.npy'} is not allowed: the vocabulary has ids 0 to 49" in str(
        err.value
    )
    with pytest.raises(DataError, match=r"holds no \.npy token files"):
        DolmaDataset(tmp_path / "empty*", "train", 3, vocab_size=VOCAB)


def test_the_loader_resumes_exactly_on_external_datasets(tmp_path):
    write_megatron(tmp_path / "mg" / "a", documents(80, 8))
    data = MegatronDataset(tmp_path / "mg", "train", 7, vocab_size=VOCAB)
    loader = TokenLoader(data, "train", 7, 2, seed=3)
    it = iter(loader)
    first = [next(it) for _ in range(3)]
    state = loader.state_dict()
    rest = [next(it) for _ in range(4)]
    again = TokenLoader(
        MegatronDataset(tmp_path / "mg", "train", 7, vocab_size=VOCAB), "train", 7, 2, seed=3
    )
    again.load_state_dict(state)
    it2 = iter(again)
    assert all((next(it2) == r).all() for r in rest) and len(first) == 3
    write_megatron(tmp_path / "other" / "a", documents(81, 8))
    other = TokenLoader(
        MegatronDataset(tmp_path / "other", "train", 7, vocab_size=VOCAB), "train", 7, 2, seed=3
    )
    assert other.state_problem(state).startswith("the data's fingerprint is ")


def test_checksums_are_recorded_in_the_run_folder_and_a_changed_file_is_refused(tmp_path):
    idx = write_megatron(tmp_path / "mg" / "a", documents(10, 9))
    before = sorted(p.name for p in (tmp_path / "mg").iterdir())
    data = MegatronDataset(tmp_path / "mg", "train", 3, vocab_size=VOCAB)
    run = tmp_path / "run"
    assert check_recorded(data, run, resuming=True).startswith("recorded the sha256 of 2 files")
    assert (tmp_path / "run" / CHECKSUMS).is_file()
    assert sorted(p.name for p in (tmp_path / "mg").iterdir()) == before  # nothing written there
    assert check_recorded(data, run, resuming=True).startswith("verified the sha256 of 2 files")
    bin_path = idx.with_suffix(".bin")
    raw = bytearray(bin_path.read_bytes())
    raw[0] ^= 1  # still a valid id: only the hash sees it
    bin_path.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=f"{bin_path} changed since this run recorded"):
        check_recorded(data, run, resuming=True)
    assert check_recorded(data, run, resuming=False).startswith("recorded")  # a new run
    assert check_recorded(data, run, resuming=True).startswith("verified")
    (run / CHECKSUMS).write_text('{"files": []}')  # JSON, but not a record this run wrote
    with pytest.raises(DataError, match="is not a checksum record this run wrote"):
        check_recorded(data, run, resuming=True)


# ---- the formats' own writers, where their packages import ------------------------------


def test_megatron_cores_own_builder_is_read_token_for_token(tmp_path):
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    docs = documents(25, 10)
    prefix = str(tmp_path / "own" / "text_document")
    (tmp_path / "own").mkdir()
    builder = indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    import torch

    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(prefix + ".idx")
    ds = MegatronDataset(tmp_path / "own", "train", 3, vocab_size=VOCAB)
    assert np.array_equal(stream(ds), np.concatenate(docs)) and ds.check_documents() == 25
    theirs = indexed.IndexedDataset(prefix)
    assert all(np.array_equal(theirs[i], d) for i, d in enumerate(docs))


def test_olmo_cores_own_writer_and_metadata_are_read_token_for_token(tmp_path):
    utils = pytest.importorskip("olmo_core.data.utils")
    docs = documents(30, 11)
    path = tmp_path / "olmo" / "part-00000.npy"
    path.parent.mkdir()
    tokens = np.concatenate(docs)
    with utils.memmap_to_write(path, shape=tokens.shape, dtype=np.uint32) as array:
        array[:] = tokens
    utils.write_document_indices(path, dtype=np.uint32, eos_token_id=EOS)
    ds = DolmaDataset(path.parent, "train", 3, vocab_size=100_000, eos_id=EOS)
    assert np.array_equal(stream(ds), tokens) and ds.check_documents() == 30 and ds.sidecars


def test_dolmas_own_memmap_writer_is_read_token_for_token(tmp_path):
    writer = pytest.importorskip("dolma.tokenizer.memmap_writer")
    types = pytest.importorskip("dolma.tokenizer.data_types")
    docs = documents(12, 12)
    path = str(tmp_path / "dolma" / "part-0.npy")
    with writer.MemmapWriter(path, np.dtype("uint16"), max_tokens=10_000) as w:
        for i, d in enumerate(docs):
            w.write(types.TokenizerOutput.from_tokens(f"d{i}", "src", i, d.tolist()))
    ds = DolmaDataset(tmp_path / "dolma", "train", 3, vocab_size=VOCAB, eos_id=EOS)
    assert np.array_equal(stream(ds), np.concatenate(docs)) and ds.check_documents() == 12


# ---- the run: config, training, moe data ------------------------------------------------


def run_args(data: Path, out: Path, fmt: str, *extra: str) -> list[str]:
    return [*BASE, "model.n_layers=2", f"data={fmt}", f"data.dir={data}", f"out_dir={out}", *extra]


def test_config_refusals_for_external_formats(tmp_path, capsys):
    cases = [
        (["data.kind=synthetic", "data.format=dolma"], "data.format='dolma' is not allowed"),
        (["data=megatron", "data.dir=/x", "data.token_dtype=uint16"], "data.token_dtype='uint16'"),
        (["data=dolma", "data.dir=/x", "eval.every=5"], "eval.every=5 is not allowed"),
    ]
    for overrides, sentence in cases:
        with pytest.raises(ConfigError, match=sentence.replace("(", r"\(")):
            compose_run([*BASE, f"out_dir={tmp_path}", *overrides])
    capsys.readouterr()
    assert main(["tokenize", "data=dolma", f"data.dir={tmp_path}"]) == 2
    said = capsys.readouterr().out.replace("\n", "")
    assert "data.format='dolma' is not allowed for moe tokenize: that corpus is tokens" in said
    assert main(["data"]) == 2  # synthetic: no folder to show
    assert "data.kind='synthetic' is not allowed for moe data" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["dolma", "megatron"])
def test_training_reads_a_corpus_in_place_records_its_checksums_and_resumes(tmp_path, capsys, fmt):
    root = tmp_path / "corpus"
    docs = documents(250, 13, top=256)
    if fmt == "dolma":
        write_dolma(root / "part-0.npy", docs[:120])
        write_dolma(root / "part-1.npy", docs[120:])
    else:
        write_megatron(root / "part_0_text_document", docs[:120])
        write_megatron(root / "part_1_text_document", docs[120:])
    before = sorted(p.name for p in root.iterdir())
    out = tmp_path / "run"
    held_out = ["data.validation_fraction=0.1", "train.eval_every=2", "train.eval_batches=2"]
    args = run_args(root, out, fmt, "model.vocab_size=256", *held_out, "train.steps=2")
    assert main(["train", *args]) == 0
    printed = capsys.readouterr().out
    assert "recorded the sha256 of 4 files in" in printed.replace("\n", "")
    assert sorted(p.name for p in root.iterdir()) == before and (out / CHECKSUMS).is_file()
    assert main(["train", *args[:-1], "train.steps=3"]) == 0
    assert "verified the sha256 of 4 files against" in capsys.readouterr().out.replace("\n", "")
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m] == [0, 1, 2]
    assert not list(out.glob("*.superseded-*"))  # resumed, not started over
    assert main(["convert", "to-hf", str(out / "model"), str(tmp_path / "hf")]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert (
        f"trained on a {fmt} corpus, which carries no tokenizer files: give --tokenizer" in printed
    )
    assert any("eval_loss" in m for m in metrics)


def test_moe_data_shows_files_documents_tokens_and_a_decoded_sample(tmp_path, capsys):
    root = tmp_path / "corpus"
    gpt2 = gpt2_tokenizer()
    ids = [*gpt2.tokenizer.encode("The sky is blue.").ids, gpt2.eos_id]
    write_dolma(root / "part-0.npy", [np.array(ids)])
    args = ["data", "data=dolma", f"data.dir={root}", "data.tokenizer=gpt2", "model=olmoe-1b-7b"]
    assert main(args) == 0
    out = capsys.readouterr().out
    for word in (
        "dolma",
        "1 token file (",
        "uint16",
        "documents",
        "50,257 ids",
        "end-of-text 50256",
    ):
        assert word in out, word
    assert "'The sky is blue.<|endoftext|>'" in out and " ".join(map(str, ids)) in out
    splits = {"train": np.arange(40), "validation": [1, 2]}
    ours = write_token_dir(
        tmp_path / "ours",
        splits,
        16,
        vocab_size=gpt2.vocab_size,
        tokenizer=gpt2.files["tokenizer.json"],
    )
    assert main(["data", "data.kind=tokens", f"data.dir={ours}", "--sample-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "moe (moe tokenize's shards and manifest)" in out and "0 1 2 3 4" in out
    manifest = json.loads((ours / "manifest.json").read_text())
    del manifest["documents"]  # optional for readers: a manifest another writer made
    (ours / "manifest.json").write_text(json.dumps(manifest))
    assert main(["data", "data.kind=tokens", f"data.dir={ours}"]) == 0
    assert "documents  ?: train 1, validation 1" in capsys.readouterr().out


def test_the_loader_benchmark_runs_small_and_reports_every_format(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "loader_formats.py"
    out = tmp_path / "loader.json"
    small = [
        "--tokens",
        "200000",
        "--files",
        "3",
        "--seq",
        "64",
        "--batches",
        "5",
        "--repeats",
        "1",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}  # this checkout's moe_core
    run = subprocess.run(
        [sys.executable, str(script), *small, "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"moe", "dolma", "megatron"} and report["gpu"] == "none (CPU)"
