"""Read model weights out of a training checkpoint, one tensor (or one expert) at a time.

Training checkpoints (``moe_core.train.checkpoint`` writes them; their format is
``moe_core.ckpt.format``) hold fp32 master weights as chunks of
each flattened global tensor, in whatever layout wrote them. ``CheckpointSource`` assembles
any parameter, or one expert's slice of a stacked expert tensor, from the chunks that cover it,
reading only those chunks; export and evaluation use it without a process group and without
ever holding the whole model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe_core.ckpt import dcp_read
from moe_core.ckpt.format import MANIFEST, buffer_key, parse_key, step_of, trainer_state, verify
from moe_core.config import ConfigError, ModelConfig, RunConfig
from moe_core.config_dict import from_dict, upgrade_saved
from moe_core.convert.folders import existing_source, refuse_overlap
from moe_core.convert.hf import MAY_BE_FP32, expected_names, save_hf
from moe_core.data.manifest import verify_data_dir
from moe_core.errors import CheckpointError
from moe_core.model.transformer import parameter_shapes, shape_mismatch


class CheckpointSource:
    """A ``convert.hf.TensorSource`` over a training checkpoint's master weights and saved
    buffers (the routers' expert bias), in ``dtype`` but the routers' tensors, which stay fp32
    (export casts them as the family keeps them)."""

    def __init__(self, path: str | os.PathLike, cfg: ModelConfig, dtype: torch.dtype) -> None:
        self.path, self.cfg, self.dtype = Path(path), cfg, dtype
        metadata = dcp_read.read_metadata(self.path).state_dict_metadata
        self.chunks: dict[str, list[tuple[int, int, str]]] = {}
        self.buffers: dict[str, torch.Size] = {}
        for key, md in metadata.items():
            parsed = parse_key(key)
            if parsed is None:
                continue
            name, kind, start = parsed
            if kind == "param":
                self.chunks.setdefault(name, []).append((start, md.size[0], key))
            elif kind is None:
                self.buffers[name] = md.size
        self.shapes = {n: torch.Size(s) for n, s in parameter_shapes(cfg).items()}
        held = {n: (sum(size for _, size, _ in c),) for n, c in self.chunks.items()}
        problem = shape_mismatch(held, {n: (s.numel(),) for n, s in self.shapes.items()})
        if problem is not None:
            raise CheckpointError(
                f"checkpoint {self.path} does not hold the model its config describes "
                f"(flattened sizes: {problem}): it cannot be converted."
            )

    def names(self) -> set[str]:
        return set(self.chunks) | set(self.buffers)

    def _read(self, name: str, start: int, length: int) -> torch.Tensor:
        request = {
            key: torch.empty(size)
            for first, size, key in self.chunks[name]
            if first < start + length and start < first + size
        }
        dcp_read.load(request, self.path, no_dist=True)
        out = torch.empty(length)
        covered = 0
        for first, size, key in self.chunks[name]:
            a, z = max(first, start), min(first + size, start + length)
            if a < z:
                out[a - start : z - start] = request[key][a - first : z - first]
                covered += z - a
        if covered != length:
            raise CheckpointError(
                f"checkpoint {self.path} does not cover all of {name} (its chunks overlap or "
                "leave a gap): it cannot be converted."
            )
        return out

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        if name in self.buffers:
            request = {buffer_key(name): torch.empty(self.buffers[name])}
            dcp_read.load(request, self.path, no_dist=True)
            return request[buffer_key(name)]
        shape = self.shapes[name]
        dtype = torch.float32 if MAY_BE_FP32.fullmatch(name) else self.dtype
        if expert is None:
            return self._read(name, 0, shape.numel()).view(shape).to(dtype)
        per_expert = shape[1:].numel()
        return self._read(name, expert * per_expert, per_expert).view(shape[1:]).to(dtype)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and saved buffer at once (small models: evaluation in one process)."""
        state = {name: self.get(name) for name in sorted(expected_names(self.cfg))}
        request = {buffer_key(n): torch.empty(size) for n, size in self.buffers.items()}
        if request:
            dcp_read.load(request, self.path, no_dist=True)
            state |= {n: request[buffer_key(n)] for n in self.buffers}
        return state


def checkpoint_config(path: str | os.PathLike) -> RunConfig:
    """The run configuration a checkpoint was written with (by any version: checkpoints of runs
    from before the precision section hold their precision keys where they were then)."""
    return from_dict(RunConfig, upgrade_saved(trainer_state(path)["config"]))


CONVERT_ASK = "give --tokenizer DIR, or --no-tokenizer to write the weights alone"


def run_tokenizer_dir(src: str | os.PathLike, ask: str = CONVERT_ASK) -> Path:
    """The data folder whose tokenizer files belong with ``src`` (a training checkpoint, or
    the model folder a run saved beside its checkpoints): the one the run trained on, from the
    config its checkpoint records, checked against the folder's manifest. One sentence where
    there is none (synthetic tokens, no checkpoint to ask, the folder moved), ending with
    ``ask``: what the caller's user can do instead (the options of their own command)."""
    src = existing_source(src)
    checkpoint = src if (src / ".metadata").is_file() else None
    if checkpoint is None:
        found = [
            (step, p)
            for p in (src.parent / "checkpoints").glob("step_*")
            if (step := step_of(p.name)) is not None and (p / ".metadata").is_file()
        ]
        checkpoint = max(found)[1] if found else None  # the newest by step, not by spelling
    if checkpoint is None:
        raise ConfigError(
            f"{src} has no training checkpoint beside it to say which tokenizer the model "
            f"was trained with: {ask}."
        )
    run = checkpoint_config(checkpoint)
    if run.data.kind != "tokens":
        raise ConfigError(
            f"the run that wrote {src} trained on synthetic tokens, which have no tokenizer: {ask}."
        )
    written = run.data.tokenizer_dir  # data.dir, or a mixture's first source of ours
    if written is None:
        what = (
            "a mixture of dolma and megatron sources, which carry"
            if run.data.sources
            else f"a {run.data.format} corpus, which carries"
        )
        raise ConfigError(f"the run that wrote {src} trained on {what} no tokenizer files: {ask}.")
    data_dir = Path(written)
    if not data_dir.is_dir():  # a relative path from another working folder: from the run's
        out_dir = checkpoint.resolve().parent.parent
        if Path(written).is_relative_to(run.out_dir):
            data_dir = out_dir / Path(written).relative_to(run.out_dir)
    if not (data_dir / "manifest.json").is_file():
        raise ConfigError(
            f"the data folder {written} that the run behind {src} trained on is not there "
            f"any more: {ask}."
        )
    verify_data_dir(data_dir, checksums=False)  # its tokenizer is the one the shards were cut by
    return data_dir


def checkpoint_to_hf(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    tokenizer_dir: str | os.PathLike | None = None,
    eos_token_id: int | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """A training checkpoint to the Hugging Face folder of its model's family (``families``),
    streamed tensor by tensor.
    One whose manifest does not verify is refused; one from elsewhere (no manifest) is read
    without running code from it (``ckpt.dcp_read``)."""
    refuse_overlap(
        Path(path), Path(out_dir), None if tokenizer_dir is None else Path(tokenizer_dir)
    )
    if (Path(path) / MANIFEST).is_file() and (problem := verify(Path(path))) is not None:
        raise CheckpointError(f"checkpoint {path} does not verify ({problem}): not converted.")
    cfg = checkpoint_config(path).model
    source = CheckpointSource(path, cfg, dtype)
    return save_hf(
        source,
        cfg,
        out_dir,
        tokenizer_dir=tokenizer_dir,
        eos_token_id=eos_token_id,
        overwrite=overwrite,
        max_shard_bytes=max_shard_bytes,
    )
