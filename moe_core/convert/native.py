"""Our own model directory: ``model.safetensors`` (full state dict) + ``moe_core_config.json``.

The simple, single-file form a short run leaves behind and ``moe convert`` reads; sharded
training checkpoints (torch.distributed.checkpoint) live in ``moe_core.train.checkpoint``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from moe_core.config import ModelConfig, from_dict, to_dict
from moe_core.convert.hf import OUR_CONFIG, refuse_existing
from moe_core.errors import CheckpointError
from moe_core.files import inside, user_mode

WEIGHTS = "model.safetensors"


def save_model_dir(
    state: dict[str, torch.Tensor],
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """Write weights then config, each to a temporary name renamed into place; a folder that
    holds anything already is refused unless ``overwrite``."""
    out = Path(out_dir)
    refuse_existing(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with tempfile.NamedTemporaryFile(dir=out, suffix=".tmp", delete=False) as f:
        tmp_weights = Path(f.name)
    save_file(tensors, str(tmp_weights), metadata={"format": "pt"})
    tmp_weights.chmod(user_mode(directory=False))  # the temporary file was made private
    tmp_weights.replace(out / WEIGHTS)
    tmp_cfg = out / (OUR_CONFIG + ".tmp")
    tmp_cfg.write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
    tmp_cfg.replace(out / OUR_CONFIG)
    return out


def load_model_dir(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    d = Path(path)
    for name in (WEIGHTS, OUR_CONFIG):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d} is not a moe_core model directory: {name} is missing.")
        inside(d, name, d, CheckpointError)  # a symlink leading out would export any file
    cfg = from_dict(ModelConfig, json.loads((d / OUR_CONFIG).read_text()), "model.")
    return cfg, load_file(str(d / WEIGHTS))
