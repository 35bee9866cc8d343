"""Our weights <-> a Hugging Face folder of one of the stock families (``convert.families``:
``OlmoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Glm4MoeForCausalLM``,
``DeepseekV3ForCausalLM``).

On disk the HF directory holds sharded safetensors with per-expert keys (as ``transformers``
saves them), ``model.safetensors.index.json``, ``config.json``, our own
``moe_core_config.json`` (so the way back is exact) and, when given, the tokenizer files.
Export writes the one class that computes what the config computes (or refuses); the
directory is written beside its destination and renamed into place only when complete.
Import reads any of the five (``model_type`` picks the family) through ``HFSource``, one
tensor at a time.
"""

from __future__ import annotations

import glob
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from moe_core.config import ARCHITECTURE_FIELDS, ConfigError, ModelConfig, safe_name
from moe_core.config_dict import from_dict, to_dict
from moe_core.convert.families import (
    DeepseekV3,
    Family,
    Glm4Moe,
    HFConfigReader,
    choose_family,
    export_note,
    family_for,
)
from moe_core.convert.folders import refuse_existing
from moe_core.data.tokenizer import TOKENIZER_FILES
from moe_core.errors import CheckpointError, RunFileError
from moe_core.files import (
    TMP_MARK,
    inside,
    is_stale_temporary,
    remove_stale_temporaries,
    temporary_name,
    user_mode,
)
from moe_core.model.transformer import parameter_shapes, shape_mismatch, state_shapes

log = logging.getLogger(__name__)

OUR_CONFIG = "moe_core_config.json"
INDEX = "model.safetensors.index.json"
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# safetensors' names of the dtypes a weight may have (our training writes one of these)
_WEIGHT_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
# our tensors that may stay fp32 in a state of lower precision: the routers' (GLM keeps them
# fp32, and the expert bias is an fp32 buffer in any model)
MAY_BE_FP32 = re.compile(r"layers\.\d+\.moe\.router\.(weight|expert_bias)")


def check_exportable(cfg: ModelConfig) -> Family:
    """The family export writes for ``cfg``; a model no stock class computes is refused in one
    sentence naming the option and the nearest class, rather than written wrong."""
    return choose_family(cfg)


def _tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files of ``folder`` an export copies: each inside it (a symlink leading
    out would copy any file of the machine into a folder that is then shared)."""
    files = [folder / f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if not files:
        raise FileNotFoundError(
            f"tokenizer directory {folder} holds none of: {', '.join(TOKENIZER_FILES)}."
        )
    return [inside(folder, f.name, folder, CheckpointError) for f in files]


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


def hf_config(cfg: ModelConfig, dtype: torch.dtype, eos_token_id: int | None = None) -> Any:
    """The ``transformers`` config (of ``cfg``'s family) that computes what ``cfg`` computes."""
    import transformers

    family = check_exportable(cfg)
    config_class = getattr(transformers, family.config_class)
    hf = config_class(
        **family.hf_fields(cfg), pad_token_id=None, bos_token_id=None, eos_token_id=eos_token_id
    )
    hf.architectures = [family.hf_class]
    hf.dtype = _DTYPE_NAMES[dtype]
    return hf


class TensorSource(Protocol):
    """Where export reads weights from: a state dict, a checkpoint or an HF folder read one
    tensor (one expert) at a time, so that no process holds the whole model."""

    dtype: torch.dtype

    def names(self) -> set[str]: ...

    def get(self, name: str, expert: int | None = None) -> torch.Tensor: ...


class StateDictSource:
    """A whole state dict as a ``TensorSource``: one dtype throughout, but the routers' weights
    and expert bias may be fp32 (as GLM keeps them, and as the bias always is)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        dtypes = {t.dtype for k, t in state.items() if not MAY_BE_FP32.fullmatch(k)}
        dtypes = dtypes or {t.dtype for t in state.values()}
        fp32_ok = dtypes | {torch.float32}
        if (
            len(dtypes) != 1
            or next(iter(dtypes)) not in _DTYPE_NAMES
            or any(t.dtype not in fp32_ok for t in state.values())
        ):
            found = sorted(str(t.dtype).removeprefix("torch.") for t in state.values())
            raise CheckpointError(
                f"the weights hold {', '.join(sorted(set(found)))}, which is not allowed: one of "
                "float32, bfloat16 or float16 throughout (the routers' may be float32); nothing "
                "was written."
            )
        self.state, self.dtype = state, next(iter(dtypes))

    def names(self) -> set[str]:
        return set(self.state)

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        t = self.state[name]
        return t if expert is None else t[expert]


class Item(NamedTuple):
    """One tensor of the HF folder: its name and shape there, what of ours it is (``ours``'s
    slice ``[expert][rows]``; None: a tensor only the class has, zeros) and whether the class
    keeps it fp32 whatever the weights' dtype."""

    key: str
    shape: tuple[int, ...]
    ours: str | None
    expert: int | None
    rows: slice | None
    fp32: bool
    order: torch.Tensor | None = None  # the class's row order (``Family.row_order``)
    copy: bool = False  # a copy of ``ours`` the class keeps beside it (DeepSeek's MTP layers)


_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")


def _as_layer(cfg: ModelConfig, name: str) -> str:
    """An MTP depth's block tensor named as the layer it is on disk (``n_layers + k``)."""
    m = _MTP.fullmatch(name)
    if m is None or not m[2].startswith("block."):
        return name
    return f"layers.{cfg.n_layers + int(m[1])}.{m[2].removeprefix('block.')}"


def hf_items(family: Family, cfg: ModelConfig, interleaved: bool = True) -> list[Item]:
    """Every tensor of ``cfg``'s model in ``family``'s folder, in a stable order (ours, then
    the class's own); experts split per expert and projection; rows reordered where the class
    lays them out otherwise (``interleaved``: the folder's rotary rows are)."""
    F = cfg.expert_hidden
    items = []
    for name, shape in state_shapes(cfg).items():
        mtp = _MTP.fullmatch(name)
        if mtp is not None and not mtp[2].startswith("block."):  # an MTP depth's own tensors
            key = family.mtp_keys[mtp[2]].format(i=cfg.n_layers + int(mtp[1]))
            items.append(Item(key, shape, name, None, None, False))
            continue
        m = _LAYER.fullmatch(_as_layer(cfg, name))
        if m is not None and m[2] in ("moe.experts.w_gate_up", "moe.experts.w_down"):
            i = int(m[1])
            for e in range(cfg.n_experts):
                if m[2].endswith("w_down"):
                    items.append(Item(family.expert_key(i, e, 2), shape[1:], name, e, None, False))
                    continue
                for proj, rows in ((0, slice(0, F)), (1, slice(F, 2 * F))):
                    key = family.expert_key(i, e, proj)
                    items.append(Item(key, (F, shape[2]), name, e, rows, False))
            continue
        template = name if m is None else f"layers.{{i}}.{m[2]}"
        theirs = family.keys[template]
        key = theirs.format(i=m[1] if m else "")
        order = family.row_order(cfg, template, interleaved)
        index = None if order is None else torch.tensor(order)
        items.append(Item(key, shape, name, None, None, theirs in family.fp32_keys, index))
    for key, shape in family.hf_only(cfg):
        template = re.sub(r"layers\.\d+\.", "layers.{i}.", key)
        items.append(Item(key, shape, None, None, None, template in family.fp32_keys))
    head = "embed.weight" if cfg.tie_embeddings else "lm_head.weight"
    for k in range(cfg.mtp_depth):  # the embedding and head each MTP layer keeps a copy of
        for theirs, ours in (("embed_tokens", "embed.weight"), ("shared_head.head", head)):
            key = f"model.layers.{cfg.n_layers + k}.{theirs}.weight"
            shape = (cfg.vocab_size, cfg.d_model)
            items.append(Item(key, shape, ours, None, None, False, copy=True))
    return items


def expected_names(cfg: ModelConfig) -> set[str]:
    """Our model's parameter names under ``cfg``."""
    return set(parameter_shapes(cfg))


def _check_names(found: set[str], cfg: ModelConfig) -> None:
    expected = set(state_shapes(cfg))
    missing, extra = sorted(expected - found), sorted(found - expected)
    if missing or extra:
        raise CheckpointError(
            f"the weights do not match the model config: missing {missing[:3]}, "
            f"unexpected {extra[:3]}; nothing was written."
        )


def recover(out: Path) -> None:
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


def put_in_place(tmp: Path, out: Path) -> None:
    """Rename the finished folder ``tmp`` to ``out``; what ``out`` was (a folder, a file or a
    symlink, which is never followed) is moved aside first and removed only once ``tmp`` is in
    place, so no file of it is left among the new ones."""
    if not (out.exists() or out.is_symlink()):
        tmp.rename(out)
        return
    old = temporary_name(out.with_name(f"{out.name}.old"))
    shutil.rmtree(old, ignore_errors=True)
    out.rename(old)
    tmp.rename(out)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()


def save_hf(
    weights: dict[str, torch.Tensor] | TensorSource,
    cfg: ModelConfig,
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_bytes: int = 5 * 1024**3,
    eos_token_id: int | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the HF directory of ``cfg``'s family from a full state dict or a ``TensorSource``;
    return it. What of the training objective the class does not carry is logged in one line.

    Shards are planned from the config's shapes, then filled one at a time, so memory holds
    one shard (plus one tensor of the source) at most."""
    family = check_exportable(cfg)
    source = StateDictSource(weights) if isinstance(weights, dict) else weights
    _check_names(source.names(), cfg)
    if isinstance(weights, dict):
        found = {name: tuple(t.shape) for name, t in weights.items()}
        problem = shape_mismatch(found, state_shapes(cfg))
        if problem is not None:
            raise CheckpointError(
                f"the weights do not fit their model config ({problem}): nothing was written."
            )
    out = Path(out_dir)
    recover(out)
    refuse_existing(out, overwrite)
    tokenizer = [] if tokenizer_dir is None else _tokenizer_files(Path(tokenizer_dir))
    element = torch.empty((), dtype=source.dtype).element_size()
    shards: list[list[Item]] = [[]]
    size = 0
    for item in hf_items(family, cfg):
        nbytes = math.prod(item.shape) * (4 if item.fp32 else element)
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
            for key, shape, ours, expert, rows, fp32, order, _ in items:
                dtype = torch.float32 if fp32 else source.dtype
                if ours is None:
                    tensors[key] = torch.zeros(shape, dtype=dtype)
                    continue
                t = source.get(ours, expert)
                t = t if rows is None else t[rows]
                t = t if order is None else t[order]
                if tuple(t.shape) != shape:
                    raise ValueError(f"{ours} has shape {tuple(t.shape)}, the config says {shape}.")
                tensors[key] = t.detach().to("cpu", dtype).contiguous().clone()
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
        put_in_place(tmp, out)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)  # it would hold the space a rerun needs
        raise unwritten(out, err) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    note = export_note(cfg, family)
    if note is not None:
        log.warning(note)
    return out


def _hub_blobs(d: Path) -> Path:
    """Where the files of HF folder ``d`` may lead: ``d`` itself, or for a snapshot of the
    Hugging Face hub cache (``models--ORG--NAME/snapshots/REV``, whose files are symlinks into
    the repo's ``blobs``) that repo's folder."""
    if d.parent.name == "snapshots" and d.parent.parent.name.startswith("models--"):
        return d.parent.parent
    return d


def read_json(d: Path, name: str) -> dict:
    """``d / name`` parsed (a file inside ``d``), refused in one sentence unless a JSON object."""
    path = inside(d, name, d, CheckpointError, _hub_blobs(d))
    try:
        content = json.loads(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): it must be an object.") from None
    if not isinstance(content, dict):
        raise CheckpointError(f"{path} holds no JSON object, so it is not a model config.")
    return content


def _folder_config(d: Path) -> tuple[ModelConfig, Family, HFConfigReader | None]:
    """The config, family and (for a folder we did not write) config.json's reader of HF
    folder ``d``: ours where ``moe_core_config.json`` carries it (exact), else derived from
    config.json by the family its ``model_type`` names."""
    if not d.is_dir() or not ((d / "config.json").exists() or (d / OUR_CONFIG).exists()):
        what = "is not a folder" if not d.is_dir() else "has no config.json"
        raise CheckpointError(
            f"{d} {what}: give the folder of a Hugging Face checkpoint (config.json and its "
            "safetensors weights, as save_pretrained writes it)."
        )
    if (d / OUR_CONFIG).is_file() or (d / OUR_CONFIG).is_symlink():
        path, ours = d / OUR_CONFIG, read_json(d, OUR_CONFIG)
        try:
            cfg = from_dict(ModelConfig, ours, "model.")
            family = choose_family(cfg)
        except ConfigError as err:
            raise ConfigError(f"{path} describes a model moe_core cannot build: {err}") from None
        if (d / "config.json").exists():
            raw = read_json(d, "config.json")
            model_type = raw.get("model_type")
            if model_type != family.model_type:
                raise CheckpointError(
                    f"{d / 'config.json'} says model_type={model_type!r} but {path} describes "
                    f"a {family.title} model ({family.model_type!r}): the two files are not "
                    "of one export; export the model again."
                )
            _check_agree(d / "config.json", raw, family, cfg, path)
        return cfg, family, None
    path, raw = d / "config.json", read_json(d, "config.json")
    family = family_for(raw.get("model_type"), path)
    reader = HFConfigReader(path, raw, family)
    fields = family.model_fields(reader)
    if fields.get("mtp_depth") and not _holds_layer(d, fields["n_layers"]):
        # transformers builds no MTP layer, so a folder it saved names them without holding any
        reader.notes.append(
            f"the {fields['mtp_depth']} multi-token prediction layer(s) config.json names "
            "(the folder holds none of their tensors)"
        )
        fields["mtp_depth"] = 0
    try:
        return ModelConfig(name=safe_name(d.name), **fields), family, reader
    except ConfigError as err:
        raise ConfigError(f"{path} describes a model moe_core cannot build: {err}") from None


def _check_agree(path: Path, raw: dict, family: Family, cfg: ModelConfig, ours_path: Path) -> None:
    """Refuse a config.json that no longer describes the model ``ours_path`` does (edited
    after the export): import reads ours, so the model would compute other than what
    ``transformers`` computes from the folder, silently."""
    fields = family.model_fields(HFConfigReader(path, raw, family))
    try:
        theirs = ModelConfig(name=cfg.name, **fields)
    except ConfigError as err:
        raise ConfigError(f"{path} describes a model moe_core cannot build: {err}") from None
    for key in ARCHITECTURE_FIELDS:
        if key == "expert_bias" and isinstance(family, Glm4Moe):
            continue  # the class always holds one; an export of a model without it writes zeros
        if getattr(theirs, key) != getattr(cfg, key):
            raise CheckpointError(
                f"{path} describes model.{key}={getattr(theirs, key)!r} but {ours_path} "
                f"describes {getattr(cfg, key)!r}: config.json was changed after the export; "
                f"export the model again, or remove {OUR_CONFIG} to import config.json as it is."
            )


def _holds_layer(d: Path, layer: int) -> bool:
    """Whether HF folder ``d``'s weights hold any tensor of ``model.layers.{layer}`` (read from
    its index, or from the safetensors header)."""
    prefix = f"model.layers.{layer}."
    if (d / INDEX).is_file():
        weight_map = read_json(d, INDEX).get("weight_map")
        names = weight_map if isinstance(weight_map, dict) else {}
    else:
        names = _scan(d / _weight_files(d)[0])
    return any(k.startswith(prefix) for k in names)


def config_from_hf(hf_dir: str | os.PathLike) -> ModelConfig:
    """Our config for an HF folder of any of the families (ours carries it; others are
    derived from config.json: the router losses as ``families`` says, no z-loss)."""
    cfg = _folder_config(Path(hf_dir))[0]
    _weight_files(Path(hf_dir))  # a folder without its weights is refused before anything starts
    return cfg


def _weight_files(d: Path) -> list[str]:
    """The safetensors files of an HF directory: those its index names (each a file inside
    ``d``, ``files.inside``), else ``model.safetensors``."""
    if not (d / INDEX).is_file() and not (d / INDEX).is_symlink():
        single = inside(d, "model.safetensors", d, CheckpointError, _hub_blobs(d))
        if not single.is_file():
            raise CheckpointError(
                f"{d} holds neither model.safetensors nor {INDEX}: only safetensors weights are "
                "read (a pytorch_model.bin could run code when loaded); save the model with "
                "save_pretrained's default safe_serialization=True."
            )
        return [single.name]
    try:
        weight_map = read_json(d, INDEX)["weight_map"]
        files = sorted({*weight_map.values()}, key=str)
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(
            f"{d / INDEX} is not a valid index: it needs a weight_map of tensor names to files."
        ) from None
    for f in files:
        if not inside(d, f, d / INDEX, CheckpointError, _hub_blobs(d)).is_file():
            raise CheckpointError(
                f"{d / INDEX} names {f!r}, which is not in {d}: the folder is incomplete; "
                "download or export it again."
            )
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
        raise unreadable(path, err) from None


def unreadable(path: Path, err: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path} is not a readable safetensors file ({err}): it may be truncated; download or "
        "export it again."
    )


class HFSource:
    """A ``TensorSource`` over a Hugging Face folder (any of the families, ours or not): each
    of our tensors, or one expert's slice of a stacked one, read from the safetensors files
    when asked, so an importer (``load_hf``, ``load_model``, an initial checkpoint) holds one
    tensor at a time. Made only once the folder checks out, before any tensor is read: its
    files inside it (or its hub snapshot's blobs), each readable, weights in one float dtype
    (the family's fp32 router tensors aside), every tensor's shape as config.json says. A
    DeepSeek folder's multi-token prediction layers are the model's MTP depths (their copies of
    the embedding and LM head checked equal); a GLM folder's are skipped, and said so."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        d = self.dir = Path(hf_dir)
        self.cfg, self.family, reader = _folder_config(d)
        notes = [] if reader is None else reader.notes
        mtp = range(0)
        if reader is not None and isinstance(self.family, Glm4Moe):
            n_layers = self.cfg.n_layers
            mtp = range(n_layers, n_layers + self.family.mtp_layers(reader))
        interleaved = not isinstance(self.family, DeepseekV3) or self.family.interleaved(reader)
        items = hf_items(self.family, self.cfg, interleaved)
        may_be_fp32 = {item.key for item in items if item.fp32}
        files = _weight_files(d)
        found: dict[str, tuple[int, ...]] = {}
        self._file: dict[str, str] = {}
        skipped = 0
        first: tuple[str, str, str] | None = None  # (file, tensor, dtype) of the first weight
        for f in files:
            for k, (shape, dtype) in _scan(d / f).items():
                m = re.match(r"model\.layers\.(\d+)\.", k)
                if m is not None and int(m[1]) in mtp:
                    skipped += 1
                    continue
                if k in found:  # which copy a reader takes would depend on the file order
                    raise CheckpointError(
                        f"{d} holds {k} twice, in {self._file[k]} and in {f}, which is not "
                        "allowed: each tensor in one file; download or export it again."
                    )
                found[k], self._file[k] = shape, f
                if dtype not in _WEIGHT_DTYPES:
                    raise CheckpointError(
                        f"{d / f} holds {k} as {dtype}, which is not allowed: weights are "
                        f"{', '.join(_WEIGHT_DTYPES.values())} (nothing is converted unasked)."
                    )
                if k in may_be_fp32 and dtype == "F32":
                    continue
                first = first or (f, k, dtype)
                if dtype != first[2]:
                    raise CheckpointError(
                        f"{d / f} holds {k} as {dtype} but {first[0]} holds {first[1]} as "
                        f"{first[2]}, which is not allowed: every weight in one dtype (convert "
                        "them to one first, so no value is rounded here unasked)."
                    )
        problem = shape_mismatch(found, {item.key: item.shape for item in items})
        if problem is not None:
            raise CheckpointError(
                f"{d} does not hold the model its config.json describes ({problem})."
            )
        self.dtype = getattr(torch, _WEIGHT_DTYPES[first[2] if first else "F32"])
        self._parts: dict[str, list[Item]] = {}
        for item in items:
            if item.ours is not None:
                self._parts.setdefault(item.ours, []).append(item)
        self._handles: dict[str, Any] = {}
        self._check_copies(items)
        if skipped:
            notes.append(
                f"{skipped} tensors of the multi-token prediction layer(s) model.layers."
                f"{mtp.start}-{mtp.stop - 1} (GLM's MTP layers are not imported; "
                "DeepSeek-V3's are, as MTP depths)"
            )
        if notes:
            log.warning(f"not imported from {d}: {'; '.join(notes)}.")

    def names(self) -> set[str]:
        return set(self._parts)

    def _check_copies(self, items: list[Item]) -> None:
        """The copies a DeepSeek folder's MTP layers keep of the embedding and the LM head must
        equal them: moe_core's MTP shares the model's, so a differing copy cannot be held."""
        for item in items:
            if item.copy and not torch.equal(self._read(item.key), self.get(item.ours)):
                main = self._parts[item.ours][0].key
                raise CheckpointError(
                    f"{self.dir} holds {item.key} unequal to {main}: moe_core's multi-token "
                    "prediction shares the model's embedding and LM head, so it cannot import "
                    "a copy of its own."
                )

    def _read(self, key: str) -> torch.Tensor:
        f = self._file[key]
        try:
            if f not in self._handles:
                self._handles[f] = safe_open(str(self.dir / f), framework="pt")
            return self._handles[f].get_tensor(key)
        except SafetensorError as err:
            raise unreadable(self.dir / f, err) from None

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Our tensor ``name`` (``[expert]`` of a stacked one) as stored: no dtype changes."""
        parts = self._parts[name]
        if parts[0].expert is None:
            t, order = self._read(parts[0].key), parts[0].order
            return t if order is None else t[torch.argsort(order)]
        experts = range(self.cfg.n_experts) if expert is None else [expert]
        per_expert = [
            torch.cat([self._read(p.key) for p in parts if p.expert == e]) for e in experts
        ]
        return per_expert[0] if expert is not None else torch.stack(per_expert)


def load_hf(hf_dir: str | os.PathLike) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read an HF folder of any of the families back into our config and state dict
    (bit-exact: no tensor changes dtype)."""
    source = HFSource(hf_dir)
    return source.cfg, {name: source.get(name) for name in sorted(source.names())}
