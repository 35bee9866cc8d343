"""The pipeline's ``init`` stage: a step-0 checkpoint written one tensor at a time.

The model is built on the meta device (no memory). Every parameter (every expert of a stacked
expert tensor separately) becomes one checkpoint entry whose values are computed only when DCP
writes that entry, with exactly the seeds ``Transformer.init_weights`` uses or, with
``init.from_hf``, read from the Hugging Face folder's safetensors (``convert.hf.HFSource``), so
no process ever holds more than one tensor (one expert) of the model, even for ``1t``. Adam
moments are not written: a checkpoint without them starts the optimizer fresh, as a new run
would. Training (in any layout) resumes from it like from any other checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from moe_core.ckpt.format import buffer_key, state_key, step_dir_name
from moe_core.config import ParallelConfig, RunConfig
from moe_core.config_dict import to_dict
from moe_core.model.meta import on_meta
from moe_core.model.transformer import Transformer, init_plan, seeded_normal_, state_shapes
from moe_core.parallel.mesh import Mesh
from moe_core.train.checkpoint import Checkpointer

if TYPE_CHECKING:
    from moe_core.convert.hf import HFSource


class _LazySavePlanner(DefaultSavePlanner):
    """Plans with meta tensors; computes each entry's values when DCP writes it."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self.makers = makers

    def resolve_data(self, write_item):  # type: ignore[override]
        maker = self.makers.get(write_item.index.fqn)
        if maker is None:
            return super().resolve_data(write_item)
        return maker()


def _param_makers(
    run: RunConfig, source: HFSource | None
) -> tuple[dict[str, torch.Tensor], dict[str, Callable]]:
    """(meta placeholders, makers) for every parameter chunk of the full model: read from
    ``source`` where given, else the model's own init."""
    cfg, seed = run.model, run.train.seed
    with on_meta():
        model = Transformer(cfg)
    placeholders: dict[str, torch.Tensor] = {}
    makers: dict[str, Callable[[], torch.Tensor]] = {}

    def normal(shape: torch.Size, key: str) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            t = torch.empty(shape, dtype=torch.float32)
            seeded_normal_(t, cfg.init_std, seed, key)
            return t.reshape(-1)

        return make

    def read(name: str, expert: int | None) -> Callable[[], torch.Tensor]:
        assert source is not None
        return lambda: source.get(name, expert).to(torch.float32).reshape(-1)

    params = dict(model.named_parameters())
    for item in init_plan(model):  # the model's own rule (Transformer.init_weights)
        p = params[item.name]
        if item.expert is None:
            key, shape = state_key(item.name, "param", 0), p.shape
        else:
            key, shape = state_key(item.name, "param", item.expert * p[0].numel()), p.shape[1:]
        placeholders[key] = torch.empty(shape.numel(), device="meta")
        fill = item.fill
        if source is not None:
            makers[key] = read(item.name, item.expert)
        elif fill is None:
            makers[key] = normal(shape, item.key)
        else:
            makers[key] = _filled(shape.numel(), fill)
    return placeholders, makers


def _hf_source(run: RunConfig) -> HFSource | None:
    """``init.from_hf``'s folder as a tensor source (None without it)."""
    if run.init.from_hf is None:
        return None
    from moe_core.convert.load import hf_source_for

    return hf_source_for(run.model, run.init.from_hf)


def _filled(n: int, value: float) -> Callable[[], torch.Tensor]:
    return lambda: torch.full((n,), value)


def write_initial_checkpoint(run: RunConfig, checkpoints: str | Path) -> Path:
    """Write ``checkpoints/step_00000000`` (atomic, with a manifest); return its path."""
    source = _hf_source(run)
    placeholders, makers = _param_makers(run, source)
    state: dict = dict(placeholders)
    for name in _expert_bias_names(run):
        bias = torch.zeros(run.model.n_experts)
        if source is not None:  # GLM's e_score_correction_bias
            bias = source.get(name).to(torch.float32)
        state[buffer_key(name)] = bias
    trainer = {"step": 0, "guards": {}, "config": to_dict(run), "loader": None}
    state["trainer"] = json.dumps(trainer)
    state["adam_step"] = 0
    ckpt = Checkpointer(
        Path(checkpoints), Mesh(ParallelConfig()), keep_last=0, keep_every=0, use_async=False
    )
    layout = {"pp": run.parallel.pp, "dp": run.parallel.dp, "ep": run.parallel.ep}
    ckpt.save(0, state, layout, planner=_LazySavePlanner(makers), file_per_entry=True)
    return Path(checkpoints) / step_dir_name(0)


def _expert_bias_names(run: RunConfig) -> list[str]:
    """Every router's expert bias (the MTP modules' blocks' too), as the state dict names it."""
    return [name for name in state_shapes(run.model) if name.endswith("router.expert_bias")]
