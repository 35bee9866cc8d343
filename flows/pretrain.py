"""The ``pretrain`` flow: tokenize -> init -> train -> convert -> evaluate, each a checkpointed
stage calling one moe_core entry point.

Every stage writes its outputs under the run directory and then a manifest (``stages/*.json``)
holding a hash of what it depends on (its config section and the manifests of the stages before
it) and the checksums of what it produced. A rerun (a new flow run, or ``prefect flow-run
retry``) reports a stage whose manifest verifies as ``Skipped`` and leaves its files untouched;
a stage whose outputs are missing or corrupt, or whose inputs changed, runs again, and so does
everything after it. Outputs of an older configuration are moved aside, never deleted. ``train``
hands the resolved config to the launcher of ``cluster.kind`` (``flows.launchers``: torchrun
here, a Slurm job or a Kubernetes Job) through ``flows.launch``; a failed attempt is launched
again (``cluster.launch_retries``) and every attempt resumes from the newest valid checkpoint.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.states import Completed, Failed

from flows import manifests
from flows.launch import launch_attempts, preflight
from flows.launchers import Attempt, launcher_class
from flows.layout import RunLayout, resolve, run_root
from flows.manifests import NOT_IN_TOKENIZE_KEY, digest, keyed, precision_section, train_section
from flows.migrate import old_stage_keys
from flows.plots import training_plots
from flows.report import (
    artifact_key,
    mlflow_where,
    publish,
    quiet_refusals,
    run_markdown,
    stage_markdown,
    stage_progress,
    summary_line,
)
from flows.tracking import LOCAL_UI, Tracker, ui_command
from moe_core.config import (
    ClusterConfig,
    RunConfig,
    SourceConfig,
)
from moe_core.config_dict import to_dict
from moe_core.data.shards import SPLITS
from moe_core.errors import RunFailedError, refusals
from moe_core.rundir import RunLock, set_aside

Logger = logging.Logger | logging.LoggerAdapter
EVAL_BATCHES = 4  # held-out micro-batches the evaluate stage scores with both models


@dataclass
class Context:
    run: RunConfig  # resolved: out_dir is the train folder, data.dir the data folder
    layout: RunLayout
    tracker: Tracker
    keys: dict[str, str]
    old_keys: dict[str, str]  # as run folders from before manifests.KEY_VERSION hold them

    @property
    def run_dir(self) -> Path:
        return self.layout.root

    @property
    def final_checkpoint(self) -> Path:
        return self.layout.train_checkpoint(self.run.train.steps)


def stage_keys(run: RunConfig) -> dict[str, str]:
    """Each stage's input hash: what its row says it depends on (its config, the keys of the
    stages before it), in the order of ``STAGES``."""
    keys: dict[str, str] = {}
    for stage in STAGES:
        keys[stage.name] = digest(stage.key(run, keys))
    return keys


def _supersede(ctx: Context, stage: str, folder: Path) -> None:
    """Outputs another configuration left in ``folder`` are moved aside (kept, never deleted);
    outputs of this configuration (an interrupted attempt, also one from before
    ``manifests.KEY_VERSION``) stay, to be resumed."""
    marker = ctx.layout.marker(stage)
    key = ctx.keys[stage]
    ours = (key, ctx.old_keys[stage])
    stale = folder.exists() and (not marker.is_file() or marker.read_text() not in ours)
    if stale and any(folder.iterdir()):
        set_aside([folder])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(key)


def _interrupted(ctx: Context, stage: str) -> bool:
    """Whether ``stage`` last started with this configuration and did not finish: its folder's
    marker (``_supersede``) holds this key, though its manifest is missing or older."""
    marker = ctx.layout.marker(stage)
    return marker.is_file() and marker.read_text() in (ctx.keys[stage], ctx.old_keys[stage])


def _status(err: BaseException) -> str:
    """MLflow's end status for a stage left by ``err``: a cancelled flow run (SIGTERM from its
    worker, Ctrl-C) arrives as a BaseException that is no Exception."""
    return "FAILED" if isinstance(err, Exception) else "KILLED"


@dataclass(frozen=True)
class Stage:
    """One row of the pipeline (``STAGES``): adding a stage is a row and its function."""

    name: str
    # What its key hashes: its config and the keys of the stages before it (given so far).
    key: Callable[[RunConfig, dict[str, str]], dict[str, Any]]
    # Writes its outputs; returns its summary and the outputs its manifest checksums.
    run: Callable[[Context, str | None], tuple[dict, list[Path]]]
    # Why its outputs are not intact beyond the manifest's checksums (None: they are).
    intact: Callable[[Context], str | None] | None = None
    # What its artifact lists as produced: paths under the run folder, globs in the last parts.
    produced: Callable[[RunLayout], list[Path]] = lambda layout: []
    timeout_s: Callable[[RunConfig], float | None] = lambda run: None


def _verified(stage: Stage, ctx: Context, logger: Logger) -> tuple[dict | None, str]:
    """(its manifest, "") when the stage's manifest (and ``stage.intact``) verify, else (None,
    why it runs). A manifest accepted under its old key (``flows.migrate``) is rewritten with
    the current one."""
    name = stage.name
    key, old_key = ctx.keys[name], ctx.old_keys[name]
    record, why = manifests.verify(ctx.run_dir, name, key, old_key)
    if record is not None and stage.intact is not None:
        problem = stage.intact(ctx)
        record, why = (record, "") if problem is None else (None, problem)
    if record is not None:
        if not manifests.current(record):
            record = manifests.rekey(ctx.run_dir, name, record, key)
            marker = ctx.layout.marker(name)
            if marker.is_file() and marker.read_text() == old_key:
                marker.write_text(key)
            logger.info(
                "%s: manifest from before key version %d rekeyed", name, record["key_version"]
            )
        logger.info("%s: outputs verified, skipped", name)
    return record, why


def _stage(stage: Stage, ctx: Context):
    """Skip when the stage's outputs verify (``_verified``); else run it, record it."""
    logger, name = get_run_logger(), stage.name
    key = ctx.keys[name]
    record, why = _verified(stage, ctx, logger)
    if record is not None:
        _publish(ctx, stage, "Skipped", record["summary"], ctx.tracker.state["stages"].get(name))
        return Completed(name="Skipped", message="outputs verified", data=record["summary"])
    if why in (manifests.NO_MANIFEST, manifests.KEY_CHANGED) and _interrupted(ctx, name):
        why = "it was interrupted before it finished"
    logger.info("%s: runs (%s)", name, why)
    run_id = ctx.tracker.stage(name)
    try:
        summary, outputs = stage.run(ctx, run_id)
    except refusals() as err:  # its sentence is the whole story: no traceback
        ctx.tracker.finish(run_id, "FAILED")
        return Failed(message=str(err), data=err)
    except BaseException as err:
        ctx.tracker.finish(run_id, _status(err))
        raise
    files = manifests.checksums(ctx.run_dir, outputs)
    manifests.write(ctx.run_dir, name, key, files, summary)
    ctx.tracker.artifacts(run_id, manifests.manifest_path(ctx.run_dir, name), "manifest")
    ctx.tracker.finish(run_id)
    _publish(ctx, stage, "Completed", summary, run_id)
    return summary


def _publish(ctx: Context, stage: Stage, status: str, summary: dict, run_id: str | None) -> None:
    """The stage's markdown artifact in Prefect (what it produced, key numbers, MLflow link)."""
    tracker, name = ctx.tracker, stage.name
    where = mlflow_where(name, tracker.link(run_id), tracker.page(run_id), tracker.uri)
    produced = ctx.layout.found(stage.produced(ctx.layout))
    markdown = stage_markdown(name, status, summary, ctx.run_dir, where, produced)
    publish(artifact_key(ctx.run_dir, name), markdown, f"{name} stage of {ctx.run_dir}")


@task(cache_policy=NO_CACHE)
def stage_task(stage: Stage, ctx: Context):
    """A stage as a Prefect task (named after it: ``STAGES`` runs it ``with_options``)."""
    return _stage(stage, ctx)


# ---- tokenize ----------------------------------------------------------------------------


def _tokenize_key(run: RunConfig, keys: dict[str, str]) -> dict[str, Any]:
    if run.data.sources:
        return _sources_key(run)
    data = keyed("data", to_dict(run.data))
    data = {k: v for k, v in data.items() if k not in NOT_IN_TOKENIZE_KEY}
    return {"data": data, "vocab": run.model.vocab_size}


def _tokenize(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    from moe_core.data.manifest import read_manifest
    from moe_core.data.tokenize import tokenize_corpus, without_text_sentence

    if ctx.run.data.sources:
        return _verify_sources(ctx, run_id)
    out = ctx.layout.data
    _supersede(ctx, "tokenize", out)
    if ctx.run.cluster.kind != "local":
        _tokenize_on_cluster(ctx)
    else:
        with stage_progress("tokenize") as progress:
            tokenize_corpus(
                ctx.run.data,
                out,
                model_vocab_size=ctx.run.model.vocab_size,
                show_progress=False,
                on_progress=lambda p: progress.update(p.text(), p.documents, p.total),
            )
    content = read_manifest(out).content
    summary = {k: content[k] for k in ("total_tokens", "dtype") if k in content}
    summary["tokenizer"] = content.get("tokenizer", {}).get("name")
    if "documents_without_text" in content:
        summary["documents_without_text"] = content["documents_without_text"]["count"]
        get_run_logger().warning(without_text_sentence(content, ctx.run.data.text_field))
    ctx.tracker.params(run_id, {"data": summary})
    for f in sorted(out.glob("tokenizer*.json")) + sorted(out.glob("special_tokens_map.json")):
        ctx.tracker.artifacts(run_id, f, "tokenizer")
    ctx.tracker.artifacts(run_id, ctx.layout.data_manifest, "data")
    return summary, [ctx.layout.data_manifest]


def _tokenize_on_cluster(ctx: Context) -> None:
    """Tokenize on ``cluster.nodes`` nodes of the cluster (a Dask scheduler, workers and the
    driver, ``moe tokenize --config tokenize/config.json``: ``flows.render``'s
    ``render_slurm_tokenize`` or ``kubernetes_tokenize_objects``); the job's log is streamed.
    A failed job fails the stage; rerunning it resumes from the units and shards written."""
    from flows.launchers import KubernetesTokenizeLauncher, SlurmTokenizeLauncher

    launcher = {"slurm": SlurmTokenizeLauncher, "kubernetes": KubernetesTokenizeLauncher}
    folder = ctx.layout.root / "tokenize"
    folder.mkdir(exist_ok=True)
    data = dataclasses.replace(ctx.run.data, dir=str(ctx.layout.data))
    resolved = dataclasses.replace(ctx.run, data=data)
    (folder / "config.json").write_text(json.dumps(to_dict(resolved), indent=1))
    kind = launcher[ctx.run.cluster.kind]
    attempt = kind(resolved, folder, get_run_logger().info).attempt(1)
    if not attempt.ok:
        raise RunFailedError(
            f"tokenizing on the cluster failed: {attempt.detail} (its log is beside "
            f"{attempt.script})."
        )


def _tokenize_intact(ctx: Context) -> str | None:
    from moe_core.data.manifest import verify_data_dir

    try:
        if ctx.run.data.sources:
            _check_sources(ctx)
        else:
            verify_data_dir(ctx.layout.data, checksums=True)
    except Exception as err:
        return str(err)
    return None


# A mixture's sources are folders tokenized already (ours, Dolma's, Megatron's): the tokenize
# stage verifies them instead, and records what it verified in the data folder (sources.json,
# each other tool's corpus's checksums, the mixture's tokenizer files for the export).


def _source_files(source: SourceConfig) -> tuple[Path, list[Path]]:
    """The folder and files a mixture source reads (a folder, a Dolma glob or a Megatron
    prefix), found without opening them."""
    path = Path(source.dir)
    if path.is_dir():
        return path, sorted(p for p in path.rglob("*") if p.is_file())
    if glob.has_magic(source.dir):  # its files lie below the folder before the first wildcard
        magic = min(source.dir.index(c) for c in "*?[" if c in source.dir)
        files = sorted(Path(p) for p in glob.glob(source.dir, recursive=True))
        return Path(os.path.dirname(source.dir[:magic])), [p for p in files if p.is_file()]
    return path.parent, sorted(path.parent.glob(path.name + ".*"))  # PREFIX.idx, PREFIX.bin


def _sources_key(run: RunConfig) -> dict[str, Any]:
    """What a mixture's verification depends on: each source's folder and format and its
    contents (ours: the manifest's sha256, which names every shard's; another tool's: each
    file's name, size and modification time, hashing a corpus at every pipeline start being
    too slow), the vocabulary they are read with and where the held-out tail starts. Weights
    are the train stage's."""
    from moe_core.data.errors import DataError
    from moe_core.data.manifest import read_manifest

    sources = []
    for s in run.data.sources:
        row: dict[str, Any] = {"name": s.name, "dir": s.dir, "format": s.format}
        if s.token_dtype is not None:
            row["token_dtype"] = s.token_dtype
        if s.format == "moe":
            try:
                row["manifest"] = read_manifest(s.dir).sha256
            except (DataError, OSError):
                row["manifest"] = None  # the stage says why when it runs
        else:
            row["files"] = manifests.files_fingerprint(*_source_files(s))
        sources.append(row)
    d = run.data
    return {
        "sources": sources,
        "tokenizer": d.tokenizer,
        "validation_fraction": d.validation_fraction,
        "vocab": run.model.vocab_size,
    }


def _verify_sources(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    """Every source checked as training checks it (``check_mixture_fits``) and hashed (ours
    against their manifests; another tool's recorded in the data folder), the mixture's
    tokenizer files written there, and ``sources.json`` saying what was verified."""
    from moe_core.data.formats import checksums_record, mixture_vocabulary, open_source
    from moe_core.files import atomic_write, json_bytes
    from moe_core.train.batches import check_mixture_fits

    run, layout, out = ctx.run, ctx.layout, ctx.layout.data
    _supersede(ctx, "tokenize", out)
    out.mkdir(parents=True, exist_ok=True)
    check_mixture_fits(run)
    vocab = mixture_vocabulary(run.data, run.model.vocab_size)
    rows, outputs = _check_sources(ctx, record=True), []
    for row in rows:
        if row["format"] != "moe":
            outputs.append(out / checksums_record(row["name"]))
    for name, content in sorted(vocab.files.items()):
        atomic_write(out / name, content)
        outputs.append(out / name)
    tokenizer = {"vocab_size": vocab.size, "eos_id": vocab.eos_id, "source": vocab.source}
    record = {"sources": rows, "tokenizer": tokenizer}
    atomic_write(layout.data_sources, json_bytes(record))
    seq_len = run.train.seq_len
    summary: dict[str, Any] = {"sources": len(rows), "total_tokens": 0}
    for s in run.data.sources:
        splits = [open_source(run.data.of_source(s), sp, seq_len, vocab) for sp in SPLITS]
        summary[f"{s.name}_tokens"] = sum(d.tokens for d in splits)
        summary["total_tokens"] += summary[f"{s.name}_tokens"]
    summary["tokenizer"] = vocab.source
    ctx.tracker.params(run_id, {"data": summary})
    for f in outputs:
        ctx.tracker.artifacts(run_id, f, "tokenizer" if f.name in vocab.files else "data")
    ctx.tracker.artifacts(run_id, layout.data_sources, "data")
    get_run_logger().info(
        "tokenize: verified %d sources (%s), %s tokens",
        len(rows),
        ", ".join(f"{r['name']}: {r['format']}" for r in rows),
        f"{summary['total_tokens']:,}",
    )
    return summary, [layout.data_sources, *outputs]


def _check_sources(ctx: Context, record: bool = False) -> list[dict[str, Any]]:
    """Each source hashed: ours against its manifest, another tool's corpus recorded in the
    data folder (``record``) or checked against that record (a changed file raises its one
    sentence). The rows of ``sources.json``."""
    from moe_core.data.formats import check_recorded, open_source, sources_vocabulary
    from moe_core.data.manifest import verify_data_dir

    run, out = ctx.run, ctx.layout.data
    vocab = sources_vocabulary(run.data, run.model.vocab_size)
    rows = []
    for s in run.data.sources:
        row: dict[str, Any] = {"name": s.name, "format": s.format, "dir": s.dir}
        if s.format == "moe":
            row["manifest_sha256"] = verify_data_dir(s.dir, checksums=True).sha256
        else:
            corpus = open_source(run.data.of_source(s), "train", run.train.seq_len, vocab)
            row["checked"] = check_recorded(corpus, out, resuming=not record, source=s.name)
        rows.append(row)
    return rows


# ---- init --------------------------------------------------------------------------------


def _init_key(run: RunConfig, keys: dict[str, str]) -> dict[str, Any]:
    key: dict[str, Any] = {"model": keyed("model", to_dict(run.model)), "seed": run.train.seed}
    if run.init.from_hf is not None:  # the weights come from there: which files, as they are
        key["from_hf"] = manifests.folder_fingerprint(Path(run.init.from_hf))
    return key


def _init(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    from moe_core.model.flops import count
    from moe_core.train.init import write_initial_checkpoint

    _supersede(ctx, "init", ctx.layout.init)
    path = write_initial_checkpoint(ctx.run, ctx.layout.init_checkpoints)
    counts = count(ctx.run.model)
    summary = {"checkpoint": str(path), "total_params": counts.total_params}
    if ctx.run.init.from_hf is not None:
        summary["from_hf"] = ctx.run.init.from_hf
    ctx.tracker.params(run_id, {"init": summary})
    return summary, [path / "manifest.json"]


def _init_intact(ctx: Context) -> str | None:
    from moe_core.train.checkpoint import verify

    return verify(ctx.layout.init_checkpoint())


# ---- train -------------------------------------------------------------------------------


def _train_key(run: RunConfig, keys: dict[str, str]) -> dict[str, Any]:
    train = {
        "model": keyed("model", to_dict(run.model)),
        "train": train_section(to_dict(run.train)),
        "parallel": keyed("parallel", to_dict(run.parallel)),
        "precision": precision_section(to_dict(run.precision)),
        "tokenize": keys["tokenize"],
        "init": keys["init"],
    }
    if run.eval.every:  # in-training downstream scores are part of what train writes
        train["eval"] = to_dict(run.eval)
    if run.data.sources:  # a mixture's draw (its sources' contents are the tokenize key's)
        train["mixture"] = [
            {"name": s.name, "weight": s.weight, "tokens": s.tokens} for s in run.data.sources
        ]
    return train


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link (copy where links are impossible) a checkpoint folder: no second copy on disk."""
    tmp = dst.with_name(f".tmp-{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    for f in src.rglob("*"):
        target = tmp / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)
    tmp.rename(dst)


def _start_from_init(ctx: Context) -> None:
    """A fresh train folder begins at the init stage's checkpoint (linked, not copied); one
    that holds checkpoints of this configuration (an interrupted attempt) is resumed."""
    from moe_core.train.checkpoint import step_of

    layout = ctx.layout
    _supersede(ctx, "train", layout.train)
    found = layout.train_checkpoints.iterdir() if layout.train_checkpoints.is_dir() else []
    if not any(step_of(p.name) is not None for p in found):
        _link_tree(layout.init_checkpoint(), layout.train_checkpoint(0))


def _write_train_config(ctx: Context, run_id: str | None) -> None:
    """The resolved config every attempt trains (``train/config.json``), also as MLflow params."""
    # Resume is what makes retries continue; the export is the convert stage's job.
    train = dataclasses.replace(ctx.run.train, resume=True, save_model=False)
    resolved = dataclasses.replace(ctx.run, train=train)
    ctx.layout.train_config.write_text(json.dumps(to_dict(resolved), indent=1))
    ctx.tracker.params(run_id, to_dict(resolved))


def _check_final_checkpoint(ctx: Context) -> None:
    from moe_core.train.checkpoint import verify

    problem = verify(ctx.final_checkpoint)
    if problem is not None:
        raise RunFailedError(f"training ended without its final checkpoint: {problem}")


def _train_summary(ctx: Context, run_id: str | None, attempts: list[Attempt]) -> dict[str, Any]:
    """The stage's numbers from ``metrics.jsonl`` (medians leave out the warm-up step), also as
    MLflow metrics."""
    lines = [json.loads(x) for x in ctx.layout.metrics.read_text().splitlines()]
    summary = {
        "final_loss": lines[-1]["loss"],
        "first_loss": lines[0]["loss"],
        "steps": len(lines),
        "skipped_steps": sum(bool(x.get("skipped")) for x in lines),
        "checkpoint": str(ctx.final_checkpoint),
        "launches": [a.record() for a in attempts],
    }
    evals = [x["eval_loss"] for x in lines if "eval_loss" in x]
    if evals:
        summary["final_eval_loss"] = evals[-1]
    timed = lines[1:] or lines  # the first step compiles and warms up
    for key in ("tokens_per_s_per_gpu", "model_tflops_per_gpu"):
        summary[f"median_{key}"] = statistics.median(x[key] for x in timed)
    ctx.tracker.metrics(
        run_id, {k: float(v) for k, v in summary.items() if isinstance(v, int | float)}
    )
    return summary


def _train(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    """Start from init (or resume), write the config, launch until an attempt finishes (the
    launcher of ``cluster.kind``, ``flows.launch.launch_attempts``), check the final
    checkpoint, plot, summarize."""
    logger, layout = get_run_logger(), ctx.layout
    _start_from_init(ctx)
    _write_train_config(ctx, run_id)
    launcher = launcher_class(ctx.run)(ctx.run, layout.train, logger.info)
    attempts = launch_attempts(launcher, ctx.tracker, run_id, logger)
    _check_final_checkpoint(ctx)
    for p in training_plots(layout.metrics, layout.plots):
        ctx.tracker.artifacts(run_id, p, "plots")
    summary = _train_summary(ctx, run_id, attempts)
    outputs = [ctx.final_checkpoint / "manifest.json", layout.metrics, layout.launches]
    return summary, outputs + [Path(a.script) for a in attempts[-1:] if a.script]


def _train_intact(ctx: Context) -> str | None:
    from moe_core.train.checkpoint import verify

    return verify(ctx.final_checkpoint)


# ---- convert -----------------------------------------------------------------------------


def _convert_key(run: RunConfig, keys: dict[str, str]) -> dict[str, Any]:
    return {"train": keys["train"]}


def _convert(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    from moe_core.convert.checkpoint import checkpoint_to_hf
    from moe_core.model.dtypes import DTYPES

    layout = ctx.layout
    out = layout.hf
    dtype = DTYPES[ctx.run.precision.params]
    # the data folder holds the tokenizer files (a mixture's: those the tokenize stage wrote)
    checkpoint_to_hf(ctx.final_checkpoint, out, dtype, layout.data, _eos(ctx), overwrite=True)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    if size <= ctx.run.tracking.hf_artifact_max_gib * 2**30:
        ctx.tracker.artifacts(run_id, out, "hf")
    else:
        link = layout.hf_location
        link.write_text(f"{out.resolve()}\n")
        ctx.tracker.artifacts(run_id, link, "hf")
    summary = {"hf_dir": str(out), "bytes": size, "dtype": str(dtype).removeprefix("torch.")}
    ctx.tracker.metrics(run_id, {"hf_bytes": float(size)})
    return summary, [out]


def _eos(ctx: Context) -> int | None:
    """The end-of-text id of the run's tokenizer: its data manifest's, a mixture's record's."""
    from moe_core.data.manifest import read_manifest

    if ctx.run.data.sources:
        return json.loads(ctx.layout.data_sources.read_text())["tokenizer"]["eos_id"]
    return read_manifest(ctx.layout.data).content.get("tokenizer", {}).get("eos_id")


# ---- evaluate ----------------------------------------------------------------------------


def _evaluate_key(run: RunConfig, keys: dict[str, str]) -> dict[str, Any]:
    evaluate: dict[str, Any] = {"convert": keys["convert"], "batches": EVAL_BATCHES}
    if run.eval.tasks:
        ev = to_dict(run.eval)
        evaluate["downstream"] = {k: ev[k] for k in ("tasks", "limit", "seed", "tasks_from")}
    return evaluate


def _evaluate(ctx: Context, run_id: str | None) -> tuple[dict, list[Path]]:
    from moe_core.eval.perplexity import evaluate, write_samples

    layout = ctx.layout
    out = layout.eval
    out.mkdir(parents=True, exist_ok=True)
    what = {"scoring": "held-out micro-batches scored", "sampling": "prompts continued"}
    with stage_progress("evaluate") as progress:
        result = evaluate(
            ctx.final_checkpoint,
            layout.hf,
            _held_out(ctx),
            EVAL_BATCHES,
            on_progress=lambda phase, done, total: progress.update(
                f"{done} of {total} {what[phase]}", done, total, force=done == total
            ),
        )
    tolerance = 1e-4 if ctx.run.precision.params == "fp32" else 2e-2
    layout.eval_result.write_text(json.dumps(result.as_dict(), indent=1))
    write_samples(result, layout.eval_samples)
    numbers = {k: float(v) for k, v in result.as_dict().items() if isinstance(v, int | float)}
    ctx.tracker.metrics(run_id, numbers)
    outputs = [layout.eval_result, layout.eval_samples]
    summary = result.as_dict()
    if ctx.run.eval.tasks:
        from moe_core.eval.downstream import evaluate_checkpoint, write_scores

        with stage_progress("evaluate") as progress:
            scores = evaluate_checkpoint(
                ctx.final_checkpoint,
                layout.data,
                ctx.run.eval,
                _eos(ctx),
                on_progress=lambda done, total: progress.update(
                    f"{done} of {total} downstream batches scored", done, total
                ),
            )
        outputs += write_scores(scores, out)
        summary["downstream"] = {s.task: {"examples": s.examples, **s.metrics()} for s in scores}
        ctx.tracker.metrics(run_id, downstream_metrics(summary["downstream"]))
        for s in scores:
            get_run_logger().info(
                "%s: %d examples, acc_raw %.4f, acc_per_char %.4f",
                s.task,
                s.examples,
                s.acc_raw,
                s.acc_per_char,
            )
    ctx.tracker.artifacts(run_id, out)
    if result.relative_difference > tolerance:
        raise RunFailedError(
            f"our model's held-out loss {result.loss:.6f} and the Hugging Face export's "
            f"{result.hf_loss:.6f} differ by {result.relative_difference:.2e} relative, more than "
            f"{tolerance:g}: the export does not compute our model."
        )
    return summary, outputs


def _held_out(ctx: Context) -> Any:
    """What the evaluate stage scores: the data folder's validation split, or a mixture's
    first source's (as training's held-out loss), in whatever format it is."""
    if not ctx.run.data.sources:
        return ctx.layout.data
    from moe_core.data.formats import open_source, sources_vocabulary

    run = ctx.run
    vocab = sources_vocabulary(run.data, run.model.vocab_size)
    first = run.data.of_source(run.data.sources[0])
    return open_source(first, "validation", run.train.seq_len, vocab)


def downstream_metrics(table: dict[str, dict]) -> dict[str, float]:
    """MLflow metric names per task and format: ``arc_easy_rc_5shot.acc_per_char``."""
    return {
        f"{task}.{k}".replace(":", "_"): float(v)
        for task, row in table.items()
        for k, v in row.items()
        if k.startswith("acc")
    }


# ---- the stages, in order -----------------------------------------------------------------

STAGES = (
    Stage(
        "tokenize",
        _tokenize_key,
        _tokenize,
        _tokenize_intact,
        lambda L: [L.data_manifest, L.data / "tokenizer.json", L.data / "*.npy"],
    ),
    Stage("init", _init_key, _init, _init_intact, lambda L: [L.init_checkpoints / "step_*"]),
    Stage(
        "train",
        _train_key,
        _train,
        _train_intact,
        lambda L: [L.train_checkpoints, L.metrics, L.launches, L.plots / "*.png"],
        # retries are the stage's own (flows.launchers)
        timeout_s=lambda run: run.cluster.train_timeout_s or None,
    ),
    Stage(
        "convert",
        _convert_key,
        _convert,
        produced=lambda L: [L.hf / "config.json", L.hf / "*.safetensors", L.hf / "tokenizer.json"],
    ),
    Stage("evaluate", _evaluate_key, _evaluate, produced=lambda L: [L.eval_result, L.eval_samples]),
)
NAMES = tuple(stage.name for stage in STAGES)


# ---- the flow ----------------------------------------------------------------------------


def default_run_dir(cluster: dict[str, Any] | None = None) -> str:
    """A flow run's own folder when none is given: ``runs/<deployment>/<flow run name>`` (for
    a deployment run; ``runs/pretrain/<flow run name>`` for a direct call), so a second run of
    a deployment never finds the first one's outputs and skips every stage. On Kubernetes
    (``cluster.kind``) it lies below ``cluster.volume_path``, the shared volume the training
    pods mount, as the flow run's own pod does (``infra/kubernetes-pool.json``)."""
    from prefect.runtime import deployment, flow_run

    folder = f"runs/{deployment.name or 'pretrain'}/{flow_run.name}"
    cluster = cluster or {}
    if cluster.get("kind") == "kubernetes":
        volume = cluster.get("volume_path", ClusterConfig.volume_path)
        return f"{volume.rstrip('/')}/{folder}"
    return folder


@flow(name="pretrain")
def pretrain(config: dict[str, Any], run_dir: str | None = None) -> dict[str, Any]:
    """Run (or resume) the pipeline for a resolved config in ``run_dir`` (default: a folder of
    this flow run's own, see ``default_run_dir``; give one to resume it), which it locks: a
    second pipeline there is refused in one sentence naming this one's process and host.

    The flow run's final state message is the run's summary line, or the one sentence of a
    refusal (a bad value, a plan that does not fit, a locked folder, a stage that gave up),
    which is logged without a traceback and raised to a direct caller; other errors keep
    Prefect's traceback."""
    logger = get_run_logger()
    quiet_refusals()  # a worker's engine would log the refusal again, with a traceback
    try:
        outcome = _pipeline(config, run_dir)
    except refusals() as err:
        logger.error("%s", err)
        return Failed(message=str(err), data=err)
    # The summary once: Prefect logs the final state with its message ("Finished in state").
    return Completed(message=summary_line(outcome), data=outcome)


def _pipeline(config: dict[str, Any], run_dir: str | None) -> dict[str, Any]:
    """Resolve, check, lock, then every stage."""
    logger = get_run_logger()
    root = run_root(default_run_dir(config.get("cluster")) if run_dir is None else run_dir)
    run = resolve(config, root)  # refusals come before anything is written
    preflight(run, logger)
    lock = RunLock(root, "pretrain pipeline")
    if lock.previous is not None:
        logger.warning("took over the lock of %s: it no longer runs", lock.previous)
    if lock.unsupported is not None:
        logger.warning("%s: a second pipeline here would not be stopped", lock.unsupported)
    try:
        return _stages(run, root)
    finally:
        lock.release()


def _stages(run: RunConfig, root: Path) -> dict[str, Any]:
    """Every stage in order, tracked; the flow's outcome."""
    ctx = _begin(run, root)
    outcome: dict[str, Any] = {"run_dir": str(root), "stages": {}}
    try:
        for stage in STAGES:
            fn = stage_task.with_options(name=stage.name, timeout_seconds=stage.timeout_s(run))
            state = fn(stage, ctx, return_state=True)
            outcome["stages"][stage.name] = state.name
            summary = state.result()
            if isinstance(summary, dict):
                outcome[stage.name] = summary
    except BaseException as err:
        ctx.tracker.finish(ctx.tracker.current, _status(err))
        raise
    return _finish(ctx, outcome, published=True)


def _begin(run: RunConfig, root: Path, keep_page: bool = False) -> Context:
    """What every pipeline writes before its stages: the resolved config, the run's page, the
    tracker (its parent run made when a stage runs). ``keep_page``: a page already there for
    this very config stays (building it composes every preset: seconds)."""
    layout = RunLayout(root)
    text = json.dumps(to_dict(run), indent=1)
    same = layout.config.is_file() and layout.config.read_text() == text
    layout.config.write_text(text)
    tracker = Tracker(root, run.tracking.uri, run.tracking.experiment, root.name)
    from moe_core.planpage import RUN_PAGE, write_run_page  # moe plan --html, for this run

    page: Path | None = root / RUN_PAGE
    if not (keep_page and same and page.is_file()):
        tokens = None
        if run.data.sources:  # the page shows each source's epochs by its size
            from moe_core.data.formats import source_tokens

            tokens = source_tokens(run.data, run.train.seq_len, run.model.vocab_size)
        page = write_run_page(run, root, tokens)
    tracker.begin(to_dict(run), [layout.config, *([page] if page is not None else [])])
    return Context(run, layout, tracker, stage_keys(run), old_stage_keys(run, EVAL_BATCHES))


def _finish(ctx: Context, outcome: dict[str, Any], published: bool) -> dict[str, Any]:
    """The parent run's record of this invocation (a note only, when every stage was skipped)
    and the outcome's links; ``published``: also the run's markdown artifact in Prefect."""
    tracker, layout, root = ctx.tracker, ctx.layout, ctx.run_dir
    evaluation = outcome.get("evaluate", {})
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if all(state == "Skipped" for state in outcome["stages"].values()):
        # Nothing ran: the parent run keeps its own timings; the rerun is a line on its page.
        tracker.note(tracker.parent, f"{when}: rerun; every stage's outputs verified, none redone.")
    else:
        parent = tracker.current  # None offline: the latest parent is an earlier attempt's
        # This attempt's parent names the run behind every stage's outputs (kept ones too).
        runs = {n: tracker.state["stages"].get(n) for n in outcome["stages"]}
        tracker.tags(parent, {f"moe.stage.{n}": r for n, r in runs.items() if r})
        ran = [n for n, state in outcome["stages"].items() if state != "Skipped"]
        kept = [f"{n} (run {runs[n]})" for n in outcome["stages"] if n not in ran and runs[n]]
        text = f"{when}: ran {', '.join(ran)}"
        tracker.note(parent, text + (f"; kept, verified: {', '.join(kept)}." if kept else "."))
        train = outcome.get("train", {})
        headline = {
            "final_loss": train.get("final_loss"),
            "final_eval_loss": train.get("final_eval_loss"),
            "tokens_per_s_per_gpu": train.get("median_tokens_per_s_per_gpu"),
            "model_tflops_per_gpu": train.get("median_model_tflops_per_gpu"),
            "perplexity": evaluation.get("perplexity"),
        }
        tracker.metrics(parent, {k: float(v) for k, v in headline.items() if v is not None})
        if downstream := evaluation.get("downstream"):
            tracker.metrics(parent, downstream_metrics(downstream))
            rows = [{"task": task, **row} for task, row in downstream.items()]
            tracker.table(parent, rows, "downstream.json")
        tracker.finish(parent)
    outcome["hf_dir"] = str(layout.hf)
    outcome["perplexity"] = evaluation.get("perplexity")
    # A store that was unreachable during the run has nothing to show yet: no link offered.
    link = tracker.link(tracker.parent)  # a server's run page, else how to serve the sqlite store
    page = tracker.page(tracker.parent)
    where = None
    outcome["mlflow_run"] = outcome["mlflow_ui"] = None
    outcome["mlflow_reached"] = tracker.online
    if tracker.online and page is not None:
        outcome["mlflow_run"] = link or f"{LOCAL_UI}/{page}"  # the parent run's page
        outcome["mlflow_ui"] = None if link else ui_command(tracker.uri)
        where = mlflow_where("parent", link, page, tracker.uri)
    if published:
        markdown = run_markdown(outcome, where)
        publish(artifact_key(root, "pretrain"), markdown, f"pretrain run {root}")
    return outcome


def verified_rerun(config: dict[str, Any], run_dir: str) -> dict[str, Any] | None:
    """A rerun in which every stage's outputs verify, done without Prefect (``moe pipeline``
    calls it first, where a flow run would have to start a temporary Prefect server: most of
    such a rerun's time): the same outcome and MLflow record as the flow's, no flow run and no
    Prefect artifacts. None, having changed nothing, when some stage would run: the flow runs.
    The keys are compared first, so a changed config costs no checksums here."""
    root = run_root(run_dir)
    run = resolve(config, root)
    keys, old_keys = stage_keys(run), old_stage_keys(run, EVAL_BATCHES)
    for name in NAMES:
        record = manifests.read(root, name)
        if not isinstance(record, dict) or record.get("key") not in (keys[name], old_keys[name]):
            return None
    logger = logging.getLogger(__name__)
    lock = RunLock(root, "pretrain pipeline")
    if lock.previous is not None:
        logger.warning("took over the lock of %s: it no longer runs", lock.previous)
    try:
        ctx = _begin(run, root, keep_page=True)
        outcome: dict[str, Any] = {"run_dir": str(root), "stages": {}}
        for stage in STAGES:
            record, why = _verified(stage, ctx, logger)
            if record is None:
                logger.info("%s: runs (%s): the flow runs it", stage.name, why)
                return None
            outcome["stages"][stage.name] = "Skipped"
            outcome[stage.name] = record["summary"]
        return _finish(ctx, outcome, published=False)
    finally:
        lock.release()
