"""Hydra composition of ``conf/`` into a typed, validated ``RunConfig``.

Hydra stays at this edge: the library below takes dataclasses, never an OmegaConf object.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import re
from pathlib import Path
from typing import Any

from moe_core.config import ConfigError, RunConfig, did_you_mean, fail, nearest_first
from moe_core.config_dict import from_dict, refuse_moved, to_dict, unknown_option

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "conf"


def config_dir(path: str | os.PathLike | None = None) -> Path:
    d = Path(path) if path is not None else DEFAULT_CONFIG_DIR
    if not (d / "config.yaml").is_file():
        raise ConfigError(
            f"config directory {str(d)!r} has no config.yaml: pass --config-dir pointing at the "
            "project's conf/ folder."
        )
    return d.resolve()


def _known_fields(overrides: list[str]) -> list[str]:
    """``section.field=value`` for a field the dataclasses define becomes ``++section.field=
    value`` (set it whether or not the section's YAML lists it: defaults live in the
    dataclasses); anything else is left for Hydra, which refuses unknown keys."""
    out = []
    for o in overrides:
        moved = re.fullmatch(r"[+~]*(\w+\.\w+)=(.*)", o, re.S)
        if moved:  # a key that moved (train.dtype=bf16): one sentence naming where it went
            refuse_moved(moved.group(1), moved.group(2))
        m = re.fullmatch(r"(\w+)\.(\w+)=(.*)", o, re.S)
        section = getattr(RunConfig(), m.group(1), None) if m else None
        if m and dataclasses.is_dataclass(section) and m.group(2) in to_dict(section):
            out.append("++" + o)
        else:
            out.append(o)
    return out


def compose_dict(
    overrides: list[str], path: str | os.PathLike | None = None, config_name: str = "config"
) -> dict[str, Any]:
    """The resolved config as a plain dict (what Prefect and MLflow receive)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    root = config_dir(path)
    try:
        with initialize_config_dir(config_dir=str(root), version_base="1.3"):
            cfg = compose(config_name, overrides=_known_fields(list(overrides)))
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as err:
        key = err.full_key
        raise ConfigError(f"{key} has no value: give one as an override ({key}=...).") from None
    except (HydraException, OmegaConfBaseException) as err:
        first = str(err).strip().splitlines()[0]
        unknown = re.search(r"Could not override '([\w.]+)'", first)
        if unknown:
            head, _, rest = unknown.group(1).partition(".")
            section = getattr(RunConfig(), head, None)
            if dataclasses.is_dataclass(section) and rest:
                raise unknown_option(unknown.group(1), to_dict(section)) from None
            raise unknown_option(head, _top_level(), rest) from None
        missing = re.search(r"Could not find '([\w/-]+)/([^'/]+)'", first)
        if missing:
            group, value = missing.group(1), missing.group(2)
            options = sorted(p.stem for p in (root / group).glob("*.yaml"))
            fail(group, value, f"one of {', '.join(options)}", options)
        primary = re.search(r"Cannot find primary config '([^']+)'", first)
        if primary:
            name, names = primary.group(1), sorted(p.stem for p in root.glob("*.yaml"))
            hint = did_you_mean(name, names)
            listed = "its configs, nearest first, are" if hint else "its configs are"
            raise ConfigError(
                f"--config-name {name!r} is not a config of {root}: {listed} "
                f"{', '.join(nearest_first(name, names))}{hint}."
            ) from None
        bad = _unparsable(list(overrides))
        if bad is not None and (not bad.isascii() or any(c.isspace() for c in bad)):
            key, _, value = bad.partition("=")
            if not re.fullmatch(r"[+~]*[A-Za-z0-9_.]+", key):
                raise ConfigError(
                    f"the override {bad!r} does not parse: its key {key!r} is not allowed, Hydra "
                    "takes keys of ASCII letters, digits, _ and . (such as train.lr)."
                ) from None
            raise ConfigError(
                f"the override {bad!r} does not parse: Hydra takes a value with spaces or "
                f"non-ASCII letters only in quotes, as in {key}='{value}'."
            ) from None
        raise ConfigError(f"the overrides {overrides} do not compose: {first}") from None
    assert isinstance(data, dict)
    _check_data_source(data.get("data") or {})
    if (data.get("init") or {}).get("from_hf") is not None:
        _model_from_hf(data, list(overrides))
    return data  # type: ignore[return-value]


def _top_level() -> list[str]:
    """What a run config takes at its top: its sections and its own fields (``out_dir``)."""
    return [f.name for f in dataclasses.fields(RunConfig)]


def _model_from_hf(data: dict[str, Any], overrides: list[str]) -> None:
    """``init.from_hf=DIR``: the model section becomes the one DIR's config describes, with the
    training-only fields the overrides set (``model.aux_loss_coef=...``) over it; an
    architecture field set otherwise than DIR says (by ``model=NAME`` or ``model.X=``) is
    refused in one sentence. DIR's tokenizer tokenizes the data unless ``data.tokenizer`` is
    given, and ``out_dir`` follows the folder's name unless given."""
    from moe_core.config import ARCHITECTURE_FIELDS, check_folder
    from moe_core.convert.hf import config_from_hf

    folder = check_folder("init.from_hf", str(data["init"]["from_hf"]))
    given = {m.group(1) for o in overrides if (m := re.fullmatch(r"[+~]*([\w.]+)=.*", o, re.S))}
    theirs = to_dict(config_from_hf(folder))
    ours = data.get("model") or {}
    fixed = (
        set(ARCHITECTURE_FIELDS)
        if "model" in given
        else {k.removeprefix("model.") for k in given if k.startswith("model.")}
    )
    for key in ARCHITECTURE_FIELDS:
        if key in fixed and key in ours and ours[key] != theirs[key] and ours[key] is not None:
            how = "model=" + str(ours.get("name")) if "model" in given else f"model.{key}"
            raise ConfigError(
                f"model.{key}={ours[key]!r} (from {how}) is not allowed with "
                f"init.from_hf={folder!r}, whose config.json says {key}={theirs[key]!r}: the "
                "architecture comes from the checkpoint, so leave it unset."
            )
    model = dict(theirs)
    for key in set(model) - set(ARCHITECTURE_FIELDS):
        if f"model.{key}" in given:
            model[key] = ours[key]
    data["model"] = model
    if "data.tokenizer" not in given:
        data.setdefault("data", {})["tokenizer"] = str(folder)
    if "out_dir" not in given:
        data["out_dir"] = f"runs/{model['name']}"


def _unparsable(overrides: list[str]) -> str | None:
    """The first override Hydra's grammar cannot read (such as an unquoted non-ASCII value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for o in overrides:
        try:
            parser.parse_override(o)
        except HydraException:
            return o
    return None


def _check_data_source(data: dict[str, Any]) -> None:
    """A token source given to the synthetic data section would be ignored: refuse it."""
    if data.get("kind", "synthetic") != "synthetic":
        return
    for key in ("dir", "path", "hub"):
        if data.get(key) is not None:
            raise ConfigError(
                f"data.{key}={data[key]!r} is not allowed with the synthetic data section, "
                "which reads no files: choose token data (data=kjv, data=files or data=hub) "
                "to train on them."
            )


def compose_run(
    overrides: list[str], path: str | os.PathLike | None = None, config_name: str = "config"
) -> RunConfig:
    return from_dict(RunConfig, compose_dict(overrides, path, config_name))


def sweep(overrides: list[str]) -> list[list[str]]:
    """Hydra's own parser expands ``key=a,b`` (and ranges, choices) into combinations: one list
    of plain overrides per run (``moe pipeline --multirun``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    options = []
    for o in parsed:
        if o.is_sweep_override():
            key = o.get_key_element()
            options.append([f"{key}={v}" for v in o.sweep_string_iterator()])
        else:
            options.append([o.input_line])
    return [list(combo) for combo in itertools.product(*options)]
