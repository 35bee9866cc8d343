"""Build-a-run: ``moe plan --html OUT.html``, one self-contained page of the planner.

The page computes in the browser with ``planner.js``, which mirrors ``plan.planner.plan``,
``plan.timing.step_time`` and the config checks over numbers exported here from Python:
parameter shapes read off meta-device blocks (an MoE block, a leading dense block, the ends),
activation bytes per token of each (``layer_activation_bytes``,
``dense_layer_activation_bytes``), FLOPs per token (``flops.count``), all-to-all rows per
token, GPU types (``hardware``), the precision presets of ``conf/precision`` and the planner's
constants (with ``ModelConfig``'s size limits, which the page's checks of typed sizes read).
``evaluate`` is the same layout through the Python planner: the tests hold the two equal on a
grid. Sizes typed into the page ("custom sizes") get ``model_data``'s numbers from
``planner.js``'s ``modelData``, which mirrors the functions ``model_data`` calls (the tests hold
those equal too).
"""

from __future__ import annotations

import dataclasses
import html
import json
import logging
import os
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from moe_core.compose import compose_run, config_dir
from moe_core.config import (
    FP8_GEMM_ALIGN,
    MAX_SIZES,
    RULES,
    ClusterConfig,
    ConfigError,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    RunConfig,
    TrainConfig,
)
from moe_core.config_dict import from_dict, to_dict
from moe_core.hardware import GPUS, MEASURED
from moe_core.model.flops import count
from moe_core.plan import (
    BLOCK_RECOMPUTE_FLOPS,
    DTYPE_BYTES,
    GIB,
    REMAT_BACKWARD,
    RUNTIME_RESERVE_GIB,
    all_to_all_rows_per_token,
    check_cluster,
    dense_layer_activation_bytes,
    experts_keep,
    fit_refusal,
    layer_activation_bytes,
    parameter_counts,
    plan,
    step_time,
)

Layout = dict[str, Any]  # the page's controls: model, gpu, nodes, gpus_per_node, pp, dp, ...
SEQ_LENS = (128, 256, 512, 1024, 2048, 4096)
GPUS_PER_NODE = (1, 2, 4, 8)  # the page's choices
CLUSTER_NAME = "page"
CUSTOM_MODEL = "custom sizes"  # the model choice whose sizes are typed into the page

# The guided tour: (title, two or three sentences, overrides of conf/ or a top-level config).
TOUR: tuple[tuple[str, str, str | None, list[str]], ...] = (
    (
        "One GPU",
        "OLMoE-1B-7B (6.9B parameters, 1.3B active) on one H200 with bf16 weights, gradients "
        "and Adam moments: 8 bytes of static state per parameter. Its compute rate is the one "
        "measured on an H200, so this layout's tokens/s is the measurement itself.",
        None,
        [
            "model=olmoe-1b-7b",
            "train=default",
            "precision=pure-bf16",
            "train.micro_batch_size=4",
            "train.global_batch_size=4",
            "cluster=local-gpu",
            "cluster.procs_per_node=1",
            "cluster.gpus_per_node=1",
        ],
    ),
    (
        "Data parallel",
        "Eight copies of the model on one node, each reading its own micro-batches. ZeRO-1 "
        "splits the optimizer state eight ways, so fp32 masters and moments fit; gradients are "
        "reduce-scattered and the updated weights all-gathered once per step over NVLink.",
        None,
        [
            "model=olmoe-1b-7b",
            "train=default",
            "precision=bf16",
            "train.micro_batch_size=4",
            "train.global_batch_size=64",
            "train.eval_batches=8",
            "cluster=local-gpu",
            "parallel.dp=8",
        ],
    ),
    (
        "Expert parallel",
        "The same node with the 64 experts split eight ways: each GPU holds 8 experts and the "
        "dense layers, so weights and their state shrink. Every MoE layer now sends each token "
        "to the GPUs holding its experts and back (all-to-all), in forward and in backward.",
        None,
        [
            "model=olmoe-1b-7b",
            "train=default",
            "precision=bf16",
            "train.micro_batch_size=4",
            "train.global_batch_size=64",
            "train.eval_batches=8",
            "cluster=local-gpu",
            "parallel=ep8",
        ],
    ),
    (
        "Pipeline",
        "The 47B model on 64 GPUs: two pipeline stages of 16 layers, four data-parallel "
        "replicas, experts eight ways. A stage waits for its neighbour at the start and end of "
        "each step (the bubble); 32 micro-batches per step keep it small.",
        "pretrain-47b",
        [],
    ),
    (
        "1T on 512 GPUs",
        "The 1.2T-parameter model on 64 nodes of 8 H200: 8 stages x 4 replicas x 16-way "
        "experts (an expert group spans two nodes, so half its all-to-all crosses the "
        "network), block recompute. Try ep 8 with dp 8: 1/64 of the experts per GPU no longer "
        "fits 141 GiB.",
        "pretrain-1t",
        [],
    ),
)


Precision = dict[str, Any]  # a precision section as a dict (``to_dict(PrecisionConfig)``)


def _precisions(conf: Path) -> dict[str, Precision]:
    """The presets of ``conf/precision`` as the precision sections they set (composed, so a
    preset built on another one reads as Hydra resolves it)."""
    return {
        path.stem: to_dict(compose_run([f"precision={path.stem}"], conf).precision)
        for path in sorted((conf / "precision").glob("*.yaml"))
    }


def _precision_of(run: RunConfig, presets: dict[str, Precision]) -> str:
    """The preset ``run``'s precision section is, else the name ``_with_run_precision`` gives
    it."""
    mine = to_dict(run.precision)
    for name, preset in presets.items():
        if preset == mine:
            return name
    name = "{params} weights, {compute} compute, {optimizer} state".format(**mine)
    if mine["fp8_parts"]:
        name += ", FP8 {} ({})".format(" and ".join(mine["fp8_parts"]), mine["fp8_scaling"])
    return name


def _with_run_precision(run: RunConfig, presets: dict[str, Precision]) -> dict[str, Precision]:
    """The presets, plus ``run``'s own precision section where it is none of them."""
    return {**presets, _precision_of(run, presets): to_dict(run.precision)}


def fp8_in_permute(p: Precision) -> bool:
    """Whether this precision's experts quantize in the permute on one EP rank
    (``plan.memory.experts_keep``): the page's activations are counted so, and its planner adds
    the experts' rows back under EP."""
    return "experts" in p["fp8_parts"] and p["fp8_scaling"] == "rowwise"


def model_data(
    m: ModelConfig, precisions: dict[str, Precision], seq_lens: list[int]
) -> dict[str, Any]:
    """What ``planner.js`` needs of one model, from the Python planner's own functions."""
    counts = count(m)
    return {
        "config": to_dict(m),
        "shapes": dataclasses.asdict(parameter_counts(m)),
        "total_params": counts.total_params,
        "active_params": counts.active_params,
        "flops_per_token": {s: count(m, s).flops_per_token for s in seq_lens if s <= m.max_seq_len},
        # the page's runs: on GPUs (compiled blocks), expert_gemm=auto, one EP rank
        "activation": {
            name: {
                r: layer_activation_bytes(
                    m,
                    p["params"],
                    p["compute"],
                    r,
                    **experts_keep("experts" in p["fp8_parts"], fp8_in_permute=fp8_in_permute(p)),
                    compiled=True,
                )
                for r in ("none", "selective")
            }
            for name, p in precisions.items()
        },
        # a leading dense block's (selective recompute touches only latent attention's core);
        # none without one
        "dense_activation": {
            name: {
                r: dense_layer_activation_bytes(m, p["params"], p["compute"], r, compiled=True)
                for r in ("none", "selective")
            }
            for name, p in precisions.items()
            if m.n_dense_layers
        },
        "rows_per_token": {
            ep: all_to_all_rows_per_token(m, ep)
            for ep in range(1, m.n_experts + 1)
            if m.n_experts % ep == 0
        },
    }


def layout_of(run: RunConfig, model_key: str, precisions: dict[str, Precision]) -> Layout:
    """The page's controls for ``run``. A GPU type the page does not know starts as H200; a
    CPU cluster becomes the layout's GPUs, as many to a node (1, 2, 4 or 8) as divide them."""
    par, c, t = run.parallel, run.cluster, run.train
    per_node, nodes = c.gpus_per_node, c.nodes
    if not per_node:
        per_node = max(n for n in GPUS_PER_NODE if par.world_size % n == 0)
        nodes = par.world_size // per_node
    return {
        "model": model_key,
        "gpu": c.gpu_type if c.gpu_type in GPUS else "H200",
        "nodes": nodes,
        "gpus_per_node": per_node,
        "pp": par.pp,
        "dp": par.dp,
        "ep": par.ep,
        "cp": par.cp,
        "virtual_stages": par.virtual_stages,
        "recompute": par.recompute,
        "dispatcher": par.dispatcher,
        "precision": _precision_of(run, precisions),
        "micro_batch_size": t.micro_batch_size,
        "global_batch_size": t.global_batch_size,
        "seq_len": t.seq_len,
    }


def run_of(layout: Layout, data: dict[str, Any]) -> RunConfig:
    """The run config of a page layout (raises ``ConfigError`` as the page refuses)."""
    m = from_dict(ModelConfig, data["models"][layout["model"]]["config"])
    precision = from_dict(PrecisionConfig, data["precisions"][layout["precision"]], "precision.")
    gpu = GPUS[layout["gpu"]]
    v, dp, ep = layout["virtual_stages"], layout["dp"], layout["ep"]
    train = TrainConfig(
        seq_len=layout["seq_len"],
        micro_batch_size=layout["micro_batch_size"],
        global_batch_size=layout["global_batch_size"],
        eval_batches=max(dp * ep, 1),
    )
    par = ParallelConfig(
        pp=layout["pp"],
        dp=dp,
        ep=ep,
        cp=layout["cp"],
        virtual_stages=v,
        pp_schedule="interleaved_1f1b" if v > 1 else "1f1b",
        recompute=layout["recompute"],
        dispatcher=layout["dispatcher"],
    )
    cluster = ClusterConfig(
        name=CLUSTER_NAME,
        kind="slurm",
        nodes=layout["nodes"],
        procs_per_node=layout["gpus_per_node"],
        gpus_per_node=layout["gpus_per_node"],
        gpu_type=gpu.name,
        gpu_memory_gib=gpu.memory_gib,
    )
    return RunConfig(model=m, train=train, parallel=par, precision=precision, cluster=cluster)


def evaluate(layout: Layout, data: dict[str, Any]) -> dict[str, Any]:
    """The Python planner on a page layout, in ``planLayout``'s shape (the tests' reference)."""
    try:
        run = run_of(layout, data)
        check_cluster(run)
    except ConfigError as err:
        return {"refusal": str(err)}
    p = plan(run)
    mem = p.memory
    parts = ("weights", "grad_buffers", "optimizer", "activations", "p2p_buffers")
    parts += ("ep_buffers", "transient", "reserve")
    return {
        "refusal": fit_refusal(p),
        "micro_batches": p.micro_batches,
        "memory": {name: getattr(mem, name) for name in parts},
        "busiest_stage": mem.stage,
        "total": mem.total,
        "stages": [s.total for s in p.stages],
        "comm": {
            name: getattr(p.comm, name)
            for name in (
                *("all_to_all", "reduce_scatter", "all_gather", "pipeline"),
                *("context_per_layer", "context"),
            )
        },
        "reach": dataclasses.asdict(p.comm.reach),
        "plain": dataclasses.asdict(p.comm.plain),
        "time": dataclasses.asdict(step_time(p, GPUS[layout["gpu"]])),
    }


def _model_key(run: RunConfig, named: dict[str, ModelConfig]) -> str:
    m = run.model
    if named.get(m.name) == m:
        return m.name
    return f"{m.name} (custom)"


def page_data(
    run: RunConfig,
    path: str | os.PathLike | None = None,
    source_tokens: dict[str, int | None] | None = None,
) -> dict[str, Any]:
    """Everything the page computes from: the planner's numbers for every model of
    ``conf/model`` (and ``run``'s own when its sizes differ), GPU types, presets, the tour,
    and a mixture's sources (``source_tokens``: their train tokens, None where unknown)."""
    conf = config_dir(path)
    precisions = _with_run_precision(run, _precisions(conf))
    named = {
        p.stem: from_dict(ModelConfig, yaml.safe_load(p.read_text()))
        for p in sorted((conf / "model").glob("*.yaml"))
    }
    if CUSTOM_MODEL in named:
        raise ConfigError(
            f"conf/model/{CUSTOM_MODEL}.yaml is not allowed: the page's choice for typed sizes "
            "has that name; rename the file."
        )
    tour = []
    for title, text, config_name, overrides in TOUR:
        r = compose_run(overrides, path, config_name or "config")
        tour.append(
            {"title": title, "text": text, "layout": layout_of(r, r.model.name, precisions)}
        )
    seq_lens = sorted({*SEQ_LENS, run.train.seq_len, *(t["layout"]["seq_len"] for t in tour)})
    models = {name: model_data(m, precisions, seq_lens) for name, m in named.items()}
    models = dict(sorted(models.items(), key=lambda kv: kv[1]["total_params"]))
    key = _model_key(run, named)
    if key not in models:
        models[key] = model_data(run.model, precisions, seq_lens)
    m = MEASURED
    return {
        "constants": {
            "gib": GIB,
            "reserve_gib": RUNTIME_RESERVE_GIB,
            "dtype_bytes": DTYPE_BYTES,
            "block_recompute_flops": BLOCK_RECOMPUTE_FLOPS,
            "remat_backward": REMAT_BACKWARD,
            "fp8_gemm_align": FP8_GEMM_ALIGN,
            "max_sizes": MAX_SIZES,  # ModelConfig's limits, for the typed sizes
        },
        "gpus": {
            name: {**dataclasses.asdict(g), "peak_tflops": g.peak_tflops}
            for name, g in GPUS.items()
        },
        "measured": {**dataclasses.asdict(m), "fraction_of_peak": m.fraction_of_peak},
        "precisions": precisions,
        "seq_lens": seq_lens,
        "gpus_per_node": list(GPUS_PER_NODE),
        "models": models,
        "custom_model": CUSTOM_MODEL,
        "rules": [dataclasses.asdict(r) for r in RULES],  # config's refusals, for configRefusal
        "initial": layout_of(run, key, precisions),
        "tour": tour,
        "mixture": _mixture(run, source_tokens or {}),
    }


def _mixture(run: RunConfig, source_tokens: dict[str, int | None]) -> dict[str, Any] | None:
    """What ``mixtureRows`` reads (``plan.mixture.mixture_plan``'s inputs); None: one folder."""
    if not run.data.sources:
        return None
    sources = zip(run.data.sources, run.source_shares, strict=True)
    return {
        "steps": run.train.steps,
        "sources": [
            {"name": s.name, "share": share, "tokens": source_tokens.get(s.name)}
            for s, share in sources
        ],
    }


def _asset(name: str) -> str:
    return files(__package__).joinpath(name).read_text(encoding="utf-8")


def render(data: dict[str, Any]) -> str:
    """The page: one HTML file with its style, script and numbers inlined (no network)."""
    # "<" only occurs inside JSON strings: escaped, no text can close the script element
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    return (
        _asset("page.html")
        .replace("/*STYLE*/", _asset("page.css"))
        .replace("/*PLANNER*/", _asset("planner.js"))
        .replace("/*PAGE*/", _asset("page.js"))
        .replace("/*DATA*/", payload)
        .replace("<!--TITLE-->", html.escape(f"build a run: {data['initial']['model']}"))
    )


def check_target(out: str | os.PathLike, overwrite: bool = False) -> Path:
    """Refuse, in one sentence, an output the page cannot go to: not ``.html``, a directory,
    a missing folder, or an existing file without ``overwrite`` (never replaced silently)."""
    target = Path(out)
    if target.suffix.lower() not in (".html", ".htm"):
        raise ConfigError(f"--html {str(out)!r} is not allowed: give a file name ending in .html.")
    if target.is_dir():
        raise ConfigError(f"--html {str(out)!r} is a directory: give a file name ending in .html.")
    if target.exists() and not overwrite:
        raise ConfigError(
            f"--html {str(out)!r} exists already: choose a new file name or add --overwrite."
        )
    if not target.parent.is_dir():
        raise ConfigError(
            f"--html {str(out)!r} is not allowed: its folder {str(target.parent)!r} does not exist."
        )
    return target


def write_page(
    run: RunConfig,
    out: str | os.PathLike,
    path: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    source_tokens: dict[str, int | None] | None = None,
) -> Path:
    """Write the page for ``run`` to ``out`` (``check_target`` first); ``path``: the conf/
    folder whose models and presets the page offers; ``source_tokens``: a mixture's sizes."""
    target = check_target(out, overwrite)
    text = render(page_data(run, path, source_tokens))
    try:
        target.write_text(text, encoding="utf-8")
    except OSError as err:
        raise ConfigError(
            f"--html {str(out)!r} cannot be written ({err.strerror}): choose a writable folder."
        ) from None
    return target


RUN_PAGE = "plan.html"  # the pipeline's copy in the run folder


def write_run_page(
    run: RunConfig,
    run_dir: str | os.PathLike,
    source_tokens: dict[str, int | None] | None = None,
) -> Path | None:
    """The pipeline's copy, ``run_dir/plan.html`` (its own file, replaced on every run but a
    verified rerun of the same config; a mixture's sizes: ``source_tokens``); a page that
    cannot be built is logged and skipped (None): it never stops a run."""
    try:
        return write_page(
            run, Path(run_dir) / RUN_PAGE, overwrite=True, source_tokens=source_tokens
        )
    except (ConfigError, OSError) as err:
        logging.getLogger(__name__).warning("no plan.html for this run: %s", err)
        return None
