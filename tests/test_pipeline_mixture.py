"""``moe pipeline`` on a weighted mixture of folders tokenized already (a Dolma web corpus, our
shards of code, a Megatron math corpus): the tokenize stage verifies the sources and records
what it verified, train reads the mixture, convert exports the mixture's tokenizer, evaluate
scores the first source's held-out tail; a rerun skips every stage, a changed weight reruns
train and after, a changed source everything from the verification on."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import run_pipeline, write_token_dir
from test_data_formats import documents, write_dolma, write_megatron

from flows.pretrain import NAMES as STAGES
from flows.pretrain import _source_files, resolve, stage_keys
from moe_core.compose import compose_dict
from moe_core.config import ConfigError, SourceConfig

SEQ, MB = 32, 2


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> Path:
    """Three sources in the ids of a byte-level BPE trained here (end-of-text 0), whose files
    the code folder holds as ``moe tokenize`` writes them."""
    from moe_core.data.sources import kjv_chapters
    from moe_core.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("corpora")
    bpe = train_bpe((c["text"] for c in kjv_chapters()[:40]), 400)
    top = bpe.vocab_size
    web = documents(300, 31, top=top)
    write_dolma(root / "web" / "part-0.npy", web[:150])
    write_dolma(root / "web" / "part-1.npy", web[150:], metadata=False)
    code = np.concatenate(documents(150, 32, top=top))
    splits = {"train": code, "validation": code[:300]}
    out = write_token_dir(
        root / "code", splits, 1000, vocab_size=top, tokenizer=bpe.files["tokenizer.json"]
    )
    for name, content in bpe.files.items():
        if name != "tokenizer.json":
            (out / name).write_bytes(content)
    write_megatron(root / "math" / "a_text_document", documents(150, 33, top=top))
    return root


def mixture(root: Path, web: float = 0.5, *extra: str) -> list[str]:
    sources = (
        f"data.sources=[{{name:web,dir:'{root}/web',format:dolma,weight:{web}}},"
        f"{{name:code,dir:'{root}/code',weight:0.3}},"
        f"{{name:math,dir:'{root}/math',format:megatron,weight:0.2}}]"
    )
    return [
        sources,
        "data.validation_fraction=0.1",
        "parallel=single",
        "cluster.procs_per_node=1",
        "train.steps=4",
        f"train.seq_len={SEQ}",
        f"train.micro_batch_size={MB}",
        "train.global_batch_size=4",
        *extra,
    ]


@pytest.mark.slow
def test_a_mixture_of_every_format_runs_through_the_pipeline_and_a_rerun_skips_it(
    prefect_home, corpora, tmp_path
):
    from transformers import AutoTokenizer

    run_dir = tmp_path / "mix"
    outcome = run_pipeline(run_dir, mixture(corpora))
    assert outcome["stages"] == dict.fromkeys(STAGES, "Completed")
    record = json.loads((run_dir / "data" / "sources.json").read_text())
    assert [(r["name"], r["format"]) for r in record["sources"]] == [
        ("web", "dolma"),
        ("code", "moe"),
        ("math", "megatron"),
    ]
    assert record["tokenizer"]["eos_id"] == 0
    assert (run_dir / "data" / "data-checksums-web.json").is_file()
    assert (run_dir / "data" / "data-checksums-math.json").is_file()
    code_tokenizer = (corpora / "code" / "tokenizer.json").read_bytes()
    assert (run_dir / "hf" / "tokenizer.json").read_bytes() == code_tokenizer
    assert AutoTokenizer.from_pretrained(run_dir / "hf").eos_token_id == 0
    lines = (run_dir / "train" / "metrics.jsonl").read_text().splitlines()
    assert set(json.loads(lines[-1])["data_tokens"]) == {"web", "code", "math"}
    result = json.loads((run_dir / "eval" / "result.json").read_text())
    assert result["tokens"] == 4 * MB * SEQ and result["relative_difference"] < 1e-4
    assert outcome["tokenize"]["total_tokens"] > 0 and outcome["tokenize"]["sources"] == 3
    # nothing written beside the corpora
    assert sorted(p.name for p in (corpora / "math").iterdir()) == [
        "a_text_document.bin",
        "a_text_document.idx",
    ]

    again = run_pipeline(run_dir, mixture(corpora))
    assert again["stages"] == dict.fromkeys(STAGES, "Skipped")
    # a changed weight reruns train and after: the stage keys' test below holds it


def test_stage_keys_of_a_mixture_follow_its_weights_and_its_sources_contents(corpora, tmp_path):
    """A weight is the train stage's; a source's contents (ours: its manifest; another tool's:
    its files' sizes and times) are the verification's, and so everything's after it."""
    config = compose_dict(mixture(corpora), config_name="pretrain-tiny")
    run = resolve(config, tmp_path)
    keys = stage_keys(run)
    sources = [replace(run.data.sources[0], weight=0.9), *run.data.sources[1:]]
    heavier = stage_keys(replace(run, data=replace(run.data, sources=sources)))
    assert heavier["tokenize"] == keys["tokenize"] and heavier["init"] == keys["init"]
    assert heavier["train"] != keys["train"] and heavier["evaluate"] != keys["evaluate"]
    part = corpora / "web" / "part-1.npy"
    stat = part.stat()
    os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten, say
    try:
        touched = stage_keys(run)
    finally:
        os.utime(part, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert touched["tokenize"] != keys["tokenize"] and touched["train"] != keys["train"]
    assert touched["init"] == keys["init"]
    assert stage_keys(run) == keys
    # a Dolma glob's files, found below the folder before its first wildcard
    glob_source = SourceConfig("w", f"{corpora}/*/part-*.npy", "dolma", weight=1.0)
    root, files = _source_files(glob_source)
    assert root == corpora and [f.relative_to(root).as_posix() for f in files] == [
        "web/part-0.npy",
        "web/part-1.npy",
    ]


def test_a_mixture_without_tokenizer_files_is_refused_before_anything_runs(tmp_path):
    sources = (
        "data.sources=[{name:web,dir:/corpora/web,format:dolma,weight:1},"
        "{name:math,dir:/corpora/math,format:megatron,weight:1}]"
    )
    config = compose_dict([sources, "eval.every=0"], config_name="pretrain-tiny")
    with pytest.raises(ConfigError) as err:
        resolve(config, tmp_path)
    assert str(err.value) == (
        "data.tokenizer='bpe' is not allowed for a pipeline whose mixture's sources (web, math) "
        "are all dolma or megatron tokens: the Hugging Face export needs the tokenizer, and only "
        "a moe-format source carries its files, so name the one the tokens were written with "
        "(data.tokenizer=gpt2, or a Hugging Face name or folder)."
    )
    assert not any(tmp_path.iterdir())
    config = compose_dict(
        [sources, "eval.every=0", "data.tokenizer=gpt2"], config_name="pretrain-tiny"
    )
    assert resolve(config, tmp_path).data.tokenizer == "gpt2"
