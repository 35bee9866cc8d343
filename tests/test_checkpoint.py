"""Checkpoints survive failures: kill -9 and resume is bit-exact, corruption is detected,
checkpoints reshard across layouts, and retention keeps what it should."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import BASE, TESTS, assert_trains_like, explain, losses, torchrun
from rich.console import Console

from moe_core.ckpt import dcp_read
from moe_core.compose import compose_run
from moe_core.config_dict import to_dict
from moe_core.convert.native import load_model_dir
from moe_core.train.checkpoint import MANIFEST, step_dir_name, verify
from moe_core.train.metrics import CHECKPOINT_LOG
from moe_core.train.trainer import Trainer

STEPS = 8


def train_cmd(nproc: int, out: Path, extra: list[str]) -> list[str]:
    args = [*BASE, f"train.steps={STEPS}", "train.checkpoint_every=1", f"out_dir={out}", *extra]
    if nproc == 1:
        return [sys.executable, "-m", "moe_core.cli", "train", *args]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*launcher, f"--nproc-per-node={nproc}", "-m", "moe_core.cli", "train", *args]


def kill_everything_mentioning(marker: str) -> None:
    """SIGKILL every process whose command line mentions ``marker`` (launcher and workers)."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline and int(pid) != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def run_and_kill(cmd: list[str], out: Path, after_steps: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= after_steps:
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended (code {proc.returncode}) before step {after_steps}")
        time.sleep(0.02)
    kill_everything_mentioning(f"out_dir={out}")
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL or proc.returncode != 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, extra",
    [pytest.param(1, [], marks=pytest.mark.extended), (2, ["parallel.ep=2"])],  # ep2 holds 1's
    ids=["1proc", "ep2"],
)
def test_sigkill_and_resume_is_bit_identical(nproc, extra, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    done = subprocess.run(
        train_cmd(nproc, straight, extra), env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, explain(done)

    kill_at = random.Random(nproc).randint(2, STEPS - 2)
    run_and_kill(train_cmd(nproc, crashed, extra), crashed, kill_at)
    assert len(losses(crashed)) < STEPS, "the run was killed before finishing"
    resumed = subprocess.run(
        train_cmd(nproc, crashed, extra), env=env, capture_output=True, text=True
    )
    assert resumed.returncode == 0, explain(resumed)
    assert "resumed from" in resumed.stdout
    # checkpoints.jsonl keeps the lines up to the checkpoint resumed from; each later one once
    at = int(
        re.search(r"resumed from .*?\(step (\d+)\)", resumed.stdout.replace("\n", "")).group(1)
    )
    costs = {
        run: [json.loads(x)["step"] for x in (run / CHECKPOINT_LOG).open()]
        for run in (straight, crashed)
    }
    assert costs[straight] == list(range(1, STEPS + 1))
    assert costs[crashed] == sorted(set(costs[crashed]))
    assert [s for s in costs[crashed] if s > at] == list(range(at + 1, STEPS + 1))

    assert losses(crashed) == losses(straight)  # per step, exactly
    _, a = load_model_dir(straight / "model")
    _, b = load_model_dir(crashed / "model")
    for name, t in a.items():
        assert torch.equal(t, b[name]), f"{name} differs after resume"


@pytest.mark.slow
def test_corrupted_newest_checkpoint_is_skipped(tmp_path):
    args = [*BASE, "train.steps=4", "train.checkpoint_every=2", f"out_dir={tmp_path}"]
    Trainer(compose_run(args)).fit(show_progress=False)
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000002", "step_00000004"]
    newest = ckpts / "step_00000004"
    victim = max(
        (p for p in newest.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size
    )
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    assert "bytes, the manifest says" in verify(newest)

    console = Console(record=True, width=200)
    trainer = Trainer(compose_run([*args, "train.steps=6"]), console=console)
    assert trainer.step == 2 and trainer.resumed_from == ckpts / "step_00000002"
    assert "skipping checkpoint step_00000004" in console.export_text()
    assert newest.exists(), "a corrupt checkpoint is reported, not deleted"


@pytest.mark.slow
def test_partial_checkpoint_without_manifest_is_never_used(tmp_path):
    args = [*BASE, "train.steps=2", "train.checkpoint_every=1", f"out_dir={tmp_path}"]
    Trainer(compose_run(args)).fit(show_progress=False)
    (tmp_path / "checkpoints" / "step_00000002" / MANIFEST).unlink()
    assert Trainer(compose_run(args)).step == 1


@pytest.mark.slow
def test_checkpoint_from_ep2_reshards_into_one_process_and_pp2(tmp_path):
    saved = tmp_path / "ep2"
    common = [*BASE, "train.steps=3", "train.eval_every=3", "train.eval_batches=2"]
    result = torchrun(
        2, ["-m", "moe_core.cli", "train", *common, "parallel.ep=2", f"out_dir={saved}"]
    )
    assert result.returncode == 0, explain(result)
    eval_ep2 = json.loads((saved / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
    _, weights_ep2 = load_model_dir(saved / "model")

    one = Trainer(compose_run([*common, f"out_dir={saved}"]))  # resumes the EP=2 checkpoint
    assert one.step == 3 and one.resumed_from is not None
    assert abs(one.evaluate() - eval_ep2) < 1e-5 * abs(eval_ep2)
    for name, t in one.chunks[0].state_dict().items():
        assert torch.equal(t, weights_ep2[name]), name  # masters are restored exactly

    pp_dir = tmp_path / "pp2"
    pp_dir.mkdir()
    os.symlink(saved / "checkpoints", pp_dir / "checkpoints")
    result = torchrun(
        2,
        [
            str(TESTS / "dist_jobs.py"),
            "eval",
            str(tmp_path / "pp2.json"),
            *common,
            "parallel.pp=2",
            f"out_dir={pp_dir}",
        ],
    )
    assert result.returncode == 0, explain(result)
    got = json.loads((tmp_path / "pp2.json").read_text())
    assert got["step"] == 3
    assert abs(got["eval_loss"] - eval_ep2) < 1e-5 * abs(eval_ep2)


@pytest.mark.slow
def test_a_run_resumed_on_half_its_nodes_trains_like_the_uninterrupted_run(tmp_path, dp2_ep2_run):
    """cluster.on_node_loss=shrink: the session's 4-rank run (dp 2 x ep 2 on 2 nodes of 2: 4
    data ranks, 1 micro-batch each) resumed from its step-2 checkpoint on 1 node (``moe train
    --nodes 1``: dp 1 x ep 2, 2 data ranks, 2 micro-batches each) keeps the global batch and
    the sample sequence: its loss curve and weights are the uninterrupted run's within the
    layout-parity tolerance (``helpers.assert_trains_like``)."""
    shrunk = tmp_path / "shrunk"
    (shrunk / "checkpoints").mkdir(parents=True)
    step2 = step_dir_name(2)
    shutil.copytree(dp2_ep2_run / "checkpoints" / step2, shrunk / "checkpoints" / step2)
    # a newer checkpoint with one byte flipped in the file the second resuming rank hashes
    # (ranks verify a checkpoint together, each its share of the files in manifest order)
    step4 = shrunk / "checkpoints" / step_dir_name(4)
    shutil.copytree(dp2_ep2_run / "checkpoints" / step_dir_name(4), step4)
    listed = sorted(json.loads((step4 / MANIFEST).read_text())["files"])
    victim = step4 / listed[1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    rows = (dp2_ep2_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (shrunk / "metrics.jsonl").write_text("".join(rows[:2]))  # what the run had logged
    layout = ["parallel.dp=2", "parallel.ep=2", "train.checkpoint_every=2"]
    cluster = ["cluster=slurm", "cluster.nodes=2", "cluster.procs_per_node=2"]
    shrink = ["cluster.gpus_per_node=0", "cluster.on_node_loss=shrink"]
    run = compose_run([*BASE, *layout, *cluster, *shrink, f"out_dir={shrunk}"])
    assert run.node_counts == {2: 2, 1: 1}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(to_dict(run)))
    result = torchrun(2, ["-m", "moe_core.cli", "train", "--config", str(config), "--nodes", "1"])
    assert result.returncode == 0, explain(result)
    assert "continuing on 1 of 2 nodes: dp 2 -> 1, accumulation 1 -> 2" in result.stdout
    assert "(pp 1, dp 1, cp 1, ep 2; accumulation 2)" in result.stdout
    assert f"resumed from {shrunk / 'checkpoints' / step2}" in result.stdout.replace("\n", "")
    said = result.stdout.replace("\n", "")
    assert f"skipping checkpoint step_00000004: step_00000004/{listed[1]} does not match" in said
    assert_trains_like(dp2_ep2_run, shrunk, steps=5)


@pytest.mark.slow
@pytest.mark.extended  # the test above holds the same path in CI (4 ranks to 2, dp 2 -> 1)
def test_a_dp4_run_resumed_on_2_ranks_at_dp2_trains_like_the_uninterrupted_run(tmp_path):
    """cluster.on_node_loss=shrink at pure data parallelism: 4 ranks (dp 4 on 2 nodes of 2, one
    micro-batch each) resumed from their step-2 checkpoint on 1 node (dp 2, two micro-batches
    each: the global batch kept, the ZeRO-1 state resharded 4 -> 2) train the uninterrupted
    4-rank run's loss curve and weights within the layout-parity tolerance."""
    cluster = ["cluster=slurm", "cluster.nodes=2", "cluster.procs_per_node=2"]
    shrink = ["cluster.gpus_per_node=0", "cluster.on_node_loss=shrink"]
    layout = ["parallel.dp=4", "train.checkpoint_every=2"]
    whole, shrunk = tmp_path / "whole", tmp_path / "shrunk"
    configs = {}
    for name, out in (("whole", whole), ("shrunk", shrunk)):
        run = compose_run([*BASE, *layout, *cluster, *shrink, f"out_dir={out}"])
        configs[name] = tmp_path / f"{name}.json"
        configs[name].write_text(json.dumps(to_dict(run)))
    assert run.node_counts == {2: 4, 1: 2}
    train = ["-m", "moe_core.cli", "train", "--config"]
    result = torchrun(4, [*train, str(configs["whole"])])
    assert result.returncode == 0, explain(result)
    step2 = step_dir_name(2)
    shutil.copytree(whole / "checkpoints" / step2, shrunk / "checkpoints" / step2)
    rows = (whole / "metrics.jsonl").read_text().splitlines(keepends=True)
    (shrunk / "metrics.jsonl").write_text("".join(rows[:2]))  # what the run had logged
    result = torchrun(2, [*train, str(configs["shrunk"]), "--nodes", "1"])
    assert result.returncode == 0, explain(result)
    assert "continuing on 1 of 2 nodes: dp 4 -> 2, accumulation 1 -> 2" in result.stdout
    assert f"resumed from {shrunk / 'checkpoints' / step2}" in result.stdout.replace("\n", "")
    assert_trains_like(whole, shrunk, steps=5)


@pytest.mark.slow
def test_retention_keeps_last_n_and_every_kth(tmp_path):
    args = [
        *BASE,
        "train.steps=9",
        "train.checkpoint_every=1",
        "train.keep_last=2",
        "train.keep_every=4",
        f"out_dir={tmp_path}",
    ]
    Trainer(compose_run(args)).fit(show_progress=False)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_00000004", "step_00000008", "step_00000009"]


@pytest.mark.slow
def test_a_run_that_fails_publishes_the_background_checkpoint_it_had_written(tmp_path):
    """An error two steps after an async save leaves that save pending: the run's error is
    raised, and the checkpoint, fully written, is published (not left as an unfinished folder
    the next start removes), so a resume starts from it."""
    args = [
        *BASE,
        "train.steps=6",
        "train.checkpoint_every=2",
        "train.async_checkpoint=true",
        "train.checkpoint_at_end=false",
        f"out_dir={tmp_path}",
    ]
    trainer = Trainer(compose_run(args))
    real = trainer.train_step

    def fails_after_the_save():
        if trainer.step == 2:  # the step right after the save
            raise RuntimeError("a failure mid-run")
        return real()

    trainer.train_step = fails_after_the_save
    with pytest.raises(RuntimeError, match="a failure mid-run"):
        trainer.fit(show_progress=False)
    published = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert published == [step_dir_name(2)], published
    assert verify(tmp_path / "checkpoints" / step_dir_name(2)) is None
    resumed = Trainer(compose_run([*args, "train.steps=3"]))
    assert resumed.step == 2
    resumed.release()


def test_async_checkpoint_equals_sync(tmp_path):
    """Both write the same checkpoints; each reports every checkpoint's cost once it is
    published: a line, and a ``checkpoints.jsonl`` record under its step whose bytes are its
    folder's; the loop's blocked time lies within the time to publish (all of it when sync)."""
    runs = {}
    for mode in ("false", "true"):
        out = tmp_path / mode
        args = [
            *BASE,
            "train.steps=3",
            "train.checkpoint_every=1",
            f"train.async_checkpoint={mode}",
            f"out_dir={out}",
        ]
        console = Console(record=True, width=300)
        trainer = Trainer(compose_run(args), console=console)
        trainer.fit(show_progress=False)
        runs[mode] = out
        records = [json.loads(x) for x in (out / CHECKPOINT_LOG).read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2, 3]
        assert records == [{"step": c.step, **c.record()} for c in trainer.checkpoint_costs]
        shown = console.export_text()
        for cost, r in zip(trainer.checkpoint_costs, records, strict=True):
            assert cost.line() in shown
            folder = out / "checkpoints" / step_dir_name(r["step"])
            size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
            assert r["checkpoint/bytes"] == size
            assert r["checkpoint/async"] is (mode == "true")
            assert 0 < r["checkpoint/stall_s"] <= r["checkpoint/durable_s"]
            if mode == "false":
                assert r["checkpoint/stall_s"] == r["checkpoint/durable_s"]
            gbps = r["checkpoint/bytes"] / r["checkpoint/durable_s"] / 1e9
            assert r["checkpoint/write_gbps"] == pytest.approx(gbps)
    for step in (1, 2, 3):
        for mode in runs:
            assert verify(runs[mode] / "checkpoints" / step_dir_name(step)) is None
        # each async save staged into the host copy the earlier ones filled: its tensors are
        # this step's, as the synchronous save wrote them
        saved = {}
        for mode in runs:
            folder = runs[mode] / "checkpoints" / step_dir_name(step)
            meta = dcp_read.read_metadata(folder)
            state = {
                k: torch.empty(m.size, dtype=m.properties.dtype)
                for k, m in meta.state_dict_metadata.items()
                if hasattr(m, "size")
            }
            dcp_read.load(state, folder)
            saved[mode] = state
        assert saved["false"].keys() == saved["true"].keys()
        for key, value in saved["false"].items():
            assert torch.equal(value, saved["true"][key]), (step, key)
    a = Trainer(compose_run([*BASE, "train.steps=3", f"out_dir={runs['false']}"]))
    b = Trainer(compose_run([*BASE, "train.steps=3", f"out_dir={runs['true']}"]))
    for (name, x), (_, y) in zip(
        a.chunks[0].state_dict().items(), b.chunks[0].state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), name
    # a fit that leaves on an error (here after its one background save) frees the host copy
    # too: the Trainer may live on in the process (a caller retrying, a test suite)
    args = [*BASE, "train.steps=1", "train.checkpoint_every=1", "train.async_checkpoint=true"]
    c = Trainer(compose_run([*args, f"out_dir={tmp_path / 'error'}"]))

    def fails(step: int) -> None:
        assert c.checkpoints.checkpointer.staged_bytes() > 0
        raise RuntimeError("an error after the save")

    c.checkpoints.at_end = fails
    with pytest.raises(RuntimeError, match="an error after the save"):
        c.fit(show_progress=False)
    assert c.checkpoints.checkpointer.staged_bytes() == 0
    c.checkpoints.checkpointer.wait()  # the write went on from the buffers it holds
    assert verify(tmp_path / "error" / "checkpoints" / step_dir_name(1)) is None


@pytest.mark.slow
def test_sigterm_stops_gracefully_with_a_checkpoint(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "moe_core.cli",
        "train",
        *BASE,
        "train.steps=100000",
        f"out_dir={tmp_path}",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert time.time() < deadline and proc.poll() is None, "the run did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, stdout
    assert "stopped at step" in stdout
    steps = [int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").iterdir()]
    assert len(steps) == 1 and steps[0] == len(losses(tmp_path)) and steps[0] < 100000


@pytest.mark.slow
def test_pure_bf16_checkpoint_resumes_under_fp32_master_state_and_back(tmp_path):
    """A pure-bf16 checkpoint (bf16 weights and moments, no master) loads into fp32 master
    state exactly (bf16 values are fp32 values); the fp32 state written from there loads back
    into pure-bf16, rounded once; both go on training."""
    common = [*BASE, "train.checkpoint_every=2", f"out_dir={tmp_path}"]
    pure = [*common, "precision=pure-bf16"]
    first = Trainer(compose_run([*pure, "train.steps=2"]))
    first.fit(show_progress=False)
    assert first.optimizer.moments[0]["exp_avg"].dtype == torch.bfloat16

    wide = Trainer(compose_run([*common, "precision=bf16", "train.steps=4"]))
    assert wide.step == 2 and wide.optimizer.state_dtype == torch.float32
    for i, b in enumerate(first.optimizer.buckets):
        name = b.names[0]
        j = next(k for k, w in enumerate(wide.optimizer.buckets) if name in w.names)
        assert wide.optimizer.buckets[j].names == b.names  # same packing: same precision of weights
        saved, loaded = first.optimizer.shards(i), wide.optimizer.shards(j)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            assert loaded[kind].dtype == torch.float32
            assert torch.equal(loaded[kind], saved[kind].float()), (name, kind)
    wide.fit(show_progress=False)

    narrow = Trainer(compose_run([*pure, "train.steps=5"]))
    assert narrow.step == 4
    for i, b in enumerate(wide.optimizer.buckets):
        j = next(k for k, w in enumerate(narrow.optimizer.buckets) if b.names[0] in w.names)
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            got, ref = narrow.optimizer.shards(j)[kind], wide.optimizer.shards(i)[kind]
            assert got.dtype == torch.bfloat16 and torch.equal(got, ref.to(torch.bfloat16))
    history = narrow.fit(show_progress=False)
    assert len(history) == 1 and history[0].step == 4


def test_a_background_saves_host_copy_holds_the_saved_elements_only(tmp_path):
    """Async saves stage into a host copy kept for the run: per entry, only the elements it
    saves. A master shard that is a view of its bucket's weights (fp32 or pure-bf16 weights,
    dp > 1) is a tenth of its storage here; copying the storage would keep every rank's shard
    of the bucket in each rank's host memory, dp times what the plan counts. Refilled by the
    next save (the same buffers) and emptied by ``close``."""
    from moe_core.config import ParallelConfig
    from moe_core.parallel.mesh import Mesh
    from moe_core.train.checkpoint import Checkpointer

    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, True, run_id="a")
    bucket = torch.arange(1000, dtype=torch.float32)  # every rank's shards of a bucket
    state = {"opt/w/param/100": bucket[100:200], "trainer": "{}", "adam_step": 1}
    ckpt.save(1, state, {})
    assert ckpt.staged_bytes() == 400  # 100 fp32 elements, not the bucket's 4000 bytes
    bucket += 1  # the next step's update
    ckpt.save(2, state, {})
    assert ckpt.staged_bytes() == 400
    ckpt.close()
    assert ckpt.staged_bytes() == 0
    for step in (1, 2):
        loaded = {"opt/w/param/100": torch.empty(100)}
        dcp_read.load(loaded, root / step_dir_name(step))
        assert torch.equal(loaded["opt/w/param/100"], torch.arange(100, 200.0) + step - 1)


def test_a_background_save_costs_its_staging_and_collection_under_its_own_step(
    tmp_path, monkeypatch
):
    """Async: a checkpoint's cost is given once it is published, under its own step, never
    before: the loop's time in its save call (staging) plus in its collection (waiting for the
    write, publishing), even when the next save is what waits for it. Host clock and the
    background write are stand-ins, so the seconds are exact."""
    import types
    from concurrent.futures import Future

    import torch.distributed.checkpoint as dcp

    import moe_core.train.checkpoint as module
    from moe_core.config import ParallelConfig
    from moe_core.parallel.mesh import Mesh
    from moe_core.train.checkpoint import Checkpointer, SaveCost

    clock = [0.0]
    monkeypatch.setattr(
        module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0], time=time.time)
    )

    class Write(Future):
        def result(self, timeout=None):
            clock[0] += 2.0  # the loop waits 2 s for the write
            return super().result(timeout)

    writes: list[Write] = []

    def async_save(state, checkpoint_id, **kwargs):
        dcp.save(state, checkpoint_id=checkpoint_id, no_dist=True)  # the files, written now
        clock[0] += 1.0  # staging takes 1 s
        writes.append(Write())
        return writes[-1]

    monkeypatch.setattr(module.dcp, "async_save", async_save)
    costs: list[SaveCost] = []
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, True, run_id="a", on_cost=costs.append)

    def size(step: int) -> int:
        return sum(f.stat().st_size for f in (root / step_dir_name(step)).rglob("*") if f.is_file())

    clock[0] = 10.0
    ckpt.save(2, {"x": torch.zeros(1000)}, {}, started=9.5)  # blocked 1.5 s
    clock[0] = 20.0
    ckpt.poll()  # the write goes on: nothing published, nothing costed
    assert costs == [] and not (root / step_dir_name(2)).exists()
    writes[0].set_result(None)
    clock[0] = 40.0
    ckpt.save(4, {"x": torch.ones(2000)}, {}, started=40.0)  # waits 2 s for step 2's write
    assert costs == [SaveCost(2, 1.5 + 2.0, 42.0 - 9.5, size(2), True, 2.0, True)]
    assert "(1.50 s to copy it, 2.00 s waiting for the write at the next" in costs[0].line()
    writes[1].set_result(None)
    clock[0] = 50.0
    ckpt.wait()  # the end of a run
    assert costs[1:] == [SaveCost(4, 1.0 + 2.0, 52.0 - 40.0, size(4), True, 2.0, False)]
    assert "(1.00 s to copy it, 2.00 s waiting for the write)," in costs[1].line()


def test_publishing_reads_each_ranks_hashes_and_hashes_only_what_no_rank_recorded(
    tmp_path, monkeypatch
):
    """Each rank hashes the files it wrote (``__<rank>_N.distcp``) and records them beside
    them; rank 0's manifest takes those records and hashes only the rest (DCP's .metadata, a
    file whose record is missing or whose size changed), so it never reads the other ranks'
    bytes. The records are gone from the published folder, which verifies."""
    import types

    import moe_core.train.checkpoint as module
    from moe_core.config import ParallelConfig
    from moe_core.files import file_sha256
    from moe_core.parallel.mesh import Mesh
    from moe_core.train.checkpoint import Checkpointer

    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, False, run_id="a")
    hashed: list[str] = []

    def counting(path):
        hashed.append(Path(path).name)
        return file_sha256(path)

    def save(step: int, ranks: int, record: list[int], wait_s: float = 600.0) -> Path:
        tmp = root / f".tmp-{step_dir_name(step)}"
        tmp.mkdir()
        (tmp / ".metadata").write_bytes(b"metadata")
        for r in range(ranks):
            (tmp / f"__{r}_0.distcp").write_bytes(bytes([r]) * (100 + r))
        for r in record:  # what rank r's own save leaves (here: as rank r)
            ckpt.mesh = types.SimpleNamespace(rank=r, cfg=types.SimpleNamespace(world_size=ranks))
            ckpt._hash_own(tmp)
        ckpt.mesh = types.SimpleNamespace(rank=0, cfg=types.SimpleNamespace(world_size=ranks))
        monkeypatch.setattr(module, "RECORD_WAIT_S", wait_s)
        hashed.clear()
        monkeypatch.setattr(module, "file_sha256", counting)
        ckpt._publish(step, tmp, {"step": step, "layout": {}})
        monkeypatch.setattr(module, "file_sha256", file_sha256)
        final = root / step_dir_name(step)
        assert verify(final) is None
        assert not list(final.glob(".sha256-*"))
        return final

    save(1, ranks=3, record=[0, 1, 2])
    assert hashed == [".metadata"]
    save(2, ranks=3, record=[0, 2], wait_s=0.0)  # rank 1's record never came
    assert sorted(hashed) == [".metadata", "__1_0.distcp"]
    # a record whose file changed size afterwards is not trusted
    tmp = root / f".tmp-{step_dir_name(3)}"
    tmp.mkdir()
    (tmp / "__0_0.distcp").write_bytes(b"short")
    ckpt.mesh = types.SimpleNamespace(rank=0, cfg=types.SimpleNamespace(world_size=1))
    ckpt._hash_own(tmp)
    (tmp / "__0_0.distcp").write_bytes(b"longer than it was")
    hashed.clear()
    monkeypatch.setattr(module, "file_sha256", counting)
    ckpt._publish(3, tmp, {"step": 3, "layout": {}})
    monkeypatch.setattr(module, "file_sha256", file_sha256)
    assert hashed == ["__0_0.distcp"] and verify(root / step_dir_name(3)) is None


def test_a_background_hash_that_fails_is_one_sentence_and_keeps_the_checkpoints(
    tmp_path, monkeypatch
):
    """Async: a rank's hashing of its files runs in the background; when it fails (a full disk
    as its record is written), collecting the save says so in one sentence naming the folder,
    removes the unfinished one, and the published checkpoints stay as they were."""
    import errno

    import torch.distributed.checkpoint as dcp

    import moe_core.train.checkpoint as module
    from moe_core.config import ParallelConfig
    from moe_core.errors import RunFileError
    from moe_core.parallel.mesh import Mesh
    from moe_core.train.checkpoint import Checkpointer

    def async_save(state, checkpoint_id, **kwargs):
        dcp.save(state, checkpoint_id=checkpoint_id, no_dist=True)
        done = module.Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(module.dcp, "async_save", async_save)
    root = tmp_path / "checkpoints"
    ckpt = Checkpointer(root, Mesh(ParallelConfig()), 0, 0, True, run_id="a")
    ckpt.save(1, {"x": torch.zeros(100)}, {})
    ckpt.wait()
    kept = sorted(p.name for p in (root / step_dir_name(1)).iterdir())

    def full(tmp):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp))

    monkeypatch.setattr(Checkpointer, "_hash_own", lambda self, tmp: full(tmp))
    ckpt.save(2, {"x": torch.ones(100)}, {})
    with pytest.raises(RunFileError, match="checkpoint step 2 could not be written") as err:
        ckpt.wait()
    assert "No space left on device" in str(err.value) and "\n" not in str(err.value)
    assert not (root / step_dir_name(2)).exists() and not list(root.glob(".tmp-*"))
    assert sorted(p.name for p in (root / step_dir_name(1)).iterdir()) == kept
    assert verify(root / step_dir_name(1)) is None
