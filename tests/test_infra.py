"""infra/: the start scripts really start MLflow and Prefect on loopback (and stop them), the
deploy script registers a prefect.yaml, the container recipe installs the project."""

from __future__ import annotations

import json
import os
import re
import shlex
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


SMALL_TINY = [
    "train.steps=2", "train.checkpoint_every=2", "data.max_documents=200",
    "data.validation_fraction=0.1", "data.workers=1",
]  # fmt: skip


@pytest.mark.slow
def test_the_local_stack_steps_of_infra_readme_run_as_written(tmp_path: Path):
    """infra/README.md's "A local stack, step by step", run line by line in a fresh clone (its
    ports made free ones, the tiny run made small: ``SMALL_TINY``): a server, a worker, MLflow,
    the deploy (which takes what the running pools can and names what it left out),
    `prefect deployment run 'pretrain/tiny' --watch` to a completed run that published its
    stages' artifacts and logged to that MLflow server, and the last step stopping every
    service."""
    from mlflow.tracking import MlflowClient

    from moe_core.compose import compose_dict

    text = (INFRA / "README.md").read_text()
    steps = re.search(r"## A local stack, step by step\n\n```bash\n(.*?)```", text, re.S)
    assert steps is not None, "infra/README.md lost its local stack steps"
    prefect_port, mlflow_port = free_port(), free_port()
    script = steps.group(1).replace("4200", str(prefect_port)).replace("5000", str(mlflow_port))
    *lines, stop = [x for x in script.splitlines() if x.strip() and not x.startswith("#")]
    assert stop.startswith("infra/stop.sh "), "the steps end by stopping the services"
    tiny = "prefect deployment run 'pretrain/tiny' --watch"
    small = json.dumps({"config": compose_dict(SMALL_TINY, config_name="pretrain-tiny")})
    lines = [x.replace(tiny, f"{tiny} --params {shlex.quote(small)}") for x in lines]
    assert sum(tiny in x for x in lines) == 1, "the steps run pretrain/tiny"
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, timeout=300)
    # `. .venv/bin/activate`, the README's first step: this test's environment.
    (clone / ".venv" / "bin").mkdir(parents=True)
    (clone / ".venv" / "bin" / "activate").write_text(
        f'export PATH="{Path(sys.executable).parent}:$PATH"\n'
    )
    services = Services(tmp_path / "state")
    env = {**services.env, "MLFLOW_PORT": str(mlflow_port)}  # deploy.sh's default MLflow port
    env.pop("PYTHONPATH", None)  # the clone's code, as a fresh user runs it
    env.pop("PREFECT_HOME", None)  # the scripts' own, under MOE_INFRA_DIR
    api, mlflow_url = f"http://127.0.0.1:{prefect_port}/api", f"http://127.0.0.1:{mlflow_port}"

    def bash(commands: str, timeout: int = 1200) -> tuple[subprocess.CompletedProcess, str]:
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", commands],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return done, " ".join((done.stdout + done.stderr).split())  # rich wraps at 80 columns

    try:
        done, shown = bash("\n".join(lines))
        assert done.returncode == 0, shown[-4000:]
        assert "deployed olmoe-1b-7b, tiny to " in shown
        assert "left out 1t, 47b: the server has no work pool 'slurm' yet" in shown
        assert "left out 1t-kubernetes, 47b-kubernetes: the server has no work pool" in shown
        assert f"flow runs log to MLflow at {mlflow_url}" in shown
        assert "Finished in state Completed('done: Hugging Face checkpoint: " in shown
        assert f"MLflow run: {mlflow_url}/#/experiments/" in shown
        (run,) = (clone / "runs" / "tiny").iterdir()  # the flow run's own folder
        assert (run / "hf" / "config.json").is_file()
        assert not (run / "mlflow.db").exists(), "the MLflow server, not the run folder"
        flow_run = get_json(f"{api}/flow_runs/filter", {"sort": "EXPECTED_START_TIME_DESC"})[0]
        of_run = {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}}
        keys = {a["key"] for a in get_json(f"{api}/artifacts/filter", of_run)}
        assert keys == {f"{run.name}-{n}" for n in (*STAGE_NAMES, "pretrain")}
        client = MlflowClient(mlflow_url)
        runs = client.search_runs([client.get_experiment_by_name("moe_core").experiment_id])
        assert sorted(r.info.run_name for r in runs) == sorted([run.name, *STAGE_NAMES])

        # The last step stops each service the steps started (server, worker, MLflow).
        pids = [int(p) for p in re.findall(r"^started [^\n]*\(pid (\d+),", done.stdout, re.M)]
        assert len(pids) == 3
        stopped, said = bash(stop)
        assert stopped.returncode == 0, said[-2000:]
        assert not any(group_alive(pid) for pid in pids)
        assert not list(services.state.glob("*.pid"))
    finally:
        services.stop_all()  # what a failed step left running
