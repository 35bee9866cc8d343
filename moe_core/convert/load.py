"""``load_model``: any model folder moe_core reads, as a ``Transformer`` ready for inference.

One entry point for a Hugging Face folder of any family (``OlmoeForCausalLM``,
``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Glm4MoeForCausalLM``; ours or not), our
model folder (``model.safetensors`` + ``moe_core_config.json``) or a training checkpoint
(``checkpoints/step_N``). The model is built on the meta device, allocated on ``device`` in
``dtype`` and filled one tensor at a time from its source, so the host never holds a second copy
of a large model. The multi-token-prediction modules a model was trained with
(``model.mtp_depth``) are left out: inference never runs them, so they are neither built nor
read.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_core.ckpt.format import MANIFEST, verify
from moe_core.config import ARCHITECTURE_FIELDS, ConfigError, ModelConfig
from moe_core.convert.checkpoint import CheckpointSource, checkpoint_config
from moe_core.convert.hf import (
    MAY_BE_FP32,
    OUR_CONFIG,
    HFSource,
    StateDictSource,
    TensorSource,
)
from moe_core.convert.native import WEIGHTS, load_model_dir
from moe_core.errors import CheckpointError
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, Router
from moe_core.model.transformer import Transformer

MTP_PREFIX = "mtp."  # the multi-token-prediction modules' tensors


def open_source(path: str | os.PathLike) -> tuple[TensorSource, Transformer]:
    """The tensors behind ``path`` and its model, unallocated on the meta device."""
    p = Path(path)
    if (p / "config.json").is_file() or (p / "config.json").is_symlink():
        hf = HFSource(p)
        source: TensorSource = hf
        cfg = hf.cfg
    elif (p / OUR_CONFIG).is_file() and (p / WEIGHTS).is_file():
        cfg, state = load_model_dir(p)
        source = StateDictSource(state)
    elif (p / ".metadata").is_file():
        if (p / MANIFEST).is_file() and (problem := verify(p)) is not None:
            raise CheckpointError(f"checkpoint {p} does not verify ({problem}): not loaded.")
        cfg = checkpoint_config(p).model
        source = CheckpointSource(p, cfg, torch.float32)
    else:
        raise CheckpointError(
            f"{p} is no model folder moe_core reads: give a Hugging Face folder (config.json "
            f"and safetensors), a moe_core model folder ({WEIGHTS} and {OUR_CONFIG}) or a "
            "training checkpoint (a step_N folder)."
        )
    with on_meta():
        model = Transformer(cfg)
    model.mtp = None  # training only (the source may hold them: they are not read)
    return source, model


def hf_source_for(cfg: ModelConfig, folder: str | os.PathLike) -> HFSource:
    """The Hugging Face folder a run starts from (``init.from_hf``) as a tensor source, refused
    in one sentence where it no longer holds the architecture the run was composed with."""
    source = HFSource(folder)
    for key in ARCHITECTURE_FIELDS:
        theirs, ours = getattr(source.cfg, key), getattr(cfg, key)
        if theirs != ours:
            raise ConfigError(
                f"init.from_hf={str(folder)!r} now describes {key}={theirs!r} but this run was "
                f"composed with model.{key}={ours!r}: compose the run again."
            )
    return source


def fill_from_source(model: torch.nn.Module, source: TensorSource) -> None:
    """Copy ``source``'s tensors into ``model``'s parameters and persistent buffers in place,
    one tensor (one expert) at a time, cast to each one's dtype. ``model`` may be a part of the
    whole: a pipeline chunk (its layers keep their global names) or an expert-parallel shard (a
    stacked expert tensor holds experts ``expert_offset ..``)."""
    offsets = {
        f"{mod_name}.{p_name}": mod.expert_offset
        for mod_name, mod in model.named_modules()
        if isinstance(mod, Experts)
        for p_name, _ in mod.named_parameters(recurse=False)
    }
    names = source.names()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name not in names:
                raise CheckpointError(f"{name} is not among the source's tensors: not loaded.")
            if name in offsets:
                for e in range(t.shape[0]):
                    t[e].copy_(source.get(name, offsets[name] + e))
            else:
                t.copy_(source.get(name))


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """The model at ``path`` (an HF folder of any family, our model folder or a training
    checkpoint) on ``device``, its weights in ``dtype`` but the routers' (fp32, as GLM keeps
    them; our router computes its logits in fp32 anyway) and buffers, in eval mode.

    ``model(tokens)`` returns ``(logits, aux_loss)``; logits equal those ``transformers``
    computes from the same HF folder (fp32, to rounding)."""
    source, model = open_source(path)
    for name, p in model.named_parameters():
        if not MAY_BE_FP32.fullmatch(name):
            p.data = p.data.to(dtype)
    model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, Router):
            m.reset_buffers()
    state = model.state_dict(keep_vars=True)
    differ = set(state) ^ {n for n in source.names() if not n.startswith(MTP_PREFIX)}
    if differ:
        raise CheckpointError(
            f"{path} does not hold the tensors of the model its config describes "
            f"({sorted(differ)[0]} is in one but not the other): not loaded."
        )
    fill_from_source(model, source)
    return model.eval()
