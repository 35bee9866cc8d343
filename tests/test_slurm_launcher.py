"""The Slurm launcher's reading of job states, against the stand-in commands (``slurm_standin``)
with jobs that never run: no training, so these take a second or two."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import slurm_standin

from flows.launchers import SlurmLauncher, _slurm
from moe_core.compose import compose_run


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
