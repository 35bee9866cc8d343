"""Where a pipeline run keeps its files: every path under the run folder, derived here and read
by the flow, its stage manifests, its reports and its tracking, so a folder's layout is spelled
once. Checkpoint folders inside ``checkpoints/`` are named by
``moe_core.train.checkpoint.step_dir_name``, the trainer's one rule for them."""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_core.config import (
    ClusterConfig,
    ConfigError,
    DataConfig,
    RunConfig,
    check_folder,
    check_path,
)
from moe_core.config_dict import from_dict


@dataclass(frozen=True)
class RunLayout:
    """The files of the pipeline run in ``root``."""

    root: Path

    # ---- the run's own files ---------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.root / "config.json"  # the resolved config of the latest invocation

    @property
    def stages(self) -> Path:
        return self.root / "stages"

    def manifest(self, stage: str) -> Path:
        """A finished stage's manifest (its key, its outputs' checksums, its summary)."""
        return self.stages / f"{stage}.json"

    def marker(self, stage: str) -> Path:
        """The key of the configuration whose outputs a stage's folder holds (finished or
        not), so another configuration's are moved aside before it writes."""
        return self.stages / f"{stage}.key"

    @property
    def mlflow_state(self) -> Path:
        return self.root / "mlflow.json"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"  # the run folder's own store (no server configured)

    @property
    def mlartifacts(self) -> Path:
        return self.root / "mlartifacts"

    # ---- the stages' outputs ---------------------------------------------------------------
    @property
    def data(self) -> Path:
        return self.root / "data"  # the token shards: the tokenize stage's output, data.dir

    @property
    def data_manifest(self) -> Path:
        return self.data / "manifest.json"

    @property
    def data_sources(self) -> Path:
        return self.data / "sources.json"  # a mixture's: what the tokenize stage verified

    @property
    def init(self) -> Path:
        return self.root / "init"

    @property
    def init_checkpoints(self) -> Path:
        return self.init / "checkpoints"

    @property
    def train(self) -> Path:
        return self.root / "train"  # the trainer's out_dir

    @property
    def train_checkpoints(self) -> Path:
        return self.train / "checkpoints"

    @property
    def train_config(self) -> Path:
        return self.train / "config.json"  # what every launch attempt trains

    @property
    def metrics(self) -> Path:
        return self.train / "metrics.jsonl"

    @property
    def launches(self) -> Path:
        return self.train / "launches.json"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def hf(self) -> Path:
        return self.root / "hf"  # the Hugging Face export

    @property
    def hf_location(self) -> Path:
        return self.root / "hf_location.txt"  # logged instead of an export too large for MLflow

    @property
    def eval(self) -> Path:
        return self.root / "eval"

    @property
    def eval_result(self) -> Path:
        return self.eval / "result.json"

    @property
    def eval_samples(self) -> Path:
        return self.eval / "samples.md"

    def init_checkpoint(self) -> Path:
        return checkpoint(self.init_checkpoints, 0)

    def train_checkpoint(self, step: int) -> Path:
        return checkpoint(self.train_checkpoints, step)

    def found(self, patterns: list[Path]) -> list[str]:
        """The files and folders under the run folder that ``patterns`` (paths below ``root``,
        globs in their last parts) name, relative to it."""
        out: list[str] = []
        for pattern in patterns:
            rel = pattern.relative_to(self.root).as_posix()
            out += sorted(p.relative_to(self.root).as_posix() for p in self.root.glob(rel))
        return out


def checkpoint(folder: Path, step: int) -> Path:
    """Checkpoint ``step`` in a ``checkpoints`` folder."""
    from moe_core.train.checkpoint import step_dir_name  # lazily: it imports torch

    return folder / step_dir_name(step)


def resolve(config: dict[str, Any], run_dir: Path) -> RunConfig:
    """The run's config with every path inside ``run_dir`` (validated on the way)."""
    if config.get("cluster", {}).get("kind", ClusterConfig.kind) != "local":
        check_path("run_dir", str(run_dir))  # the batch script or manifest holds it
    layout = RunLayout(run_dir)
    data = dict(config.get("data", {}))
    fmt = data.get("format", DataConfig.format)
    if fmt != "moe":
        raise ConfigError(
            f"data.format={fmt!r} is not allowed for the pipeline: its stages start by "
            "tokenizing a corpus into the run folder; train on tokens another tool wrote with "
            "moe train (moe data shows them)."
        )
    if data.get("dir") not in (None, str(layout.data)):
        raise ConfigError(
            f"data.dir={data['dir']!r} is not allowed for the pipeline: its tokenize stage "
            f"writes the shards into the run folder ({layout.data}), so leave it unset."
        )
    data["dir"] = str(layout.data)
    kind = data.get("kind", DataConfig.kind)
    if kind != "tokens":
        raise ConfigError(
            f"data.kind={kind!r} is not allowed for the pipeline: it tokenizes a "
            "corpus, so use a token data option (e.g. data=kjv)."
        )
    run = from_dict(RunConfig, {**config, "data": data, "out_dir": str(layout.train)})
    if run.data.sources and run.data.tokenizer_dir is None and run.data.tokenizer == "bpe":
        names = ", ".join(s.name for s in run.data.sources)
        raise ConfigError(
            f"data.tokenizer='bpe' is not allowed for a pipeline whose mixture's sources ({names}) "
            "are all dolma or megatron tokens: the Hugging Face export needs the tokenizer, and "
            "only a moe-format source carries its files, so name the one the tokens were written "
            "with (data.tokenizer=gpt2, or a Hugging Face name or folder)."
        )
    return run


def run_root(run_dir: str) -> Path:
    """``run_dir`` made absolute; an empty one or a symlink loop on the way is refused in one
    sentence."""
    check_folder("run_dir", run_dir)
    try:
        return Path(run_dir).resolve()
    except (RuntimeError, OSError) as err:  # Python 3.11/3.12 raise RuntimeError for a loop
        if isinstance(err, OSError) and err.errno != errno.ELOOP:
            raise
        raise ConfigError(
            f"run_dir={run_dir!r} is not allowed: it leads into a symlink loop; give a folder "
            "that exists or can be made."
        ) from None
