"""Our weights <-> a Hugging Face ``OlmoeForCausalLM`` directory.

On disk the HF directory holds sharded safetensors with per-expert keys (as ``transformers``
saves them), ``model.safetensors.index.json``, ``config.json``, our own
``moe_core_config.json`` (so the way back is exact) and, when given, the tokenizer files.
The directory is written beside its destination and renamed into place only when complete.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_core.config import ConfigError, ModelConfig, safe_name
from moe_core.config_dict import from_dict, to_dict
from moe_core.errors import CheckpointError, RunFileError
from moe_core.files import (
    TMP_MARK,
    inside,
    is_stale_temporary,
    remove_stale_temporaries,
    temporary_name,
    user_mode,
)
from moe_core.model.transformer import parameter_shapes, shape_mismatch

OUR_CONFIG = "moe_core_config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
)
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

# our key (with {i} for the layer) -> HF key; experts are handled separately
_DIRECT = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.k_proj.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.v_proj.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attn.q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "layers.{i}.attn.k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "layers.{i}.moe_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight",
}
_EXPERT_HF = "model.layers.{i}.mlp.experts.{e}.{proj}.weight"


def check_exportable(cfg: ModelConfig) -> None:
    """Refuse a model that HF OLMoE would compute differently, rather than write it wrong."""
    if cfg.n_shared_experts:
        raise ConfigError(
            f"model.n_shared_experts={cfg.n_shared_experts} cannot be exported: Hugging Face "
            "OLMoE has no shared expert (only 0 is allowed)."
        )
    if cfg.router != "softmax":
        raise ConfigError(
            f"model.router={cfg.router!r} cannot be exported: Hugging Face OLMoE routes with "
            "softmax only."
        )
    if cfg.expert_bias:
        raise ConfigError(
            "model.expert_bias=true cannot be exported: Hugging Face OLMoE selects experts "
            "without a bias, so routing would differ."
        )


def refuse_existing(out: Path, overwrite: bool) -> None:
    """Refuse to write into ``out`` when it holds anything (but temporaries of a killed
    convert), unless ``overwrite``."""
    if overwrite or not (out.exists() or out.is_symlink()):
        return
    # What a killed convert left is removed by the rerun, not counted as the user's files.
    if not out.is_dir() or any(not is_stale_temporary(p) for p in out.iterdir()):
        raise FileExistsError(
            f"{out} already exists and is not empty: pass --overwrite (overwrite=True) to "
            "replace it, or choose another folder."
        )


def _tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files of ``folder`` an export copies: each inside it (a symlink leading
    out would copy any file of the machine into a folder that is then shared)."""
    files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if not files:
        raise FileNotFoundError(
            f"tokenizer directory {folder} holds none of: {', '.join(TOKENIZER_FILES)}."
        )
    return [inside(folder, f.name, folder, CheckpointError) for f in files]


def refuse_overlap(src: Path, out: Path, tokenizer_dir: Path | None = None) -> None:
    """Refuse an ``out`` that is ``src``, holds it or lies inside it, or the same with the
    ``checkpoints`` folder of the run ``src`` belongs to (the one it lies in, or its sibling
    for a run's model folder) or the tokenizer folder read: writing there replaces what is
    being read, and ``--overwrite`` would delete the whole run (or data set)."""
    s, o = src.resolve(), out.resolve()
    checkpoints = s.parent if s.parent.name == "checkpoints" else s.parent / "checkpoints"
    guarded = [("SRC", s)] + ([("the run's checkpoints", checkpoints)] * checkpoints.is_dir())
    if tokenizer_dir is not None:
        guarded.append(("the tokenizer folder", tokenizer_dir.resolve()))
    for what, folder in guarded:
        how = "is" if o == folder else "holds" if folder.is_relative_to(o) else "lies inside"
        if folder.is_relative_to(o) or o.is_relative_to(folder):
            raise ConfigError(
                f"OUT {out} {how} {what} {folder}: writing there would replace (with "
                f"--overwrite delete) what is being converted; choose an OUT outside {folder}."
            )


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``save_file``, with a failed write raised as the OSError it was (safetensors reports a
    full disk as a SafetensorError that names only the errno)."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except Exception as err:
        code = re.search(r"\(os error (\d+)\)", str(err))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def unwritten(out: Path, err: OSError) -> RunFileError:
    """A convert whose write failed (a full disk, no permission), in one sentence."""
    return RunFileError(
        f"{out} could not be written ({err.strerror or err}: {err.filename or out}); its "
        "unfinished files were removed: free space (or fix the permission) and convert again."
    )


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_token_id: int | None = None):
    """The ``transformers.OlmoeConfig`` that computes what ``cfg`` computes."""
    from transformers import OlmoeConfig

    check_exportable(cfg)
    hf = OlmoeConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.expert_hidden,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        rms_norm_eps=cfg.norm_eps,
        num_experts=cfg.n_experts,
        num_experts_per_tok=cfg.top_k,
        norm_topk_prob=cfg.normalize_top_k,
        router_aux_loss_coef=cfg.aux_loss_coef,
        initializer_range=cfg.init_std,
        tie_word_embeddings=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=eos_token_id,
    )
    hf.architectures = ["OlmoeForCausalLM"]
    hf.dtype = _DTYPE_NAMES[dtype]
    return hf


class TensorSource(Protocol):
    """Where export reads weights from: a state dict, or a checkpoint read one tensor (one
    expert) at a time so that no process holds the whole model."""

    dtype: torch.dtype

    def names(self) -> set[str]: ...

    def get(self, name: str, expert: int | None = None) -> torch.Tensor: ...


class StateDictSource:
    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        dtypes = {t.dtype for t in state.values()}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPE_NAMES:
            raise ValueError(f"expected one of float32/bfloat16/float16 throughout, got {dtypes}.")
        self.state, self.dtype = state, next(iter(dtypes))

    def names(self) -> set[str]:
        return set(self.state)

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        t = self.state[name]
        return t if expert is None else t[expert]


def _hf_items(
    cfg: ModelConfig,
) -> Iterator[tuple[str, tuple[int, ...], str, int | None, slice | None]]:
    """(HF key, shape, our name, expert, rows) in a stable order; experts split per expert."""
    D, H, F, V = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.expert_hidden, cfg.vocab_size
    kv = cfg.kv_heads * cfg.head_dim
    shapes = {
        "attn_norm.weight": (D,), "attn.q_proj.weight": (H, D), "attn.k_proj.weight": (kv, D),
        "attn.v_proj.weight": (kv, D), "attn.o_proj.weight": (D, H), "attn.q_norm.weight": (H,),
        "attn.k_norm.weight": (kv,), "moe_norm.weight": (D,),
        "moe.router.weight": (cfg.n_experts, D),
    }  # fmt: skip
    yield "model.embed_tokens.weight", (V, D), "embed.weight", None, None
    for i in range(cfg.n_layers):
        for ours, theirs in _DIRECT.items():
            if "{i}" in ours:
                local = ours.removeprefix("layers.{i}.")
                yield theirs.format(i=i), shapes[local], ours.format(i=i), None, None
        gate_up, down = f"layers.{i}.moe.experts.w_gate_up", f"layers.{i}.moe.experts.w_down"
        for e in range(cfg.n_experts):
            yield _EXPERT_HF.format(i=i, e=e, proj="gate_proj"), (F, D), gate_up, e, slice(0, F)
            yield _EXPERT_HF.format(i=i, e=e, proj="up_proj"), (F, D), gate_up, e, slice(F, 2 * F)
            yield _EXPERT_HF.format(i=i, e=e, proj="down_proj"), (D, F), down, e, None
    yield "model.norm.weight", (D,), "norm.weight", None, None
    yield "lm_head.weight", (V, D), "lm_head.weight", None, None


def expected_names(cfg: ModelConfig) -> set[str]:
    names = {k.format(i=i) for k in _DIRECT for i in range(cfg.n_layers)}
    for i in range(cfg.n_layers):
        names |= {f"layers.{i}.moe.experts.w_gate_up", f"layers.{i}.moe.experts.w_down"}
    return names


def _check_names(found: set[str], cfg: ModelConfig) -> None:
    expected = expected_names(cfg)
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing or extra:
        raise ValueError(
            f"the weights do not match the model config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}."
        )


def _recover(out: Path) -> None:
    """Undo what a convert to ``out`` that was killed (or ran out of disk) left: the folder it
    was replacing goes back to ``out`` if it had been moved aside, and its unfinished new
    folder is removed."""
    if not (out.exists() or out.is_symlink()) and out.parent.is_dir():
        for p in out.parent.glob(f".{glob.escape(out.name)}.old{TMP_MARK}*"):
            if is_stale_temporary(p):
                p.rename(out)
                break
    if out.parent.is_dir():
        remove_stale_temporaries(out.parent, [out.name, f"{out.name}.old"])


def save_hf(
    weights: dict[str, torch.Tensor] | TensorSource,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    eos_token_id: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an HF OLMoE directory from a full state dict or a ``TensorSource``; return it.

    Shards are planned from the config's shapes, then filled one at a time, so memory holds
    one shard (plus one tensor of the source) at most."""
    check_exportable(cfg)
    source = StateDictSource(weights) if isinstance(weights, dict) else weights
    _check_names(source.names(), cfg)
    if isinstance(weights, dict):
        found = {name: tuple(t.shape) for name, t in weights.items()}
        problem = shape_mismatch(found, parameter_shapes(cfg))
        if problem is not None:
            raise CheckpointError(
                f"the weights do not fit their model config ({problem}): nothing was written."
            )
    out = Path(out_dir)
    _recover(out)
    refuse_existing(out, overwrite)
    tokenizer = [] if tokenizer_dir is None else _tokenizer_files(Path(tokenizer_dir))
    element = torch.empty((), dtype=source.dtype).element_size()
    shards: list[list[tuple]] = [[]]
    size = 0
    for item in _hf_items(cfg):
        nbytes = math.prod(item[1]) * element
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_name(out)
    tmp.mkdir()
    try:
        weight_map: dict[str, str] = {}
        total = 0
        n = len(shards)
        for s, items in enumerate(shards, start=1):
            fname = f"model-{s:05d}-of-{n:05d}.safetensors"
            tensors = {}
            for key, shape, ours, expert, rows in items:
                t = source.get(ours, expert)
                t = t if rows is None else t[rows]
                if tuple(t.shape) != shape:
                    raise ValueError(f"{ours} has shape {tuple(t.shape)}, the config says {shape}.")
                tensors[key] = t.detach().to("cpu", source.dtype).contiguous().clone()
            write_safetensors(tensors, tmp / fname)
            for k, t in tensors.items():
                weight_map[k] = fname
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        hf_config(cfg, source.dtype, eos_token_id).save_pretrained(str(tmp))
        (tmp / OUR_CONFIG).write_text(json.dumps(to_dict(cfg), indent=2) + "\n")
        for f in tokenizer:
            shutil.copy2(f, tmp / f.name)
        for f in tmp.iterdir():  # safetensors writes its files private
            f.chmod(user_mode(directory=False))
        if out.exists():
            old = temporary_name(out.with_name(f"{out.name}.old"))
            shutil.rmtree(old, ignore_errors=True)
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)  # it would hold the space a rerun needs
        raise unwritten(out, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# config.json's keys, the type each must have and its default (None: the key is required)
_HF_KEYS: dict[str, tuple[type, object]] = {
    "vocab_size": (int, None),
    "hidden_size": (int, None),
    "num_hidden_layers": (int, None),
    "num_attention_heads": (int, None),
    "num_experts": (int, None),
    "num_experts_per_tok": (int, None),
    "intermediate_size": (int, None),
    "num_key_value_heads": (int, 0),  # 0: as many as num_attention_heads
    "max_position_embeddings": (int, 4096),
    "rope_theta": (float, 10000.0),
    "rms_norm_eps": (float, 1e-5),
    "norm_topk_prob": (bool, False),
    "router_aux_loss_coef": (float, 0.01),
    "initializer_range": (float, 0.02),
}
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}
# safetensors' names of the dtypes a weight may have (our training writes one of these)
_WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def _hub_blobs(d: Path) -> Path:
    """Where the files of HF folder ``d`` may lead: ``d`` itself, or for a snapshot of the
    Hugging Face hub cache (``models--ORG--NAME/snapshots/REV``, whose files are symlinks into
    the repo's ``blobs``) that repo's folder."""
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent
    return d


def _read_json(d: Path, name: str) -> dict:
    """``d / name`` parsed (a file inside ``d``), refused in one sentence unless a JSON object."""
    path = inside(d, name, d, CheckpointError, _hub_blobs(d))
    try:
        content = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): it must be an object.") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds no JSON object, so it is not a model config.")
    return content


def _hf_value(path: Path, hf: dict, key: str) -> object:
    """``hf[key]`` (or its default) once it has the type config.json gives it."""
    kind, default = _HF_KEYS[key]
    value = hf.get(key)
    if value is None:
        if default is None:
            raise ConfigError(
                f"{path} has no {key}, which an OLMoE config.json must give ({_KINDS[kind]})."
            )
        return default
    fits = isinstance(value, bool) == (kind is bool) and isinstance(value, (int, float))
    if not fits or (kind is int and not isinstance(value, int)):
        raise ConfigError(f"{key}={value!r} in {path} is not allowed: {_KINDS[kind]}.")
    return float(value) if kind is float else value


def config_from_hf(hf_dir: str | os.PathLike) -> ModelConfig:
    """Our config for an HF OLMoE directory (ours carries it; others are derived)."""
    d = Path(hf_dir)
    if not d.is_dir() or not ((d / "config.json").exists() or (d / OUR_CONFIG).exists()):
        what = "is not a folder" if not d.is_dir() else "has no config.json"
        raise CheckpointError(
            f"{d} {what}: give the folder of a Hugging Face checkpoint (config.json and its "
            "safetensors weights, as save_pretrained writes it)."
        )
    if (d / OUR_CONFIG).is_file() or (d / OUR_CONFIG).is_symlink():
        path, ours = d / OUR_CONFIG, _read_json(d, OUR_CONFIG)
        try:
            return from_dict(ModelConfig, ours, "model.")
        except ConfigError as err:
            raise ConfigError(f"{path} describes a model moe_core cannot build: {err}") from None
    path, hf = d / "config.json", _read_json(d, "config.json")
    if hf.get("model_type") != "olmoe":
        raise ConfigError(
            f"model_type={hf.get('model_type')!r} in {d} is not supported: only 'olmoe'."
        )
    for key, allowed in (("clip_qkv", None), ("attention_bias", False), ("hidden_act", "silu")):
        if hf.get(key, allowed) != allowed:
            raise ConfigError(f"{key}={hf[key]!r} in {d} is not supported: only {allowed!r}.")
    rope = hf.get("rope_parameters") or {"rope_theta": hf.get("rope_theta")}
    if not isinstance(rope, dict):
        raise ConfigError(f"rope_parameters={rope!r} in {path} is not allowed: a mapping.")
    v = {key: _hf_value(path, hf, key) for key in _HF_KEYS if key != "rope_theta"}
    n_heads = v["num_attention_heads"]
    if hf.get("head_dim") not in (None, v["hidden_size"] // max(n_heads, 1)):
        raise ConfigError(f"head_dim={hf['head_dim']} in {d} is not supported: only hidden/heads.")
    try:
        return ModelConfig(
            name=safe_name(Path(hf_dir).name),
            vocab_size=v["vocab_size"],
            d_model=v["hidden_size"],
            n_layers=v["num_hidden_layers"],
            n_heads=n_heads,
            n_kv_heads=v["num_key_value_heads"] or n_heads,
            n_experts=v["num_experts"],
            top_k=v["num_experts_per_tok"],
            expert_hidden=v["intermediate_size"],
            max_seq_len=v["max_position_embeddings"],
            rope_theta=_hf_value(path, rope, "rope_theta"),
            norm_eps=v["rms_norm_eps"],
            normalize_top_k=v["norm_topk_prob"],
            aux_loss_coef=v["router_aux_loss_coef"],
            init_std=v["initializer_range"],
        )
    except ConfigError as err:
        raise ConfigError(f"{path} describes a model moe_core cannot build: {err}") from None


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _weight_files(d: Path) -> list[str]:
    """The safetensors files of an HF directory: those its index names (each a file inside
    ``d``, ``files.inside``), else ``model.safetensors``."""
    if not (d / INDEX).is_file() and not (d / INDEX).is_symlink():
        return [inside(d, "model.safetensors", d, CheckpointError, _hub_blobs(d)).name]
    try:
        weight_map = _read_json(d, INDEX)["weight_map"]
        files = sorted({*weight_map.values()}, key=str)
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"{d / INDEX} is not a valid index: it needs a weight_map of tensor names to files."
        ) from None
    for f in files:
        inside(d, f, d / INDEX, CheckpointError, _hub_blobs(d))
    return files


def _scan(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Each tensor of a safetensors file with its shape and dtype, without reading the data."""
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {
                k: (tuple(fh.get_slice(k).get_shape()), fh.get_slice(k).get_dtype())
                for k in fh.keys()  # noqa: SIM118 (safe_open is not a mapping)
            }
    except SafetensorError as err:
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable safetensors file ({err}): it may be truncated; download or "
        "export it again."
    )


def load_hf(hf_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF OLMoE directory back into our config and state dict (bit-exact)."""
    d = Path(hf_dir)
    cfg = config_from_hf(d)
    files = _weight_files(d)
    found: dict[str, tuple[int, ...]] = {}
    first: tuple[str, str, str] | None = None  # (file, tensor, dtype) of the first weight
    for f in files:
        for k, (shape, dtype) in _scan(d / f).items():
            found[k] = shape
            if dtype not in _WEIGHT_DTYPES:
                raise CheckpointError(
                    f"{d / f} holds {k} as {dtype}, which is not allowed: weights are "
                    f"{', '.join(_WEIGHT_DTYPES.values())} (nothing is converted unasked)."
                )
            first = first or (f, k, dtype)
            if dtype != first[2]:
                raise CheckpointError(
                    f"{d / f} holds {k} as {dtype} but {first[0]} holds {first[1]} as "
                    f"{first[2]}, which is not allowed: every weight in one dtype (convert them "
                    "to one first, so no value is rounded here unasked)."
                )
    problem = shape_mismatch(found, {key: shape for key, shape, *_ in _hf_items(cfg)})
    if problem is not None:
        raise CheckpointError(f"{d} does not hold the model its config.json describes ({problem}).")
    theirs: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(d / f), framework="pt") as fh:
                for k in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    theirs[k] = fh.get_tensor(k)
        except SafetensorError as err:
            raise _unreadable(d / f, err) from None
    inverse = {v: k for k, v in _DIRECT.items()}
    state: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, int, str], torch.Tensor] = {}
    for key, t in theirs.items():
        m = _LAYER_KEY.fullmatch(key)
        generic = key if m is None else f"model.layers.{{i}}.{m.group(2)}"
        if generic in inverse:
            state[inverse[generic].format(i=m.group(1) if m else "")] = t
            continue
        em = (
            re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", m.group(2))
            if m
            else None
        )
        if em is None:
            raise CheckpointError(f"{d} holds tensor {key}, which an OLMoE model does not have.")
        experts[(int(m.group(1)), int(em.group(1)), em.group(2))] = t
    for i in range(cfg.n_layers):
        E = range(cfg.n_experts)
        state[f"layers.{i}.moe.experts.w_gate_up"] = torch.stack(
            [torch.cat([experts[(i, e, "gate_proj")], experts[(i, e, "up_proj")]]) for e in E]
        )
        state[f"layers.{i}.moe.experts.w_down"] = torch.stack(
            [experts[(i, e, "down_proj")] for e in E]
        )
    _check_names(set(state), cfg)
    return cfg, state
