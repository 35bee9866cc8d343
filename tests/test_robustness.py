"""Nothing lost, nothing silently wrong: each test gives a hostile or unlucky input (a foreign or
corrupt checkpoint, another model, a non-finite setting, flipped bytes, a second run, a full
disk) and checks both the one-sentence refusal and that nothing already written changed."""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import shutil
import socket
import string
import subprocess
import typing
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import BASE, lock_held_elsewhere, small_config, write_token_dir
from rich.console import Console

from moe_core.cli import main
from moe_core.compose import compose_run
from moe_core.config import ConfigError, DataConfig, ParallelConfig, RunConfig
from moe_core.config_dict import from_dict
from moe_core.convert.hf import INDEX, OUR_CONFIG, load_hf, save_hf
from moe_core.convert.native import WEIGHTS, save_model_dir
from moe_core.data.errors import DataError
from moe_core.data.sources import open_source
from moe_core.data.tokenize import (
    MAX_TRAINING_RUN,
    _training_texts,
    tokenize_corpus,
    validation_phase,
)
from moe_core.data.tokenizer import load_tokenizer
from moe_core.errors import CheckpointError, RunFileError
from moe_core.model import build_model
from moe_core.parallel.mesh import Mesh
from moe_core.rundir import LOCK
from moe_core.train.checkpoint import (
    MANIFEST,
    Checkpointer,
    newest_verified,
    run_id_of,
    step_dir_name,
    verify,
)
from moe_core.train.guards import TrainingHaltedError
from moe_core.train.trainer import Trainer

TINY = [*BASE, "model.n_layers=2"]


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {
        str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
    }


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# ---- checkpoint retention ------------------------------------------------------------------


def test_retention_never_deletes_another_runs_or_unverified_checkpoints(tmp_path):
    """Pruning after each save keeps ``keep_last`` of this run's valid checkpoints; a newer
    foreign checkpoint, an older run's and a corrupt one of this run are all left alone."""
    root, mesh = tmp_path / "checkpoints", Mesh(ParallelConfig())
    state = {"x": torch.arange(1000, dtype=torch.float32)}
    earlier = Checkpointer(root, mesh, keep_last=0, keep_every=0, use_async=False, run_id="a")
    for step in (1, 2, 3):
        earlier.save(step, state, {})
    shutil.copytree(root / "step_00000003", root / "step_00000090")  # a newer entry, run "a"
    before = snapshot(root)

    ours = Checkpointer(root, mesh, keep_last=1, keep_every=0, use_async=False, run_id="b")
    for step in (4, 5, 6):
        ours.save(step, state, {})
    victim = max((root / "step_00000006").glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(victim.read_bytes()[:-8])  # this run's newest is now corrupt
    for step in (7, 8):
        ours.save(step, state, {})

    assert names(root) == [step_dir_name(s) for s in (1, 2, 3, 6, 8, 90)]
    assert {k: v for k, v in snapshot(root).items() if k in before} == before, "run a unchanged"
    assert verify(root / "step_00000006") is not None, "the corrupt one is kept, not deleted"
    assert run_id_of(root / "step_00000008") == "b" and run_id_of(root / "step_00000090") == "a"


def saved_run(root: Path, steps: tuple[int, ...], run_id: str = "a") -> None:
    """Checkpoints ``steps`` of one run under ``root``, written by the Checkpointer."""
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, use_async=False, run_id=run_id)
    for step in steps:
        ckpt.save(step, {"x": torch.arange(1000, dtype=torch.float32) + step}, {})


def test_a_folder_renamed_to_another_step_is_skipped_and_retention_keeps_the_real_ones(
    tmp_path, capsys
):
    """A copy of step 1 named step 9 claims to be the newest: resume skips it with a sentence
    and retention orders by the verified steps, so steps 3 and 4 survive ``keep_last=2``."""
    root = tmp_path / "checkpoints"
    saved_run(root, (1, 2, 3))
    shutil.copytree(root / step_dir_name(1), root / step_dir_name(9))
    renamed = snapshot(root / step_dir_name(9))
    said: list[str] = []
    assert newest_verified(root, said.append) == root / step_dir_name(3)
    assert said == [
        "skipping checkpoint step_00000009: step_00000009/manifest.json says step 1, not the "
        "9 its folder name says"
    ]
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 2, 0, use_async=False, run_id="a")
    ckpt.save(4, {"x": torch.zeros(1000)}, {})
    assert names(root) == [step_dir_name(s) for s in (3, 4, 9)]
    assert snapshot(root / step_dir_name(9)) == renamed, "reported, not deleted"
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(root / step_dir_name(9)), str(hf), "--no-tokenizer"]) == 2
    why = said[0].removeprefix("skipping checkpoint step_00000009: ")
    assert f"checkpoint {root / step_dir_name(9)} does not verify ({why}): not converted." in (
        capsys.readouterr().out.replace("\n", "")
    )
    assert not hf.exists()


@pytest.mark.parametrize("listing", ["none", "partial", "flipped"])
def test_a_manifest_that_does_not_list_every_file_never_verifies(tmp_path, listing):
    """``files: {}``, or a listing without one data file (here with a byte flipped in it):
    the checkpoint does not verify and resume takes the older one; nothing is changed."""
    root = tmp_path / "checkpoints"
    saved_run(root, (1, 2))
    newest = root / step_dir_name(2)
    manifest = json.loads((newest / MANIFEST).read_text())
    data = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if listing == "none":
        manifest["files"] = {}
    else:
        del manifest["files"][data.name]
    if listing == "flipped":
        raw = bytearray(data.read_bytes())
        raw[-9] ^= 0xFF
        data.write_bytes(bytes(raw))
    (newest / MANIFEST).write_text(json.dumps(manifest))
    before = snapshot(root)
    why = verify(newest)
    if listing == "none":
        assert why == "step_00000002/manifest.json lists no files"
    else:
        assert why == f"step_00000002/{data.name} is not listed in its manifest.json"
    said: list[str] = []
    assert newest_verified(root, said.append) == root / step_dir_name(1)
    assert said == [f"skipping checkpoint step_00000002: {why}"]
    assert snapshot(root) == before


def test_a_step_past_eight_digits_is_found_again(tmp_path):
    root = tmp_path / "checkpoints"
    saved_run(root, (99_999_999, 100_000_000))
    assert names(root) == ["step_100000000", "step_99999999"]
    assert newest_verified(root) == root / "step_100000000"
    assert step_dir_name(7) == "step_00000007"  # the folders written so far keep their names


@pytest.mark.slow
def test_a_new_run_sets_the_earlier_runs_outputs_aside_and_prunes_only_its_own(tmp_path):
    """``train.resume=false`` in a folder with an earlier run: that run's checkpoints, metrics
    and model move to ``*.superseded-1`` unchanged; the new run prunes only its own."""
    first = [*TINY, "train.steps=3", "train.checkpoint_every=1", "train.keep_last=0"]
    Trainer(compose_run([*first, f"out_dir={tmp_path}"])).fit(show_progress=False)
    before = {
        p: snapshot(tmp_path / p) if (tmp_path / p).is_dir() else (tmp_path / p).read_bytes()
        for p in ("checkpoints", "model", "metrics.jsonl", "checkpoints.jsonl")
    }
    old_id = run_id_of(tmp_path / "checkpoints" / "step_00000003")

    console = Console(record=True, width=300)
    second = [*TINY, "train.steps=2", "train.checkpoint_every=1", "train.keep_last=1"]
    trainer = Trainer(
        compose_run([*second, "train.resume=false", f"out_dir={tmp_path}"]), console=console
    )
    assert trainer.step == 0 and trainer.resumed_from is None
    trainer.fit(show_progress=False)

    text = console.export_text()
    assert f"starting a new run in {tmp_path} (train.resume=false)" in text
    assert "checkpoints, checkpoints.jsonl, metrics.jsonl, model moved to *.superseded-1" in text
    assert snapshot(tmp_path / "checkpoints.superseded-1") == before["checkpoints"]
    assert snapshot(tmp_path / "model.superseded-1") == before["model"]
    assert (tmp_path / "metrics.jsonl.superseded-1").read_bytes() == before["metrics.jsonl"]
    costs = tmp_path / "checkpoints.jsonl.superseded-1"
    assert costs.read_bytes() == before["checkpoints.jsonl"]
    ckpts = tmp_path / "checkpoints"
    assert names(ckpts) == ["step_00000002"]  # keep_last=1 of the new run
    assert verify(ckpts / "step_00000002") is None
    assert run_id_of(ckpts / "step_00000002") not in (None, old_id)
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_a_resumed_run_continues_its_checkpoints_run_id(tmp_path):
    args = [*TINY, "train.checkpoint_every=1", "train.keep_last=2", f"out_dir={tmp_path}"]
    Trainer(compose_run([*args, "train.steps=2"])).fit(show_progress=False)
    ckpts = tmp_path / "checkpoints"
    run = run_id_of(ckpts / "step_00000002")
    manifest = json.loads((ckpts / "step_00000002" / MANIFEST).read_text())
    assert manifest["run_id"] == run and run
    Trainer(compose_run([*args, "train.steps=4"])).fit(show_progress=False)
    assert names(ckpts) == ["step_00000003", "step_00000004"]  # its own older ones pruned
    assert {run_id_of(ckpts / n) for n in names(ckpts)} == {run}


# ---- another model -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, mismatch",
    [
        ("model.d_model=64", "embed.weight is (4096, 128) there, (4096, 64) here"),
        ("model.n_layers=4", "layers.2.attn_norm.weight (128,) is missing there"),
        (
            "model.expert_hidden=512",
            "layers.0.moe.experts.w_gate_up is (8, 512, 128) there, (8, 1024, 128) here",
        ),
    ],
)
def test_resume_into_another_model_is_refused_naming_the_first_mismatch(
    override, mismatch, tmp_path
):
    args = [*TINY, "train.steps=1", f"out_dir={tmp_path}"]
    Trainer(compose_run(args)).fit(show_progress=False)
    before = snapshot(tmp_path)
    with pytest.raises(CheckpointError) as err:
        Trainer(compose_run([*args, "train.steps=2", override]))
    text = str(err.value)
    assert f"checkpoint {tmp_path / 'checkpoints' / 'step_00000001'} was written for" in text
    assert f"another model ({mismatch}): resume it with the model settings" in text
    assert "\n" not in text
    assert snapshot(tmp_path) == before, "nothing changed"


def hf_dir(tmp_path: Path) -> Path:
    cfg = small_config()
    return save_hf(build_model(cfg, seed=3).state_dict(), cfg, tmp_path / "hf")


def test_hf_index_pointing_outside_its_folder_is_refused(tmp_path, capsys):
    src = hf_dir(tmp_path)
    secret = tmp_path / "elsewhere.safetensors"
    shutil.copy(next(src.glob("model-*.safetensors")), secret)
    index = json.loads((src / INDEX).read_text())
    for target in ("../elsewhere.safetensors", str(secret)):
        index["weight_map"] = dict.fromkeys(index["weight_map"], target)
        (src / INDEX).write_text(json.dumps(index))
        assert main(["convert", "from-hf", str(src), str(tmp_path / "out")]) == 2
        out = capsys.readouterr().out.replace("\n", "")
        assert f"{src / INDEX} names '{target}', which is not allowed: only a relative" in out
        assert not (tmp_path / "out").exists()


def test_conversion_of_weights_that_do_not_fit_their_config_is_refused(tmp_path, capsys):
    src = hf_dir(tmp_path)
    (src / OUR_CONFIG).unlink()  # config.json alone describes the model
    theirs = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**theirs, "intermediate_size": 64}))
    assert main(["convert", "from-hf", str(src), str(tmp_path / "back")]) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert "does not hold the model its config.json describes" in out
    assert "model.layers.0.mlp.experts.0.gate_proj.weight is (32, 64) there, (64, 64) here" in out
    assert not (tmp_path / "back").exists()

    cfg = small_config()
    state = build_model(cfg).state_dict()
    save_model_dir(state, small_config(d_model=32), tmp_path / "ours")
    to_hf = ["convert", "to-hf", str(tmp_path / "ours"), str(tmp_path / "hf2"), "--no-tokenizer"]
    assert main(to_hf) == 2
    out = capsys.readouterr().out.replace("\n", "")
    assert "the weights do not fit their model config (embed.weight is (256, 64) there" in out
    assert not (tmp_path / "hf2").exists()


# ---- non-finite values ---------------------------------------------------------------------


def float_fields() -> list[tuple[str, str]]:
    """(section, field) of every float option of the run config."""
    hints = typing.get_type_hints(RunConfig)
    out = []
    for section in dataclasses.fields(RunConfig):
        cls = hints[section.name]
        if not dataclasses.is_dataclass(cls):
            continue
        for name, tp in typing.get_type_hints(cls).items():
            if tp is float or float in typing.get_args(tp):
                out.append((section.name, name))
    return out


def test_every_float_option_refuses_nan_and_infinity():
    fields = float_fields()
    assert ("train", "lr") in fields and ("model", "rope_theta") in fields and len(fields) >= 20
    for section, name in fields:
        for value in (math.nan, math.inf, -math.inf):
            with pytest.raises(ConfigError) as err:
                from_dict(RunConfig, {section: {name: value}})
            assert str(err.value) == (
                f"{section}.{name}={value!r} is not allowed: a finite number."
            ), (section, name, value)


@pytest.mark.parametrize("override", ["train.lr=nan", "model.rope_theta=nan", "model.norm_eps=inf"])
def test_non_finite_overrides_fail_before_anything_runs(override, tmp_path, capsys):
    assert main(["train", *TINY, override, f"out_dir={tmp_path}"]) == 2
    key, value = override.split("=")
    out = capsys.readouterr().out
    assert f"{key}={value} is not allowed: a finite number." in out
    assert list(tmp_path.iterdir()) == [], "nothing was written"


def poisoned(args: list[str]) -> Trainer:
    """A trainer resumed from ``args``' out_dir whose weights then turn NaN in part (as an
    update with a bad setting, such as train.eps=0 on a never-used expert, would make them)."""
    trainer = Trainer(compose_run(args))
    trainer.optimizer.masters[0][:10] = float("nan")
    trainer.optimizer.publish_weights()
    return trainer


@pytest.mark.slow
def test_non_finite_weights_are_never_checkpointed_and_the_last_checkpoint_is_named(tmp_path):
    args = [*TINY, "train.checkpoint_every=1", "train.keep_last=0", f"out_dir={tmp_path}"]
    Trainer(compose_run([*args, "train.steps=2"])).fit(show_progress=False)
    ckpts = tmp_path / "checkpoints"
    before = snapshot(ckpts)
    newest = f"the newest valid checkpoint is {ckpts / 'step_00000002'}: resume from it after "
    cause = "fixing the cause (such as a lower train.lr or a larger train.eps)."
    state = "weights, Adam moments or router buffers hold NaN or infinity, so that state was not"

    periodic = poisoned([*args, "train.steps=8"])  # the step-3 checkpoint is refused
    with pytest.raises(TrainingHaltedError) as err:
        periodic.fit(show_progress=False)
    assert str(err.value) == f"at step 3 the {state} checkpointed; {newest}{cause}"
    assert snapshot(ckpts) == before

    halted = poisoned(
        [*args, "train.steps=8", "train.checkpoint_every=0", "train.max_consecutive_skips=2"]
    )
    with pytest.raises(TrainingHaltedError) as err:
        halted.fit(show_progress=False)
    assert str(err.value) == (
        "2 steps in a row had a non-finite loss or gradient norm (steps 2 to 3); at step 4 the "
        f"{state} checkpointed; {newest}{cause}"
    )
    assert snapshot(ckpts) == before, "no poisoned checkpoint, nothing lost"
    resumed = Trainer(compose_run([*args, "train.steps=3"]))
    assert resumed.step == 2
    assert all(torch.isfinite(p).all() for p in resumed.chunks[0].parameters())


# ---- corrupt data --------------------------------------------------------------------------


def token_data(tmp_path: Path) -> Path:
    """A data directory of in-vocabulary tokens (ids below 256) for a tiny token run."""
    rng = np.random.default_rng(0)
    splits = {s: rng.integers(0, 256, n) for s, n in (("train", 4000), ("validation", 700))}
    return write_token_dir(tmp_path / "data", splits, 1000, dtype="uint16", vocab_size=256)


def flip_bytes(shard: Path, value: int) -> None:
    """Overwrite the shard's tokens with ``value`` (size and header unchanged)."""
    array = np.load(shard, mmap_mode="r+")
    array[:] = value
    array.flush()


def token_run(data: Path, out: Path, *extra: str) -> list[str]:
    return [*TINY, "data.kind=tokens", f"data.dir={data}", f"out_dir={out}", *extra]


def test_flipped_shard_bytes_are_caught_at_train_start(tmp_path):
    data = token_data(tmp_path)
    console = Console(record=True, width=300)
    Trainer(compose_run(token_run(data, tmp_path / "ok")), console=console)
    text = console.export_text()
    assert "verified the sha256 of 5 shards (" in text
    assert "(data.verify_checksums=false skips this)" in text

    flip_bytes(data / "train-00002.npy", 7)  # ids still in the vocabulary: only a hash sees it
    before = snapshot(data)
    with pytest.raises(DataError) as err:
        Trainer(compose_run(token_run(data, tmp_path / "run")))
    text = str(err.value)
    assert f"shard train-00002.npy in {data} has sha256 " in text and "(corrupted)" in text
    assert "\n" not in text and snapshot(data) == before
    assert not (tmp_path / "run").exists(), "nothing was written"


def test_out_of_vocabulary_token_ids_stop_the_run_in_one_sentence(tmp_path, capsys):
    data = token_data(tmp_path)
    for shard in data.glob("train-*.npy"):
        flip_bytes(shard, 4000)  # below the model's 4096 rows: an embedding would take it
    out = tmp_path / "run"
    args = ["train", *token_run(data, out, "data.verify_checksums=false", "train.steps=2")]
    assert main(args) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert "data.verify_checksums=false: shard sha256 not checked" in printed
    assert "token id 4000 in shard train-0000" in printed
    assert "is not allowed: the tokenizer has ids 0 to 255, so the shard is corrupt" in printed
    assert "IndexError" not in printed and not list((out / "checkpoints").glob("step_*"))


def test_rows_without_the_text_field_are_reported_not_dropped_silently(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": "in the beginning"}, {"body": "no text"}, {"text": None}, {"text": "end"}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(kind="tokens", path=str(corpus), bpe_vocab_size=300, workers=1)
    console = Console(record=True, width=300)
    out = tokenize_corpus(cfg, tmp_path / "data", console=console)
    assert (
        "2 of 4 documents have no data.text_field='text' (missing or null; the first is document "
        "1) and were left out of the shards" in console.export_text()
    )
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["documents_without_text"] == {"count": 2, "first": 1}


# ---- one run per directory -----------------------------------------------------------------


@pytest.mark.slow
def test_a_second_run_is_refused_naming_the_holder_and_a_dead_holders_lock_is_taken_over(
    tmp_path, capsys
):
    out = tmp_path / "run"
    args = [*TINY, "train.checkpoint_every=1", f"out_dir={out}"]
    assert main(["train", *args, "train.steps=1"]) == 0
    capsys.readouterr()
    before = snapshot(out)
    del before[LOCK]  # the holder writes its name there
    with lock_held_elsewhere(out) as holder:
        assert main(["train", *args, "train.steps=2"]) == 2
        printed = capsys.readouterr().out.replace("\n", "")
        assert (
            f"{out} is in use by another run: process {holder.pid} on host "
            f"{socket.gethostname()} (a test holder, since " in printed
        )
        assert "wait for it to end (or stop it), or choose another directory." in printed
        assert {k: v for k, v in snapshot(out).items() if k != LOCK} == before, "nothing changed"

    console = Console(record=True, width=300)
    trainer = Trainer(compose_run([*args, "train.steps=2"]), console=console)
    assert f"took over the lock of process {holder.pid} on host" in console.export_text()
    assert trainer.step == 1
    trainer.fit(show_progress=False)
    assert trainer.step == 2 and (out / "checkpoints" / "step_00000002").is_dir()


# ---- a full disk, a cut-short log, an unusable out_dir -------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (a disk that fills up), where mounting one is permitted."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)]
    try:
        done = subprocess.run(mount, capture_output=True, text=True)
    except OSError as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


@pytest.mark.parametrize("use_async", [False, True])
def test_a_really_full_disk_while_checkpointing_is_one_sentence(small_disk, use_async):
    """torch's writer reports a write a full disk had no room for as ``unexpected pos``, its
    errno lost: still one sentence, the unfinished folder removed, step 1 untouched."""
    root = small_disk / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, use_async=use_async, run_id="a")
    ckpt.save(1, {"x": torch.zeros(10_000)}, {})
    ckpt.wait()
    before = snapshot(root)
    tmp = root / ".tmp-step_00000002"
    with pytest.raises(RunFileError) as err:
        ckpt.save(2, {"x": torch.zeros(1_000_000)}, {})  # 4 MB on a 2 MiB disk
        ckpt.wait()
    assert str(err.value) == (
        f"checkpoint step 2 could not be written (No space left on device: {tmp}); its "
        f"unfinished folder .tmp-step_00000002 was removed and the checkpoints already in "
        f"{root} are untouched: free space (or fix the permission) and resume."
    )
    assert names(root) == ["step_00000001"] and snapshot(root) == before
    assert verify(root / "step_00000001") is None


def test_a_short_write_is_a_full_disk_even_where_space_is_left(tmp_path, monkeypatch):
    """On the GPU machine's real disk a 7B checkpoint ended in torch's ``unexpected pos``
    with space still free (the piece that failed was larger than what was left): a short
    write is read as a full disk whatever ``df`` says."""
    import torch.distributed.checkpoint.filesystem as fs

    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, use_async=False, run_id="a")
    ckpt.save(1, {"x": torch.zeros(10)}, {})
    before = snapshot(root)

    def short(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(fs, "_write_item", short)
    with pytest.raises(RunFileError, match=r"^checkpoint step 2 could not be written \(No space"):
        ckpt.save(2, {"x": torch.zeros(10)}, {})
    assert names(root) == ["step_00000001"] and snapshot(root) == before


@pytest.mark.slow
@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_full_disk_while_checkpointing_then_a_resume_over_a_cut_short_metrics_line(tmp_path):
    args = [*TINY, "train.checkpoint_every=1", f"out_dir={tmp_path}"]
    trainer = Trainer(compose_run([*args, "train.steps=2"]))
    ckpts = tmp_path / "checkpoints"
    tmp = ckpts / ".tmp-step_00000002"
    tmp.mkdir()
    (tmp / "__0_0.distcp").symlink_to("/dev/full")  # step 2's data file: no space left there
    with pytest.raises(RunFileError) as err:
        trainer.fit(show_progress=False)
    assert str(err.value) == (
        f"checkpoint step 2 could not be written (No space left on device: {tmp}); its "
        f"unfinished folder .tmp-step_00000002 was removed and the checkpoints already in "
        f"{ckpts} are untouched: free space (or fix the permission) and resume."
    )
    assert names(ckpts) == ["step_00000001"] and verify(ckpts / "step_00000001") is None

    metrics = tmp_path / "metrics.jsonl"
    first = metrics.read_text().splitlines()[0]
    with metrics.open("a") as f:
        f.write('{"step": 2, "loss": 8.1')  # a line the crash cut short
    resumed = Trainer(compose_run([*args, "train.steps=3"]))
    assert resumed.step == 1
    resumed.fit(show_progress=False)
    lines = metrics.read_text().splitlines()
    assert lines[0] == first and [json.loads(x)["step"] for x in lines] == [0, 1, 2]

    metrics.write_text(lines[0] + "\n" + "garbage\n" + lines[2] + "\n")
    before = metrics.read_bytes()
    with pytest.raises(RunFileError, match=r"metrics.jsonl line 2 is not a JSON object"):
        Trainer(compose_run([*args, "train.steps=4"])).fit(show_progress=False)
    assert metrics.read_bytes() == before, "a damaged log is refused, not rewritten"


def test_an_out_dir_that_cannot_be_a_folder_is_one_sentence(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for out in (loop, afile, afile / "below"):
        assert main(["train", *TINY, f"out_dir={out}"]) == 2
        printed = capsys.readouterr().out.replace("\n", "")
        assert f"{out} cannot be a run directory: it (or a folder above it) exists but" in printed
    assert afile.read_text() == "keep" and loop.is_symlink()


# ---- outputs and checkpoints from elsewhere ------------------------------------------------


def test_convert_from_hf_into_a_non_empty_folder_is_refused_unless_overwrite(tmp_path, capsys):
    src = hf_dir(tmp_path)
    out = tmp_path / "ours"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["convert", "from-hf", str(src), str(out)]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"{out} already exists and is not empty: pass --overwrite (overwrite=True)" in printed
    assert names(out) == ["notes.txt"]
    assert main(["convert", "from-hf", str(src), str(out), "--overwrite"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / WEIGHTS).is_file()


@pytest.mark.parametrize(
    ("direction", "src", "out", "how"),
    [
        ("to-hf", "run/checkpoints/step_00000001", "run", "holds SRC"),
        ("to-hf", "run/checkpoints/step_00000001", "run/checkpoints/step_00000001", "is SRC"),
        ("to-hf", "run/checkpoints/step_00000001", "run/checkpoints/step_00000001/hf", "lies"),
        ("to-hf", "run/checkpoints/step_00000001", "run/checkpoints/hf", "lies inside the run's"),
        ("to-hf", "run/model", "run/checkpoints", "is the run's checkpoints"),
        ("to-hf", "run/model", "run", "holds SRC"),
        ("from-hf", "run/model", "run/model", "is SRC"),
        ("to-hf", "run/model", "data", "is the tokenizer folder"),
        ("to-hf", "run/model", ".", "holds SRC"),
    ],
)
def test_convert_into_its_own_source_or_run_is_refused_and_deletes_nothing(
    tmp_path, capsys, direction, src, out, how
):
    """``--overwrite`` with an OUT that is, holds or lies inside SRC or the run's checkpoints
    would replace the run: refused in one sentence naming both, before anything is touched."""
    saved_run(tmp_path / "run" / "checkpoints", (1,))
    save_model_dir(
        build_model(small_config(), seed=3).state_dict(), small_config(), tmp_path / "run" / "model"
    )
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokenizer.json").write_text("{}")
    before = snapshot(tmp_path)
    argv = ["convert", direction, str(tmp_path / src), str(tmp_path / out), "--overwrite"]
    tokenizer = ["--tokenizer", str(tmp_path / "data")]
    assert main([*argv, *(tokenizer if direction == "to-hf" else [])]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"error: OUT {tmp_path / out} {how}" in printed
    assert "what is being converted; choose an OUT outside " in printed
    assert snapshot(tmp_path) == before and names(tmp_path) == ["data", "run"]


def test_a_missing_source_says_so_and_eval_suggests_no_option_it_lacks(tmp_path, capsys):
    """A path that is not there is named as missing (not as lacking a checkpoint beside it);
    ``moe eval score`` never points at ``--tokenizer``, which it does not have."""
    missing, empty = tmp_path / "no-such-run" / "model", tmp_path / "empty"
    empty.mkdir()
    for argv in (
        ["convert", "to-hf", str(missing), str(tmp_path / "hf")],
        ["eval", "score", str(missing)],
    ):
        assert main(argv) == 2
        printed = capsys.readouterr().out.replace("\n", "")
        assert f"error: {missing} does not exist: name a training checkpoint (a step_N" in printed
    # (a task named: an empty eval.tasks is refused first, before torch is imported)
    assert main(["eval", "score", str(empty), "eval.tasks=[arc_easy:rc_5shot]"]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"{empty} has no training checkpoint beside it" in printed
    assert "--tokenizer" not in printed and "moe eval score scores only checkpoints" in printed
    assert names(tmp_path) == ["empty"] and names(empty) == []


def dead_pid() -> int:
    """The pid of a process that has ended: what a killed convert's temporaries carry."""
    ended = subprocess.Popen(["true"])
    ended.wait()
    return ended.pid


def test_a_rerun_cleans_what_a_killed_convert_left(tmp_path):
    """from-hf killed while writing leaves its weights' temporary in OUT (the rerun refused
    the folder as not empty); to-hf killed leaves its unfinished folder beside OUT (kept
    forever). The rerun removes both and nothing else."""
    src, model, pid = hf_dir(tmp_path), tmp_path / "model", dead_pid()
    model.mkdir()
    (model / f".{WEIGHTS}.tmp-{pid}").write_bytes(b"cut short")
    assert main(["convert", "from-hf", str(src), str(model)]) == 0
    assert names(model) == [WEIGHTS, OUR_CONFIG]
    left = tmp_path / f".hf2.tmp-{pid}"
    left.mkdir()
    (left / "model-00001-of-00001.safetensors").write_bytes(b"cut short")
    (tmp_path / ".hf2.tmp-notes").write_text("mine")  # named alike, but no process's
    before = snapshot(src)
    assert main(["convert", "to-hf", str(model), str(tmp_path / "hf2"), "--no-tokenizer"]) == 0
    assert names(tmp_path) == [".hf2.tmp-notes", "hf", "hf2", "model"]
    assert (tmp_path / ".hf2.tmp-notes").read_text() == "mine" and snapshot(src) == before


def test_a_convert_killed_while_replacing_its_out_puts_the_old_one_back(tmp_path, capsys):
    """Killed between moving the old OUT aside and renaming the new one in: the rerun puts the
    old one back (refused without --overwrite, as any OUT that holds files) and drops the
    unfinished new folder; with --overwrite it is replaced."""
    src, pid = hf_dir(tmp_path), dead_pid()
    out = tmp_path / "hf2"
    shutil.copytree(src, tmp_path / f".hf2.old.tmp-{pid}")
    shutil.copytree(src, tmp_path / f".hf2.tmp-{pid}")
    before = snapshot(src)
    model = save_model_dir(*reversed(load_hf(src)), tmp_path / "model")
    assert main(["convert", "to-hf", str(model), str(out), "--no-tokenizer"]) == 2
    assert f"{out} already exists and is not empty" in capsys.readouterr().out.replace("\n", "")
    assert names(tmp_path) == ["hf", "hf2", "model"] and snapshot(out) == before
    assert main(["convert", "to-hf", str(model), str(out), "--no-tokenizer", "--overwrite"]) == 0
    assert names(tmp_path) == ["hf", "hf2", "model"] and snapshot(src) == before


def test_a_convert_onto_a_full_disk_is_one_sentence_and_leaves_no_temporaries(
    tmp_path, small_disk, capsys
):
    src = hf_dir(tmp_path)
    save_model_dir(*reversed(load_hf(src)), tmp_path / "model")
    filler = small_disk / "filler"
    filler.write_bytes(b"x" * 1_600_000)  # what else the disk holds, ~0.4 MB left
    # from-hf knows the size of what it writes: refused before reading, nothing written
    out = small_disk / "ours"
    assert main(["convert", "from-hf", str(src), str(out)]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"error: {out} needs " in printed and "of disk for the converted weights" in printed
    assert not out.exists()
    # to-hf meets the full disk while writing
    out = small_disk / "hf"
    assert main(["convert", "to-hf", str(tmp_path / "model"), str(out), "--no-tokenizer"]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"error: {out} could not be written (No space left on device: " in printed
    assert "its unfinished files were removed: free space (or fix the permission)" in printed
    assert not [p for p in small_disk.rglob("*") if ".tmp-" in p.name]
    assert filler.read_bytes() == b"x" * 1_600_000
    filler.unlink()
    assert main(["convert", "from-hf", str(src), str(small_disk / "ours")]) == 0


class Payload:
    """What a hostile ``.metadata`` could hold: unpickling it writes a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "ran"))


def test_a_checkpoint_from_elsewhere_cannot_run_code_when_converted(tmp_path, capsys):
    Trainer(compose_run([*TINY, "train.steps=1", f"out_dir={tmp_path / 'run'}"])).fit(
        show_progress=False
    )
    bad = tmp_path / "downloaded"
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step_00000001", bad)
    (bad / MANIFEST).unlink()  # from elsewhere: no manifest of ours
    marker = tmp_path / "marker"
    (bad / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(AttributeError):  # what plain DCP does: it runs the payload
        dcp.FileSystemReader(str(bad)).read_metadata()
    assert marker.read_text() == "ran"
    marker.unlink()

    assert main(["convert", "to-hf", str(bad), str(tmp_path / "hf")]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"{bad / '.metadata'} asks to load pathlib.Path.write_text, which checkpoint " in printed
    assert "refused, since unpickling it could run code; load only checkpoints you trust" in printed
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_a_finished_run_rerun_and_a_bad_shard_size_are_one_sentence(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", *TINY, "train.steps=1", f"out_dir={out}"]
    assert main(args) == 0
    before = snapshot(out / "checkpoints")
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out.replace("\n", "")
    assert f"nothing to train: {out} already holds step 1 of train.steps=1; raise" in printed
    assert snapshot(out / "checkpoints") == before
    for bad in ("5XB", "0", "nan", "-1GB"):
        convert = ["convert", "to-hf", str(out / "model"), str(tmp_path / "hf")]
        assert main([*convert, f"--max-shard-size={bad}"]) == 2
        printed = capsys.readouterr().out.replace("\n", "")
        assert f"--max-shard-size '{bad}' is not allowed: a positive number of bytes" in printed
    assert not (tmp_path / "hf").exists()


def test_a_long_run_without_spaces_is_cut_for_bpe_training_only(tmp_path):
    """A multi-megabyte "word" made BPE training run for minutes (it grows with the square of
    the run): the trainer sees such runs cut into pieces, the shards keep the text as it is."""
    rng = np.random.default_rng(0)
    blob = "".join(rng.choice(list(string.ascii_letters), 3 * MAX_TRAINING_RUN + 500))
    corpus = tmp_path / "corpus.jsonl"
    rows = [{"text": "in the beginning was the word " * 20}, {"text": blob}]
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(
        kind="tokens", path=str(corpus), bpe_vocab_size=300, workers=1, validation_fraction=0.0
    )
    seen = list(_training_texts(open_source(cfg), cfg, validation_phase(cfg.seed)))
    assert [len(w) for w in seen[1].split()] == [MAX_TRAINING_RUN] * 3 + [500]
    assert "".join(seen[1].split()) == blob and seen[0] == rows[0]["text"]
    out = tokenize_corpus(cfg, tmp_path / "data", show_progress=False)
    ids = np.concatenate([np.load(p) for p in sorted(out.glob("train-*.npy"))]).tolist()
    assert blob in load_tokenizer(out).decode(ids), "the shards hold the whole run"
