"""The pretrain flow with ``cluster.kind=slurm`` against stand-ins for the Slurm commands
(``slurm_standin``): the rendered batch script really runs, 2 "nodes" x 1 rank joining a c10d
rendezvous on loopback (gloo), and the flow's code is the production code."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import slurm_standin
import torch
from helpers import copy_of, masters, run_pipeline, seeded_run
from test_multinode import free_port

from flows.launchers import LaunchTimeoutError
from flows.render import render_slurm
from moe_core.config import RunConfig
from moe_core.config_dict import from_dict

pytestmark = pytest.mark.slow


def one_sentence(message: str) -> bool:
    return message.endswith(".") and not re.search(r"[.!?]\s+[A-Z]", message)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, prefect_home):
    """The stand-in commands first on PATH (then this environment's torchrun); their state."""
    root = tmp_path_factory.mktemp("slurm")
    slurm_standin.install(root / "bin", root / "state")
    path = os.pathsep.join(
        [str(root / "bin"), str(Path(sys.executable).parent), os.environ["PATH"]]
    )
    before = os.environ["PATH"]
    os.environ["PATH"] = path
    yield root / "state"
    os.environ["PATH"] = before


def cluster(*more: str) -> list[str]:
    """pretrain-tiny's 2 ranks (ep 2) as 2 Slurm nodes of 1 rank each, polled often."""
    return [
        "cluster=slurm",
        "cluster.nodes=2",
        "cluster.procs_per_node=1",
        "cluster.gpus_per_node=0",
        "cluster.partition=standin",
        f"cluster.rdzv_port={free_port()}",
        "cluster.poll_s=0.2",
        *more,
    ]


def job_ids(state: Path, tool: str) -> list[str]:
    return [c[-1] for c in slurm_standin.calls(state) if c[0] == tool]


@pytest.fixture(scope="module")
def never_started(slurm, tiny_run, tmp_path_factory):
    """A first flow run whose job stays queued (tokenize and init done, from the session's
    tiny run), train times out. Its run directory is where the other tests start."""
    run_dir = seeded_run(tiny_run[0], tmp_path_factory.mktemp("held") / "run")
    (slurm / "hold").touch()
    try:
        with pytest.raises(LaunchTimeoutError) as err:
            run_pipeline(run_dir, cluster("cluster.start_timeout_s=1"))
    finally:
        (slurm / "hold").unlink()
    return run_dir, str(err.value)


def test_a_job_that_never_starts_times_out_and_is_cancelled(slurm, never_started):
    run_dir, message = never_started
    job_id = str(slurm_standin.FIRST_ID)  # the first job of the module
    assert job_ids(slurm, "sbatch")[0] == str(run_dir / "train" / "slurm.sbatch")
    assert message == (
        f"slurm job {job_id} did not start within cluster.start_timeout_s=1 s (still PENDING), "
        "so it was cancelled: check the partition and queue (squeue), or raise "
        "cluster.start_timeout_s."
    )
    assert one_sentence(message)
    assert job_ids(slurm, "scancel") == [job_id]
    assert slurm_standin.job(slurm, job_id)["state"] == "CANCELLED"
    stages = run_dir / "stages"
    assert (stages / "tokenize.json").is_file() and (stages / "init.json").is_file()
    assert not (stages / "train.json").exists()


@pytest.fixture(scope="module")
def resubmitted(slurm, never_started, tmp_path_factory) -> tuple[Path, dict, int]:
    """A flow run whose first job loses node 1 after three steps (its processes killed); the
    job fails, the stage resubmits it, the second job resumes and the flow runs to the end."""
    run_dir = copy_of(never_started[0], tmp_path_factory.mktemp("resubmitted") / "run")
    metrics = run_dir / "train" / "metrics.jsonl"
    first = int((slurm / "next_id").read_text())
    killed: list[int] = []

    def kill_node_1_mid_run() -> None:
        deadline = time.time() + 240
        while time.time() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
                node = slurm_standin.job(slurm, str(first))["node_pids"][1]
                slurm_standin.kill_tree(node)
                killed.append(node)
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_node_1_mid_run, daemon=True)
    watcher.start()
    outcome = run_pipeline(run_dir, cluster())
    watcher.join()
    assert killed, "node 1 was never killed"
    return run_dir, outcome, first


def test_a_killed_node_fails_the_job_which_is_resubmitted_and_resumes(resubmitted):
    run_dir, outcome, first = resubmitted
    failed, resumed = outcome["train"]["launches"]
    assert failed["job_id"] == str(first) and failed["state"] == "FAILED" and not failed["ok"]
    assert resumed["job_id"] == str(first + 1) and resumed["state"] == "COMPLETED"
    assert resumed["number"] == 2 and resumed["ok"]
    # what the failed job's nodes recorded, in one clause: node 1 was killed with its launcher,
    # so no rank's failure was recorded; no torchrun "Root Cause" summary in the job's log
    assert failed["detail"] == (
        f"slurm job {first} ended FAILED: no node recorded a failed rank, so the job's processes "
        "were killed from outside (a lost node, the out-of-memory killer or a cancellation)"
    ), failed["detail"]
    assert failed["context"] == f"the nodes' logs: {run_dir / 'train' / 'logs' / f'job-{first}'}"
    first_log = (run_dir / "train" / f"slurm-{first}.out").read_text()
    assert "Root Cause" not in first_log and "ChildFailedError" not in first_log
    assert (run_dir / "train" / "logs" / f"job-{first}" / "node-1").is_dir()
    log = (run_dir / "train" / f"slurm-{first + 1}.out").read_text()
    unwrapped = re.sub(r"\s*\n\s*", "", log)  # the console wraps a long checkpoint path
    resumed_at = re.search(r"resumed from\s*\S*step_(\d+)", unwrapped)
    assert resumed_at and int(resumed_at.group(1)) >= 2, "the second job resumes mid-run"
    steps = [json.loads(x)["step"] for x in (run_dir / "train" / "metrics.jsonl").open()]
    assert steps == list(range(8)), "every step once, the redone ones replaced"


def test_the_resumed_job_ends_with_the_weights_of_an_uninterrupted_run(resubmitted, tiny_run):
    """The session's tiny run trained the same config in one go, on one node with two ranks."""
    run_dir, _, _ = resubmitted
    reference, resumed = masters(tiny_run[0]), masters(run_dir)
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), "resume must be exact"


def test_the_flow_finishes_with_the_submitted_scripts_and_job_ids_recorded(slurm, resubmitted):
    from mlflow.tracking import MlflowClient

    run_dir, outcome, first = resubmitted
    assert outcome["stages"] == {
        "tokenize": "Skipped",
        "init": "Skipped",
        "train": "Completed",
        "convert": "Completed",
        "evaluate": "Completed",
    }
    script = run_dir / "train" / "slurm.sbatch"
    submitted = [c for c in slurm_standin.calls(slurm) if c[0] == "sbatch"][-2:]
    assert submitted == [["sbatch", "--parsable", str(script)]] * 2
    # What was submitted is the rendered script of the resolved config, kept for the user.
    resolved = from_dict(RunConfig, json.loads((run_dir / "train" / "config.json").read_text()))
    train_dir = str(run_dir / "train")
    assert script.read_text() == render_slurm(resolved, train_dir, f"{train_dir}/config.json")
    log = (run_dir / "train" / f"slurm-{first + 1}.out").read_text()
    assert f"moe_core: job {first + 1}, rendezvous on 127.0.0.1" in log
    launches = outcome["train"]["launches"]
    assert json.loads((run_dir / "train" / "launches.json").read_text()) == launches
    assert [a["script"] for a in launches] == [str(script)] * 2

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    train = client.get_run(json.loads((run_dir / "mlflow.json").read_text())["stages"]["train"])
    params = train.data.params
    for n, job_id in ((1, first), (2, first + 1)):
        assert params[f"launch.attempt_{n}.job_id"] == str(job_id)
        assert params[f"launch.attempt_{n}.script"] == str(script)
        assert params[f"launch.attempt_{n}.kind"] == "slurm"
    assert params["launch.attempt_1.state"] == "FAILED"
    # the layout each attempt trained at: all 2 nodes (on_node_loss=wait), pretrain-tiny's ep 2
    assert [(a["nodes"], a["dp"], a["accumulation"]) for a in launches] == [(2, 1, 1)] * 2
    assert (params["launch.attempt_2.nodes"], params["launch.attempt_2.dp"]) == ("2", "1")
    history = client.get_metric_history(train.info.run_id, "loss")
    assert sorted({m.step for m in history}) == list(range(8))


def test_cancelling_the_flow_run_scancels_the_job(slurm, never_started, tmp_path):
    """A Prefect worker cancels a flow run with SIGTERM; Prefect turns it into an exception in
    the flow's thread, and the train stage scancels its job on the way out."""
    from mlflow.tracking import MlflowClient
    from prefect.exceptions import TerminationSignal

    run_dir = copy_of(never_started[0], tmp_path / "run")
    job_id = (slurm / "next_id").read_text()
    trees: list[int] = []

    def cancel_once_running() -> None:
        deadline = time.time() + 120
        while time.time() < deadline:
            path = slurm / f"job-{job_id}.json"
            if path.is_file() and slurm_standin.job(slurm, job_id)["node_pids"]:
                nodes = slurm_standin.job(slurm, job_id)["node_pids"]
                trees.extend(p for n in nodes for p in slurm_standin.descendants(n))
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    # After its teardown Prefect hands SIGTERM to the handler it found (to end the process);
    # here that is one that records it, so pytest lives on.
    received: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))
    watcher = threading.Thread(target=cancel_once_running, daemon=True)
    try:
        watcher.start()
        with pytest.raises(TerminationSignal):
            run_pipeline(run_dir, cluster())
        watcher.join()
    finally:
        signal.signal(signal.SIGTERM, before)
    assert received == [signal.SIGTERM], "the process is told to end after the cleanup"
    assert trees, "the job never ran"
    assert ["scancel", job_id] in slurm_standin.calls(slurm)
    assert slurm_standin.job(slurm, job_id)["state"] == "CANCELLED"
    time.sleep(0.5)
    alive = [p for p in trees if Path(f"/proc/{p}").exists() and not zombie(p)]
    assert not alive, "the job's processes must end"
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    train = client.get_run(json.loads((run_dir / "mlflow.json").read_text())["stages"]["train"])
    assert train.info.status == "KILLED", "the stage is reported cancelled"
    assert not (run_dir / "stages" / "train.json").exists()


def test_a_stage_timeout_scancels_the_job(slurm, never_started, tmp_path):
    from prefect.task_engine import TaskRunTimeoutError

    run_dir = copy_of(never_started[0], tmp_path / "run")
    job_id = (slurm / "next_id").read_text()
    (slurm / "hold").touch()  # queued for good; only the stage's own limit ends the wait
    try:
        with pytest.raises(TaskRunTimeoutError):
            run_pipeline(run_dir, cluster("cluster.start_timeout_s=0", "cluster.train_timeout_s=2"))
    finally:
        (slurm / "hold").unlink()
    assert ["scancel", job_id] in slurm_standin.calls(slurm)
    assert slurm_standin.job(slurm, job_id)["state"] == "CANCELLED"


def test_kubernetes_without_cluster_access_is_refused_before_any_stage(
    prefect_home, tmp_path, monkeypatch
):
    from moe_core.config import ConfigError

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    overrides = [*cluster()[1:], "cluster=kubernetes", f"cluster.volume_path={tmp_path}"]
    with pytest.raises(ConfigError) as err:
        run_pipeline(tmp_path / "run", overrides)
    assert str(err.value) == (
        "cluster.kind='kubernetes' is not allowed on this machine: it has no in-cluster service "
        "account and no usable kubeconfig (run the pipeline where kubectl reaches the cluster, "
        "e.g. a worker of a Kubernetes work pool)."
    )
    assert not (tmp_path / "run").exists(), "nothing may start"


def zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] == "Z"
    except OSError:
        return False
