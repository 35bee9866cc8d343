"""`moe pipeline`: run-directory argument, Hydra sweep expansion, registration in `moe`."""

from __future__ import annotations

from flows.cli import split_run_dir
from moe_core.cli import build_parser
from moe_core.compose import sweep


def test_sweep_expands_hydra_sweep_overrides_into_combinations():
    combos = sweep(["train.lr=1e-3,3e-3", "model=tiny", "train.steps=range(10,30,10)"])
    assert len(combos) == 4
    assert ["train.lr=0.001", "model=tiny", "train.steps=10"] in combos
    assert ["train.lr=0.003", "model=tiny", "train.steps=20"] in combos


def test_run_dir_is_the_pipelines_own_argument():
    assert split_run_dir(["run_dir=/x", "train.steps=3"], "runs/d") == ("/x", ["train.steps=3"])
    assert split_run_dir(["train.steps=3"], "runs/d") == ("runs/d", ["train.steps=3"])


def test_pipeline_command_is_registered_through_the_entry_point():
    args = build_parser().parse_args(["pipeline", "--multirun", "train.lr=1e-3,3e-3"])
    assert args.command == "pipeline" and args.multirun and args.config_name == "pretrain-tiny"


def test_prefect_telemetry_is_off_in_every_process_that_imports_the_flows():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    code = "import flows, os; print(os.environ['PREFECT_SERVER_ANALYTICS_ENABLED'])"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "false", done.stderr
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "true"  # the user's own choice stands
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "true", done.stderr


def test_a_deployment_run_without_run_dir_gets_a_folder_of_its_own(monkeypatch):
    from flows.pretrain import default_run_dir

    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__NAME", "tiny")
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "brave-otter")
    assert default_run_dir() == "runs/tiny/brave-otter"
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__NAME", "calm-heron")
    assert default_run_dir() == "runs/tiny/calm-heron"
    # On Kubernetes the folder lies on the volume the training pods mount.
    cluster = {"kind": "kubernetes", "volume_path": "/mnt/runs/"}
    assert default_run_dir(cluster) == "/mnt/runs/runs/tiny/calm-heron"
    assert default_run_dir({"kind": "kubernetes"}) == "/runs/runs/tiny/calm-heron"


def test_generated_deployments_leave_the_run_folder_to_each_flow_run():
    import yaml

    from flows.deployments import render

    for d in yaml.safe_load(render())["deployments"]:
        assert set(d["parameters"]) == {"config"}, d["name"]


def test_prefects_engine_does_not_log_a_refusal_again_with_its_traceback():
    import logging

    from flows.report import RefusalTraceback, quiet_refusals
    from moe_core.config import ConfigError
    from moe_core.errors import RunFailedError

    def record(exc: Exception) -> logging.LogRecord:
        message = "Engine execution exited with unexpected exception"
        info = (type(exc), exc, None)
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, message, (), info)

    keep = RefusalTraceback()
    assert not keep.filter(record(ConfigError("model.top_k=9 is not allowed: at most 8.")))
    assert not keep.filter(record(RunFailedError("training exited with code 1 on attempt 3 of 3.")))
    assert keep.filter(record(RuntimeError("a bug: its traceback stays")))
    quiet_refusals()
    quiet_refusals()
    filters = logging.getLogger("prefect.flow_runs").filters
    assert sum(isinstance(f, RefusalTraceback) for f in filters) == 1


def _python(code: str, tmp_path, **env: str):
    """``code`` in a fresh Python (a private Prefect home, no Prefect server configured)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    base |= {"PREFECT_HOME": str(tmp_path / "prefect"), **env}
    return subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True)


def test_prefects_temporary_server_gets_minutes_to_start_unless_the_user_chose_a_time(tmp_path):
    code = (
        "from flows.cli import server_startup_time\n"
        "from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS as s\n"
        "with server_startup_time():\n"
        "    print(s.value())\n"
    )
    done = _python(code, tmp_path)
    assert done.stdout.strip() == "180", done.stderr
    done = _python(code, tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="45")
    assert done.stdout.strip() == "45", done.stderr


def test_a_temporary_server_that_does_not_start_is_one_sentence_naming_the_setting(tmp_path):
    code = (
        "import sys\nfrom moe_core.cli import main\n"
        f"sys.exit(main(['pipeline', 'run_dir={tmp_path / 'run'}']))"
    )
    done = _python(code, tmp_path, PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    assert (
        "error: Prefect's temporary API server did not start within 1 s (a busy machine): set "
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS higher, or PREFECT_API_URL to a running "
        "server." in " ".join(output.split())
    )
