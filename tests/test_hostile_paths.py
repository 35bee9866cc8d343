"""Nothing written or read outside its folder: an empty out_dir, run_dir or data.dir, and a data
manifest, HF index or DCP ``.metadata`` naming a file elsewhere (``..``, an absolute path, a
symlink leading out) are refused in one sentence naming the value; so are HF folders with
mistyped configs, truncated or integer weights, and ``.metadata`` pickles that call an allowed
constructor badly. Each test checks that nothing was created or changed."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import BASE, small_config, write_token_dir
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, MetadataIndex

from flows.cli import split_run_dir
from flows.layout import run_root
from flows.manifests import checksums
from flows.manifests import verify as verify_stage
from flows.manifests import write as write_stage
from moe_core.ckpt.dcp_read import REFUSAL, load, quiet, read_metadata
from moe_core.cli import main
from moe_core.config import ConfigError, DataConfig
from moe_core.convert.hf import INDEX, OUR_CONFIG, load_hf, save_hf
from moe_core.convert.native import WEIGHTS, save_model_dir
from moe_core.data.dataset import TokenDataset
from moe_core.data.errors import DataError
from moe_core.data.manifest import MANIFEST, verify_data_dir
from moe_core.data.shards import shard_problem
from moe_core.errors import CheckpointError
from moe_core.files import file_sha256, inside
from moe_core.model import build_model

TINY = [*BASE, "model.n_layers=2"]
ALLOWED = "only a relative path to a file inside"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {
        str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
    }


def printed(capsys) -> str:
    return capsys.readouterr().out.replace("\n", "")


# ---- the path rule ---------------------------------------------------------------------------


def test_inside_keeps_files_of_the_folder_and_refuses_every_way_out(tmp_path):
    folder = tmp_path / "folder"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a").write_text("a")
    (tmp_path / "secret").write_text("s")
    (folder / "out").symlink_to(tmp_path / "secret")
    (folder / "loop").symlink_to(folder / "loop")
    assert inside(folder, "sub/a", "m.json") == folder / "sub" / "a"
    for bad in (
        "sub/../sub/a",
        "../secret",
        str(tmp_path / "secret"),
        "out",
        "loop",
        "",
        ".",
        "sub/..",
        3,
        None,
    ):
        with pytest.raises(ValueError) as err:
            inside(folder, bad, "m.json")
        assert str(err.value) == (
            f"m.json names {bad!r}, which is not allowed: {ALLOWED} {folder} (no .., no "
            "absolute path, no symlink leading out) is read."
        )


# ---- empty folders ---------------------------------------------------------------------------


@pytest.mark.parametrize(("override", "value"), [("out_dir=", ""), ("out_dir='  '", "  ")])
def test_an_empty_out_dir_is_refused_before_anything_is_written(
    override, value, tmp_path, monkeypatch, capsys
):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    assert main(["train", *TINY, override]) == 2
    sentence = f"out_dir={value!r} is not allowed: a folder path (it is empty or blank: an unset"
    assert sentence in printed(capsys)
    assert list(cwd.iterdir()) == [], "nothing written into the current folder"


def test_an_empty_data_dir_or_run_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"data\.dir=' ' is not allowed: a folder path"):
        DataConfig(kind="tokens", dir=" ")
    for value in ("", "\t"):
        sentence = re.escape(f"run_dir={value!r} is not allowed: a folder path")
        with pytest.raises(ConfigError, match=sentence):
            split_run_dir([f"run_dir={value}", "train.steps=1"], "runs/x")
        with pytest.raises(ConfigError, match=sentence):
            run_root(value)
    assert list(tmp_path.iterdir()) == []


# ---- data manifests --------------------------------------------------------------------------


def data_dir(tmp_path: Path) -> Path:
    return write_token_dir(tmp_path / "data", {"train": np.arange(300)}, shard_tokens=100)


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_a_data_manifest_naming_a_shard_outside_its_folder_is_refused(how, tmp_path):
    data = data_dir(tmp_path)
    outside = tmp_path / "outside.npy"
    shutil.copy(data / "train-00001.npy", outside)
    manifest = json.loads((data / MANIFEST).read_text())
    shards = manifest["splits"]["train"]["shards"]
    if how == "symlink":
        (data / "train-00001.npy").unlink()
        (data / "train-00001.npy").symlink_to(outside)
        bad = "train-00001.npy"
    else:
        bad = "../outside.npy" if how == "parent" else str(outside)
        shards[1]["file"] = bad
        (data / MANIFEST).write_text(json.dumps(manifest))
    before = snapshot(tmp_path)
    for read in (verify_data_dir, lambda d: TokenDataset(d, "train", 8)):
        with pytest.raises(DataError) as err:
            read(data)
        assert str(err.value) == (
            f"{data / MANIFEST} names {bad!r}, which is not allowed: {ALLOWED} {data} (no .., no "
            "absolute path, no symlink leading out) is read."
        )
    assert snapshot(tmp_path) == before


def test_a_data_tokenizer_reached_through_a_symlink_out_is_refused(tmp_path):
    data = data_dir(tmp_path)
    shutil.move(data / "tokenizer.json", tmp_path / "tokenizer.json")
    (data / "tokenizer.json").symlink_to(tmp_path / "tokenizer.json")
    with pytest.raises(DataError, match=re.escape(f"{data} names 'tokenizer.json', which is not")):
        verify_data_dir(data)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda m: m.pop("splits"), "lacks splits (a mapping)"),
        (lambda m: m["splits"].pop("validation"), "lacks splits.validation (a mapping)"),
        (
            lambda m: m["splits"]["train"]["shards"][0].pop("file"),
            "lacks splits.train.shards[0].file (a string)",
        ),
        (
            lambda m: m["splits"]["train"]["shards"][0].update(tokens="100"),
            "has '100' at splits.train.shards[0].tokens (an integer)",
        ),
        (
            lambda m: m["splits"]["train"].update(shards=["train-00000.npy"]),
            "has 'train-00000.npy' at splits.train.shards[0] (a mapping)",
        ),
        (lambda m: m["tokenizer"].update(sha256=None), "has None at tokenizer.sha256 (a string)"),
        (lambda m: m.update(dtype="junk"), "has 'junk' at dtype (uint16 or uint32)"),
    ],
    ids=["no-splits", "no-validation", "no-file", "tokens-text", "shard-text", "no-sha", "dtype"],
)
def test_a_data_manifest_missing_its_shard_list_is_one_sentence(damage, problem, tmp_path):
    data = data_dir(tmp_path)
    manifest = json.loads((data / MANIFEST).read_text())
    damage(manifest)
    (data / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError) as err:
        verify_data_dir(data)
    assert str(err.value) == (
        f"{data / MANIFEST} {problem}, so it is not a manifest moe tokenize wrote: tokenize the "
        "corpus again into a new data.dir."
    )


def test_training_on_a_manifest_naming_a_shard_elsewhere_is_refused(tmp_path, monkeypatch, capsys):
    data = write_token_dir(
        tmp_path / "data",
        {"train": np.arange(4000) % 256, "validation": np.arange(2000) % 256},
        shard_tokens=1000,
        vocab_size=256,
    )
    shutil.copy(data / "train-00001.npy", tmp_path / "elsewhere.npy")
    manifest = json.loads((data / MANIFEST).read_text())
    manifest["splits"]["train"]["shards"][1]["file"] = "../elsewhere.npy"
    (data / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    out = tmp_path / "run"
    args = [*TINY, "data.kind=tokens", f"data.dir={data}"]
    assert main(["train", *args, f"out_dir={out}"]) == 2
    text = printed(capsys)
    assert f"{data / MANIFEST} names '../elsewhere.npy', which is not allowed: {ALLOWED}" in text
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("run/")} == before


@pytest.mark.parametrize(
    "content",
    [
        "[]",
        '{"key": "k", "files": []}',
        '{"key": "k", "files": {"data/a": 5}}',
        '{"key": "k", "files": {}}',  # a hand-edited one without its summary (a traceback once)
        '{"key": "k", "files": {}, "summary": [1]}',
        '{"key": ["k"], "files": {}, "summary": {}}',  # a TypeError once
    ],
)
def test_a_stage_manifest_without_its_file_list_reruns_the_stage(content, tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "tokenize.json").write_text(content)
    record, why = verify_stage(tmp_path, "tokenize", "k")
    assert record is None
    assert why in (
        "no manifest",
        "its manifest does not list its files",
        "its manifest holds no summary",
        "its inputs or config changed",
    )


def test_a_rerun_of_tokenize_never_keeps_a_shard_leading_out_of_its_folder(tmp_path):
    data = data_dir(tmp_path)
    outside = tmp_path / "outside.npy"
    shutil.move(data / "train-00001.npy", outside)
    (data / "train-00001.npy").symlink_to(outside)
    assert shard_problem(data, "train-00001.npy", 100, "", "uint32") == (
        f"shard train-00001.npy of {data} leads outside it"
    )
    before = outside.read_bytes()
    data_dir(tmp_path)  # the same shards again: the real shard writer's rerun
    assert not (data / "train-00001.npy").is_symlink() and outside.read_bytes() == before
    assert (data / "train-00001.npy").read_bytes() == before


def test_a_stage_manifest_of_files_inside_the_run_still_verifies(tmp_path):
    run = tmp_path / "run"
    (run / "data" / "sub").mkdir(parents=True)
    (run / "data" / "sub" / "a").write_text("a")
    files = checksums(run, [run / "data"])
    write_stage(run, "tokenize", "k", files, {"n": 1})
    record, why = verify_stage(run, "tokenize", "k")
    assert why == "" and record["files"] == files == {"data/sub/a": files["data/sub/a"]}


def test_a_stage_manifest_naming_a_file_outside_the_run_reruns_the_stage(tmp_path):
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    (tmp_path / "secret").write_text("s")
    info = {"bytes": 1, "sha256": file_sha256(tmp_path / "secret")}
    write_stage(run, "tokenize", "k", {"../secret": info}, {})
    record, why = verify_stage(run, "tokenize", "k")
    assert record is None
    assert why == "its manifest names '../secret', a path outside the run folder"


def test_a_run_whose_data_folder_links_to_another_disk_still_verifies(tmp_path):
    """A link the user made inside the run (data or checkpoints on a bigger disk) is theirs:
    the stage is not redone for it."""
    run, disk = tmp_path / "run", tmp_path / "disk"
    (disk / "sub").mkdir(parents=True)
    (disk / "sub" / "a").write_text("a")
    run.mkdir()
    (run / "data").symlink_to(disk)
    files = {"data/sub/a": {"bytes": 1, "sha256": file_sha256(disk / "sub" / "a")}}
    write_stage(run, "tokenize", "k", files, {})
    assert verify_stage(run, "tokenize", "k")[1] == ""


# ---- Hugging Face folders --------------------------------------------------------------------


def hf_dir(tmp_path: Path, ours: bool = True) -> Path:
    cfg = small_config()
    out = save_hf(build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "hf", max_shard_bytes=1e5)
    if not ours:  # as transformers writes it: config.json only
        (out / OUR_CONFIG).unlink()
    return out


def refused_from_hf(tmp_path: Path, capsys) -> str:
    """The printed refusal of ``moe convert from-hf``; nothing was written anywhere."""
    before = snapshot(tmp_path)
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    text = printed(capsys)
    assert text.startswith("error: ") and "Traceback" not in text
    assert not (tmp_path / "out").exists() and snapshot(tmp_path) == before
    return text


@pytest.mark.parametrize("name", ["shard", "index", OUR_CONFIG, "config.json"])
def test_hf_files_reached_through_a_symlink_out_of_their_folder_are_refused(name, tmp_path, capsys):
    src = hf_dir(tmp_path, ours=name != "config.json")
    (tmp_path / "elsewhere").mkdir()
    file = {"shard": sorted(src.glob("model-*.safetensors"))[0].name, "index": INDEX}.get(
        name, name
    )
    moved = tmp_path / "elsewhere" / file
    shutil.move(src / file, moved)
    (src / file).symlink_to(moved)
    named_by = src / INDEX if name == "shard" else src
    assert f"{named_by} names {file!r}, which is not allowed: {ALLOWED} {src}" in (
        refused_from_hf(tmp_path, capsys)
    )


def test_an_hf_hub_snapshot_whose_files_link_into_its_blobs_converts(tmp_path):
    """The hub cache's layout: a snapshot's files are symlinks into the repo's blobs."""
    src = hf_dir(tmp_path)
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot_dir, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot_dir.mkdir(parents=True)
    blobs.mkdir()
    for f in src.iterdir():
        shutil.copy(f, blobs / f.name)
        (snapshot_dir / f.name).symlink_to(Path("../../blobs") / f.name)
    _, theirs = load_hf(snapshot_dir)
    _, ours = load_hf(src)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_an_hf_index_naming_a_path_elsewhere_is_refused(tmp_path, capsys):
    src = hf_dir(tmp_path)
    index = json.loads((src / INDEX).read_text())
    for bad in ("../elsewhere.safetensors", "/etc/hostname", 3):
        index["weight_map"] = dict.fromkeys(index["weight_map"], bad)
        (src / INDEX).write_text(json.dumps(index))
        text = refused_from_hf(tmp_path, capsys)
        assert f"{src / INDEX} names {bad!r}, which is not allowed: {ALLOWED}" in text


def test_an_hf_shard_missing_or_a_tensor_held_twice_is_one_sentence(tmp_path, capsys):
    """A shard the index names but the folder lacks (a cut-short download) is named with the
    index; a tensor in two shards was read from whichever came last, silently."""
    src = hf_dir(tmp_path)
    shards = sorted(src.glob("model-*.safetensors"))
    first, last = shards[0], shards[-1]
    a, b = load_file(str(first)), load_file(str(last))
    name = sorted(a)[0]
    save_file(b | {name: a[name] + 1}, str(last), metadata={"format": "pt"})
    text = refused_from_hf(tmp_path, capsys)
    assert f"{src} holds {name} twice, in {first.name} and in {last.name}, which is not" in text
    last.unlink()
    text = refused_from_hf(tmp_path, capsys)
    assert f"{src / INDEX} names {last.name!r}, which is not in {src}: the folder is" in text


def test_an_hf_folder_without_safetensors_weights_says_only_those_are_read(tmp_path, capsys):
    """A folder of pickled weights was told to fix its config's sizes (from-hf) or ended in a
    bare file-not-found (load_model, init.from_hf)."""
    src = hf_dir(tmp_path)
    for f in [*src.glob("model-*.safetensors"), src / INDEX]:
        f.unlink()
    (src / "pytorch_model.bin").write_bytes(b"pickled")
    text = refused_from_hf(tmp_path, capsys)
    assert f"error: {src} holds neither model.safetensors nor {INDEX}: only safetensors" in text


def test_an_exports_config_json_changed_afterwards_is_refused_not_ignored(tmp_path, capsys):
    """Import reads moe_core_config.json: a config.json edited since (another RoPE base) was
    ignored, so the model computed other than transformers does from the same folder."""
    src = hf_dir(tmp_path)
    hf = json.loads((src / "config.json").read_text())
    hf["rope_theta"] = hf.get("rope_theta", 10000.0) * 2
    hf.pop("rope_parameters", None)
    (src / "config.json").write_text(json.dumps(hf))
    text = refused_from_hf(tmp_path, capsys)
    assert f"{src / 'config.json'} describes model.rope_theta={hf['rope_theta']!r} but " in text
    assert f"remove {OUR_CONFIG} to import config.json as it is." in text


def test_an_hf_folder_as_transformers_writes_it_still_converts(tmp_path):
    cfg = small_config()
    model = build_model(cfg, seed=3)
    theirs, state = load_hf(hf_dir(tmp_path, ours=False))
    # what the class computes: the load-balancing term's weight per layer as a mean, no z-loss
    layers = cfg.n_layers if cfg.aux_loss_reduction == "sum" else 1
    per_layer = dict(aux_loss_coef=cfg.aux_loss_coef * layers, aux_loss_reduction="mean")
    assert dataclasses.replace(theirs, name=cfg.name) == dataclasses.replace(
        cfg, **per_layer, z_loss_coef=0.0
    )
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("change", "sentence"),
    [
        ({"hidden_size": "64"}, "hidden_size='64' in {cfg} is not allowed: an integer."),
        ({"num_experts": None}, "{cfg} has no num_experts, which an OLMoE config.json must give"),
        ({"num_experts_per_tok": True}, "num_experts_per_tok=True in {cfg} is not allowed: an "),
        ({"rms_norm_eps": [1]}, "rms_norm_eps=[1] in {cfg} is not allowed: a number."),
        (
            {"rope_parameters": {"rope_theta": "big"}},
            "rope_theta='big' in {cfg} is not allowed: a number.",
        ),
        ({"rope_parameters": 5}, "rope_parameters=5 in {cfg} is not allowed: a mapping."),
        ({"norm_topk_prob": 1}, "norm_topk_prob=1 in {cfg} is not allowed: true or false."),
        ({"num_experts_per_tok": 99}, "{cfg} describes a model moe_core cannot build: model.top_k"),
    ],
)
def test_an_hf_config_with_wrong_types_or_missing_keys_is_one_sentence(
    change, sentence, tmp_path, capsys
):
    src = hf_dir(tmp_path, ours=False)
    hf = json.loads((src / "config.json").read_text())
    hf.update(change)
    hf = {k: v for k, v in hf.items() if v is not None}
    (src / "config.json").write_text(json.dumps(hf))
    assert sentence.format(cfg=src / "config.json") in refused_from_hf(tmp_path, capsys)


def test_an_hf_source_that_is_no_checkpoint_folder_says_so(tmp_path, capsys):
    for src, what in (
        (tmp_path / "nothere", "is not a folder"),
        (tmp_path / "empty", "has no config.json"),
    ):
        if what == "has no config.json":
            src.mkdir()
        assert main(["convert", "from-hf", str(src), str(tmp_path / "out")]) == 2
        assert printed(capsys) == (
            f"error: {src} {what}: give the folder of a Hugging Face checkpoint (config.json "
            "and its safetensors weights, as save_pretrained writes it)."
        )
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("content", [b"[1, 2]", b"{not json", b"\xff\xfe"])
def test_an_hf_config_that_is_no_json_object_is_one_sentence(content, tmp_path, capsys):
    src = hf_dir(tmp_path)
    (src / OUR_CONFIG).write_bytes(content)
    text = refused_from_hf(tmp_path, capsys)
    assert f"{src / OUR_CONFIG} " in text and ("not valid JSON" in text or "no JSON object" in text)


def test_a_truncated_safetensors_file_is_one_sentence(tmp_path, capsys):
    src = hf_dir(tmp_path)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-10])
    assert f"{shard} is not a readable safetensors file (" in refused_from_hf(tmp_path, capsys)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16])
def test_integer_or_mixed_dtype_weights_are_refused_not_written(dtype, tmp_path, capsys):
    src = hf_dir(tmp_path)
    shard = sorted(src.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = tensors[name].to(dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    text = refused_from_hf(tmp_path, capsys)
    if dtype == torch.int32:
        assert f"{shard} holds {name} as I32, which is not allowed: weights are float32," in text
    else:
        assert f"{shard} holds {name} as BF16 but " in text and " as F32, which is not" in text


@pytest.mark.parametrize("damage", ["missing", "int32", "cut", "no json", "list", "bad value"])
def test_a_damaged_model_folder_is_one_sentence_on_export(damage, tmp_path, capsys):
    """A model folder missing a tensor, holding integer weights, cut short, or whose config is
    no JSON object ended to-hf (and load_model) in a traceback."""
    cfg = small_config()
    ours = save_model_dir(build_model(cfg).state_dict(), cfg, tmp_path / "ours")
    tensors = load_file(str(ours / WEIGHTS))
    name = sorted(tensors)[0]
    if damage == "missing":
        del tensors[name]
    elif damage == "int32":
        tensors[name] = tensors[name].to(torch.int32)
    if damage in ("missing", "int32"):
        save_file(tensors, str(ours / WEIGHTS))
    if damage == "cut":
        (ours / WEIGHTS).write_bytes((ours / WEIGHTS).read_bytes()[:-10])
    config = {"no json": "{not json", "list": "[1]", "bad value": '{"d_model": "x"}'}
    if damage in config:
        (ours / OUR_CONFIG).write_text(config[damage])
    assert main(["convert", "to-hf", str(ours), str(tmp_path / "hf"), "--no-tokenizer"]) == 2
    text = printed(capsys)
    assert text.startswith("error: ") and not (tmp_path / "hf").exists()
    expected = {
        "missing": f"the weights do not match the model config: missing ['{name}']",
        "int32": "the weights hold float32, int32, which is not allowed: one of float32,",
        "cut": f"{ours / WEIGHTS} is not a readable safetensors file (",
        "no json": f"{ours / OUR_CONFIG} is not valid JSON (",
        "list": f"{ours / OUR_CONFIG} holds no JSON object",
        "bad value": f"{ours / OUR_CONFIG} describes a model moe_core cannot build: model.d_model=",
    }
    assert expected[damage] in text


def test_an_export_never_copies_files_reached_through_a_symlink_out(tmp_path, capsys):
    cfg = small_config()
    ours = save_model_dir(build_model(cfg).state_dict(), cfg, tmp_path / "ours")
    (tmp_path / "secret").write_text("private")
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").symlink_to(tmp_path / "secret")
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(ours), str(hf), "--tokenizer", str(tok)]) == 2
    assert f"{tok} names 'tokenizer.json', which is not allowed: {ALLOWED} {tok}" in (
        printed(capsys)
    )
    assert not hf.exists()
    shutil.move(ours / WEIGHTS, tmp_path / WEIGHTS)
    (ours / WEIGHTS).symlink_to(tmp_path / WEIGHTS)
    assert main(["convert", "to-hf", str(ours), str(hf), "--no-tokenizer"]) == 2
    assert f"{ours} names {WEIGHTS!r}, which is not allowed" in printed(capsys)
    assert not hf.exists()


@pytest.mark.parametrize("out", ["", " "])
def test_convert_into_an_empty_out_is_refused(out, tmp_path, monkeypatch, capsys):
    src = hf_dir(tmp_path)
    monkeypatch.chdir(tmp_path / "hf")  # not empty, so --overwrite would have written here
    before = snapshot(tmp_path)
    assert main(["convert", "from-hf", str(src), out, "--overwrite"]) == 2
    assert f"OUT={out!r} is not allowed: a folder path" in printed(capsys)
    assert snapshot(tmp_path) == before


# ---- DCP metadata ----------------------------------------------------------------------------


def dcp_dir(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    with quiet():
        dcp.save({"w": torch.arange(4.0)}, checkpoint_id=str(path), no_dist=True)
    return path


def test_a_dcp_metadata_file_reached_through_a_symlink_out_is_refused(tmp_path):
    ckpt = dcp_dir(tmp_path)
    shutil.move(ckpt / ".metadata", tmp_path / "elsewhere.metadata")
    (ckpt / ".metadata").symlink_to(tmp_path / "elsewhere.metadata")
    with pytest.raises(CheckpointError, match=re.escape(f"{ckpt} names '.metadata', which is")):
        read_metadata(ckpt)


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_dcp_metadata_naming_a_file_outside_the_checkpoint_is_refused(how, tmp_path):
    ckpt = dcp_dir(tmp_path)
    (tmp_path / "secret.distcp").write_bytes(b"s")
    meta = pickle.loads((ckpt / ".metadata").read_bytes())  # our own file: trusted here
    info = next(iter(meta.storage_data.values()))
    bad = info.relative_path
    if how == "symlink":
        (ckpt / bad).unlink()
        (ckpt / bad).symlink_to(tmp_path / "secret.distcp")
    else:
        bad = "../secret.distcp" if how == "parent" else str(tmp_path / "secret.distcp")
        info.relative_path = bad
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as err:
        read_metadata(ckpt)
    assert str(err.value).startswith(
        f"{ckpt / '.metadata'} names {bad!r}, which is not allowed: {ALLOWED} {ckpt} "
    )
    assert snapshot(tmp_path) == before


def test_a_checkpoint_of_our_own_still_loads(tmp_path):
    ckpt = dcp_dir(tmp_path)
    state = {"w": torch.zeros(4)}
    with quiet():
        load(state, ckpt, no_dist=True)
    assert torch.equal(state["w"], torch.arange(4.0))


class Call:
    """A pickle that calls an allowed global with the given arguments."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return (self.fn, self.args)


@pytest.mark.parametrize(
    "payload",
    [
        Call(torch.serialization._get_layout, "torch.no_such_layout"),
        Call(MetadataIndex, 1, 2, 3, 4, 5),
        Call(collections.OrderedDict, 5),
        Call(collections.OrderedDict, [1, 2]),
        Call(_MEM_FORMAT_ENCODING, 99),
        Call(torch.Size, ["a"]),
    ],
    ids=["layout", "index", "odict-int", "odict-list", "memformat", "size"],
)
def test_dcp_metadata_calling_an_allowed_global_badly_is_one_sentence(payload, tmp_path):
    ckpt = dcp_dir(tmp_path)
    (ckpt / ".metadata").write_bytes(pickle.dumps(payload))
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as err:
        read_metadata(ckpt)
    text = str(err.value)
    assert text.startswith(f"{ckpt / '.metadata'} asks to load something unreadable (")
    assert text.endswith(f"which checkpoint metadata never needs: {REFUSAL}.")
    assert "\n" not in text and snapshot(tmp_path) == before


def test_dcp_metadata_cut_short_or_malformed_is_one_sentence(tmp_path):
    ckpt = dcp_dir(tmp_path)
    raw = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(CheckpointError, match="asks to load something unreadable"):
        read_metadata(ckpt)
    for field, value, sentence in (
        ("storage_data", None, "holds no storage map of tensors to files"),
        ("state_dict_metadata", [], "holds no map of the checkpoint's entries"),
        ("offset", "0", "stores a tensor at offset and length ('0', "),
        ("length", -1, "stores a tensor at offset and length (0, -1), which is not allowed"),
    ):
        meta = pickle.loads(raw)
        info = next(iter(meta.storage_data.values()))
        setattr(info if field in ("offset", "length") else meta, field, value)
        (ckpt / ".metadata").write_bytes(pickle.dumps(meta))
        with pytest.raises(CheckpointError, match=re.escape(sentence)):
            read_metadata(ckpt)
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(dcp_dir(tmp_path / "again")))


def test_a_write_that_finds_the_disk_full_leaves_no_partial_temporary(tmp_path):
    """``atomic_write`` cut short (here by a file size limit, as a full disk would) removes its
    hidden temporary, which would otherwise hold the space the user must free; the old file
    stays whole."""
    import resource
    import subprocess
    import sys

    (tmp_path / "manifest.json").write_bytes(b"old")
    code = (
        "import resource, signal, sys; from pathlib import Path; "
        "from moe_core.files import atomic_write; "
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "  # write() fails instead
        f"resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, {resource.RLIM_INFINITY})); "
        "atomic_write(Path(sys.argv[1]) / 'manifest.json', b'x' * (1 << 17))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True)
    assert done.returncode != 0 and b"File too large" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]
    assert (tmp_path / "manifest.json").read_bytes() == b"old"
