"""Stage keys as written before ``manifests.KEY_VERSION`` 2, kept only so that run folders of
that time are recognized: a finished stage whose manifest holds the old key of the current
config is accepted (and rekeyed) instead of running again, and a stage folder left by an
interrupted attempt is resumed instead of being moved aside. Nothing else reads this module."""

from __future__ import annotations

from typing import Any

from flows.manifests import NOT_IN_TOKENIZE_KEY, digest, keyed, train_section
from moe_core.config import RunConfig
from moe_core.config_dict import MOVED_TO_PRECISION, to_dict

# Options added after run folders existed, with the value that means "as before": the old keys
# hashed one only when set otherwise.
ADDED_LATER = {"parallel.gather_rows": False}


def old_layout(run: RunConfig) -> dict[str, Any]:
    """``to_dict(run)`` with the precision settings at their keys from before the precision
    section, and without the options of ``ADDED_LATER`` where they keep their old meaning."""
    out = to_dict(run)
    out["model"] = keyed("model", out["model"])
    precision = out.pop("precision")
    for old, new in MOVED_TO_PRECISION.items():
        section, key = old.split(".")
        out[section][key] = precision[new.split(".")[1]]
    for added, as_before in ADDED_LATER.items():
        section, key = added.split(".")
        if out[section][key] == as_before:
            del out[section][key]
    out["train"] = train_section(out["train"])  # options added since version 2 as it hashes them
    out["parallel"] = keyed("parallel", out["parallel"])
    return out


def old_stage_keys(run: RunConfig, eval_batches: int) -> dict[str, str]:
    """Each stage's key as version 1 computed it (``eval_batches``: the evaluate stage's)."""
    data = keyed("data", to_dict(run.data))
    data = {k: v for k, v in data.items() if k not in NOT_IN_TOKENIZE_KEY}
    keys = {"tokenize": digest({"data": data, "vocab": run.model.vocab_size})}
    keys["init"] = digest({"model": keyed("model", to_dict(run.model)), "seed": run.train.seed})
    sections = old_layout(run)
    train = {
        "model": sections["model"],
        "train": sections["train"],
        "parallel": sections["parallel"],
        "tokenize": keys["tokenize"],
        "init": keys["init"],
    }
    ev = to_dict(run.eval)
    if run.eval.every:
        train["eval"] = ev
    keys["train"] = digest(train)
    keys["convert"] = digest({"train": keys["train"]})
    final = {k: ev[k] for k in ("tasks", "limit", "seed", "tasks_from")}
    evaluate = {"convert": keys["convert"], "batches": eval_batches}
    if run.eval.tasks:
        evaluate["downstream"] = final
    keys["evaluate"] = digest(evaluate)
    return keys
