"""MLflow tracking never stops the pipeline, and nothing logged while it was away is lost."""

from __future__ import annotations

import json
import logging
import shutil
import socket

import pytest

from flows.tracking import Tracker, metric_rows


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket closes


def write_metrics(path, steps):
    with path.open("a") as f:
        for step in steps:
            f.write(json.dumps({"step": step, "loss": 5.0 - step, "lr": 1e-3}) + "\n")


@pytest.mark.slow
def test_unreachable_server_warns_and_the_lines_are_sent_later(tmp_path, caplog):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, range(3))
    with caplog.at_level(logging.WARNING):
        down = Tracker(tmp_path, f"http://127.0.0.1:{closed_port()}", "exp", "run")
    assert not down.online and "unreachable" in caplog.text
    assert down.stage("train") is None and down.send_metrics_file(None, metrics) == 0

    # The store is reachable again (here: the local sqlite store): everything is sent.
    up = Tracker(tmp_path, None, "exp", "run")
    run_id = up.stage("train")
    write_metrics(metrics, range(3, 5))
    assert up.send_metrics_file(run_id, metrics) == 5
    assert up.send_metrics_file(run_id, metrics) == 0  # nothing twice
    history = up.client.get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_every_invocation_that_runs_a_stage_gets_fresh_runs_and_the_folder_keeps_them(tmp_path):
    first = Tracker(tmp_path, None, "exp", "run")
    assert first.parent is None, "no run before a stage runs"
    stage = first.stage("train")
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, range(3))
    assert first.send_metrics_file(stage, metrics) == 3

    again = Tracker(tmp_path, None, "exp", "run")
    assert again.parent == first.parent, "the latest parent until this invocation runs a stage"
    redo = again.stage("train")
    assert redo != stage and again.parent != first.parent
    assert again.send_metrics_file(redo, metrics) == 3, "a fresh run gets the whole history"
    # A resumed training rewrote the file from step 2 on: no step reaches the run twice.
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")
    write_metrics(metrics, range(2, 5))
    assert again.send_metrics_file(redo, metrics) == 2
    assert [m.step for m in again.client.get_metric_history(redo, "loss")] == [0, 1, 2, 3, 4]
    assert [m.step for m in again.client.get_metric_history(stage, "loss")] == [0, 1, 2]

    state = json.loads((tmp_path / "mlflow.json").read_text())
    assert state["parents"] == [first.parent, again.parent] and state["parent"] == again.parent
    assert state["attempts"]["train"] == [stage, redo] and state["stages"]["train"] == redo
    runs = {r: again.client.get_run(r) for r in (*state["parents"], stage, redo)}
    assert [runs[r].info.run_name for r in state["parents"]] == ["run", "run #2"]
    assert {r.data.tags["moe.run_dir"] for r in runs.values()} == {str(tmp_path)}

    # Train reran (a changed config) while the store was away: a later rerun that skips it must
    # not name the earlier train run, or parent, whose params are the old config's.
    again.stage("tokenize")
    down = Tracker(tmp_path, f"http://127.0.0.1:{closed_port()}", "exp", "run")
    assert down.stage("train") is None
    later = Tracker(tmp_path, None, "exp", "run")
    assert later.parent is None and "train" not in later.state["stages"]
    assert later.state["stages"]["tokenize"] == again.state["stages"]["tokenize"]

    # A copy of the folder: its sqlite store named this folder as the artifacts' place, so the
    # copy's runs wrote their artifacts (an HF export among them) here.
    copy = tmp_path.with_name(f"{tmp_path.name}-copy")
    shutil.copytree(tmp_path, copy)
    moved = Tracker(copy, None, "exp", "run")
    (copy / "config.json").write_text("{}")
    moved.artifacts(moved.stage("train"), copy / "config.json")
    assert not list(tmp_path.rglob("config.json")) and list(copy.rglob("artifacts/config.json"))
    location = moved.client.get_run(stage).info.artifact_uri
    assert location.startswith((copy / "mlartifacts").resolve().as_uri())


def test_metric_rows_take_scalars_router_health_and_downstream_accuracy():
    line = {
        "step": 3,
        "loss": 2.5,
        "skipped": False,
        "ep_rows_per_token": 3.25,
        "router": {"layer_0": {"load_imbalance": 1.5, "load_share": [0.5, 0.5]}},
        "downstream": {"piqa_rc_0shot": {"acc": 0.75, "acc_raw": 0.5}},
        "ranks": {"work_s_max": 0.61, "slowest": 3, "stragglers": 1, "straggler_ranks": [3]},
    }
    assert metric_rows(line) == {
        "loss": 2.5,
        "ep_rows_per_token": 3.25,
        "router.layer_0.load_imbalance": 1.5,
        "downstream.piqa_rc_0shot.acc": 0.75,
        "downstream.piqa_rc_0shot.acc_raw": 0.5,
        "ranks.work_s_max": 0.61,  # the straggler report (moe_core.train.stragglers)
        "ranks.slowest": 3.0,
        "ranks.stragglers": 1.0,
    }


def test_a_checkpoints_cost_reaches_mlflow_beside_the_steps(tmp_path):
    """A ``checkpoints.jsonl`` line's numbers are metrics at its checkpoint's step, and the
    sender passes that file on with ``metrics.jsonl`` (at the end of an attempt too)."""
    from flows.launch import MetricsSender
    from moe_core.train.checkpoint import SaveCost

    cost = SaveCost(200, 0.5, 8.0, 4 * 10**9, background=True)
    assert metric_rows({"step": 200, **cost.record()}) == {
        "checkpoint/stall_s": 0.5,
        "checkpoint/durable_s": 8.0,
        "checkpoint/bytes": 4e9,
        "checkpoint/write_gbps": 0.5,
        "checkpoint/wait_s": 0.0,
    }

    sent: list[tuple[str, str]] = []

    class Seen:
        def send_metrics_file(self, run_id, path) -> None:
            sent.append((run_id, path.name))

    logs = (tmp_path / "metrics.jsonl", tmp_path / "checkpoints.jsonl")
    with MetricsSender(Seen(), "run", *logs, every_s=3600):
        pass
    assert sent == [("run", "metrics.jsonl"), ("run", "checkpoints.jsonl")]


def test_metric_rows_keep_the_mtp_loss_apart_from_the_loss_and_per_depth():
    line = {"step": 3, "loss": 2.5, "mtp_loss": 3.25, "mtp_losses": [3.0, 3.5]}
    assert metric_rows(line) == {
        "loss": 2.5,
        "mtp_loss": 3.25,
        "mtp_loss.0": 3.0,
        "mtp_loss.1": 3.5,
    }


@pytest.mark.slow
def test_tracking_follows_the_environment_and_tags_the_experiment_as_model_training(
    tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    shared = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", shared)
    for d in ("run", "other"):
        (tmp_path / d).mkdir()
    tracker = Tracker(tmp_path / "run", None, "exp", "run")
    tracker.stage("tokenize")
    assert tracker.uri == shared and not (tmp_path / "run" / "mlflow.db").exists()
    exp = MlflowClient(shared).get_experiment_by_name("exp")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    tracker.note(tracker.parent, "first line")
    tracker.note(tracker.parent, "second line")
    tags = MlflowClient(shared).get_run(tracker.parent).data.tags
    assert tags["mlflow.note.content"] == "first line\n\nsecond line"
    explicit = Tracker(tmp_path / "other", f"sqlite:///{tmp_path / 'own.db'}", "exp", "run")
    assert explicit.uri.endswith("own.db")  # the config's own server wins over the environment


def test_the_summary_offers_no_mlflow_ui_for_a_store_that_was_not_reached():
    from flows.report import summary_line
    from flows.tracking import ui_command

    outcome = {"hf_dir": "run/hf", "stages": {"train": "Completed"}, "mlflow_run": None}
    line = summary_line(outcome)
    assert "MLflow run" not in line
    assert "MLflow: unreachable, so there is nothing to browse yet" in line
    reached = summary_line(outcome | {"mlflow_reached": True})  # every stage skipped, no run
    assert "MLflow: no run holds these outputs (made while the store was away)" in reached
    outcome["mlflow_run"] = "http://127.0.0.1:5000/#/experiments/1/runs/abc"
    outcome["mlflow_ui"] = ui_command("sqlite:///run/mlflow.db")
    assert summary_line(outcome).endswith(
        "; MLflow run: http://127.0.0.1:5000/#/experiments/1/runs/abc (once "
        "`MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1 "
        "--backend-store-uri sqlite:///run/mlflow.db` serves it)"
    )


def test_the_summary_names_the_losses_from_the_first_step_and_the_relaunches():
    from flows.report import summary_text

    launches = [
        {"number": 2, "ok": False, "detail": "training exited with code 1"},
        {"number": 3, "ok": True, "detail": "training exited with code 0"},
    ]
    outcome = {
        "run_dir": "/runs/tiny",
        "hf_dir": "/runs/tiny/hf",
        "stages": {"tokenize": "Skipped", "train": "Completed"},
        "train": {"first_loss": 8.3, "final_loss": 4.8, "steps": 150, "launches": launches},
        "evaluate": {"perplexity": 102.26, "hf_perplexity": 102.261},
        "mlflow_run": "http://mlflow:5000/#/experiments/1/runs/abc",
        "mlflow_ui": None,
    }
    lines = summary_text(outcome).splitlines()
    assert lines[0] == "pipeline done: /runs/tiny"
    rows = {line[:27].strip(): line[27:] for line in lines[1:]}
    assert rows == {
        "Hugging Face checkpoint": "/runs/tiny/hf",
        "held-out perplexity": "102.260 (transformers: 102.261)",
        "loss": "8.3000 -> 4.8000 over 150 steps",
        "training launches": "2 (relaunched after: training exited with code 1), after 1 "
        "launch by an interrupted pipeline",
        "skipped (verified)": "tokenize",
        "MLflow run": "http://mlflow:5000/#/experiments/1/runs/abc",
    }


def tracking_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "flows.tracking"]


@pytest.mark.slow
def test_a_damaged_mlflow_json_is_set_aside_in_one_line_and_tracking_starts_afresh(
    tmp_path, caplog
):
    state = tmp_path / "mlflow.json"
    for n, damage in enumerate(['{"parent": "1a2b", "stag', '["not", "ours"]'], start=1):
        state.write_text(damage)
        with caplog.at_level(logging.WARNING):
            tracker = Tracker(tmp_path, None, "exp", "run")
        (line,) = tracking_warnings(caplog)
        assert line.startswith(f"{state} is damaged (") and "\n" not in line
        assert f"set aside as mlflow.json.damaged-{n}; this run's MLflow runs start afresh" in line
        assert (tmp_path / f"mlflow.json.damaged-{n}").read_text() == damage, "kept as it was"
        assert tracker.online and tracker.parent is None and tracker.stage("train") is not None
        assert json.loads(state.read_text())["stages"]["train"] == tracker.state["stages"]["train"]
        caplog.clear()


def test_a_corrupt_or_locked_sqlite_store_is_one_line_and_the_pipeline_goes_on(tmp_path, caplog):
    import contextlib
    import sqlite3

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    garbage = b"these bytes are no sqlite database " * 200
    (corrupt / "mlflow.db").write_bytes(garbage)
    with caplog.at_level(logging.WARNING):
        tracker = Tracker(corrupt, None, "exp", "run")
    (line,) = tracking_warnings(caplog)
    assert f"MLflow's store sqlite:///{corrupt}/mlflow.db cannot be used (file is not a" in line
    assert line.endswith("stop what holds it or move the file aside.") and "\n" not in line
    assert not tracker.online and tracker.stage("train") is None
    assert (corrupt / "mlflow.db").read_bytes() == garbage, "the store is left as it was"

    caplog.clear()
    store = tmp_path / "locked.db"
    with contextlib.closing(sqlite3.connect(store, isolation_level=None)) as holder:
        holder.execute("CREATE TABLE t (x)")
        holder.execute("BEGIN EXCLUSIVE")  # as another process writing to it
        with caplog.at_level(logging.WARNING):
            tracker = Tracker(tmp_path, f"sqlite:///{store}", "exp", "run")
        holder.execute("ROLLBACK")
    (line,) = tracking_warnings(caplog)
    assert f"MLflow's store sqlite:///{store} cannot be used (database is locked)" in line
    assert not tracker.online and tracker.stage("train") is None
