"""Configs as plain dicts: a composed or saved dict into the typed sections (one-sentence
refusals of unknown keys and mistyped values), the sections back into a dict, and the keys that
moved (refused on input, upgraded in configs that checkpoints saved)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, TypeVar, get_args, get_origin

from moe_core.config import ConfigError, did_you_mean, fail

T = TypeVar("T")


# Where each precision setting lived before the precision section (old key -> new key). A user
# who still writes an old key is told the new one; configs that checkpoints saved are read
# through ``upgrade_saved`` (and ``flows.migrate`` recognizes old run folders' stage keys).
MOVED_TO_PRECISION = {
    "train.dtype": "precision.compute",
    "train.optimizer_dtype": "precision.optimizer",
    "parallel.param_dtype": "precision.params",
    "parallel.fp8_parts": "precision.fp8_parts",
    "parallel.fp8_scaling": "precision.fp8_scaling",
}


def refuse_moved(key: str, value: Any) -> None:
    """Refuse ``key`` in one sentence naming its new key, when it is one that moved."""
    if key in MOVED_TO_PRECISION:
        fail(
            key,
            value,
            f"it moved to {MOVED_TO_PRECISION[key]} (or choose a preset: precision=bf16, "
            "pure-bf16, fp8, ...)",
        )


def upgrade_saved(config: dict[str, Any]) -> dict[str, Any]:
    """A run config saved before the precision section (in a checkpoint) with its precision keys
    moved to where they live now; other configs come back unchanged."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in config.items()}
    for old, new in MOVED_TO_PRECISION.items():
        section, key = old.split(".")
        if isinstance(out.get(section), dict) and key in out[section]:
            out.setdefault("precision", {})[new.split(".")[1]] = out[section].pop(key)
    return out


def _describe(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if isinstance(tp, type):
        return f"a {tp.__name__}"
    return str(tp)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    origin = get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        inner = [o for o in options if o is not type(None)]
        return _coerce(name, value, inner[0])
    if origin is Literal:
        if value not in get_args(tp):
            fail(name, value, _describe(tp), [a for a in get_args(tp) if isinstance(a, str)])
        return value
    if origin is list:
        if not isinstance(value, list | tuple):
            fail(name, value, f"a list of {_describe(get_args(tp)[0])} values")
        item = get_args(tp)[0]
        if dataclasses.is_dataclass(item):  # each entry's fields named by its index
            return [_coerce(f"{name}[{i}]", v, item) for i, v in enumerate(value)]
        return [_coerce(name, v, item) for v in value]
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            fail(name, value, f"a mapping of {tp.__name__} fields")
        return from_dict(tp, value, prefix=name + ".")
    if tp is bool:
        if not isinstance(value, bool):
            fail(name, value, "true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(name, value, "an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            fail(name, value, "a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(name, value, "a string")
        return value
    return value


def from_dict(cls: type[T], data: dict[str, Any], prefix: str = "") -> T:
    """Build dataclass ``cls`` from a plain dict, refusing unknown keys and mistyped values."""
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - fields)
    for key in unknown:
        refuse_moved(prefix + key, data[key])
    if unknown:
        raise unknown_option(prefix + unknown[0], fields)
    kwargs = {k: _coerce(prefix + k, v, hints[k]) for k, v in data.items()}
    return cls(**kwargs)


def unknown_option(key: str, fields: Iterable[str], rest: str = "") -> ConfigError:
    """The refusal of ``key`` (``section.name``, or a top-level ``name``), which its section
    does not take: the ``fields`` it takes, and the nearest one when ``key`` looks like a
    misspelling of it (``rest``: what followed ``key`` in the override, as in ``tain.steps``)."""
    section, _, name = key.rpartition(".")
    fields = sorted(fields)
    hint = did_you_mean(name, fields, lambda f: ".".join(filter(None, (section, f, rest))))
    whole = ".".join(filter(None, (key, rest)))
    return ConfigError(
        f"{whole} is not a known option: {section or 'the run config'} takes "
        f"{', '.join(fields)}{hint}."
    )


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass config as a plain dict (JSON- and Hydra-friendly)."""
    return dataclasses.asdict(obj)
