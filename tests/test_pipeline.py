"""The pretrain flow end to end on CPU: stages, resume, tracking (Prefect + MLflow + torchrun)."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    SMALL,
    artifacts,
    chromium,
    copy_of,
    flow_runs,
    masters,
    run_logs,
    run_pipeline,
    seeded_run,
    write_toy_tasks,
)

from flows.pretrain import NAMES as STAGES
from moe_core.compose import compose_dict


@pytest.fixture(scope="module")
def finished(prefect_home, tiny_run) -> tuple[Path, dict]:
    """The session's tiny run (read only here: tests that change a run take a copy)."""
    return tiny_run


@pytest.mark.slow
def test_stages_publish_artifacts_and_the_final_state_carries_the_summary(finished):
    run_dir, outcome = finished
    first = flow_runs(run_dir)[0]
    assert first.state.type.value == "COMPLETED"
    message = first.state.message
    assert message.startswith(f"done: Hugging Face checkpoint: {run_dir}/hf; held-out perplexity: ")
    assert f"perplexity: {outcome['perplexity']:.3f}" in message
    lines = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert f"; loss: {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f} over 8 steps" in message
    assert "; training launches: 1; " in message
    parent = json.loads((run_dir / "mlflow.json").read_text())["parent"]
    assert outcome["mlflow_run"] == (
        f"http://127.0.0.1:5000/#/experiments/1/runs/{parent}?workflowType=machine_learning"
    )
    assert message.endswith(
        f"; MLflow run: {outcome['mlflow_run']} (once `MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false "
        f"mlflow ui --workers 1 --backend-store-uri sqlite:///{run_dir}/mlflow.db` serves it)"
    )
    found = artifacts(first.id)
    assert set(found) == {f"tiny-{name}" for name in (*STAGES, "pretrain")}
    tokens = json.loads((run_dir / "data" / "manifest.json").read_text())["total_tokens"]
    assert "## tokenize: completed" in found["tiny-tokenize"]
    assert f"| tokens | {tokens:,} |" in found["tiny-tokenize"]
    assert "- `data/manifest.json`" in found["tiny-tokenize"]
    train = outcome["train"]
    assert f"| final loss | {train['final_loss']:.6g} |" in found["tiny-train"]
    assert "- `plots/loss.png`" in found["tiny-train"]
    assert "- `hf/config.json`" in found["tiny-convert"]
    assert f"| perplexity | {outcome['perplexity']:.6g} |" in found["tiny-evaluate"]
    assert "*In the beginning* →" in found["tiny-evaluate"]
    assert all(f"| {name} | Completed |" in found["tiny-pretrain"] for name in STAGES)
    ids = json.loads((run_dir / "mlflow.json").read_text())
    page = f"http://127.0.0.1:5000/#/experiments/1/runs/{ids['stages']['train']}?workflowType="
    assert f"MLflow: `{outcome['mlflow_ui']}`, then `{page}" in found["tiny-train"]
    log = run_logs(first.id)
    assert "tokenize: " in log and " documents, " in log and "tokens/s" in log
    assert "evaluate: 4 of 4 held-out micro-batches scored" in log
    assert "evaluate: 4 of 4 prompts continued" in log


@pytest.mark.slow
def test_tiny_pipeline_end_to_end(finished):
    from mlflow.tracking import MlflowClient
    from transformers import OlmoeForCausalLM

    run_dir, outcome = finished
    assert outcome["stages"] == dict.fromkeys(STAGES, "Completed")
    assert list((run_dir / "data").glob("train/*.npy")) or list((run_dir / "data").rglob("*.npy"))
    assert (run_dir / "train" / "checkpoints" / "step_00000008" / "manifest.json").is_file()
    model = OlmoeForCausalLM.from_pretrained(run_dir / "hf")
    assert model.config.num_experts == 8
    result = json.loads((run_dir / "eval" / "result.json").read_text())
    assert result["relative_difference"] < 1e-4 and result["tokens"] > 0
    assert outcome["perplexity"] == pytest.approx(result["perplexity"])
    assert outcome["mlflow_ui"] == (
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1 --backend-store-uri "
        f"sqlite:///{run_dir}/mlflow.db"
    )

    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("moe_core").experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id]
    assert len(parent) == 1 and sorted(r.info.run_name for r in children) == sorted(STAGES)
    assert parent[0].data.params["model.name"] == "tiny"
    assert "plan.html" in {a.path for a in client.list_artifacts(parent[0].info.run_id)}
    assert "plan-data" in (run_dir / "plan.html").read_text()
    train = next(r for r in children if r.info.run_name == "train")
    history = client.get_metric_history(train.info.run_id, "loss")
    assert [m.step for m in history] == list(range(8))
    costs = [json.loads(x) for x in (run_dir / "train" / "checkpoints.jsonl").open()]
    stalls = client.get_metric_history(train.info.run_id, "checkpoint/stall_s")
    assert [m.step for m in stalls] == [c["step"] for c in costs] and costs[-1]["step"] == 8
    assert [m.value for m in stalls] == [c["checkpoint/stall_s"] for c in costs]
    assert {a.path for a in client.list_artifacts(train.info.run_id, "plots")} == {
        "plots/loss.png",
        "plots/tokens_per_s.png",
        "plots/expert_load.png",
        "plots/downstream.png",
    }
    evaluate = next(r for r in children if r.info.run_name == "evaluate")
    assert evaluate.data.metrics["relative_difference"] < 1e-4

    # Downstream tasks: scored in training on 2 expert-parallel gloo ranks (split over both,
    # fixed [micro_batch, seq_len] batches) and by the evaluate stage from the final checkpoint
    # in one process: the same accuracies.
    table = json.loads((run_dir / "eval" / "downstream.json").read_text())
    assert sorted(table) == ["toy:mc_5shot", "toy:rc_0shot"]
    assert all(row["examples"] == 6 for row in table.values())
    lines = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "downstream" in x] == [3, 7]
    for task, row in table.items():
        in_training = lines[-1]["downstream"][task.replace(":", "_")]
        assert in_training == pytest.approx({k: v for k, v in row.items() if "acc" in k})
    examples = (run_dir / "eval" / "downstream_examples.jsonl").read_text().splitlines()
    assert len(examples) == 12 and len(json.loads(examples[0])["choices"]) == 3
    rc = table["toy:rc_0shot"]
    assert evaluate.data.metrics["toy_rc_0shot.acc_per_char"] == pytest.approx(rc["acc_per_char"])
    assert parent[0].data.metrics["toy_rc_0shot.acc"] == pytest.approx(rc["acc"])
    assert "downstream.json" in {a.path for a in client.list_artifacts(parent[0].info.run_id)}
    curve = client.get_metric_history(train.info.run_id, "downstream.toy_mc_5shot.acc_raw")
    assert [m.step for m in curve] == [3, 7]
    tokenize = next(r for r in children if r.info.run_name == "tokenize")
    assert "tokenizer/tokenizer.json" in {
        a.path for a in client.list_artifacts(tokenize.info.run_id, "tokenizer")
    }


@contextlib.contextmanager
def mlflow_ui(command: str) -> Iterator[str]:
    """``command`` (the ``VAR=value mlflow ui ...`` a run prints, as a shell runs it) on a free
    loopback port, in a session of its own; yields its address. After, SIGTERM to the command
    alone (what Ctrl-C or a kill of the printed command does) must end every process it
    started."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    words = command.split()
    at = words.index("mlflow")  # before it: the command's environment assignments
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_SERVER_")}
    env |= dict(w.split("=", 1) for w in words[:at])
    mlflow = str(Path(sys.executable).parent / "mlflow")
    args = [mlflow, *words[at + 1 :], "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None, f"{command} exited with {proc.returncode}"
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert time.time() < deadline, f"{command} did not answer within 180 s"
                time.sleep(0.5)
        yield url
        proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 120  # generous: a loaded machine
        while _session(proc.pid) and time.time() < deadline:
            time.sleep(0.5)
        assert _session(proc.pid) == [], f"{command} left processes after SIGTERM"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _session(sid: int) -> list[int]:
    """The live processes of session ``sid`` (zombies not counted)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # state, ppid, pgrp, session
                found.append(int(pid))
    return found


@pytest.mark.slow
def test_the_printed_mlflow_ui_command_serves_the_run_and_ends_on_sigterm(finished):
    """The `mlflow ui` command `moe pipeline` prints, run as printed: it answers with the run
    folder's experiment, and SIGTERM to it (as Ctrl-C) ends every process it started
    (``mlflow_ui`` checks that after the block)."""
    run_dir, outcome = finished
    parent = json.loads((run_dir / "mlflow.json").read_text())["parent"]
    with mlflow_ui(outcome["mlflow_ui"]) as url:
        found = urllib.request.urlopen(f"{url}/api/2.0/mlflow/runs/get?run_id={parent}", timeout=60)
        assert json.loads(found.read())["run"]["info"]["run_name"] == "tiny"


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None,
    reason="playwright is not installed (pip install playwright; no browser download needed)",
)
@pytest.mark.skipif(
    chromium() is None, reason="no Chromium installed (apt-get install chromium-headless-shell)"
)
def test_mlflow_ui_shows_the_parent_run_its_stage_runs_the_loss_chart_and_the_plots(finished):
    """What a user browses after `moe pipeline`: the printed `mlflow ui` command over the run's
    store, in headless Chromium (the system's binary, driven by Playwright)."""
    from playwright.sync_api import expect, sync_playwright

    from flows.tracking import LOCAL_UI, ui_page

    run_dir, outcome = finished
    ids = json.loads((run_dir / "mlflow.json").read_text())
    with mlflow_ui(outcome["mlflow_ui"]) as url, sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium())
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(60_000)
        expect.set_options(timeout=60_000)  # a loaded CI machine serves the UI slowly
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))

        # The experiment's runs: the parent, and its five stage runs nested under it.
        page.goto(f"{url}/{ui_page('1')}")
        parent = page.locator(f'a[href="#/experiments/1/runs/{ids["parent"]}"]')
        expect(parent).to_have_text("tiny")
        page.locator('button[data-component-id*="runnamecellrenderer"]').first.click()
        for name in STAGES:
            expect(
                page.locator(f'a[href="#/experiments/1/runs/{ids["stages"][name]}"]')
            ).to_have_text(name)

        # The parent run's page, at the address `moe pipeline` prints last (served here on
        # another port): the headline metrics (docs/mlflow_screenshot.py takes the README's
        # picture of the quickstart's run the same way).
        page.goto(outcome["mlflow_run"].replace(LOCAL_UI, url))
        expect(page.get_by_text("tiny", exact=True).first).to_be_visible()
        for metric in ("final_loss", "final_eval_loss", "perplexity", "tokens_per_s_per_gpu"):
            expect(page.get_by_text(metric, exact=True).first).to_be_visible()
        expect(page.get_by_text("Child runs", exact=True)).to_be_visible()
        for name in STAGES:  # listed under "Child runs"
            expect(page.get_by_role("link", name=name, exact=True).first).to_be_visible()
        close = page.get_by_role("button", name="Close")  # the assistant's side panel
        if close.count():
            close.first.click()

        # The train run's charts: the loss over the 8 steps (charts draw once in view).
        train = ids["stages"]["train"]
        page.set_viewport_size({"width": 1280, "height": 3000})
        page.goto(f"{url}/#/experiments/1/runs/{train}/model-metrics?workflowType=machine_learning")
        expect(page.get_by_text("train (loss)", exact=True).first).to_be_visible()

        # Its plots, previewed from the artifact store.
        page.goto(f"{url}/#/experiments/1/runs/{train}/artifacts?workflowType=machine_learning")
        page.get_by_text("plots", exact=True).first.click()
        for plot in ("loss.png", "tokens_per_s.png", "expert_load.png"):
            expect(page.get_by_text(plot, exact=True).first).to_be_visible()
        page.get_by_text("loss.png", exact=True).first.click()
        expect(page.get_by_text("plots/loss.png", exact=True).first).to_be_visible()
        image = page.locator('img[src^="blob:"]').first  # the preview, fetched from the store
        expect(image).to_be_visible()
        assert image.evaluate("img => img.complete && img.naturalWidth > 0"), "the plot must load"
        browser.close()
    assert errors == []


@pytest.mark.slow
def test_rerun_skips_verified_stages_and_redoes_corrupt_ones(finished, tmp_path):
    run_dir = copy_of(finished[0], tmp_path / "tiny")  # artifact keys are named after the folder
    shard = sorted((run_dir / "hf").glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])  # corrupt the export only
    data_mtimes = {p: p.stat().st_mtime_ns for p in (run_dir / "data").rglob("*") if p.is_file()}
    outcome = run_pipeline(run_dir, [])
    assert outcome["stages"] == {
        "tokenize": "Skipped",
        "init": "Skipped",
        "train": "Skipped",
        "convert": "Completed",
        "evaluate": "Skipped",
    }
    assert all(p.stat().st_mtime_ns == t for p, t in data_mtimes.items())
    found = artifacts(flow_runs(run_dir)[-1].id)
    assert "## tokenize: skipped (its outputs verified" in found["tiny-tokenize"]
    assert "## convert: completed" in found["tiny-convert"]
    assert "skipped (verified): tokenize, init, train, evaluate" in found["tiny-pretrain"]


@pytest.mark.slow
def test_parent_run_has_the_headline_and_a_skip_only_rerun_leaves_its_timings(
    finished, tmp_path, capsys, monkeypatch
):
    from mlflow.tracking import MlflowClient

    from moe_core.cli import main

    run_dir = copy_of(finished[0], tmp_path / "run")
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    parent_id = json.loads((run_dir / "mlflow.json").read_text())["parent"]
    before = client.get_run(parent_id)
    assert {"final_loss", "perplexity", "tokens_per_s_per_gpu"} <= set(before.data.metrics)
    capsys.readouterr()
    assert main(["pipeline", *SMALL, f"run_dir={run_dir}"]) == 0  # as a user reruns it
    # Its last lines on stdout: the summary, a row a line, the earlier run's numbers and page.
    last = capsys.readouterr().out.splitlines()[-7:]
    assert last[0] == f"pipeline done: {run_dir}"
    rows = dict(line.strip().split("  ", 1) for line in last[1:])
    rows = {k.strip(): v.strip() for k, v in rows.items()}
    assert rows["Hugging Face checkpoint"] == str(run_dir / "hf")
    assert rows["held-out perplexity"].startswith(f"{finished[1]['perplexity']:.3f} (transformers")
    assert rows["training launches"] == "1"
    assert rows["skipped (verified)"] == "tokenize, init, train, convert, evaluate"
    assert rows["MLflow run"].startswith(f"http://127.0.0.1:5000/#/experiments/1/runs/{parent_id}")
    steps = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert rows["loss"].startswith(f"{steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} over 8 ")
    assert "Completed(" not in "\n".join(last)
    after = client.get_run(parent_id)
    assert after.info.end_time == before.info.end_time
    assert "every stage's outputs verified, none redone" in after.data.tags["mlflow.note.content"]

    # With no Prefect API to talk to (a user's plain `moe pipeline`), such a rerun starts no
    # temporary server and no flow run, and says and records the same.
    from prefect.settings import PREFECT_API_URL, temporary_settings

    import flows.pretrain

    def no_flow(**kwargs):
        raise AssertionError("a rerun with nothing to run must not start the flow")

    monkeypatch.setattr(flows.pretrain, "pretrain", no_flow)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["pipeline", *SMALL, f"run_dir={run_dir}"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-7:] == last
    assert f"{run_dir}: every stage's outputs verified, nothing to run (no Prefect" in err
    note = client.get_run(parent_id).data.tags["mlflow.note.content"]
    assert note.count("rerun; every stage's outputs verified, none redone.") == 2
    assert client.get_run(parent_id).info.end_time == before.info.end_time


def kill_training_after(run_dir: Path, steps: int) -> None:
    """SIGKILL the training's ranks (as the OOM killer would; torchrun lives on and reports it)
    once ``steps`` metrics lines are written."""
    metrics = run_dir / "train" / "metrics.jsonl"
    deadline = time.time() + 300
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= steps):
        if time.time() > deadline:
            return  # the test's own assertions report it
        time.sleep(0.05)
    marker = str(run_dir / "train" / "config.json").encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if marker in cmdline and b"moe_core.train.torchrun" not in cmdline:  # a rank
                os.kill(int(pid), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass


@pytest.mark.slow
def test_failed_training_resumes_on_rerun_with_identical_results(finished, tmp_path):
    from moe_core.errors import RunFailedError

    reference_dir, _ = finished
    run_dir = seeded_run(reference_dir, tmp_path / "crash")  # its tokenize and init are done
    killer = threading.Thread(target=kill_training_after, args=(run_dir, 3), daemon=True)
    killer.start()
    with pytest.raises(RunFailedError) as err:  # the training's processes killed mid-run
        run_pipeline(run_dir, ["cluster.launch_retries=0"])
    killer.join()
    # torchrun's "Root Cause" summary is one sentence: the rank, its signal, its last lines,
    # where the whole report and the rank's log are kept.
    said = str(err.value)
    killed = r"^rank [01] was killed by SIGKILL \(exit code -9\) on attempt 1 of 1 "
    assert re.search(killed + r".*; a rerun resumes from step_\d+; its last lines: .", said)
    logs = run_dir / "train" / "logs" / "attempt-1"
    assert said.endswith(f"; torchrun's report: {logs / 'torchrun.log'}.")
    assert "Root Cause (first observed failure)" in (logs / "torchrun.log").read_text()
    log = run_logs(flow_runs(run_dir)[0].id)
    assert "Root Cause" not in log and "ChildFailedError" not in log
    before = {p: p.stat().st_mtime_ns for p in (run_dir / "data").rglob("*") if p.is_file()}
    before |= {p: p.stat().st_mtime_ns for p in (run_dir / "init").rglob("*") if p.is_file()}

    outcome = run_pipeline(run_dir, ["cluster.launch_retries=0"])
    assert outcome["stages"]["tokenize"] == "Skipped" and outcome["stages"]["init"] == "Skipped"
    assert outcome["stages"]["train"] == "Completed"
    assert all(p.stat().st_mtime_ns == t for p, t in before.items())
    lines = [json.loads(x) for x in (run_dir / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(8))
    # The rerun says the stage was interrupted (nothing changed); its summary's loss is from
    # the run's first step, not the resumed one, and it counts the crashed pipeline's launch.
    log = run_logs(flow_runs(run_dir)[-1].id)
    assert "train: runs (it was interrupted before it finished)" in log
    assert "resumed from " in log and "(step 0)" not in log.split("train: runs")[1]
    message = flow_runs(run_dir)[-1].state.message
    assert f"loss: {lines[0]['loss']:.4f} -> {lines[-1]['loss']:.4f} over 8 steps" in message
    assert "training launches: 1, after 1 launch by an interrupted pipeline" in message
    ref, got = masters(reference_dir), masters(run_dir)
    assert all(torch.equal(ref[k], got[k]) for k in ref), "resumed training must end identical"


@pytest.mark.slow
def test_changing_train_config_reruns_train_and_later_only(finished, tmp_path):
    from mlflow.tracking import MlflowClient

    run_dir = copy_of(finished[0], tmp_path / "changed")
    before = json.loads((run_dir / "mlflow.json").read_text())
    change = ["train.steps=4", "train.lr=2e-3"]  # a change to train (and a short one)
    outcome = run_pipeline(run_dir, change)
    assert outcome["stages"] == {
        "tokenize": "Skipped",
        "init": "Skipped",
        "train": "Completed",
        "convert": "Completed",
        "evaluate": "Completed",
    }
    assert (run_dir / "train.superseded-1" / "checkpoints").is_dir(), "old outputs are kept"

    # In MLflow the change is a fresh attempt: its own parent and stage runs, whose params,
    # metrics and description are its own; the first attempt's runs stay as they were.
    client = MlflowClient(f"sqlite:///{run_dir / 'mlflow.db'}")
    after = json.loads((run_dir / "mlflow.json").read_text())
    old, new = before["stages"]["train"], after["stages"]["train"]
    assert after["attempts"]["train"] == [old, new] and new != old
    assert after["parents"] == [before["parent"], after["parent"]]
    assert client.get_run(new).data.params["train.lr"] == "0.002"
    assert client.get_run(old).data.params["train.lr"] != "0.002"
    assert [m.step for m in client.get_metric_history(new, "loss")] == list(range(4))
    assert [m.step for m in client.get_metric_history(old, "loss")] == list(range(8))
    parent = client.get_run(after["parent"])
    assert parent.info.run_name == "changed #2" and parent.data.params["train.lr"] == "0.002"
    assert parent.data.tags["moe.run_dir"] == str(run_dir)
    kept = {n: before["stages"][n] for n in ("tokenize", "init")}
    assert all(parent.data.tags[f"moe.stage.{n}"] == r for n, r in kept.items())
    assert after["stages"]["tokenize"] == kept["tokenize"], "a skipped stage keeps its run"
    note = parent.data.tags["mlflow.note.content"]
    assert "ran train, convert, evaluate; kept, verified: tokenize (run " in note
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{after['parent']}'"
    )
    assert sorted(r.info.run_name for r in children) == ["convert", "evaluate", "train"]
    assert parent.data.metrics["final_loss"] == client.get_run(new).data.metrics["final_loss"]


def test_a_missing_task_is_refused_before_any_stage(prefect_home, tmp_path):
    tasks = write_toy_tasks(tmp_path / "tasks")
    extra = ["eval.tasks=[toy:rc_5shot]", f"eval.tasks_from={tasks}"]
    with pytest.raises(Exception, match=r"'toy:rc_5shot' is not allowed: the variants of toy"):
        run_pipeline(tmp_path / "run", extra)
    assert not (tmp_path / "run" / "stages").exists()


def test_1t_refuses_before_any_stage_on_a_machine_without_slurm(
    prefect_home, tmp_path, monkeypatch
):
    from flows.pretrain import pretrain
    from moe_core.config import ConfigError

    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no Slurm commands
    config = compose_dict([], config_name="pretrain-1t")
    with pytest.raises(ConfigError, match=r"^cluster\.kind='slurm' is not allowed on this machine"):
        pretrain(config=config, run_dir=str(tmp_path / "1t"))
    assert not (tmp_path / "1t").exists(), "nothing may start"
    (refused,) = flow_runs(tmp_path / "1t")
    assert refused.state.type.value == "FAILED"
    assert refused.state.message.startswith("cluster.kind='slurm' is not allowed on this machine")
    assert "Traceback" not in refused.state.message
    log = run_logs(refused.id)
    assert "plan for 1t" in log and "cluster.kind='slurm' is not allowed" in log
    assert "Traceback" not in log, "an expected refusal is one sentence"


def test_tracking_uri_comes_from_config_environment_prefect_variable_then_run_folder(
    prefect_home, tmp_path, monkeypatch
):
    from prefect import flow
    from prefect.variables import Variable

    from flows.tracking import PREFECT_VARIABLE, RUN_FOLDER, tracking_uri

    @flow
    def where(configured: str | None) -> tuple[str, str]:
        return tracking_uri(configured, tmp_path)

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert where(None) == (f"sqlite:///{tmp_path / 'mlflow.db'}", RUN_FOLDER)
    Variable.set(PREFECT_VARIABLE, "http://127.0.0.1:5999", overwrite=True)
    try:
        assert where(None) == ("http://127.0.0.1:5999", f"the Prefect variable {PREFECT_VARIABLE}")
        # outside a flow run no API is asked (that would start a temporary server)
        assert tracking_uri(None, tmp_path)[1] == RUN_FOLDER
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///env.db")
        assert where(None) == ("sqlite:///env.db", "MLFLOW_TRACKING_URI")
        assert where("http://127.0.0.1:5001") == ("http://127.0.0.1:5001", "tracking.uri")
    finally:
        Variable.unset(PREFECT_VARIABLE)


def test_a_second_pipeline_in_a_locked_run_dir_is_refused_before_any_stage(prefect_home, tmp_path):
    from helpers import lock_held_elsewhere

    from flows.pretrain import pretrain
    from moe_core.errors import RunDirLockedError
    from moe_core.rundir import LOCK

    run_dir = tmp_path / "tiny"
    with lock_held_elsewhere(run_dir) as first:  # as the first pipeline holds it
        with pytest.raises(RunDirLockedError) as err:
            pretrain(config=compose_dict(SMALL, config_name="pretrain-tiny"), run_dir=str(run_dir))
        message = str(err.value)
        assert f"{run_dir} is in use by another run: process {first.pid} on host" in message
        assert [p.name for p in run_dir.iterdir()] == [LOCK], "no stage, no tracking store"


def test_a_run_dir_in_a_symlink_loop_is_one_sentence(prefect_home, tmp_path):
    from flows.pretrain import pretrain
    from moe_core.config import ConfigError

    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    run_dir = str(tmp_path / "a" / "run")
    with pytest.raises(ConfigError) as err:
        pretrain(config=compose_dict(SMALL, config_name="pretrain-tiny"), run_dir=run_dir)
    assert str(err.value) == (
        f"run_dir={run_dir!r} is not allowed: it leads into a symlink loop; give a folder that "
        "exists or can be made."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"], "nothing was written"
