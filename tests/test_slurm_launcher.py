"""The Slurm launcher's reading of job states, against the stand-in commands (``slurm_standin``)
with jobs that never run: no training, so these take a second or two."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import slurm_standin
from helpers import BASE

from flows.launchers import SlurmLauncher, _slurm
from moe_core.compose import compose_run
from moe_core.config_dict import to_dict


@pytest.fixture
def standin(tmp_path: Path, monkeypatch) -> Path:
    slurm_standin.install(tmp_path / "bin", tmp_path / "state")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "state" / "hold").touch()  # submitted jobs stay queued
    return tmp_path / "state"


def launcher(tmp_path: Path, logged: list[str]) -> SlurmLauncher:
    run = compose_run(
        [
            "cluster.poll_s=0.05",
            "cluster.start_timeout_s=0",
            f"out_dir={tmp_path}/train",
        ],
        config_name="pretrain-47b",
    )
    train = tmp_path / "train"
    train.mkdir(exist_ok=True)
    return SlurmLauncher(run, train, logged.append)


def test_a_job_cancelled_by_hand_fails_the_stage_without_a_resubmission(standin, tmp_path):
    logged: list[str] = []
    slurm = launcher(tmp_path, logged)
    job_id = str(slurm_standin.FIRST_ID)

    def cancel_by_hand() -> None:
        while not (standin / f"job-{job_id}.json").is_file():
            time.sleep(0.02)
        subprocess.run(["scancel", job_id], check=True)

    hand = threading.Thread(target=cancel_by_hand, daemon=True)
    hand.start()
    with pytest.raises(RuntimeError) as err:
        slurm.attempt(1)
    hand.join()
    assert str(err.value) == (
        f"slurm job {job_id} was cancelled outside the pipeline (scancel), so it is not "
        "resubmitted: run the pipeline again to resume from the newest checkpoint."
    )
    assert f"slurm job {job_id}: CANCELLED" in logged  # read from sacct's "CANCELLED by 1000"
    assert [c for c in slurm_standin.calls(standin) if c[0] == "scancel"] == [["scancel", job_id]]


def test_states_come_from_squeue_then_sacct(standin, tmp_path):
    slurm = launcher(tmp_path, [])
    job_id = slurm.submit()
    assert slurm.state(job_id) == "PENDING"  # squeue
    slurm_standin.set_state(standin, job_id, "FAILED")
    assert slurm.state(job_id) == "FAILED"  # gone from squeue: sacct
    assert slurm.state("999999") is None  # neither knows it


def test_a_job_neither_squeue_nor_sacct_knows_is_lost_and_cancelled(standin, tmp_path):
    logged: list[str] = []
    slurm = launcher(tmp_path, logged)
    job_id = str(slurm_standin.FIRST_ID)

    def forget() -> None:  # the controller loses the job (its state files are gone)
        while not (standin / f"job-{job_id}.json").is_file():
            time.sleep(0.01)
        (standin / f"job-{job_id}.json").unlink()

    lost = threading.Thread(target=forget, daemon=True)
    lost.start()
    attempt = slurm.attempt(1)
    lost.join()
    assert (attempt.state, attempt.ok) == ("LOST", False)
    assert attempt.detail == (
        f"slurm job {job_id} left the queue without an accounting record (sacct)"
    )
    assert ["scancel", job_id] in slurm_standin.calls(standin)  # in case it still runs
    assert any(x.startswith(f"scancel {job_id} failed: ") for x in logged)


def test_a_hanging_slurm_command_reads_as_a_failed_call():
    start = time.monotonic()
    done = _slurm([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)
    assert done.returncode == 124 and "no answer within 0.5 s" in done.stderr
    assert time.monotonic() - start < 10


class NoTracker:
    """``launch_attempts``' tracker where no MLflow run is open (every call a no-op)."""

    def params(self, run_id, values) -> None:
        pass

    def send_metrics_file(self, run_id, path) -> None:
        pass


@pytest.mark.slow
@pytest.mark.extended  # three jobs (~45 s): test_launch's shrink tests and the resume one cover it
def test_a_lost_node_shrinks_the_relaunch_and_returning_nodes_grow_it_back(tmp_path, monkeypatch):
    """cluster.on_node_loss=shrink on the stand-in: the first job (2 nodes, dp 2) loses node 1
    and the cluster is down to 1 node; the relaunch (sbatch --nodes=1-2) gets 1 and trains at
    dp 1, accumulation 4 (2 before); when the node is back (sinfo) that job is stopped at a
    checkpoint and the third trains on both to the end, every step logged once."""
    from test_multinode import free_port

    from flows.launch import launch_attempts

    state = tmp_path / "state"
    slurm_standin.install(tmp_path / "bin", state)
    path = [str(tmp_path / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    train = tmp_path / "train"
    train.mkdir()
    run = compose_run(
        [
            *BASE,
            "train.steps=12",
            "train.checkpoint_every=1",
            "parallel.dp=2",
            "cluster=slurm",
            "cluster.nodes=2",
            "cluster.procs_per_node=1",
            "cluster.gpus_per_node=0",
            "cluster.partition=standin",
            f"cluster.rdzv_port={free_port()}",
            "cluster.poll_s=0.2",
            "cluster.on_node_loss=shrink",
            f"out_dir={train}",
        ]
    )
    (train / "config.json").write_text(json.dumps(to_dict(run)))
    metrics, first = train / "metrics.jsonl", slurm_standin.FIRST_ID
    events: list[str] = []

    def steps() -> int:
        return len(metrics.read_text().splitlines()) if metrics.is_file() else 0

    def nodes_come_and_go() -> None:
        deadline = time.time() + 300
        while time.time() < deadline and steps() < 3:
            time.sleep(0.05)
        (state / "nodes_up").write_text("1")  # node 1 is lost: the cluster has 1 node left
        slurm_standin.kill_tree(slurm_standin.job(state, str(first))["node_pids"][1])
        events.append("lost")
        while time.time() < deadline:  # the relaunch resumes and logs a step of its own
            rows = [json.loads(x) for x in metrics.read_text().splitlines()]
            if (state / f"job-{first + 1}.json").is_file() and len(rows) > 3:
                break
            time.sleep(0.05)
        (state / "nodes_up").write_text("2")  # and it is back
        events.append("back")

    watcher = threading.Thread(target=nodes_come_and_go, daemon=True)
    watcher.start()
    logged: list[str] = []
    logger = logging.getLogger("test-shrink")
    monkeypatch.setattr(logger, "warning", lambda msg, *a: logged.append(msg % a))
    attempts = launch_attempts(SlurmLauncher(run, train, logged.append), NoTracker(), None, logger)
    watcher.join()
    assert events == ["lost", "back"]

    lost, shrunk, grown = attempts
    assert (lost.state, lost.nodes, lost.dp, lost.grow) == ("FAILED", 2, 2, False)
    assert (shrunk.nodes, shrunk.dp, shrunk.accumulation, shrunk.grow) == (1, 1, 4, True)
    assert (grown.state, grown.ok, grown.nodes, grown.dp, grown.accumulation) == (
        "COMPLETED",
        True,
        2,
        2,
        2,
    )
    sentence = "continuing on 1 of 2 nodes: dp 2 -> 1, accumulation 2 -> 4"
    assert f"slurm job {first + 1}: {sentence}" in logged  # the launcher's
    assert sentence in logged  # the trainer's, streamed from the job's log
    assert "stopped at step" in (train / f"slurm-{first + 1}.out").read_text()
    assert ["scancel", "--signal=TERM", str(first + 1)] in slurm_standin.calls(state)
    assert any(
        x.endswith("launching again, asking for all 2 nodes, resuming from " + x.split()[-1])
        for x in logged
    )
    assert json.loads((train / "launches.json").read_text()) == [a.record() for a in attempts]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == list(range(12))
    assert "--nodes=1-2" in (train / "slurm.sbatch").read_text()


def test_growing_back_counts_each_idle_node_once_and_only_where_the_job_runs(tmp_path, monkeypatch):
    """sinfo lists a node once per partition it is in, and without cluster.partition the job
    runs in the default one (``%P`` ends in ``*``): two idle nodes of the default partition
    (one of them in a second partition too) and a third of another partition are 2 nodes, too
    few with the job's 5 for 8; with cluster.partition=gpu the gpu partition's are counted."""
    import flows.launchers

    answers = {
        "": "node1 batch*\nnode1 debug\nnode2 batch*\nnode9 cpu\n",
        "gpu": "node5 gpu\nnode6 gpu\nnode7 gpu\n",
    }
    asked: list[list[str]] = []

    def sinfo(args, timeout_s=120.0):
        if args[0] == "squeue":  # the nodes the job holds: as many as it trains on
            return subprocess.CompletedProcess(args, 0, "", "")
        asked.append(args)
        part = next((a.split("=", 1)[1] for a in args if a.startswith("--partition=")), "")
        return subprocess.CompletedProcess(args, 0, answers[part], "")

    monkeypatch.setattr(flows.launchers, "_slurm", sinfo)
    for partition, five_more in ((None, False), ("gpu", True)):
        over = [f"cluster.partition={partition or 'null'}"]
        run = compose_run([*over, "cluster.on_node_loss=shrink"], config_name="pretrain-47b")
        slurm = SlurmLauncher(run, tmp_path, lambda _: None)
        assert slurm.all_nodes_free("7", 5) is five_more, partition
        assert slurm.all_nodes_free("7", 6) is True
        assert slurm.all_nodes_free("7", 4) is False
    assert all("--states=idle" in a for a in asked)


def test_growing_back_counts_the_nodes_the_job_holds_not_only_those_it_trains_on(
    tmp_path, monkeypatch
):
    """Given 7 of 8 nodes the job trains on 4 (the layout allows 2, 4, 8) but holds all 7:
    when the eighth is idle again all 8 are there, so it grows back (it counted 1 + 4)."""
    import flows.launchers

    def slurm(args, timeout_s=120.0):
        out = "7\n" if args[0] == "squeue" else "node8 gpu\n"
        return subprocess.CompletedProcess(args, 0, out, "")

    monkeypatch.setattr(flows.launchers, "_slurm", slurm)
    run = compose_run(["cluster.on_node_loss=shrink"], config_name="pretrain-47b")
    assert sorted(run.node_counts) == [2, 4, 8]
    slurm_launcher = SlurmLauncher(run, tmp_path, lambda _: None)
    assert slurm_launcher.nodes("7") == 4
    assert slurm_launcher.all_nodes_free("7", 4) is True
