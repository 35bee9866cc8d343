"""``moe plan --html``: the page's numbers against the planner's on a grid of models x GPU types
x layouts (the page's own script and data, run by QuickJS), the calibration, and the
refusals of a bad output path."""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import json
import math
import random
import re
import shutil
from pathlib import Path

import pytest
from rich.console import Console

import moe_core.cli as cli
from moe_core.compose import compose_run
from moe_core.config import ConfigError, ModelConfig, ParallelConfig
from moe_core.config_dict import from_dict, to_dict
from moe_core.hardware import GPUS, MEASURED
from moe_core.plan import fit_refusal, max_in_flight, plan, step_time
from moe_core.planpage import (
    CUSTOM_MODEL,
    TOUR,
    evaluate,
    model_data,
    page_data,
    render,
    write_run_page,
)

ROOT = Path(__file__).resolve().parent.parent
CUSTOM = ["model=small-64e", "model.n_layers=8", "model.d_model=768", "model.n_heads=12"]
CUSTOM += ["cluster=local-gpu", "cluster.procs_per_node=1", "cluster.gpus_per_node=1"]
CUSTOM += ["precision.compute=bf16"]  # autocast over fp32 weights: no preset, the page adds it
AUTOCAST = "fp32 weights, bf16 compute, fp32 state"


def one_sentence(message: str) -> bool:
    return message.endswith(".") and not re.search(r"[.!?]\s+[A-Z]", message)


def page_scripts(page: str) -> tuple[dict, str]:
    """The data and the planner script the page runs, cut out of the written HTML."""
    data = re.search(r'<script id="plan-data" type="application/json">(.*?)</script>', page, re.S)
    scripts = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert data is not None and len(scripts) == 2
    return json.loads(data.group(1)), scripts[0]


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> str:
    """The page ``moe plan --html`` writes for a custom-sized model (it joins conf/model's)."""
    out = tmp_path_factory.mktemp("page") / "plan.html"
    assert cli.main(["plan", *CUSTOM, "--html", str(out)]) == 0
    return out.read_text()


def page_engine(page: str):
    """A JavaScript engine (QuickJS, the ``test`` extra) holding the page's data and planner."""
    quickjs = pytest.importorskip("quickjs", reason="quickjs is not installed (the test extra)")
    data, planner = page_scripts(page)
    js = quickjs.Context()
    js.eval(planner)
    js.eval(f"var DATA = {json.dumps(data)};")
    return js


def run_planner(page: str, layouts: list[dict]) -> list[dict]:
    """``planLayout`` of the page on each layout, as the browser runs it."""
    js = page_engine(page)
    script = f"JSON.stringify({json.dumps(layouts)}.map((L) => planLayout(DATA, L)))"
    return json.loads(js.eval(script))


def layout(**kw) -> dict:
    base = dict(
        gpu="H200",
        nodes=1,
        gpus_per_node=1,
        pp=1,
        dp=1,
        ep=1,
        cp=1,
        virtual_stages=1,
        recompute="none",
        dispatcher="all_to_all",
        precision="fp32",
        micro_batch_size=1,
        global_batch_size=2,
        seq_len=128,
    )
    return {**base, **kw}


# Valid for some models and refused for others (layers, experts, sequence length), plus
# refusals of their own: a cluster of the wrong size, batches that do not divide.
LAYOUTS = [
    layout(),
    layout(gpus_per_node=8, dp=4, ep=2, precision="bf16", recompute="selective",
           micro_batch_size=2, global_batch_size=32, seq_len=256),
    layout(gpus_per_node=8, ep=8, dispatcher="nvshmem_rowwise", precision="pure-bf16",
           global_batch_size=16, seq_len=256),
    layout(nodes=2, gpus_per_node=8, pp=2, dp=2, ep=4, recompute="block", precision="bf16",
           global_batch_size=64),
    layout(gpus_per_node=8, pp=4, virtual_stages=2, ep=2, precision="bf16", global_batch_size=16),
    layout(nodes=64, gpus_per_node=8, pp=8, dp=4, ep=16, recompute="block", precision="bf16",
           global_batch_size=128, seq_len=512),
    layout(nodes=2, gpus_per_node=1, ep=2, dispatcher="nvshmem_rowwise", recompute="selective",
           precision="bf16", micro_batch_size=2, global_batch_size=8, seq_len=1024),
    layout(nodes=2, gpus_per_node=8, dp=8),  # the cluster starts 16, the layout needs 8
    layout(nodes=2, gpus_per_node=1, pp=2, virtual_stages=2, global_batch_size=3),
    layout(micro_batch_size=3, global_batch_size=8),
    layout(virtual_stages=2),  # interleaving needs two stages
    layout(gpus_per_node=4, dp=2, ep=2, precision=AUTOCAST, global_batch_size=8, seq_len=256),
    layout(gpus_per_node=8, ep=8, precision="fp8", global_batch_size=16, seq_len=256),
    # FP8 experts on one EP rank quantize in the permute: no rows in kept (under EP they are)
    layout(precision="fp8", micro_batch_size=2, global_batch_size=4, seq_len=256),
    # one GPU, one micro-batch: autograd's gradients beyond the activations (short and long)
    layout(precision="pure-bf16", micro_batch_size=2, global_batch_size=2, seq_len=128),
    layout(precision="pure-bf16", micro_batch_size=4, global_batch_size=4, seq_len=1024),
    layout(nodes=2, gpus_per_node=1, pp=2, precision="bf16", global_batch_size=1),
    # context parallelism: with EP and DP over two nodes, alone with selective recompute (latent
    # attention keeps nothing gathered), with block recompute; refused with pipeline stages, at
    # a sequence 2 x cp does not divide, on a cluster sized without it
    layout(nodes=2, gpus_per_node=8, dp=2, cp=2, ep=4, precision="bf16", global_batch_size=16,
           seq_len=1024),
    layout(gpus_per_node=4, cp=4, recompute="selective", precision="pure-bf16", seq_len=2048),
    layout(gpus_per_node=8, cp=2, ep=4, recompute="block", precision="bf16", seq_len=4096,
           micro_batch_size=2, global_batch_size=8),
    layout(gpus_per_node=4, pp=2, cp=2, precision="bf16"),
    layout(nodes=3, gpus_per_node=1, cp=3),
    layout(gpus_per_node=8, dp=2, cp=2, global_batch_size=4),
]  # fmt: skip


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1.0)


@pytest.mark.slow
def test_page_numbers_are_the_planners_on_a_grid(page: str):
    """Models (conf/model and the custom size) x GPU types x layouts: the same refusal sentence,
    or the same memory by part, communication, step time, tokens/s and MFU."""
    data, _ = page_scripts(page)
    assert "small-64e (custom)" in data["models"]
    grid = [
        {**lay, "model": model, "gpu": gpu}
        for model, gpu, lay in itertools.product(data["models"], GPUS, LAYOUTS)
    ]
    page_results = run_planner(page, grid)
    pairs = zip(grid, page_results, strict=True)
    sized = [same_plan(mine, evaluate(lay, data), lay) for lay, mine in pairs]
    # the grid holds both: layouts the planner sizes, and layouts the config refuses
    numbers, refusals = sum(sized), len(sized) - sum(sized)
    assert numbers >= 60 and refusals >= 60, (numbers, refusals)
    # context-parallel layouts among the sized ones (their K/V exchange and gathered keys)
    with_cp = sum(ok for lay, ok in zip(grid, sized, strict=True) if lay["cp"] > 1)
    assert with_cp >= 10, with_cp


def same_plan(mine: dict, ref: dict, lay: dict) -> bool:
    """Assert the page's ``planLayout`` result is ``evaluate``'s; True where it sized the layout."""
    assert mine["refusal"] == ref["refusal"], lay
    if "memory" not in ref:
        assert "memory" not in mine, lay
        return False
    assert mine["memory"].keys() == ref["memory"].keys()
    for part, value in ref["memory"].items():
        assert close(mine["memory"][part], value), (lay, part)
    assert close(mine["total"], ref["total"]) and mine["busiest_stage"] == ref["busiest_stage"]
    assert all(close(a, b) for a, b in zip(mine["stages"], ref["stages"], strict=True))
    for kind, value in ref["comm"].items():
        assert close(mine["comm"][kind], value), (lay, kind)
    for which in ("reach", "plain"):  # bounds and flags exactly, expected rows to rounding
        same_numbers(mine[which], ref[which], f"{lay} {which}")
    for name, value in ref["time"].items():
        assert math.isclose(mine["time"][name], value, rel_tol=1e-9, abs_tol=1e-15), name
    assert mine["micro_batches"] == ref["micro_batches"]
    return True


SIZES = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "n_experts"]
SIZES += ["top_k", "expert_hidden", "n_shared_experts", "n_dense_layers", "dense_hidden"]
SIZES += ["max_seq_len"]


def sizes(vocab, d, layers, heads, kv, experts, top_k, hidden, shared=0, seq=4096, **more) -> dict:
    """Typed sizes; ``more``: head_dim, n_dense_layers, dense_hidden (else empty: d_model /
    n_heads, no dense blocks)."""
    assert set(more) <= set(SIZES)
    typed = dict(
        vocab_size=vocab, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
        head_dim=None, n_experts=experts, top_k=top_k, expert_hidden=hidden,
        n_shared_experts=shared, n_dense_layers=0, dense_hidden=None, max_seq_len=seq,
    )  # fmt: skip
    assert list(typed) == SIZES
    return {**typed, **more}


# Shapes the named models do not have: grouped-query attention, shared experts, every expert
# active, one expert, odd vocabularies, a max_seq_len between the page's sequence lengths.
SHAPES = [
    sizes(50257, 2048, 16, 16, 4, 64, 8, 1024),
    sizes(32001, 512, 4, 8, None, 8, 8, 256, shared=2, seq=1000),
    sizes(1001, 64, 2, 4, 1, 1, 1, 96, shared=1, seq=128),
    sizes(100352, 4096, 3, 32, 8, 256, 8, 1536, shared=1),
    sizes(7, 12, 1, 2, 2, 6, 4, 10, seq=300),
    sizes(999, 16, 1, 2, 1, 240, 100, 8),  # q below 2^-60 for some splits, 0 for others
]


# Block options the typed sizes keep from the model they start from, with the sizes that meet
# them: a head_dim of its own, QK-norm per head or none, partial RoPE, biases, leading dense
# blocks, expert groups, a sigmoid router, tied embeddings.
OPTIONS = [
    {**sizes(50257, 512, 4, 8, 2, 16, 4, 128, head_dim=96), "qk_norm": "head"},
    {**sizes(32000, 256, 3, 4, 2, 8, 2, 512), "qk_norm": "none", "tie_embeddings": True},
    {
        **sizes(151552, 512, 5, 12, 4, 32, 8, 64, shared=1, head_dim=64, n_dense_layers=2,
                dense_hidden=1000),
        **{"qk_norm": "none", "rotary_fraction": 0.5, "attention_bias": "qkv"},
        **{"router": "sigmoid", "normalize_top_k": True, "expert_bias": True},
    },
    {
        **sizes(1000, 128, 2, 4, 4, 16, 4, 32, n_dense_layers=1, dense_hidden=48),
        **{"attention_bias": "qkvo", "n_expert_groups": 4, "top_k_groups": 2},
        "tie_embeddings": True,
    },
    {**sizes(1000, 128, 2, 4, 4, 16, 4, 32, shared=1), "mtp_depth": 2},
]  # fmt: skip


# Group-limited routing: DeepSeek-V3's routing (256 experts, 8 groups, top-4 groups, top-8) at
# a small width, and groups that nest in no expert split of theirs (6 and 4 experts over ranks
# of 4, 3, 2 and 8, 5, 2), or only in some (groups of 6 over 48 experts), many groups kept.
GROUPED = [
    {**sizes(1000, 64, 2, 4, 4, 256, 8, 32), "n_expert_groups": 8, "top_k_groups": 4},
    {**sizes(1000, 64, 2, 4, 4, 12, 2, 32), "n_expert_groups": 2, "top_k_groups": 1},
    {**sizes(1000, 64, 2, 4, 4, 40, 5, 32), "n_expert_groups": 10, "top_k_groups": 3},
    {**sizes(1000, 64, 2, 4, 4, 48, 6, 32), "n_expert_groups": 8, "top_k_groups": 2},
    {**sizes(1000, 64, 2, 4, 4, 96, 40, 32), "n_expert_groups": 16, "top_k_groups": 12},
]  # fmt: skip


def random_shapes(n: int, seed: int = 20) -> list[dict]:
    """Small valid sizes (few layers: each is built on the meta device several times)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        heads = rng.choice([1, 2, 3, 4, 6, 8, 12])
        kv = rng.choice([None, *(k for k in range(1, heads + 1) if heads % k == 0)])
        experts = rng.randint(1, 48)
        out.append(
            sizes(rng.randint(2, 5000) | 1, heads * rng.choice([2, 4, 6, 8, 16, 24]),
                  rng.randint(1, 3), heads, kv, experts, rng.randint(1, experts),
                  rng.randint(1, 200), rng.choice([0, 0, 1, 2]),
                  rng.choice([64, 128, 200, 512, 1024, 4096]))
        )  # fmt: skip
    return out


def same_numbers(mine, ref, where: str = "") -> None:
    """Equal structures: integers exactly, floats within rounding."""
    if isinstance(ref, dict):
        assert isinstance(mine, dict) and mine.keys() == ref.keys(), where
        for key in ref:
            same_numbers(mine[key], ref[key], f"{where}.{key}")
    elif isinstance(ref, float) or isinstance(mine, float):
        assert math.isclose(mine, ref, rel_tol=1e-12, abs_tol=1e-15), (where, mine, ref)
    else:
        assert type(mine) is type(ref) and mine == ref, (where, mine, ref)


def custom_configs(data: dict, shapes: list[dict]) -> list[dict]:
    """Whole model configs as the page builds them: a named model's fields, typed sizes over
    (its head_dim, d_model / n_heads, is seeded empty: it follows the typed sizes)."""
    base = {**data["models"]["tiny"]["config"], "name": "custom", "head_dim": None}
    return [{**base, **s} for s in shapes]


def test_custom_sizes_give_model_datas_numbers(page: str):
    """The page's ``modelData`` of typed sizes is ``planpage.model_data``: parameter counts by
    place, total/active parameters, FLOPs per token per sequence length, activation bytes per
    precision and recompute, all-to-all rows per expert split; named models and varied shapes."""
    data, _ = page_scripts(page)
    js = page_engine(page)
    named = [m["config"] for m in data["models"].values()]
    typed = custom_configs(data, SHAPES + random_shapes(16) + OPTIONS + GROUPED)
    configs = named + typed
    script = f"JSON.stringify({json.dumps(configs)}.map((c) => modelData(DATA, c)))"
    got = json.loads(js.eval(script))
    expected = list(data["models"].values()) + [
        json.loads(
            json.dumps(model_data(from_dict(ModelConfig, c), data["precisions"], data["seq_lens"]))
        )
        for c in typed
    ]
    assert len(got) == len(expected) == len(data["models"]) + 22 + len(OPTIONS) + len(GROUPED)
    for config, mine, ref in zip(configs, got, expected, strict=True):
        same_numbers(mine, ref, json.dumps({k: config[k] for k in SIZES}))
    # a grouped-query shape, a shared expert and every expert active are in the grid
    assert any(c["n_kv_heads"] and c["n_kv_heads"] < c["n_heads"] for c in configs)
    assert any(c["n_shared_experts"] for c in configs)
    assert any(c["top_k"] == c["n_experts"] > 1 for c in configs)
    # and each block option: typed (head_dim, dense blocks) or kept from the model (the rest)
    assert {c["qk_norm"] for c in typed} == {"projection", "head", "none"}
    assert {c["attention_bias"] for c in typed} == {"none", "qkv", "qkvo"}
    for option in ("head_dim", "n_dense_layers", "tie_embeddings", "mtp_depth"):
        assert any(c[option] for c in typed), option
    assert any(c["rotary_fraction"] < 1 for c in typed)
    assert any(c["n_expert_groups"] > 1 for c in typed)
    assert {c["name"] for c in named} >= {"qwen3-30b-a3b", "mixtral-8x7b", "glm-4.5-air"}


def test_custom_sizes_start_as_the_model_picked_before(page: str):
    """page.js's ``seed`` (on picking custom sizes) then ``readCustom`` (on every input) give
    back the model picked before, its block options kept: its model data, and so its plan,
    are the named model's. head_dim shows empty where it is d_model / n_heads."""
    data, _ = page_scripts(page)
    js = page_engine(page)
    source = (ROOT / "moe_core" / "planpage" / "page.js").read_text()
    js.eval("const inputs = {}; const $ = (id) => inputs[id] || (inputs[id] = {dataset: {}});")
    for name in ("seed", "readCustom"):  # the two functions alone (the page runs its DOM)
        js.eval(re.search(rf"^function {name}\(.*?^}}$", source, re.S | re.M).group(0))
    assert json.loads(js.eval("JSON.stringify(MODEL_SIZES)")) == SIZES  # the dataclass's order
    for name, model in data["models"].items():
        config = model["config"]
        js.eval(f"seed({json.dumps(config)});")
        shown = json.loads(js.eval("JSON.stringify(MODEL_SIZES.map((k) => $(`m-${k}`).value))"))
        own_head_dim = config["head_dim"] * config["n_heads"] != config["d_model"]
        assert (shown[SIZES.index("head_dim")] != "") == own_head_dim, name
        again = json.loads(js.eval("JSON.stringify(modelData(DATA, readCustom()))"))
        same_numbers(again, {**model, "config": {**config, "name": "custom"}}, name)


BAD_SIZES = [
    {"d_model": ""},  # an emptied field
    {"n_layers": 2.5},
    {"vocab_size": 0},
    {"expert_hidden": -3},
    {"max_seq_len": 0},
    {"n_shared_experts": -1},
    {"n_kv_heads": 0},
    {"n_experts": 4, "top_k": 5},
    {"d_model": 96, "n_heads": 5},
    {"n_heads": 4, "n_kv_heads": 3},
    {"d_model": 12, "n_heads": 4},  # head_dim 3: odd, no rotary embedding
    {"top_k": 0, "d_model": 7},  # the first failing check wins, as in Python
    {"head_dim": 3},  # a head_dim of its own, odd
    {"head_dim": 6, "rotary_fraction": 0.5},  # 3 rotated dimensions
    {"head_dim": "x"},
    {"n_heads": 5000, "n_kv_heads": 1, "head_dim": 2},  # no real model has that many
    {"vocab_size": 2**33},
    {"n_dense_layers": -1},
    {"n_dense_layers": 4},  # every block dense
    {"n_dense_layers": 1},  # dense_hidden missing
    {"dense_hidden": 64},  # without dense blocks
    {"n_dense_layers": 1, "dense_hidden": 0},
    {"n_experts": 6, "n_expert_groups": 4},
    {"n_experts": 4, "top_k": 1, "n_expert_groups": 4},  # one expert per group
    {"n_expert_groups": 2, "top_k_groups": 3},
    {"top_k": 4, "n_expert_groups": 4, "top_k_groups": 1},  # 4 of the one group's 2
    {},
    {"n_kv_heads": None},
    {"d_model": 96, "n_heads": 5, "n_kv_heads": None, "head_dim": 16},  # need not divide
    {"n_dense_layers": 1, "dense_hidden": 48},
]
ACCEPTED_SIZES = 4  # the last four


def test_custom_sizes_are_refused_as_the_config_refuses(page: str):
    """Typed sizes the config refuses: the page shows ``ModelConfig``'s own sentence (the first
    check that fails), and none for sizes it accepts."""
    data, _ = page_scripts(page)
    js = page_engine(page)
    configs = custom_configs(data, BAD_SIZES)
    got = json.loads(
        js.eval(f"JSON.stringify({json.dumps(configs)}.map((c) => modelRefusal(DATA, c)))")
    )
    refused = 0
    for config, mine in zip(configs, got, strict=True):
        try:
            from_dict(ModelConfig, config, prefix="model.")
            expected = None
        except ConfigError as err:
            expected = str(err)
            refused += 1
            assert one_sentence(mine) and mine.startswith("model.")
        assert mine == expected, config
    assert refused == len(BAD_SIZES) - ACCEPTED_SIZES
    # counts past 2^53 - 1: refused in one sentence, not rounded
    huge = custom_configs(data, [sizes(262144, 65536, 512, 512, None, 4096, 8, 65536)])[0]
    small = custom_configs(data, SHAPES[:1])[0]
    big, fine = json.loads(
        js.eval(f"JSON.stringify([{json.dumps(huge)}, {json.dumps(small)}].map("
                "(c) => countRefusal(modelData(DATA, c))))")
    )  # fmt: skip
    assert fine is None and one_sentence(big) and "2^53 - 1" in big
    assert big.startswith("the custom model's total parameters, ")


def test_custom_sizes_plan_as_moe_plan(page: str):
    """A layout of typed sizes: the page's model data through ``planLayout`` against the Python
    planner on the same config."""
    data, _ = page_scripts(page)
    js = page_engine(page)
    config = custom_configs(data, [sizes(50257, 1536, 8, 12, 4, 32, 4, 768, shared=1)])[0]
    m = from_dict(ModelConfig, config)
    ref_data = {**data, "models": {**data["models"], CUSTOM_MODEL: {}}}
    ref_data["models"][CUSTOM_MODEL] = model_data(m, data["precisions"], data["seq_lens"])
    assert data["custom_model"] == CUSTOM_MODEL and CUSTOM_MODEL not in data["models"]
    grid = [{**lay, "model": CUSTOM_MODEL, "gpu": gpu} for gpu in GPUS for lay in LAYOUTS]
    mine = json.loads(
        js.eval(
            f"const C = {json.dumps(config)};"
            f"const D = {{...DATA, models: {{...DATA.models, [{json.dumps(CUSTOM_MODEL)}]: "
            "modelData(DATA, C)}};"
            f"JSON.stringify({json.dumps(grid)}.map((L) => planLayout(D, L)))"
        )
    )
    sized = [same_plan(r, evaluate(lay, ref_data), lay) for lay, r in zip(grid, mine, strict=True)]
    assert sum(sized) >= 16 and not all(sized)
    assert to_dict(m)["n_kv_heads"] == 4


FAMILIES = ("qwen3-30b-a3b", "mixtral-8x7b", "glm-4.5-air")
# Layouts these sizes meet: one node with experts split, two stages (GLM's dense block on the
# first), interleaved chunks, a refused pipeline, and the grid's own.
FAMILY_LAYOUTS = [
    layout(gpus_per_node=8, ep=8, precision="bf16", global_batch_size=16, seq_len=256),
    layout(nodes=2, gpus_per_node=8, pp=2, ep=8, precision="bf16", global_batch_size=16),
    layout(nodes=2, gpus_per_node=8, pp=2, ep=8, precision="bf16", recompute="block",
           global_batch_size=16),
    layout(nodes=2, gpus_per_node=1, pp=2, virtual_stages=2, global_batch_size=4),
    layout(nodes=4, gpus_per_node=1, pp=4, global_batch_size=4),
    *LAYOUTS[:4],
]  # fmt: skip


def test_block_options_plan_on_the_page_as_in_python(page: str):
    """The named families (a leading dense block, a head_dim of its own, partial RoPE, biases,
    no QK-norm) and what no named model has (a tied head; dense blocks over interleaved chunks;
    FP8 parts those options refuse) through the page's ``planLayout`` against ``evaluate``:
    the same refusal sentences, or the same bytes per stage and traffic."""
    data, _ = page_scripts(page)
    fp8 = data["precisions"]["fp8"]
    for part in ("attention", "dense", "lm_head"):
        data["precisions"][f"fp8 {part}"] = {**fp8, "fp8_parts": ["experts", part]}
    tiny = from_dict(ModelConfig, data["models"]["tiny"]["config"])
    models = {name: from_dict(ModelConfig, data["models"][name]["config"]) for name in FAMILIES}
    models["tiny-tied"] = dataclasses.replace(tiny, name="tiny-tied", tie_embeddings=True)
    models["tiny-dense"] = dataclasses.replace(  # 3 dense blocks over chunks of 2
        tiny, name="tiny-dense", n_layers=8, n_dense_layers=3, dense_hidden=200, vocab_size=1001
    )
    models["tiny-mtp"] = dataclasses.replace(tiny, name="tiny-mtp", mtp_depth=2)
    for name, m in models.items():  # again: with the FP8 precisions added
        data["models"][name] = model_data(m, data["precisions"], data["seq_lens"])
    grid = [
        {**lay, "model": name, "precision": precision}
        for name in models
        for precision in ("bf16", "fp8 attention", "fp8 dense", "fp8 lm_head")
        for lay in FAMILY_LAYOUTS
    ]
    js = page_engine(page)
    js.eval(f"DATA = {json.dumps(data)};")
    mine = json.loads(
        js.eval(f"JSON.stringify({json.dumps(grid)}.map((L) => planLayout(DATA, L)))")
    )
    refs = [evaluate(lay, data) for lay in grid]
    sized = [same_plan(r, ref, lay) for lay, r, ref in zip(grid, mine, refs, strict=True)]
    assert sum(sized) >= 40 and len(sized) - sum(sized) >= 40, sum(sized)
    refusals = "\n".join(ref["refusal"] for ref in refs if "memory" not in ref)
    for reason in (
        "model.tie_embeddings=true with parallel.pp=2 is not built yet",  # a tied head
        "a list without 'lm_head' when model.tie_embeddings=true",
        "a list without 'attention' when model.attention_bias='qkv'",  # GLM's biases
        "a list without 'dense' when model.n_shared_experts=0 and model.n_dense_layers=0",
        "part 'lm_head' runs lm_head, a [1001, 128] weight",  # FP8 GEMMs' alignment
        "part 'dense' runs w_gate, a [200, 128] weight",
    ):
        assert reason in refusals, reason
    # sized: GLM's dense block on the first of two stages, dense blocks in interleaved chunks
    held = {
        (lay["model"], lay["pp"], lay["virtual_stages"])
        for lay, z in zip(grid, sized, strict=True)
        if z
    }
    assert {("glm-4.5-air", 2, 1), ("tiny-dense", 2, 2), ("tiny-dense", 4, 1)} <= held
    assert {("tiny-mtp", 1, 1), ("tiny-mtp", 2, 2)} <= held  # MTP on the last stage


def grouped_layouts(experts: int) -> list[dict]:
    """Every expert split of ``experts`` up to 64 ranks, on nodes of 1, 2, 4 and 8 GPUs."""
    return [
        layout(nodes=-(-ep // per_node), gpus_per_node=per_node, ep=ep, precision="bf16",
               global_batch_size=max(ep, per_node))
        for ep in range(1, 65)
        if experts % ep == 0
        for per_node in (1, 2, 4, 8)
        if ep % per_node == 0 or ep < per_node
    ]  # fmt: skip


def test_group_limited_routing_plans_on_the_page_as_moe_plan(page: str):
    """Models with expert groups (nesting in the ranks and nodes or not) on every expert split
    and node size: the page's bound on ranks and nodes, its expected rows (to other ranks,
    across nodes, other nodes reached) for the model and for plain top-k, and the all-to-all
    bytes are ``evaluate``'s; DeepSeek-V3's routing at EP 64 on 8 nodes reaches 4 nodes."""
    data, _ = page_scripts(page)
    js = page_engine(page)
    models = {}
    for i, config in enumerate(custom_configs(data, GROUPED)):
        m = from_dict(ModelConfig, {**config, "name": f"grouped-{i}"})
        models[m.name] = model_data(m, data["precisions"], data["seq_lens"])
    data["models"].update(models)
    js.eval(f"DATA = {json.dumps(data)};")
    grid = [
        {**lay, "model": name}
        for name, md in models.items()
        for lay in grouped_layouts(md["config"]["n_experts"])
    ]
    mine = json.loads(
        js.eval(f"JSON.stringify({json.dumps(grid)}.map((L) => planLayout(DATA, L)))")
    )
    refs = [evaluate(lay, data) for lay in grid]
    sized = [same_plan(r, ref, lay) for lay, r, ref in zip(grid, mine, refs, strict=True)]
    assert sum(sized) >= 60, sum(sized)
    seen = [ref for ref in refs if "reach" in ref]
    assert any(not r["reach"]["nests_ranks"] for r in seen)  # the layouts that do not nest
    assert any(r["reach"]["rows_per_token"] < r["plain"]["rows_per_token"] for r in seen)
    deepseek = [
        r["reach"] for lay, r in zip(grid, refs, strict=True)
        if lay["model"] == "grouped-0" and lay["ep"] == 64 and lay["gpus_per_node"] == 8
    ]  # fmt: skip
    assert [(r["nodes"], r["max_nodes"]) for r in deepseek] == [(8, 4)]


def test_fp8_dispatch_rows_plan_as_moe_plan(tmp_path):
    """A run sending FP8 token rows (precision.fp8_parts 'dispatch'): its precision joins the
    page, whose planner refuses it where Python does (one rank: no rows travel) and otherwise
    gives Python's numbers, fewer all-to-all bytes than bf16 rows, and over the rowwise
    dispatcher a routing row one scale wider."""
    out = tmp_path / "plan.html"
    run = ["precision=fp8", "precision.fp8_parts=[experts,dispatch]", "parallel.ep=2"]
    run += ["cluster=local-gpu", "cluster.procs_per_node=2", "cluster.gpus_per_node=2"]
    assert cli.main(["plan", *run, "train.global_batch_size=32", "--html", str(out)]) == 0
    page = out.read_text()
    data, _ = page_scripts(page)
    names = [n for n, p in data["precisions"].items() if "dispatch" in p["fp8_parts"]]
    assert len(names) == 1
    keys = list(itertools.product(range(len(LAYOUTS)), (names[0], "fp8"), ("olmoe-1b-7b", "tiny")))
    grid = [{**LAYOUTS[i], "precision": p, "model": m, "gpu": "H200"} for i, p, m in keys]
    mine = run_planner(page, grid)
    refs = dict(zip(keys, (evaluate(lay, data) for lay in grid), strict=True))
    sized = [same_plan(r, refs[k], lay) for k, lay, r in zip(keys, grid, mine, strict=True)]
    assert sum(sized) >= 8 and not all(sized)
    refusals = [r["refusal"] or "" for r in refs.values()]
    assert any(r.startswith("precision.fp8_parts=['experts', 'dispatch'] is not") for r in refusals)
    rowwise = [
        (refs[(i, names[0], m)], refs[(i, "fp8", m)])
        for i, p, m in keys
        if p == "fp8" and grid[keys.index((i, p, m))]["dispatcher"] == "nvshmem_rowwise"
    ]
    planned = [(a, b) for a, b in rowwise if not a["refusal"] and not b["refusal"]]
    assert planned, "no rowwise layout plans with FP8 rows"
    for fp8_rows, bf16_rows in planned:  # the scale column: 4 bytes a buffer row
        extra = fp8_rows["memory"]["ep_buffers"] - bf16_rows["memory"]["ep_buffers"]
        assert extra > 0 and extra % 4 == 0
    # FP8 rows against bf16 rows, the same layout and model, where rows travel
    fewer = [
        refs[(i, names[0], m)]["comm"]["all_to_all"] < refs[(i, "fp8", m)]["comm"]["all_to_all"]
        for i, p, m in keys
        if p == "fp8" and refs[(i, names[0], m)].get("comm")
    ]
    assert fewer and all(fewer)


def test_a_conf_model_named_as_the_custom_choice_is_refused(tmp_path):
    """A model file that would hide the page's typed sizes stops the page in one sentence."""
    conf = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", conf)
    shutil.copy(conf / "model" / "tiny.yaml", conf / "model" / f"{CUSTOM_MODEL}.yaml")
    with pytest.raises(ConfigError) as err:
        page_data(compose_run([], conf), conf)
    message = str(err.value)
    assert message.startswith(f"conf/model/{CUSTOM_MODEL}.yaml is not allowed")
    assert one_sentence(message)


def test_page_in_flight_is_the_schedules(page: str):
    """The pipeline's in-flight micro-batches: the page's closed form against the schedule the
    runner executes, for 1F1B and interleaved 1F1B."""
    js = page_engine(page)
    cases = [
        (pp, v, s, n)
        for pp in (1, 2, 3, 4, 8)
        for v in ((1, 2, 3) if pp > 1 else (1,))
        for s in range(pp)
        for n in (1, 2, 3, 4, 8, 16)
        if v == 1 or n % pp == 0
    ]
    got = json.loads(js.eval(f"JSON.stringify({json.dumps(cases)}.map((c) => inFlight(...c)))"))
    expected = [
        max_in_flight(
            ParallelConfig(
                pp=pp, virtual_stages=v, pp_schedule="interleaved_1f1b" if v > 1 else "1f1b"
            ),
            s,
            n,
        )
        for pp, v, s, n in cases
    ]
    assert got == expected


def test_page_is_self_contained_and_starts_at_the_run(page: str):
    data, _ = page_scripts(page)
    assert not re.search(r"""(src|href)\s*=|https?://|@import|url\(""", page)
    run = compose_run(CUSTOM)
    start = data["initial"]
    assert start["model"] == "small-64e (custom)" and start["precision"] == AUTOCAST
    assert data["models"][start["model"]]["config"]["d_model"] == 768
    assert evaluate(start, data)["total"] == plan(run).memory.total
    # the tour: one GPU -> data -> expert -> pipeline -> 1t on 512 GPUs
    world = [t["layout"]["pp"] * t["layout"]["dp"] * t["layout"]["ep"] for t in data["tour"]]
    assert world == [1, 8, 8, 64, 512]
    assert [t["layout"]["model"] for t in data["tour"]][-1] == "1t"
    # presets compare as whole precision sections: pure-bf16 is not taken for fp8 (same dtypes)
    assert [t["layout"]["precision"] for t in data["tour"]][:2] == ["pure-bf16", "bf16"]
    assert all(evaluate(t["layout"], data)["refusal"] is None for t in data["tour"])


def names_python(dotted: str) -> bool:
    """Whether ``dotted`` (from the top, from ``moe_core``, its ``model`` package or
    ``moe_core.config``) names a module of ours or an attribute of one."""
    for prefix in ("", "moe_core.", "moe_core.model.", "moe_core.config."):
        parts = f"{prefix}{dotted}".split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            try:
                for attr in parts[cut:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            return True
    return False


def test_planner_js_names_python_that_exists():
    """planner.js says which Python function each part mirrors: every module path and dotted
    name in its comments still exists (a function that moves takes its comments along)."""
    source = (ROOT / "moe_core" / "planpage" / "planner.js").read_text()
    comments = "\n".join(re.findall(r"//(.*)", source))
    paths = set(re.findall(r"\b(?:moe_core|tests)/[\w/.]*\w", comments))
    dotted = {
        name
        for name in re.findall(r"\b[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+", comments)
        if not name.endswith((".py", ".js")) and name != "e.g"
    }
    assert dotted and paths  # the comments were read
    assert [p for p in sorted(paths) if not (ROOT / p).exists()] == []
    assert [name for name in sorted(dotted) if not names_python(name)] == []


def test_calibration_is_the_measured_h200_run():
    """The compute rate is the JSON's figure, and a one-GPU layout predicts exactly it."""
    result = json.loads((ROOT / MEASURED.source).read_text())
    assert result["gpu"] == f"NVIDIA {MEASURED.gpu}"
    assert MEASURED.model_tflops == pytest.approx(result["trainer_tflops"], abs=0.005)
    assert MEASURED.peak_gib == pytest.approx(result["trainer"]["peak_mem_gib"], abs=0.005)
    assert (result["layers"], result["seq"], result["mbs"]) == (16, 4096, 4)
    assert result["precision"] == "pure-bf16"  # the tour's first step, below
    run = compose_run(TOUR[0][3])  # the tour's first step: the measured layout
    t = step_time(plan(run))
    assert t.bubble == 0 and t.all_to_all == t.reduce_scatter == t.pipeline == 0
    assert t.tokens_per_s_per_gpu * plan(run).flops_per_token / 1e12 == pytest.approx(
        MEASURED.model_tflops
    )


def test_gpu_memory_decides_the_refusal():
    """pp8-dp8-ep8 for 1t: refused on a 141 GiB H200 in one sentence, fits a 288 GiB B300."""
    run = compose_run(["parallel=pp8-dp8-ep8"], config_name="pretrain-1t")
    p = plan(run)
    message = fit_refusal(p)
    assert message is not None and one_sentence(message)
    assert f"needs {p.per_gpu_gib:.1f} GiB per GPU but a H200 has 141 GiB" in message
    run.cluster.gpu_type, run.cluster.gpu_memory_gib = "B300", GPUS["B300"].memory_gib
    assert fit_refusal(plan(run)) is None


def test_step_time_needs_a_known_gpu():
    p = plan(compose_run([]))  # local CPU processes: no GPU type
    with pytest.raises(ConfigError) as err:
        step_time(p)
    message = str(err.value)
    assert message.startswith("cluster.gpu_type='none' is not allowed") and one_sentence(message)
    assert "H100, H200, B200, B300" in message
    assert step_time(p, GPUS["H100"]).step > step_time(p, GPUS["B200"]).step  # faster peak


def test_all_to_all_time_follows_the_links():
    """ep 16 across two nodes sends half its all-to-all over the NIC: slower than ep 8."""
    inside = compose_run(["parallel=pp8-dp8-ep8"], config_name="pretrain-1t")
    across = compose_run([], config_name="pretrain-1t")
    a, b = plan(inside), plan(across)
    t_in, t_across = step_time(a), step_time(b)
    gpu = GPUS["H200"]
    assert t_in.all_to_all == pytest.approx(a.comm.all_to_all / (gpu.nvlink_gb_s * 1e9))
    share = 8 / 15  # ranks of the 16 on the other node
    assert t_across.all_to_all == pytest.approx(
        b.comm.all_to_all * share / (gpu.network_gb_s * 1e9)
    )


@pytest.mark.slow
def test_html_refuses_an_existing_file_and_overwrites_on_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))
    out = tmp_path / "mine.html"
    out.write_text("my notes")
    assert cli.main(["plan", "--html", str(out)]) == 2
    message = capsys.readouterr().out.strip()  # the sentence alone: refused before the table
    assert message.startswith("error: --html") and "exists already" in message
    assert "--overwrite" in message and one_sentence(message)
    assert out.read_text() == "my notes"
    assert cli.main(["plan", "--html", str(out), "--overwrite"]) == 0
    assert "plan-data" in out.read_text()


@pytest.mark.parametrize(
    "name, expected",
    [("no-such-dir/p.html", "does not exist"), ("p.txt", "ending in .html"), ("d.html", "is a")],
)
def test_html_refuses_a_bad_path_in_one_sentence(name, expected, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))
    (tmp_path / "d.html").mkdir()
    assert cli.main(["plan", "--html", str(tmp_path / name)]) == 2
    message = capsys.readouterr().out.strip()
    assert message.startswith("error: --html") and expected in message and one_sentence(message)
    assert name in message


def test_html_refuses_an_unwritable_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "console", Console(width=300))

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "write_text", refuse)
    assert cli.main(["plan", "--html", str(tmp_path / "p.html")]) == 2
    message = capsys.readouterr().out.strip().splitlines()[-1]
    assert "cannot be written (Permission denied)" in message and one_sentence(message)


def test_html_refuses_an_unknown_model(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli, "console", Console(width=300))
    assert cli.main(["plan", "model=2t", "--html", str(tmp_path / "p.html")]) == 2
    message = capsys.readouterr().out.strip()
    assert message.startswith("error: model='2t' is not allowed: one of 1t, 47b")
    assert not (tmp_path / "p.html").exists()


def test_page_data_cannot_close_its_script(page: str):
    """Text in the data (a model name, the tour) never ends the script element holding it."""
    data, _ = page_scripts(page)
    data["tour"][0]["text"] = "</script><script>alert(1)</script><!--"
    written = render(data)
    again, _ = page_scripts(written)
    assert again == data and written.count("</script>") == 3


def test_run_page_is_replaced_and_never_stops_a_run(tmp_path, monkeypatch, caplog):
    """The pipeline's plan.html: written (and rewritten) in the run directory; without a conf/
    folder to read models from, a warning and no page instead of an error."""
    import moe_core.compose

    run = compose_run([])
    (tmp_path / "plan.html").write_text("an older run's page")
    assert write_run_page(run, tmp_path) == tmp_path / "plan.html"
    assert "plan-data" in (tmp_path / "plan.html").read_text()
    monkeypatch.setattr(moe_core.compose, "DEFAULT_CONFIG_DIR", tmp_path / "no-conf")
    (tmp_path / "other").mkdir()
    assert write_run_page(run, tmp_path / "other") is None
    assert not (tmp_path / "other" / "plan.html").exists()
    assert "no plan.html for this run: config directory" in caplog.text


def test_config_and_page_refuse_a_grid_of_layouts_with_the_same_rule_table(page: str):
    """``config.RULES`` read by both sides: on a grid of layouts built to break each row, the
    page's ``configRefusal`` gives the sentence config validation raises (or none where it
    accepts), and every row of the table is met."""
    from moe_core.config import RULES
    from moe_core.planpage import run_of

    data, _ = page_scripts(page)
    assert data["rules"] == [dataclasses.asdict(r) for r in RULES]
    dispatch = {**data["precisions"]["fp8"], "fp8_parts": ["experts", "dispatch"]}
    data["precisions"]["fp8 dispatch"] = dispatch  # no preset sends FP8 rows
    grid = [
        {**layout(), "model": model, **kw}
        for model in ("small-64e", "olmoe-1b-7b")
        for kw in (
            {},
            {"global_batch_size": 3, "micro_batch_size": 2},
            {"virtual_stages": 2},
            {"seq_len": 8192},
            {"ep": 3, "gpus_per_node": 1, "nodes": 3, "global_batch_size": 3},
            {"pp": 3, "nodes": 3, "global_batch_size": 2},
            {"dp": 2, "gpus_per_node": 2, "global_batch_size": 3, "micro_batch_size": 1},
            {"pp": 2, "virtual_stages": 2, "nodes": 2, "global_batch_size": 3},
            {"precision": "fp8 dispatch", "ep": 1},
            {
                "precision": "fp8 dispatch",
                "ep": 2,
                "gpus_per_node": 2,
                "dispatcher": "nvshmem_rowwise",
            },
            {"ep": 2, "gpus_per_node": 2, "dispatcher": "nvshmem_rowwise", "precision": "bf16"},
            {"pp": 2, "cp": 2, "nodes": 4},
            {"cp": 3, "nodes": 3},
            {"cp": 2, "nodes": 2, "seq_len": 1024},
        )
    ]
    mtp = {**data["models"]["small-64e"]["config"], "mtp_depth": 1}  # no conf/model has MTP
    data["models"]["mtp"] = {"config": mtp}
    grid += [{**layout(), "model": "mtp", "cp": cp, "nodes": cp} for cp in (1, 2)]
    js = page_engine(page)
    js.eval(f"DATA.precisions['fp8 dispatch'] = {json.dumps(dispatch)};")
    js.eval(f"DATA.models.mtp = {{config: {json.dumps(mtp)}}};")
    script = (
        f"JSON.stringify({json.dumps(grid)}.map((L) => configRefusal("
        "DATA.models[L.model].config, L, DATA.precisions[L.precision], DATA.rules, "
        "DATA.constants)))"
    )
    mine = json.loads(js.eval(script))
    met = set()
    for lay, got in zip(grid, mine, strict=True):
        try:
            run_of(lay, data)
            want = None
        except ConfigError as err:
            want = str(err)
        if got is None:  # the page checks the cluster's size after config (check_cluster)
            assert want is None, lay
        else:
            assert got == want, lay
        for i, r in enumerate(RULES):
            pattern = re.sub(r"\\\{.*?\\\}", ".*", re.escape(r.sentence or r.allowed))
            if got is not None and re.search(pattern, got):
                met.add(i)
    # the page sets train.eval_batches to dp x ep (run_of): the one row it never trips
    untripped = {i for i, r in enumerate(RULES) if r.field == "train.eval_batches"}
    assert met == set(range(len(RULES))) - untripped, met
