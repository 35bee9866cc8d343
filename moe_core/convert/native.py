"""Our own model directory: ``model.safetensors`` (full state dict) + ``moe_core_config.json``.

The simple, single-file form a short run leaves behind and ``moe convert`` reads; sharded
training checkpoints (torch.distributed.checkpoint) live in ``moe_core.train.checkpoint``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from moe_core.config import ConfigError, ModelConfig
from moe_core.config_dict import from_dict, to_dict
from moe_core.convert.folders import refuse_existing
from moe_core.convert.hf import OUR_CONFIG, read_json, unreadable, unwritten, write_safetensors
from moe_core.errors import CheckpointError
from moe_core.files import (
    inside,
    remove_stale_temporaries,
    temporary_name,
    user_mode,
)

WEIGHTS = "model.safetensors"
# the files that make a folder read as a Hugging Face one (its config, index and shards)
HF_FILES = re.compile(r"config\.json|model\.safetensors\.index\.json|model-\d+-of-\d+\.safetensors")


def save_model_dir(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """Write weights and config, each to a temporary name renamed into place; a folder that
    holds anything already is refused unless ``overwrite``, which keeps the user's own files
    but drops those of a Hugging Face folder (``HF_FILES``): a reader would take them for the
    model instead of the new weights."""
    out = Path(out_dir)
    refuse_existing(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(out, [WEIGHTS, OUR_CONFIG])  # a killed convert's, never the user's
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    tmp_weights, tmp_config = temporary_name(out / WEIGHTS), temporary_name(out / OUR_CONFIG)
    try:
        write_safetensors(tensors, tmp_weights)
        tmp_weights.chmod(user_mode(directory=False))  # safetensors writes its files private
        # both written before either is renamed: new weights never sit beside an old config
        tmp_config.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        tmp_weights.replace(out / WEIGHTS)
        tmp_config.replace(out / OUR_CONFIG)
        for f in out.iterdir():
            if HF_FILES.fullmatch(f.name) and (f.is_file() or f.is_symlink()):
                f.unlink()
    except OSError as err:
        for tmp in (tmp_weights, tmp_config):
            tmp.unlink(missing_ok=True)  # it would hold the space a rerun needs
        raise unwritten(out, err) from None
    return out


def load_model_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    d = Path(path)
    for name in (WEIGHTS, OUR_CONFIG):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d} is not a moe_core model directory: {name} is missing.")
        inside(d, name, d, CheckpointError)  # a symlink leading out would export any file
    try:
        cfg = from_dict(ModelConfig, read_json(d, OUR_CONFIG), "model.")
    except ConfigError as err:
        raise ConfigError(
            f"{d / OUR_CONFIG} describes a model moe_core cannot build: {err}"
        ) from None
    try:
        return cfg, load_file(str(d / WEIGHTS))
    except SafetensorError as err:
        raise unreadable(d / WEIGHTS, err) from None
