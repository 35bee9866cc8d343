"""``moe tokenize`` on its engine: a real local Dask cluster on 127.0.0.1 (2 worker processes),
a running cluster by its address, a worker killed mid-run, bad engine options, and a Slurm job
(the stand-in commands of ``slurm_standin``) that starts a scheduler and workers on its nodes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import slurm_standin
from test_multinode import free_port

from flows.launchers import SlurmTokenizeLauncher
from flows.render import render_slurm_tokenize
from moe_core.compose import compose_run
from moe_core.config import ConfigError, DataConfig, RunConfig
from moe_core.config_dict import to_dict
from moe_core.data import engine
from moe_core.data.errors import DataError
from moe_core.data.manifest import verify_data_dir
from moe_core.data.tokenize import TokenizeStats, tokenize_corpus

SMALL = dict(
    kind="tokens",
    tokenizer="gpt2",
    max_documents=120,
    shard_tokens=3000,
    validation_fraction=0.1,
    unit_documents=8,
    workers=1,
)


def every_file(folder: Path) -> dict[str, bytes]:
    """Each file below ``folder`` (subfolders too) by its relative path, with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def cluster_workers() -> list[psutil.Process]:
    """This process's living children that are worker processes (spawned; multiprocessing's
    own resource tracker lives on until this process ends, cluster or not)."""
    return [
        p
        for p in psutil.Process().children(recursive=True)
        if p.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(p.cmdline())
    ]


@pytest.fixture(scope="module")
def one_worker(tmp_path_factory) -> dict[str, bytes]:
    out = tokenize_corpus(DataConfig(**SMALL), tmp_path_factory.mktemp("one") / "data")
    return every_file(out)


@pytest.mark.slow
def test_a_two_process_local_cluster_writes_the_bytes_of_one_worker(one_worker, tmp_path):
    before = {p.pid for p in cluster_workers()}
    cfg = DataConfig(**{**SMALL, "workers": 2})
    seen: list[int] = []

    def progress(p):  # the cluster's workers are up while the units run
        seen.append(len(cluster_workers()))

    out = tokenize_corpus(cfg, tmp_path / "data", show_progress=False, on_progress=progress)
    assert every_file(out) == one_worker
    assert len(verify_data_dir(out).shards("train")) > 3 and not (out / "units").exists()
    assert max(seen) >= 2, "no worker processes were started"
    assert {p.pid for p in cluster_workers()} == before, "the local cluster was left running"


@pytest.mark.slow
def test_a_running_cluster_by_its_address_writes_the_same_bytes(one_worker, tmp_path):
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        host="127.0.0.1",
        dashboard_address=None,
        scheduler_kwargs={"dashboard": False},
        local_directory=str(tmp_path / "scratch"),
    ) as cluster:
        cfg = DataConfig(**{**SMALL, "workers": 0, "scheduler": cluster.scheduler_address})
        out = tokenize_corpus(cfg, tmp_path / "data", show_progress=False)
        assert every_file(out) == one_worker
        assert len(cluster.scheduler.workers) == 2, "the cluster's workers stay up"


@pytest.mark.slow
def test_a_worker_killed_mid_run_is_replaced_and_the_bytes_stay_the_same(one_worker, tmp_path):
    cfg = DataConfig(**{**SMALL, "workers": 2})
    killed: list[int] = []

    def kill_a_worker(p) -> None:
        if killed:
            return
        workers = cluster_workers()  # a local cluster's nannies run in this process
        if workers:
            killed.append(workers[0].pid)
            os.kill(workers[0].pid, signal.SIGKILL)

    out = tokenize_corpus(cfg, tmp_path / "data", show_progress=False, on_progress=kill_a_worker)
    assert killed, "no worker was killed"
    assert every_file(out) == one_worker


def test_an_interrupted_run_keeps_its_finished_units_and_shards(one_worker, tmp_path):
    cfg = DataConfig(**SMALL)
    out = tmp_path / "data"

    class InterruptError(Exception):
        pass

    def stop_half_way(p) -> None:
        if p.documents >= 64:
            raise InterruptError

    with pytest.raises(InterruptError):
        tokenize_corpus(cfg, out, show_progress=False, on_progress=stop_half_way)
    records = (out / "units").glob("*.json")
    units = {p.stem: sum(json.loads(p.read_text())["lengths"]) for p in records}
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("*-0*.npy")}
    assert len(units) == 8 and shards and not (out / "manifest.json").exists()
    (out / "units" / "00000003.npy").write_bytes(b"half a unit")  # redone, not trusted
    kept = sum(tokens for unit, tokens in units.items() if unit != "00000003")

    stats = TokenizeStats()
    tokenize_corpus(cfg, out, show_progress=False, stats=stats)
    assert every_file(out) == one_worker
    total = verify_data_dir(out).total_tokens
    assert stats.tokens == total - kept, "finished units were encoded again"
    assert stats.shards_reused == len(shards)
    assert {name: (out / name).stat().st_mtime_ns for name in shards} == shards


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.scheduler=localhost:8786", "data.scheduler='localhost:8786' is not allowed: a Dask"),
        ("data.scheduler='tcp://h:1;rm'", "data.scheduler='tcp://h:1;rm' is not allowed"),
        ("data.unit_documents=0", "data.unit_documents=0 is not allowed: it must be positive"),
        ("data.workers=-1", "data.workers=-1 is not allowed: it must be zero or positive"),
    ],
)
def test_bad_engine_options_are_refused_in_one_sentence(override, message):
    with pytest.raises(ConfigError) as err:
        compose_run(["data=kjv", override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_workers_beside_a_scheduler_are_refused():
    with pytest.raises(ConfigError) as err:
        DataConfig(**{**SMALL, "workers": 2, "scheduler": "tcp://127.0.0.1:8786"})
    assert str(err.value) == (
        "data.workers=2 is not allowed: 0 with data.scheduler (the running cluster's workers "
        "tokenize)."
    )


def test_a_scheduler_that_does_not_answer_is_named_before_anything_is_written(
    tmp_path, monkeypatch
):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(engine, "CONNECT_TIMEOUT_S", 1)
    cfg = dataclasses.replace(DataConfig(**SMALL), workers=0, scheduler=f"tcp://127.0.0.1:{port}")
    with pytest.raises(DataError) as err:
        tokenize_corpus(cfg, tmp_path / "data", show_progress=False)
    assert f"data.scheduler='tcp://127.0.0.1:{port}' did not answer" in str(err.value)
    assert not list((tmp_path / "data").glob("*.npy"))


def test_a_unit_that_kills_every_worker_is_one_sentence_and_keeps_the_finished_units(
    tmp_path, monkeypatch
):
    """Dask gives up on a task whose workers all died (``KilledWorker``: a document too large
    for a worker's memory): the stage names the unit in one sentence, not Dask's traceback,
    and the units done before it stay for the rerun."""
    import types

    from distributed import KilledWorker

    import moe_core.data.tokenize as stage

    real = stage.encode_unit

    def dies_on_unit_2(data_dir, routing, unit, first, texts):
        if unit == 2:
            raise KilledWorker(f"encode_unit-{unit}", types.SimpleNamespace(address="w"), 3)
        return real(data_dir, routing, unit, first, texts)

    monkeypatch.setattr(stage, "encode_unit", dies_on_unit_2)
    out = tmp_path / "data"
    with pytest.raises(DataError) as err:
        tokenize_corpus(DataConfig(**{**SMALL, "max_documents": 40}), out, show_progress=False)
    assert str(err.value).startswith(
        "the tokenize task of unit 2 (documents 16 to 23) ended every Dask worker that ran it"
    )
    assert sorted(p.name for p in (out / "units").glob("*.json"))[:2] == [
        "00000000.json",
        "00000001.json",
    ]


# --------------------------------------------------------------------------------------------
# on Slurm: the rendered batch script starts the scheduler and the workers across the nodes


def slurm_run(tmp_path: Path, port: int) -> RunConfig:
    run = compose_run(
        [
            "cluster=slurm",
            "cluster.nodes=2",
            "cluster.procs_per_node=1",
            "cluster.gpus_per_node=0",
            "cluster.partition=standin",
            f"cluster.dask_port={port}",
            "cluster.poll_s=0.2",
            "model.vocab_size=50304",
        ],
        config_name="pretrain-tiny",
    )
    data = DataConfig(**{**SMALL, "dir": str(tmp_path / "run" / "data")})
    return dataclasses.replace(run, data=data)


def test_the_slurm_tokenize_script_starts_a_scheduler_and_workers_on_every_node(tmp_path):
    run = slurm_run(tmp_path, 8786)
    script = render_slurm_tokenize(run, str(tmp_path / "run"), str(tmp_path / "c.json"))
    path = tmp_path / "tokenize.sbatch"
    path.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert "#SBATCH --nodes=2" in script and "--gpus-per-node" not in script
    assert 'MOE_DASK="tcp://${MOE_HOST}:8786"' in script
    assert "distributed.cli.dask_scheduler" in script and "trap moe_stop EXIT" in script
    worker = next(line for line in script.splitlines() if "dask_worker" in line)
    assert '"${MOE_DASK}" --nworkers=1 --nthreads=1' in worker  # data.workers per node
    last = script.strip().splitlines()[-1]
    assert last == (
        f"python -m moe_core.cli tokenize --config {tmp_path / 'c.json'} --scheduler "
        '"${MOE_DASK}"'
    )
    every_core = dataclasses.replace(run, data=dataclasses.replace(run.data, workers=0))
    rendered = render_slurm_tokenize(every_core, str(tmp_path), str(tmp_path / "c.json"))
    assert '"--nworkers=${SLURM_CPUS_ON_NODE}"' in rendered  # one per core of each node


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_slurm_job_tokenizes_on_its_nodes_to_the_bytes_of_one_worker(
    one_worker, tmp_path, monkeypatch
):
    slurm_standin.install(tmp_path / "bin", tmp_path / "state")
    path = [str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    run = slurm_run(tmp_path, free_port())
    folder = tmp_path / "run" / "tokenize"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(to_dict(run)))
    logged: list[str] = []
    attempt = SlurmTokenizeLauncher(run, folder, logged.append).attempt(1)
    assert attempt.ok, "\n".join(logged)
    assert every_file(tmp_path / "run" / "data") == one_worker
    log = (folder / f"slurm-{attempt.job_id}.out").read_text()
    assert log.count("Start worker at") == 2, log  # one worker process on each "node"
    assert not cluster_workers()
