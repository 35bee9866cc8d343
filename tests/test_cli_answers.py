"""Every ``moe`` command answers a config error in one sentence before it imports torch, Prefect,
MLflow or transformers (what made an answer take 10-15 s on a busy machine), and names the
nearest option of a mistyped key, value or config name."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "prefect", "mlflow", "transformers")

# ``moe`` with, once it has answered, the heavy packages that were imported on the way.
RUNNER = f"""
import sys
from moe_core.cli import main
code = main(sys.argv[1:])
heavy = [m for m in {HEAVY!r} if m in sys.modules]
print("imported:", ",".join(heavy), file=sys.stderr)
sys.exit(code)
"""


def moe(*args: str) -> tuple[int, str, list[str]]:
    """Run ``moe args`` in a fresh process: its exit code, its output, and which of ``HEAVY``
    it had imported when it answered."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "400"}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    print(f"moe {' '.join(args)}: {time.perf_counter() - start:.2f} s")  # shown, not asserted
    imported = done.stderr.rsplit("imported:", 1)[-1].strip()
    return done.returncode, done.stdout, [m for m in imported.split(",") if m]


def one_sentence(text: str) -> str:
    """The one line of an ``error:`` answer, checked to be one sentence."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), text
    sentence = lines[0].removeprefix("error: ")
    assert sentence.endswith(".") and "Traceback" not in text
    return sentence


TRAIN_STEP = (
    "train.step is not a known option: train takes async_checkpoint, beta1, beta2, "
    "checkpoint_at_end, checkpoint_every"
)


@pytest.mark.parametrize(
    "args",
    [
        ["info", "train.step=10"],
        ["plan", "train.step=10"],
        ["data", "train.step=10"],
        ["tokenize", "train.step=10"],
        ["train", "train.step=10"],
        ["eval", "score", "no/such/step_00000008", "train.step=10"],
        ["pipeline", "train.step=10"],
    ],
)
def test_a_mistyped_key_is_answered_before_anything_heavy_with_the_nearest_key(args):
    code, out, imported = moe(*args)
    sentence = one_sentence(out)
    assert code == 2
    assert sentence.startswith(TRAIN_STEP)
    assert sentence.endswith("warmup_steps, weight_decay (did you mean train.steps?).")
    assert imported == [], f"imported {imported} before answering"


@pytest.mark.parametrize(
    "args, start",
    [
        (
            ["pipeline", "data.format=dolma"],  # the pipeline's own refusals are as quick
            "data.format='dolma' is not allowed for the pipeline",
        ),
        (
            ["convert", "to-hf", "no/such/step_00000008", "out"],
            "no/such/step_00000008 does not exist: name a training checkpoint",
        ),
        (
            ["convert", "to-hf", "no/such/step_00000008", "out", "--max-shard-size", "5XB"],
            "--max-shard-size '5XB' is not allowed",
        ),
        (
            ["eval", "score", "no/such/step_00000008"],
            "no/such/step_00000008 does not exist: name a training checkpoint",
        ),
        (["eval", "score", "conf"], "eval.tasks=[] is not allowed here"),
    ],
)
def test_other_config_errors_are_answered_before_anything_heavy(args, start):
    code, out, imported = moe(*args)
    assert code == 2 and one_sentence(out).startswith(start)
    assert imported == [], f"imported {imported} before answering"


def test_info_of_the_largest_model_imports_no_torch():
    code, out, imported = moe("info", "model=1t")
    assert code == 0 and "1.20T" in out
    assert imported == []


def test_a_pipeline_this_machine_cannot_launch_is_refused_before_prefect_starts(tmp_path):
    """The 1t layout needs Slurm's commands: refused by the same checks the flow makes, before
    Prefect's temporary server starts (which took a minute on a busy machine)."""
    code, out, imported = moe(
        "pipeline", "--config-name", "pretrain-1t", f"run_dir={tmp_path / '1t'}"
    )
    sentence = one_sentence(out)
    assert code == 2
    assert sentence.startswith("cluster.kind='slurm' is not allowed on this machine")
    assert "prefect" not in imported and "mlflow" not in imported
    assert not (tmp_path / "1t").exists()


@pytest.mark.parametrize(
    "override, end",
    [
        ("model.router=sigmod", "one of 'softmax', 'sigmoid' (did you mean 'sigmoid'?)."),
        ("model=olmoe-1b7b", "small-mla, tiny (did you mean 'olmoe-1b-7b'?)."),
        ("out_dirr=runs/x", "tracking, train (did you mean out_dir?)."),
        ("tain.steps=3", "tracking, train (did you mean train.steps?)."),
    ],
)
def test_mistyped_values_sections_and_options_name_the_nearest(override, end):
    from moe_core.cli import main
    from moe_core.compose import compose_run
    from moe_core.config import ConfigError

    with pytest.raises(ConfigError) as err:
        compose_run([override])
    assert str(err.value).endswith(end)
    assert main(["info", override]) == 2


def test_a_mistyped_config_name_lists_the_configs_nearest_first(capsys):
    from moe_core.cli import main

    assert main(["info", "--config-name", "pretrain-1T"]) == 2
    sentence = one_sentence(capsys.readouterr().out)
    assert sentence.startswith("--config-name 'pretrain-1T' is not a config of ")
    assert ": its configs, nearest first, are pretrain-1t, " in sentence
    assert sentence.endswith(" (did you mean pretrain-1t?).")
    assert main(["info", "--config-name", "zzz"]) == 2
    assert "its configs are config, pretrain-1t, " in capsys.readouterr().out


def test_the_help_has_no_markup_of_docstrings(capsys):
    from moe_core.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    assert "``" not in shown
    assert "info, plan, tokenize, data, train, convert, eval, and pipeline" in " ".join(
        shown.split()
    )
