"""MLflow for the pipeline: a parent run per pipeline invocation that runs a stage, a nested run
per stage it runs.

MLflow params are write-once, so a run's params, metrics and description belong together only if
every run records one attempt: a rerun with a changed config (``train.lr=1e-3``), or a relaunch
after a failure, gets a fresh parent (named after the run folder, ``#2``, ``#3`` after the first)
and fresh stage runs, params logged from that attempt's resolved config, so MLflow's compare
view sets the attempts side by side and none of them is rewritten. Every run carries the tag
``moe.run_dir`` (search ``tags.`moe.run_dir` = '...'`` for a folder's history); a stage skipped
as verified gets no run: ``run_dir/mlflow.json`` keeps the id of the run that produced its
outputs (``stages``), the parent names it (tag ``moe.stage.NAME``), and every attempt's run id is
listed (``attempts``). A rerun that runs nothing adds a line to the latest parent's description.
Tracking never stops the work: if the tracking store cannot be reached, the pipeline warns once
and goes on; training metrics stay in ``metrics.jsonl`` (the local buffer) and the lines not yet
sent are sent by a later call that can reach the store.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from flows.layout import RunLayout
from moe_core.rundir import set_aside

log = logging.getLogger(__name__)

# Fail fast instead of retrying for minutes when a server is down.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

SCALARS = (
    "loss",
    "aux_loss",
    "lb_loss",
    "z_loss",
    "grad_norm",
    "lr",
    "tokens_per_s_per_gpu",
    "model_tflops_per_gpu",
    "mfu",
    "peak_mem_gib",
    "alloc_retries",
    "eval_loss",
    "ep_rows_per_token",  # rows a token sent to other expert-parallel ranks (all_to_all)
    "mtp_loss",
    # a checkpoints.jsonl line (moe_core.train.checkpoint.SaveCost), at its checkpoint's step
    "checkpoint/stall_s",
    "checkpoint/durable_s",
    "checkpoint/bytes",
    "checkpoint/write_gbps",
    "checkpoint/wait_s",
)
ROUTER_SCALARS = ("load_imbalance", "ep_rank_imbalance", "lb_score", "bias_abs_max")


# MLflow's UI opens an experiment in the view its kind names (model training, not GenAI).
KIND_TAG, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
NOTE_TAG = "mlflow.note.content"  # the run's description in the UI
RUN_DIR_TAG = "moe.run_dir"  # groups the attempts of one run folder


# Where ``mlflow ui`` serves a local store unless told otherwise (its default host and port).
LOCAL_UI = "http://127.0.0.1:5000"


def ui_command(uri: str) -> str:
    """The command a user runs to browse a local store. As MLflow 3.17 ships it, ``mlflow ui``
    also starts a pool of server-side job runners (GenAI features tracking does not use): ~15
    processes, 40+ s before it answers on a loaded machine, and runners that outlive Ctrl-C.
    Without them and with one worker it is two processes, answering in seconds, both gone on
    Ctrl-C or SIGTERM."""
    return (
        f"MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow ui --workers 1 --backend-store-uri {uri}"
    )


# The Prefect variable infra/deploy.sh sets to its MLflow server's URI (when one answers).
PREFECT_VARIABLE = "mlflow_tracking_uri"
RUN_FOLDER = "the run folder's sqlite store"


def tracking_uri(configured: str | None, run_dir: Path) -> tuple[str, str]:
    """The MLflow store a pipeline logs to, and where that choice came from: the config's
    ``tracking.uri``, else ``MLFLOW_TRACKING_URI``, else (inside a flow run) the Prefect variable
    ``mlflow_tracking_uri``, else a sqlite file in the run folder (meant for ``moe pipeline`` on
    one machine; a deployment run that lands there says so in its log)."""
    if configured:
        return configured, "tracking.uri"
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"], "MLFLOW_TRACKING_URI"
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is not None:  # a flow run has an API to ask (outside one, asking starts a server)
        from prefect.variables import Variable

        value = Variable.get(PREFECT_VARIABLE, default=None)
        if isinstance(value, str) and value:
            return value, f"the Prefect variable {PREFECT_VARIABLE}"
        if context.flow_run is not None and context.flow_run.deployment_id is not None:
            from prefect import get_run_logger

            get_run_logger().warning(
                "no MLflow server is configured for this deployment run (tracking.uri, "
                "MLFLOW_TRACKING_URI or the Prefect variable %s, which infra/deploy.sh sets "
                "while infra/start-mlflow.sh's server runs): it logs to %s.",
                PREFECT_VARIABLE,
                RunLayout(run_dir).mlflow_db,
            )
    return f"sqlite:///{RunLayout(run_dir).mlflow_db.resolve()}", RUN_FOLDER


def sqlite_problem(uri: str) -> str | None:
    """Why a sqlite store's file cannot be used (not a database, locked by another writer), in a
    second instead of MLflow's minute of retries; None when it can (or is no sqlite file yet)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = Path(uri.removeprefix("sqlite:///").split("?")[0])
    if not path.is_file():
        return None
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(path, timeout=1)) as db:
            db.execute("PRAGMA schema_version")  # reads the header: fails on a corrupt file
            db.execute("BEGIN IMMEDIATE")  # the write lock MLflow needs, not kept
            db.rollback()
    except sqlite3.Error as err:
        return str(err)
    return None


def ui_page(experiment_id: str, run_id: str | None = None) -> str:
    """An experiment's (or run's) page in the MLflow UI, in its model-training view: MLflow 3's
    UI picks GenAI or model training from the address or the browser's last choice (GenAI in a
    fresh browser), not from the experiment's kind tag."""
    run = f"/runs/{run_id}" if run_id else ""
    return f"#/experiments/{experiment_id}{run}?workflowType=machine_learning"


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out |= flatten(v, key + ".")
        else:
            out[key] = json.dumps(v) if isinstance(v, list | bool) or v is None else str(v)
    return out


def metric_rows(line: dict[str, Any]) -> dict[str, float]:
    """The numbers of one ``metrics.jsonl`` line worth a chart (per-layer router health too)."""
    out = {k: float(line[k]) for k in SCALARS if isinstance(line.get(k), int | float)}
    for k, v in enumerate(line.get("mtp_losses") or []):
        out[f"mtp_loss.{k}"] = float(v)
    for layer, health in (line.get("router") or {}).items():
        for k in ROUTER_SCALARS:
            if k in health:
                out[f"router.{layer}.{k}"] = float(health[k])
    for k, v in (line.get("ranks") or {}).items():  # the ranks' time spread, the stragglers
        if isinstance(v, int | float):
            out[f"ranks.{k}"] = float(v)
    for kind in ("data_tokens", "data_epochs"):  # a mixture's sources
        for source, v in (line.get(kind) or {}).items():
            out[f"{kind}.{source}"] = float(v)
    for task, accuracies in (line.get("downstream") or {}).items():
        for k, v in accuracies.items():
            out[f"downstream.{task}.{k}"] = float(v)
    if line.get("skipped"):
        out["skipped"] = 1.0
    return out


class Tracker:
    """One pipeline invocation's MLflow runs (see the module's docstring)."""

    def __init__(self, run_dir: Path, uri: str | None, experiment: str, run_name: str) -> None:
        self.run_dir = run_dir
        self.run_name = run_name
        self.state_path = RunLayout(run_dir).mlflow_state
        self.state: dict[str, Any] = {
            "parent": None,
            "parents": [],
            "stages": {},
            "attempts": {},
            "sent": {},
        }
        self.state |= self._read_state()
        if self.state["parent"] and not self.state["parents"]:  # written before attempts were kept
            self.state["parents"] = [self.state["parent"]]
        self.uri, self.source = tracking_uri(uri, run_dir)
        self.online = True
        self.client = None
        self.experiment_id: str | None = None
        self.current: str | None = None  # this invocation's parent, made with its first stage run
        self._on_parent: tuple[dict[str, Any], list[Path]] = ({}, [])
        if (problem := sqlite_problem(self.uri)) is not None:  # MLflow would take a minute
            self.online = False
            log.warning(
                "MLflow's store %s cannot be used (%s); the pipeline goes on without tracking, "
                "metrics stay in metrics.jsonl: stop what holds it or move the file aside.",
                self.uri,
                problem,
            )
        if self.online and self.source == RUN_FOLDER:
            self._claim_store(experiment)
        self._guard(self._connect, experiment, self.source == RUN_FOLDER)

    # ---- plumbing -------------------------------------------------------------------------

    def _read_state(self) -> dict[str, Any]:
        """``mlflow.json``'s ids; a damaged one is set aside (kept) and tracking starts afresh."""
        if not self.state_path.is_file():
            return {}
        try:
            state = json.loads(self.state_path.read_text())
            kinds = {"parent": str, "parents": list, "stages": dict, "attempts": dict, "sent": dict}
            if not isinstance(state, dict) or any(
                state.get(k) is not None and not isinstance(state[k], kind)
                for k, kind in kinds.items()
            ):
                raise ValueError("it does not hold the run ids this pipeline writes")
        except ValueError as err:  # not JSON (a UnicodeDecodeError too), or not ours
            n = set_aside([self.state_path], "damaged")
            log.warning(
                "%s is damaged (%s) and was set aside as %s.damaged-%d; this run's MLflow runs "
                "start afresh, the earlier ones stay in the store.",
                self.state_path,
                str(err).splitlines()[0][:100],
                self.state_path.name,
                n,
            )
            return {}
        return {k: v for k, v in state.items() if v is not None}

    def _guard(self, fn, *args):
        """Run an MLflow call; on failure warn once, go offline, return None."""
        if not self.online:
            return None
        try:
            return fn(*args)
        except Exception as err:
            self.online = False
            log.warning(
                "MLflow at %s is unreachable (%s); the pipeline goes on, metrics stay in "
                "metrics.jsonl and are sent on a later run.",
                self.uri,
                str(err).splitlines()[0][:200],
            )
            return None

    def _claim_store(self, experiment: str) -> None:
        """A run folder copied or moved brings its sqlite store, which names the first folder
        as where the experiment's artifacts go: MLflow would write this folder's there. Its
        locations are pointed at this folder's ``mlartifacts`` (which holds the copied ones);
        where that fails, tracking goes offline rather than write outside the folder."""
        import sqlite3

        path = Path(self.uri.removeprefix("sqlite:///"))
        ours = RunLayout(self.run_dir).mlartifacts.resolve().as_uri()
        if not path.is_file():
            return
        old = None
        try:
            with contextlib.closing(sqlite3.connect(path, timeout=1)) as db, db:
                row = db.execute(
                    "SELECT experiment_id, artifact_location FROM experiments WHERE name = ?",
                    (experiment,),
                ).fetchone()
                if row is None or row[1] == ours:
                    return
                found, old = row
                db.execute(
                    "UPDATE experiments SET artifact_location = ? WHERE experiment_id = ?",
                    (ours, found),
                )
                db.execute(
                    "UPDATE runs SET artifact_uri = ? || substr(artifact_uri, ?) "
                    "WHERE experiment_id = ? AND substr(artifact_uri, 1, ?) = ?",
                    (ours, len(old) + 1, found, len(old), old),
                )
        except sqlite3.Error as err:
            self.online = False
            log.warning(
                "%s keeps its artifacts in %s, not in this folder, and could not be changed "
                "(%s); the pipeline goes on without tracking rather than write there.",
                self.uri,
                old or "another folder",
                err,
            )
            return
        log.warning("%s came from another folder: its artifacts now go to %s.", path, ours)

    def _connect(self, experiment: str, local: bool) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
            if found.tags.get(KIND_TAG) is None:
                self.client.set_experiment_tag(self.experiment_id, KIND_TAG, MODEL_TRAINING)
        else:
            location = RunLayout(self.run_dir).mlartifacts.resolve().as_uri() if local else None
            self.experiment_id = self.client.create_experiment(
                experiment, location, tags={KIND_TAG: MODEL_TRAINING}
            )

    def _create(self, name: str, parent: str | None) -> str:
        tags = {"mlflow.runName": name, RUN_DIR_TAG: str(self.run_dir)}
        if parent is not None:
            tags["mlflow.parentRunId"] = parent
        return self.client.create_run(self.experiment_id, tags=tags).info.run_id

    def _new_parent(self) -> str | None:
        """This invocation's parent run, with the params and files ``begin`` gave."""
        earlier = len(self.state["parents"])
        name = self.run_name if not earlier else f"{self.run_name} #{earlier + 1}"
        run_id = self._guard(self._create, name, None)
        if run_id is None:
            return None
        self.current = self.state["parent"] = run_id
        self.state["parents"].append(run_id)
        self._save()
        values, files = self._on_parent
        self.params(run_id, values)
        for f in files:
            self.artifacts(run_id, f)
        return run_id

    def _save(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state, indent=1))
        tmp.replace(self.state_path)

    # ---- what the flow calls --------------------------------------------------------------

    @property
    def parent(self) -> str | None:
        """This invocation's parent run, else the latest one of the run folder."""
        return self.current or self.state["parent"]

    def begin(self, config: dict[str, Any], files: list[Path]) -> None:
        """What this invocation's parent run holds (its params, its artifacts), logged when its
        first stage runs: an invocation that only skips makes no run."""
        self._on_parent = (config, files)

    def stage(self, name: str) -> str | None:
        """A fresh nested run of ``name`` for this attempt (the parent made first if needed)."""
        parent = self.current or self._new_parent()
        run_id = None if parent is None else self._guard(self._create, name, parent)
        if run_id is None:
            # The outputs this attempt writes are no earlier run's: a later rerun that skips
            # them must not link or note them under a run logged with another config's params.
            self.state["stages"].pop(name, None)
            if self.current is None:
                self.state["parent"] = None
        else:
            self.state["stages"][name] = run_id
            self.state["attempts"].setdefault(name, []).append(run_id)
        self._save()
        return run_id

    def params(self, run_id: str | None, values: dict[str, Any]) -> None:
        if run_id is None:
            return
        from mlflow.entities import Param

        flat = flatten(values)
        already = self._guard(lambda: set(self.client.get_run(run_id).data.params)) or set()
        params = [Param(k, v[:6000]) for k, v in sorted(flat.items()) if k not in already]
        for i in range(0, len(params), 100):
            self._guard(self.client.log_batch, run_id, [], params[i : i + 100])

    def metrics(self, run_id: str | None, values: dict[str, float], step: int = 0) -> None:
        if run_id is None:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, v, now, step) for k, v in values.items()]
        for i in range(0, len(batch), 1000):
            self._guard(self.client.log_batch, run_id, batch[i : i + 1000])

    def send_metrics_file(self, run_id: str | None, path: Path) -> int:
        """Send the lines of a metrics.jsonl not sent yet; returns how many were sent."""
        if run_id is None or not path.is_file() or not self.online:
            return 0
        done = (
            self.state["sent"]
            .setdefault(run_id, {})
            .setdefault(str(path.resolve()), {"lines": 0, "step": -1})
        )
        lines = path.read_text().splitlines()
        if done["lines"] > len(lines):  # the file was rewritten (a resumed run dropped steps)
            done["lines"] = 0
        sent = 0
        for raw in lines[done["lines"] :]:
            if not raw.strip():
                done["lines"] += 1
                continue
            try:
                line = json.loads(raw)
            except ValueError:
                break  # a line still being written
            if int(line["step"]) > done["step"]:  # a step redone after a resume is not sent twice
                self.metrics(run_id, metric_rows(line), int(line["step"]))
                if not self.online:
                    break
                done["step"] = int(line["step"])
                sent += 1
            done["lines"] += 1
        self._save()
        return sent

    def table(self, run_id: str | None, rows: list[dict[str, Any]], name: str) -> None:
        """A table (one dict per row) as the run's artifact ``name``, shown in the MLflow UI."""
        if run_id is None or not rows:
            return
        columns = {k: [r.get(k) for r in rows] for k in rows[0]}
        self._guard(self.client.log_table, run_id, columns, name)

    def artifacts(self, run_id: str | None, path: Path, artifact_path: str | None = None) -> None:
        if run_id is None or not path.exists():
            return
        if path.is_dir():
            self._guard(self.client.log_artifacts, run_id, str(path), artifact_path)
        else:
            self._guard(self.client.log_artifact, run_id, str(path), artifact_path)

    def tags(self, run_id: str | None, values: dict[str, str]) -> None:
        if run_id is None:
            return
        from mlflow.entities import RunTag

        batch = [RunTag(k, v) for k, v in values.items()]
        self._guard(self.client.log_batch, run_id, [], [], batch)

    def note(self, run_id: str | None, text: str) -> None:
        """Add a line to the run's description (shown on its page), keeping what was there."""
        if run_id is None:
            return
        before = self._guard(lambda: self.client.get_run(run_id).data.tags.get(NOTE_TAG)) or ""
        self._guard(self.client.set_tag, run_id, NOTE_TAG, (before + "\n\n" + text).strip())

    def page(self, run_id: str | None) -> str | None:
        """The run's page in the MLflow UI, relative to the UI's address (see ``ui_page``)."""
        if run_id is None or self.experiment_id is None:
            return None
        return ui_page(self.experiment_id, run_id)

    def link(self, run_id: str | None) -> str | None:
        """The run's page when the store is a server (a sqlite file has no address until
        ``mlflow ui`` serves it)."""
        page = self.page(run_id)
        if page is None or not self.uri.startswith(("http://", "https://")):
            return None
        return f"{self.uri.rstrip('/')}/{page}"

    def finish(self, run_id: str | None, status: str = "FINISHED") -> None:
        if run_id is not None:
            self._guard(self.client.set_terminated, run_id, status)
