"""What the pipeline shows where Prefect users look: a markdown artifact per stage (what it
produced, its key numbers, paths and the MLflow link), one for the whole run, and the one-line
summary that becomes the flow run's final state message.

Publishing is best effort: an artifact the API refuses is a warning in the log, never a failed
stage (the stage's outputs and manifest are already written when it is published).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from flows.tracking import LOCAL_UI, ui_command
from moe_core.progress import LineProgress

LABELS = {
    "total_tokens": "tokens",
    "total_params": "parameters",
    "first_loss": "first loss",
    "final_loss": "final loss",
    "final_eval_loss": "final eval loss",
    "skipped_steps": "skipped steps",
    "median_tokens_per_s_per_gpu": "tokens/s/GPU (median)",
    "median_model_tflops_per_gpu": "model TFLOP/s/GPU (median)",
    "hf_dir": "Hugging Face folder",
    "bytes": "size",
    "hf_loss": "loss (transformers)",
    "hf_perplexity": "perplexity (transformers)",
    "relative_difference": "relative difference",
    "tokens": "held-out tokens",
    "documents_without_text": "documents without text",
}


def artifact_key(run_dir: Path, name: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) per run folder and stage, so
    the UI's artifact page keeps each run folder's history of a stage together."""
    slug = re.sub(r"[^a-z0-9-]+", "-", f"{run_dir.name}-{name}".lower()).strip("-")
    return slug or name


def _number(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def _path(value: str, run_dir: Path) -> str:
    """A path shown relative to the run folder when it lies inside it."""
    try:
        return str(Path(value).resolve().relative_to(run_dir.resolve()))
    except ValueError:
        return value


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _rows(summary: dict[str, Any], run_dir: Path) -> list[str]:
    rows = []
    for key, value in summary.items():
        label = LABELS.get(key, key.replace("_", " "))
        if key == "bytes" and isinstance(value, int):
            shown = f"{value / 2**20:,.1f} MiB"
        elif key == "launches" and isinstance(value, list):
            states = ", ".join(f"{a.get('job_id')}: {a.get('state')}" for a in value)
            shown = f"{len(value)} ({states})" if value else "0"
        elif isinstance(value, list | dict):
            continue  # samples and the like get their own section
        elif isinstance(value, str) and ("/" in value or value.startswith(".")):
            shown = f"`{_path(value, run_dir)}`"
        else:
            shown = _number(value)
        rows.append(f"| {_cell(label)} | {_cell(shown)} |")
    return rows


def stage_markdown(
    name: str,
    status: str,
    summary: dict[str, Any],
    run_dir: Path,
    mlflow: str | None,
    produced: tuple[str, ...] | list[str] = (),
) -> str:
    """A stage's artifact: its status, key numbers, the files it produced (``produced``, paths
    relative to the run folder: its row's in ``flows.pretrain.STAGES``) and where its MLflow
    run is (``mlflow``: markdown, see ``mlflow_where``)."""
    head = f"## {name}: {status.lower()}"
    if status == "Skipped":
        head += " (its outputs verified against the manifest; nothing was redone)"
    lines = [head, "", f"Run folder: `{run_dir}`", ""]
    rows = _rows(summary, run_dir)
    if rows:
        lines += ["| | |", "|---|---|", *rows, ""]
    for sample in summary.get("samples") or []:
        if isinstance(sample, dict) and "prompt" in sample:
            continuation = " ".join(str(sample.get("continuation", "")).split()).replace("`", "'")
            lines.append(f"- *{sample['prompt']}* → `{continuation}`")
    if summary.get("samples"):
        lines.append("")
    if produced:
        lines += ["Produced:", "", *(f"- `{p}`" for p in produced), ""]
    if mlflow is not None:
        lines.append(f"MLflow: {mlflow}")
    return "\n".join(lines).rstrip() + "\n"


def mlflow_where(name: str, link: str | None, page: str | None, uri: str) -> str | None:
    """A run's place in MLflow as markdown: its page on a server, or, for a local store, the
    command that serves it and the page's address under it (``mlflow ui``'s default port)."""
    if link is not None:
        return f"[{name} run]({link})"
    if page is not None:
        return f"`{ui_command(uri)}`, then `{LOCAL_UI}/{page}`"
    return None


def _launches(launches: list[dict[str, Any]]) -> str:
    """How training was launched: how many times, why it was relaunched, and whether an
    earlier pipeline (stopped or crashed) launched it before."""
    failed = [str(a.get("detail")) for a in launches if not a.get("ok")]
    text = str(len(launches))
    if failed:
        text += f" (relaunched after: {'; '.join(failed)})"
    earlier = int(launches[0].get("number", 1)) - 1 if launches else 0
    if earlier:
        text += f", after {earlier} launch{'es' if earlier > 1 else ''} by an interrupted pipeline"
    return text


def summary_rows(outcome: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's headline as (label, text) rows: the Hugging Face folder, the perplexities,
    the losses from the run's first step, the launches, the skipped stages and the MLflow run's
    page. ``moe pipeline`` prints them last; ``summary_line`` joins them."""
    evaluation = outcome.get("evaluate", {})
    train = outcome.get("train", {})
    rows = [("Hugging Face checkpoint", str(outcome["hf_dir"]))]
    if "perplexity" in evaluation:
        rows.append(
            (
                "held-out perplexity",
                f"{evaluation['perplexity']:.3f} (transformers: "
                f"{evaluation.get('hf_perplexity', float('nan')):.3f})",
            )
        )
    if "final_loss" in train:
        loss = f"{train['first_loss']:.4f} -> {train['final_loss']:.4f} over {train['steps']} steps"
        if "final_eval_loss" in train:
            loss += f" (held-out {train['final_eval_loss']:.4f})"
        rows.append(("loss", loss))
    if train.get("launches"):
        rows.append(("training launches", _launches(train["launches"])))
    skipped = [n for n, s in outcome["stages"].items() if s == "Skipped"]
    if skipped:
        rows.append(("skipped (verified)", ", ".join(skipped)))
    if outcome.get("mlflow_run") is None and outcome.get("mlflow_reached"):
        # Reached, but every stage was skipped and no run holds these outputs: they were made
        # while the store was away (a run of an earlier config is never offered in their place).
        rows.append(("MLflow", "no run holds these outputs (made while the store was away)"))
    elif outcome.get("mlflow_run") is None:  # the store was unreachable during the run
        rows.append(
            (
                "MLflow",
                "unreachable, so there is nothing to browse yet: the metrics are in "
                "metrics.jsonl and go to MLflow on a later run",
            )
        )
    else:
        serve = f" (once `{outcome['mlflow_ui']}` serves it)" if outcome.get("mlflow_ui") else ""
        rows.append(("MLflow run", f"{outcome['mlflow_run']}{serve}"))
    return rows


def summary_line(outcome: dict[str, Any]) -> str:
    """The run in one line: the flow run's final state message."""
    return "done: " + "; ".join(f"{label}: {text}" for label, text in summary_rows(outcome))


def summary_text(outcome: dict[str, Any]) -> str:
    """The run in a line per row, labels aligned: what ``moe pipeline`` prints last."""
    rows = summary_rows(outcome)
    width = max(len(label) for label, _ in rows)
    head = f"pipeline done: {outcome['run_dir']}"
    return "\n".join([head, *(f"  {label:<{width}}  {text}" for label, text in rows)])


def run_markdown(outcome: dict[str, Any], mlflow: str | None) -> str:
    """The whole run's artifact: each stage's state, the headline numbers and where the MLflow
    parent run is (``mlflow``, see ``mlflow_where``)."""
    lines = ["## pretrain", "", f"Run folder: `{outcome['run_dir']}`", "", "| stage | state |"]
    lines.append("|---|---|")
    lines += [f"| {n} | {s} |" for n, s in outcome["stages"].items()]
    lines += ["", "  \n".join(f"{label}: {text}" for label, text in summary_rows(outcome)), ""]
    if mlflow is not None:
        lines.append(f"MLflow: {mlflow}")
    return "\n".join(lines).rstrip() + "\n"


def stage_progress(name: str, every_s: float = 10.0, bar: bool | None = None) -> LineProgress:
    """A running stage's progress in the run's log (``moe_core.progress.LineProgress``)."""
    from prefect import get_run_logger

    return LineProgress(name, get_run_logger().info, every_s, bar)


def publish(key: str, markdown: str, description: str) -> None:
    """A markdown artifact of the current task or flow run (a warning if the API refuses)."""
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    try:
        create_markdown_artifact(markdown=markdown, key=key, description=description)
    except Exception as err:
        get_run_logger().warning("the artifact %s was not published: %s", key, err)


class RefusalTraceback(logging.Filter):
    """Drops the record Prefect's engine logs, with a traceback, when a flow run that returned
    ``Failed`` for a refusal (``moe_core.errors.refusals()``) ends in a worker's process: the
    flow already logged the sentence, and the final state carries it."""

    def filter(self, record: logging.LogRecord) -> bool:
        from moe_core.errors import refusals

        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, refusals())


def quiet_refusals() -> None:
    """Install ``RefusalTraceback`` on Prefect's flow-run logger (once)."""
    logger = logging.getLogger("prefect.flow_runs")
    if not any(isinstance(f, RefusalTraceback) for f in logger.filters):
        logger.addFilter(RefusalTraceback())
