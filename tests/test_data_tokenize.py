"""``moe tokenize``: sources, tokenizers, shards, manifest, resume after a kill, bad input."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_core.cli import main
from moe_core.compose import compose_run
from moe_core.config import ConfigError, DataConfig
from moe_core.data.errors import DataError
from moe_core.data.loader import TokenLoader
from moe_core.data.manifest import verify_data_dir
from moe_core.data.sources import kjv_chapters
from moe_core.data.tokenize import (
    TokenizeStats,
    is_validation,
    tokenize_corpus,
    validation_phase,
)
from moe_core.data.tokenizer import load_tokenizer
from moe_core.train.trainer import Trainer

KJV_SMALL = dict(
    kind="tokens",
    max_documents=60,
    bpe_vocab_size=512,
    shard_tokens=5000,
    validation_fraction=0.05,
    workers=1,
)


def kjv(**overrides) -> DataConfig:
    return DataConfig(**{**KJV_SMALL, **overrides})


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def stream(data_dir: Path, split: str) -> np.ndarray:
    manifest = verify_data_dir(data_dir)
    shards = [np.load(data_dir / s["file"]) for s in manifest.shards(split)]
    return np.concatenate(shards).astype(np.int64) if shards else np.zeros(0, np.int64)


def documents_back(data_dir: Path, split: str) -> list[str]:
    """The split's documents decoded from its shards, cut at EOS."""
    tokenizer = load_tokenizer(data_dir)
    eos = verify_data_dir(data_dir).tokenizer["eos_id"]
    tokens = stream(data_dir, split)
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) and ends[-1] == len(tokens) - 1, "every document ends with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokenizer.decode(tokens[s:e].tolist()) for s, e in zip(starts, ends, strict=True)]


def held_out(n: int, cfg: DataConfig) -> list[bool]:
    phase = validation_phase(cfg.seed)
    return [is_validation(i, cfg.validation_fraction, phase) for i in range(n)]


def assert_one_sentence(message: str, *fragments: str) -> None:
    assert "\n" not in message and message.endswith("."), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


# --------------------------------------------------------------------------------------------
# acceptance: the built-in corpus offline, trained BPE and GPT-2, decode(encode) round trip


def test_builtin_corpus_with_trained_bpe_round_trips(tmp_path):
    cfg = kjv(workers=2)
    out = tokenize_corpus(cfg, tmp_path / "data", model_vocab_size=4096, show_progress=False)
    manifest = verify_data_dir(out)
    assert manifest.dtype == "uint16" and manifest.tokenizer["vocab_size"] <= 512
    assert manifest.tokenizer["eos_id"] == 0 and manifest.content["documents"] == 60
    texts = [c["text"] for c in kjv_chapters()[:60]]
    val = held_out(60, cfg)
    assert sum(val) == 3
    assert documents_back(out, "train") == [t for t, v in zip(texts, val, strict=True) if not v]
    assert documents_back(out, "validation") == [t for t, v in zip(texts, val, strict=True) if v]
    shards = manifest.shards("train")
    assert len(shards) > 3 and all(s["tokens"] == 5000 for s in shards[:-1])
    assert 0 < shards[-1]["tokens"] <= 5000
    assert manifest.tokens("train") + manifest.tokens("validation") == manifest.total_tokens


def test_builtin_corpus_with_gpt2_round_trips_and_loads_in_transformers(tmp_path):
    from transformers import AutoTokenizer

    cfg = kjv(tokenizer="gpt2", max_documents=25)
    out = tokenize_corpus(cfg, tmp_path / "data", model_vocab_size=50304, show_progress=False)
    manifest = verify_data_dir(out)
    assert manifest.tokenizer["vocab_size"] == 50257 and manifest.tokenizer["eos_id"] == 50256
    texts = [c["text"] for c in kjv_chapters()[:25]]
    val = held_out(25, cfg)
    assert documents_back(out, "train") == [t for t, v in zip(texts, val, strict=True) if not v]
    hf = AutoTokenizer.from_pretrained(str(out))
    assert hf("Hello world").input_ids == [15496, 995]
    assert hf.eos_token_id == 50256
    sample = texts[3][:400]
    ids = load_tokenizer(out).encode(sample, add_special_tokens=False).ids
    assert hf(sample).input_ids == ids and hf.decode(ids) == sample
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (out / name).is_file()


def test_cli_tokenize_prints_progress_summary_and_feeds_the_loader(tmp_path, capsys):
    args = ["tokenize", f"out_dir={tmp_path}", "data.max_documents=40", "data.workers=1"]
    assert main(args) == 0
    printed = capsys.readouterr()
    text = printed.out + printed.err
    assert "tokens/s" in text and "tokenized 40 documents" in text and "shards" in text
    assert "manifest.json" in text
    run = compose_run(["data=kjv", f"out_dir={tmp_path}"])
    assert run.data.dir == f"{tmp_path}/data"
    loader = TokenLoader(run.data.dir, "train", seq_len=64, micro_batch_size=4)
    batch = next(iter(loader))
    assert batch.shape == (4, 65) and int(batch.max()) < run.model.vocab_size
    assert main(args) == 0
    assert "complete and verified" in capsys.readouterr().out


# --------------------------------------------------------------------------------------------
# local files, text field, a Hugging Face tokenizer by path


def test_local_jsonl_txt_parquet_folder_and_glob(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = ["In the beginning.", "Second document, with more words in it.", "", "Last one."]
    (tmp_path / "c.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(docs))
    )
    (tmp_path / "c.txt").write_text("\n\n".join(d for d in docs if d))
    folder = tmp_path / "parts"
    folder.mkdir()
    for i, doc in enumerate(docs):
        pq.write_table(pa.table({"body": [doc]}), folder / f"p{i}.parquet")
    cases = [
        ("jsonl", dict(path=str(tmp_path / "c.jsonl"))),
        ("txt", dict(path=str(tmp_path / "c.txt"))),
        ("folder", dict(path=str(folder), text_field="body")),
        ("glob", dict(path=str(folder / "p*.parquet"), text_field="body")),
    ]
    for name, source in cases:
        cfg = kjv(**source, tokenizer="gpt2", validation_fraction=0.0, max_documents=None)
        out = tokenize_corpus(cfg, tmp_path / name, show_progress=False)
        assert documents_back(out, "train") == [d for d in docs if d], name
        assert verify_data_dir(out).content["source"]["kind"] == "files"


def test_progress_reports_documents_tokens_and_rate_and_is_logged_every_few_seconds(tmp_path):
    from moe_core.progress import LineProgress

    docs = [f"Document number {i} with a few words." for i in range(50)]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    cfg = kjv(path=str(tmp_path / "c.jsonl"), tokenizer="gpt2", max_documents=None)
    seen = []
    out = tokenize_corpus(cfg, tmp_path / "out", show_progress=False, on_progress=seen.append)
    last = seen[-1]
    assert last.documents == 50 and last.tokens == verify_data_dir(out).total_tokens
    assert last.tokens_per_s > 0
    assert [p.documents for p in seen] == sorted(p.documents for p in seen)
    expected = rf"50 (of 50 )?documents, {last.tokens:,} tokens \([\d,]+ tokens/s\)"
    assert re.match(expected, last.text()), last.text()

    logged: list[str] = []
    with LineProgress("tokenize", logged.append, every_s=3600, bar=False) as progress:
        for text in ("first", "second", "third"):
            progress.update(text)
        progress.update("phase end", force=True)
        progress.update("last")
    assert logged == ["tokenize: first", "tokenize: phase end", "tokenize: last"]


def test_hugging_face_tokenizer_by_local_path(tmp_path):
    gpt2 = tokenize_corpus(kjv(tokenizer="gpt2"), tmp_path / "gpt2", show_progress=False)
    hf = tokenize_corpus(kjv(tokenizer=str(gpt2)), tmp_path / "hf", show_progress=False)
    assert np.array_equal(stream(hf, "train"), stream(gpt2, "train"))
    assert verify_data_dir(hf).tokenizer["name"] == str(gpt2)


def test_literal_end_of_text_in_a_document_is_not_a_document_boundary(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"text": "before <|endoftext|> after"}) + "\n")
    cfg = kjv(path=str(corpus), tokenizer="gpt2", validation_fraction=0.0)
    out = tokenize_corpus(cfg, tmp_path / "data", show_progress=False)
    tokens = stream(out, "train")
    assert int((tokens == 50256).sum()) == 1 and tokens[-1] == 50256


# --------------------------------------------------------------------------------------------
# resume: kill mid-run, broken shards, half-written files


@pytest.mark.timeout(120)
def test_killed_tokenize_reruns_to_byte_identical_shards_and_manifest(tmp_path):
    overrides = [
        "data=kjv",
        "data.max_documents=500",
        "data.bpe_vocab_size=1024",
        "data.shard_tokens=2048",
        "data.workers=2",  # a local Dask cluster: its worker processes die with the process group
        "data.unit_documents=50",
        f"out_dir={tmp_path}",
    ]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_core.cli", "tokenize", *overrides, f"data.dir={killed}"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 90
    while len(list(killed.glob("train-*.json"))) < 8:
        assert proc.poll() is None, "tokenize ended before it could be killed"
        assert time.monotonic() < deadline, "no shards appeared"
        time.sleep(0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert not (killed / "manifest.json").exists(), "the run finished before the kill"
    shards = [p.with_suffix(".npy") for p in sorted(killed.glob("train-*.json"))]
    survivors = {p.name: p.stat().st_mtime_ns for p in shards}

    assert list(killed.glob("units/*.json")), "no finished unit to keep"
    cfg = compose_run(overrides).data
    resumed = TokenizeStats()
    tokenize_corpus(cfg, killed, show_progress=False, stats=resumed)
    one_worker = dataclasses.replace(cfg, workers=1)  # the output does not depend on it
    whole = tokenize_corpus(one_worker, tmp_path / "whole", show_progress=False)
    assert len(survivors) < len(verify_data_dir(whole).shards("train"))
    assert 0 < resumed.tokens < verify_data_dir(whole).total_tokens, "finished units redone"
    assert snapshot(killed) == snapshot(whole)
    kept = {name: (killed / name).stat().st_mtime_ns for name in survivors}
    assert kept == survivors, "verified shards were rewritten instead of skipped"
    assert not list(killed.glob(".*"))


def test_corrupted_shard_is_named_then_repaired_by_a_rerun(tmp_path):
    out = tokenize_corpus(kjv(), tmp_path / "data", show_progress=False)
    before = snapshot(out)
    victim = out / "train-00002.npy"
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(DataError) as err:
        verify_data_dir(out)
    assert_one_sentence(str(err.value), "train-00002.npy", "corrupted", "rerun moe tokenize")
    assert verify_data_dir(out, checksums=False).total_tokens > 0  # sizes alone cannot tell
    untouched = {p.name: p.stat().st_mtime_ns for p in out.glob("train-0000[013].npy")}
    tokenize_corpus(kjv(), out, show_progress=False)
    assert snapshot(out) == before
    assert {p: (out / p).stat().st_mtime_ns for p in untouched} == untouched


def test_truncated_or_half_written_shard_does_not_count(tmp_path):
    out = tokenize_corpus(kjv(), tmp_path / "data", show_progress=False)
    before = snapshot(out)
    shard = out / "train-00001.npy"
    shard.write_bytes(shard.read_bytes()[:3000])
    with pytest.raises(DataError) as err:
        verify_data_dir(out, checksums=False)
    assert_one_sentence(str(err.value), "train-00001.npy", "truncated")
    with pytest.raises(DataError, match=r"train-00001\.npy.*\(truncated\)"):
        TokenLoader(out, "train", seq_len=32, micro_batch_size=2)
    (out / "manifest.json").unlink()
    (out / "train-00003.json").unlink()  # a shard whose record was never written
    (out / ".train-00004.npy.tmp-999").write_bytes(b"half a shard")
    tokenize_corpus(kjv(), out, show_progress=False)
    assert snapshot(out) == before


# --------------------------------------------------------------------------------------------
# bad input: one sentence naming the value, nothing already written lost


def test_missing_path_and_unreadable_kinds(tmp_path):
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(path=str(tmp_path / "nope.jsonl")), tmp_path / "d")
    assert_one_sentence(str(err.value), "data.path=", "nope.jsonl", "no such file", "jsonl")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(path=str(tmp_path / "*.parquet")), tmp_path / "d")
    assert_one_sentence(str(err.value), "matches no file")
    (tmp_path / "a.docx").write_text("x")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(path=str(tmp_path / "a.docx")), tmp_path / "d")
    assert_one_sentence(str(err.value), "a.docx is not")
    assert not (tmp_path / "d").exists()
    # a file damaged past the first document (read in chunks: from its first row on): one
    # sentence, not the reader's traceback
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.jsonl").write_text("".join(f'{{"text": "doc {i}"}}\n' for i in range(3)))
    (corpus / "b.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n')
    cfg = kjv(path=str(corpus), tokenizer="gpt2", validation_fraction=0.0, max_documents=None)
    with pytest.raises(DataError) as err:
        tokenize_corpus(cfg, tmp_path / "d", show_progress=False)
    assert_one_sentence(
        str(err.value), f"data.path={str(corpus)!r} could not be read at document 3"
    )


def test_empty_corpus_and_corpus_without_text(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError) as err:
        tokenize_corpus(kjv(path=str(empty)), tmp_path / "d1")
    assert_one_sentence(str(err.value), "empty.jsonl", "holds no documents")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": ""}) + "\n" + json.dumps({"text": None}) + "\n")
    for tokenizer in ("bpe", "gpt2"):
        with pytest.raises(DataError) as err:
            tokenize_corpus(kjv(path=str(blank), tokenizer=tokenizer), tmp_path / tokenizer)
        assert_one_sentence(str(err.value), "blank.jsonl", "no", "text")
    assert not any((tmp_path / name).exists() for name in ("d1", "bpe", "gpt2"))


def test_text_field_absent(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": 1, "body": "words"}) + "\n")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(path=str(corpus)), tmp_path / "d")
    assert_one_sentence(str(err.value), "data.text_field='text'", "body, id")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(text_field="verse"), tmp_path / "d")
    assert_one_sentence(str(err.value), "data.text_field='verse'", "book, chapter, text")


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path, capsys):
    assert main(["tokenize", "data=kjv-gpt2", f"out_dir={tmp_path}"]) == 2
    out = capsys.readouterr().out
    assert "data.tokenizer='gpt2' is not allowed" in out and "model.vocab_size (4096)" in out
    with pytest.raises(ConfigError) as err:
        compose_run(["data=kjv", "data.bpe_vocab_size=8192"])
    assert_one_sentence(str(err.value), "data.bpe_vocab_size=8192", "model.vocab_size (4096)")
    gpt2 = tokenize_corpus(kjv(tokenizer="gpt2"), tmp_path / "gpt2", show_progress=False)
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(tokenizer=str(gpt2)), tmp_path / "hf", model_vocab_size=4096)
    assert_one_sentence(str(err.value), "50257 tokens", "model.vocab_size (4096)")
    assert not (tmp_path / "hf").exists() and not (tmp_path / "data").exists()


def test_directory_from_another_tokenizer_is_refused_and_kept(tmp_path):
    out = tokenize_corpus(kjv(), tmp_path / "data", show_progress=False)
    before = snapshot(out)
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(tokenizer="gpt2"), out)
    assert_one_sentence(str(err.value), "another tokenizer", "'gpt2'", "'bpe' of 512 tokens")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(shard_tokens=4000), out)
    assert_one_sentence(str(err.value), "data.shard_tokens 5000, not 4000")
    assert snapshot(out) == before
    with pytest.raises(DataError) as err:
        verify_data_dir(out, tokenizer_sha256="0" * 64)
    assert_one_sentence(str(err.value), "another tokenizer")
    other = tokenize_corpus(kjv(tokenizer="gpt2"), tmp_path / "other", show_progress=False)
    (out / "tokenizer.json").write_bytes((other / "tokenizer.json").read_bytes())
    with pytest.raises(DataError) as err:
        verify_data_dir(out)
    assert_one_sentence(str(err.value), "tokenizer.json", "another tokenizer")
    with pytest.raises(DataError) as err:
        tokenize_corpus(kjv(), out)
    assert_one_sentence(str(err.value), "tokenizer.json", "another tokenizer")


def test_foreign_folder_and_unreachable_hub_are_refused(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(), foreign)
    assert_one_sentence(str(err.value), "did not write", "notes.txt")
    assert snapshot(foreign) == {"notes.txt": b"keep me"}
    (foreign / "job.json").write_text("[1, 2]")  # another tool's job.json
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(), foreign)
    assert_one_sentence(str(err.value), "did not write", "job.json")
    (foreign / "job.json").unlink()
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(hub="no-such-user/no-such-dataset"), tmp_path / "d")
    assert_one_sentence(str(err.value), "data.hub='no-such-user/no-such-dataset'")
    # a glob reaching into data.dir: refused before the rerun reads the first run's output
    corpus = tmp_path / "corpus"
    (corpus / "tokens").mkdir(parents=True)
    (corpus / "a.json").write_text('{"text": "one"}\n')
    (corpus / "tokens" / "job.json").write_text("{}")
    with pytest.raises(ConfigError) as err:
        tokenize_corpus(kjv(path=f"{corpus}/**/*.json"), corpus / "tokens")
    assert_one_sentence(str(err.value), "names", "job.json", "own output would be read")


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.validation_fraction=0.9", "data.validation_fraction=0.9 is not allowed"),
        ("data.bpe_vocab_size=100", "data.bpe_vocab_size=100 is not allowed: at least 257"),
        ("data.shard_tokens=0", "data.shard_tokens=0 is not allowed: it must be positive"),
        ("data.hub=x", "data.hub='x' is not allowed: leave it unset when data.path is given"),
        ("data.kind=shards", "data.kind='shards' is not allowed: one of 'synthetic', 'tokens'"),
        # a rerun would read the shards and records written into the corpus's folder as text
        ("data.path=runs", "data.dir='runs/tiny/data' is not allowed: a folder outside data.path"),
    ],
)
def test_invalid_data_values_fail_with_one_sentence(override, message, capsys):
    overrides = ["data=kjv", override] + (["data.path=c.jsonl"] if "hub" in override else [])
    with pytest.raises(ConfigError) as err:
        compose_run(overrides)
    assert_one_sentence(str(err.value), message)
    assert main(["tokenize", *overrides]) == 2
    assert message.split(" is ")[0] in capsys.readouterr().out


def test_files_option_requires_a_path(capsys):
    assert main(["tokenize", "data=files"]) == 2
    assert "data.path has no value: give one as an override (data.path=...)." in (
        capsys.readouterr().out
    )
    assert main(["tokenize", "data=synthetic"]) == 2
    assert "data.kind='synthetic' is not allowed for moe tokenize" in capsys.readouterr().out


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine torch's spinning threads slow it ~30x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_moe_train_reads_the_tokenized_corpus(tmp_path, one_thread):
    common = [f"out_dir={tmp_path}", "data=kjv", "data.max_documents=30", "data.workers=1"]
    assert main(["tokenize", *common, "data.bpe_vocab_size=512"]) == 0
    run = compose_run([*common, "data.bpe_vocab_size=512", "train.seq_len=32"])
    trainer = Trainer(dataclasses.replace(run, train=dataclasses.replace(run.train, steps=2)))
    expected = next(iter(TokenLoader(run.data.dir, "train", 32, run.train.micro_batch_size)))
    assert torch.equal(trainer.micro_batches()[0], expected)
    trainer = Trainer(dataclasses.replace(run, train=dataclasses.replace(run.train, steps=2)))
    history = trainer.fit(show_progress=False)
    assert len(history) == 2 and all(math.isfinite(m.loss) for m in history)
