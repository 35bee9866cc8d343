"""infra/: the start scripts really start MLflow and Prefect on loopback (and stop them), the
deploy script registers a prefect.yaml, the container recipe installs the project."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from helpers import seeded_run

ROOT = Path(__file__).resolve().parent.parent
INFRA = ROOT / "infra"
STAGE_NAMES = ["tokenize", "init", "train", "convert", "evaluate"]
SCRIPTS = ["start-prefect-server.sh", "start-worker.sh", "start-mlflow.sh", "deploy.sh", "stop.sh"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies awaiting their reaper do not)."""
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_file.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


class Services:
    """Runs infra scripts with a private state folder; stops whatever they started."""

    def __init__(self, state: Path) -> None:
        self.state = state
        bin_dir = str(Path(sys.executable).parent)  # this environment's prefect and mlflow
        self.env = {
            **os.environ,
            "MOE_INFRA_DIR": str(state),
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_HOME": str(state / "prefect"),
            "MOE_STOP_GRACE": "3",  # then a second TERM (a Prefect worker's "now"), then KILL
            "PREFECT_WORKER_QUERY_SECONDS": "1",  # workers poll each second (default 10 s)
        }
        self.env.pop("PREFECT_API_URL", None)
        self.env.pop("MLFLOW_TRACKING_URI", None)

    def run(self, script: str, *args: str, timeout: int = 150) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", str(INFRA / script), *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pid(self, name: str) -> int:
        return int((self.state / f"{name}.pid").read_text())

    def stop_all(self) -> None:
        """Workers first, then servers (a server waits for its clients' connections)."""
        pidfiles = sorted(self.state.glob("*.pid"), key=lambda p: not p.stem.startswith("worker"))
        for pidfile in pidfiles:
            pid = int(pidfile.read_text())
            self.run("stop.sh", pidfile.stem, timeout=60)
            if group_alive(pid):  # stop.sh failed: end the group we started ourselves
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    s = Services(tmp_path / "state")
    try:
        yield s
    finally:
        s.stop_all()


def get_json(url: str, body: dict | None = None) -> dict | list:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"Content-Type": "application/json"},
        method="POST" if data else "GET",
    )
    with urllib.request.urlopen(req, timeout=30) as response:
        return json.load(response)


@pytest.mark.slow
def test_mlflow_server_records_a_run(services: Services, tmp_path: Path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    port, store = free_port(), tmp_path / "mlflow"
    started = services.run("start-mlflow.sh", str(port), str(store))
    assert started.returncode == 0, started.stderr + started.stdout
    pid = services.pid("mlflow")
    url = f"http://127.0.0.1:{port}"
    assert f"started mlflow server: {url} (pid {pid}," in started.stdout

    client = MlflowClient(tracking_uri=url)
    experiment = client.create_experiment("infra-test")
    run = client.create_run(experiment, run_name="smoke")
    client.log_param(run.info.run_id, "layout", "pp1-dp1-ep2")
    for step, loss in enumerate([3.0, 2.5, 2.25]):
        client.log_metric(run.info.run_id, "loss", loss, step=step)
    client.log_text(run.info.run_id, "hello from the test", "notes/hello.txt")
    client.set_terminated(run.info.run_id)

    found = get_json(f"{url}/api/2.0/mlflow/experiments/search?max_results=100")
    by_name = {e["name"]: e["experiment_id"] for e in found["experiments"]}
    assert by_name["infra-test"] == experiment
    runs = get_json(f"{url}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment]})
    (record,) = runs["runs"]
    assert record["info"]["run_name"] == "smoke" and record["info"]["status"] == "FINISHED"
    assert {"key": "layout", "value": "pp1-dp1-ep2"} in record["data"]["params"]
    assert [m["value"] for m in record["data"]["metrics"] if m["key"] == "loss"] == [2.25]
    # Artifacts go through the server into the folder given to the script.
    (artifact,) = (store / "artifacts").rglob("hello.txt")
    assert artifact.read_text() == "hello from the test"
    assert (store / "mlflow.db").is_file()

    stopped = services.run("stop.sh", "mlflow")
    assert stopped.returncode == 0 and f"stopped mlflow (pid {pid})" in stopped.stdout
    assert not group_alive(pid)


@pytest.mark.parametrize("script", ["start-mlflow.sh", "start-prefect-server.sh"])
def test_servers_refuse_a_busy_port(services: Services, script: str):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = services.run(script, str(port), timeout=30)
    assert done.returncode == 1
    assert f"error: port {port} on 127.0.0.1 is in use" in done.stderr
    assert not list(services.state.glob("*.pid"))  # nothing was started


def test_deploy_refuses_a_missing_file(services: Services, tmp_path: Path):
    done = services.run("deploy.sh", str(tmp_path / "nowhere.yaml"), timeout=30)
    assert done.returncode == 1 and "nowhere.yaml does not exist" in done.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_scripts_parse_and_stay_on_loopback(script: str):
    path = INFRA / script
    assert os.access(path, os.X_OK), f"{script} is not executable"
    syntax = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    text = path.read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text
    hosts = set(re.findall(r"--host\s+(\S+)", text))
    assert hosts <= {"127.0.0.1"}


def test_shared_shell_helpers_parse():
    syntax = subprocess.run(
        ["bash", "-n", str(INFRA / "common.sh")], capture_output=True, text=True
    )
    assert syntax.returncode == 0, syntax.stderr
    assert all("common.sh" in (INFRA / script).read_text() for script in SCRIPTS)


def test_containerfile_installs_the_project_with_the_gpu_extra():
    lines = [
        line.strip()
        for line in (INFRA / "Containerfile").read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    base = next(line for line in lines if line.startswith("ARG BASE_IMAGE="))
    assert re.fullmatch(r"ARG BASE_IMAGE=nvidia/cuda:\d+\.\d+\.\d+-\w+(-\w+)*-ubuntu\d+\.\d+", base)
    assert lines[lines.index(base) + 1] == "FROM ${BASE_IMAGE}"
    joined = "\n".join(lines)
    assert 'pip install --no-cache-dir -e ".[gpu]"' in joined
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "gpu" in pyproject["project"]["optional-dependencies"]
    packages = [
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    for folder in [*packages, "conf"]:
        assert f"COPY {folder} ./{folder}" in lines, folder
        assert (ROOT / folder).is_dir()
    assert "COPY pyproject.toml README.md ./" in lines
    assert lines[-1].startswith("CMD [")
    # Every RUN that calls apt-get cleans its lists in the same layer.
    for run in re.findall(
        r"RUN apt-get[^\n]*(?:\n(?!RUN|ENV|COPY|WORKDIR|CMD|ARG|FROM)[^\n]*)*", joined
    ):
        assert "rm -rf /var/lib/apt/lists/*" in run


def test_committed_prefect_yaml_is_what_deployments_renders():
    from flows.deployments import render

    assert (INFRA / "prefect.yaml").read_text() == render(), (
        "regenerate it: python -m flows.deployments > infra/prefect.yaml"
    )
    pools = {d["name"]: d["work_pool"]["name"] for d in yaml.safe_load(render())["deployments"]}
    assert pools == {
        "tiny": "local",
        "olmoe-1b-7b": "local",
        "47b": "slurm",
        "47b-kubernetes": "kubernetes",
        "1t": "slurm",
        "1t-kubernetes": "kubernetes",
    }


@pytest.mark.slow
def test_deployments_from_prefect_yaml_run_through_a_worker(
    services: Services, tiny_run: tuple[Path, dict], tmp_path: Path
):
    """The committed infra/prefect.yaml, deployed to a real server while an MLflow server runs:
    `prefect deployment run pretrain/tiny --watch` completes through a process worker, shows
    its summary and progress, publishes the stages' artifacts and logs to that MLflow server
    (the Prefect variable deploy.sh set); `pretrain/1t` refuses with the plan and one sentence;
    the Kubernetes twins deploy into a pool made from infra/kubernetes-pool.json."""
    from mlflow.tracking import MlflowClient

    from moe_core.compose import compose_dict

    port, mlflow_port = free_port(), free_port()
    api = f"http://127.0.0.1:{port}/api"
    mlflow_url = f"http://127.0.0.1:{mlflow_port}"
    started = services.run("start-prefect-server.sh", str(port))
    assert started.returncode == 0, started.stderr + started.stdout
    server_pid = services.pid("prefect-server")
    assert f"started prefect server: {api} (pid {server_pid}," in started.stdout
    assert get_json(f"{api}/health") is True
    worker = services.run("start-worker.sh", "local", api)
    assert worker.returncode == 0, worker.stderr + worker.stdout
    worker_pid = services.pid("worker-local")
    assert f"started prefect worker: pool local on {api} (pid {worker_pid}," in worker.stdout
    assert get_json(f"{api}/work_pools/local")["type"] == "process"
    assert len(get_json(f"{api}/work_pools/local/workers/filter", {})) == 1
    # pretrain/1t's pool is `slurm` (a login node's worker); here a machine without sbatch.
    assert services.run("start-worker.sh", "slurm", api).returncode == 0
    # The Kubernetes pool as infra/README.md makes it (its worker runs in the cluster).
    pool = ["work-pool", "create", "kubernetes", "--type", "kubernetes"]
    pool += ["--base-job-template", str(INFRA / "kubernetes-pool.json")]
    made = subprocess.run(["prefect", *pool], env={**services.env, "PREFECT_API_URL": api},
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert made.returncode == 0, made.stderr + made.stdout
    assert services.run("start-mlflow.sh", str(mlflow_port), str(tmp_path / "ml")).returncode == 0
    services.env["MLFLOW_TRACKING_URI"] = mlflow_url  # what deploy.sh checks; workers lack it
    deployed = services.run("deploy.sh", str(INFRA / "prefect.yaml"), api)
    del services.env["MLFLOW_TRACKING_URI"]
    assert deployed.returncode == 0, deployed.stderr + deployed.stdout
    assert f"flow runs log to MLflow at {mlflow_url}" in deployed.stdout
    assert get_json(f"{api}/variables/name/mlflow_tracking_uri")["value"] == mlflow_url
    deployments = {d["name"]: d for d in get_json(f"{api}/deployments/filter", {})}
    assert set(deployments) == {
        "tiny", "olmoe-1b-7b", "47b", "47b-kubernetes", "1t", "1t-kubernetes"
    }  # fmt: skip
    k8s = deployments["1t-kubernetes"]
    assert k8s["work_pool_name"] == "kubernetes"
    assert k8s["job_variables"]["volume_path"] == "/runs"

    small = [
        "train.steps=4", "train.checkpoint_every=2", "train.eval_every=4",
        "data.max_documents=400", "data.validation_fraction=0.05", "data.workers=1",
    ]  # fmt: skip
    params = {
        "config": compose_dict(small, config_name="pretrain-tiny"),
        # The session's tiny run tokenized and initialized this config already: the flow run
        # skips those two stages and trains, converts and evaluates through the worker.
        "run_dir": str(seeded_run(tiny_run[0], tmp_path / "tiny")),
    }
    env = {**services.env, "PREFECT_API_URL": api}

    watched: dict[str, str] = {}

    def run(name: str, parameters: dict | None = None) -> dict:
        cmd = [
            "prefect",
            "deployment",
            "run",
            f"pretrain/{name}",
            "--watch",
            "--watch-interval",
            "1",
        ]
        if parameters is not None:
            cmd += ["--params", json.dumps(parameters)]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
        watched[name] = " ".join((done.stdout + done.stderr).split())  # rich wraps at 80
        runs = get_json(f"{api}/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC", "limit": 1})
        return runs[0]

    tiny = run("tiny", params)
    assert tiny["state"]["type"] == "COMPLETED", tiny["state"]
    assert (tmp_path / "tiny" / "hf" / "config.json").is_file()
    perplexity = json.loads((tmp_path / "tiny" / "eval" / "result.json").read_text())["perplexity"]
    assert perplexity > 1
    summary = tiny["state"]["message"]
    assert summary.startswith(f"done: Hugging Face checkpoint: {tmp_path / 'tiny' / 'hf'}; ")
    assert f"held-out perplexity: {perplexity:.3f}" in summary
    assert f"MLflow run: {mlflow_url}/#/experiments/" in summary
    shown = "Finished in state Completed('done: Hugging Face checkpoint:"
    assert shown in watched["tiny"], watched["tiny"][-3000:]  # --watch streams the log
    # (tokenize and init were done by the session's run; evaluate's progress streams)
    assert "evaluate: 4 of 4 held-out micro-batches scored" in watched["tiny"]
    of_run = {"artifacts": {"flow_run_id": {"any_": [tiny["id"]]}}}
    keys = {a["key"] for a in get_json(f"{api}/artifacts/filter", of_run)}
    assert keys == {f"tiny-{n}" for n in (*STAGE_NAMES, "pretrain")}
    client = MlflowClient(mlflow_url)
    runs = client.search_runs([client.get_experiment_by_name("moe_core").experiment_id])
    # tokenize and init were skipped (verified outputs of the session's run): no runs of theirs
    assert sorted(r.info.run_name for r in runs) == sorted(["tiny", "train", "convert", "evaluate"])
    assert not (tmp_path / "tiny" / "mlflow.db").exists(), "the server, not the run folder"

    big = run(
        "1t",
        {"config": compose_dict([], config_name="pretrain-1t"), "run_dir": str(tmp_path / "1t")},
    )
    assert big["state"]["type"] == "FAILED"
    assert big["state"]["message"].startswith("cluster.kind='slurm' is not allowed on this machine")
    logs = get_json(
        f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [big["id"]]}}, "limit": 200}
    )
    text = "\n".join(entry["message"] for entry in logs)
    assert "cluster.kind='slurm' is not allowed on this machine" in text, text[-2000:]
    assert "plan for 1t" in text and "per GPU" in text
    assert "Traceback" not in text, "an expected refusal is one sentence"
    assert "cluster.kind='slurm' is not allowed on this machine" in watched["1t"]
    assert not (tmp_path / "1t" / "data").exists(), "nothing may start"

    services.stop_all()  # infra/stop.sh ends each service with its children
    assert not group_alive(worker_pid) and not group_alive(server_pid)


@pytest.mark.slow
def test_the_local_stack_steps_of_infra_readme_run_as_written(tmp_path: Path):
    """infra/README.md's "A local stack, step by step", run line by line in a fresh clone (its
    ports made free ones): a server, a worker, MLflow, the deploy (which takes what the running
    pools can and names what it left out), `prefect deployment run 'pretrain/tiny' --watch` to
    a completed run that logged to that MLflow server, and the services stopped."""
    text = (INFRA / "README.md").read_text()
    steps = re.search(r"## A local stack, step by step\n\n```bash\n(.*?)```", text, re.S)
    assert steps is not None, "infra/README.md lost its local stack steps"
    prefect_port, mlflow_port = free_port(), free_port()
    script = steps.group(1).replace("4200", str(prefect_port)).replace("5000", str(mlflow_port))
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    # `. .venv/bin/activate`, the README's first step: this test's environment.
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "activate").write_text(
        f'export PATH="{Path(sys.executable).parent}:$PATH"\n'
    )
    state = tmp_path / "state"
    services = Services(state)
    env = {**services.env, "MLFLOW_PORT": str(mlflow_port)}  # deploy.sh's default MLflow port
    env.pop("PYTHONPATH", None)  # the clone's code, as a fresh user runs it
    env.pop("PREFECT_HOME", None)  # the scripts' own, under MOE_INFRA_DIR
    try:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        shown = " ".join((done.stdout + done.stderr).split())  # rich wraps at 80 columns
        assert done.returncode == 0, shown[-4000:]
        assert "deployed olmoe-1b-7b, tiny to " in shown
        assert "left out 1t, 47b: the server has no work pool 'slurm' yet" in shown
        assert "left out 1t-kubernetes, 47b-kubernetes: the server has no work pool" in shown
        assert f"flow runs log to MLflow at http://127.0.0.1:{mlflow_port}" in shown
        assert "Finished in state Completed('done: Hugging Face checkpoint: " in shown
        (run,) = (clone / "runs" / "tiny").iterdir()  # the flow run's own folder
        assert (run / "hf" / "config.json").is_file()
        assert not (run / "mlflow.db").exists(), "the MLflow server, not the run folder"
        # The last step stopped each service it started (server, worker, MLflow).
        pids = [int(p) for p in re.findall(r"^started [^\n]*\(pid (\d+),", done.stdout, re.M)]
        assert len(pids) == 3 and not any(group_alive(pid) for pid in pids)
        assert not list(state.glob("*.pid"))
    finally:
        services.stop_all()  # what a failed step left running
