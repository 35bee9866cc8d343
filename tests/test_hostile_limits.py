"""Issue 35, the second hostile pass: sizes that cannot be real, runs larger than the machine and
data that does not fit the run are refused in one sentence before anything large is built."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from helpers import BASE, write_token_dir

from moe_core.cli import main
from moe_core.compose import DEFAULT_CONFIG_DIR, compose_run
from moe_core.config import ModelConfig
from moe_core.model.flops import ModelCounts, count
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, Router
from moe_core.model.norm import RMSNorm
from moe_core.model.transformer import Transformer
from moe_core.plan import InsufficientResourcesError, check_conversion, check_memory, plan
from moe_core.plan.report import plan_text

MODELS = sorted(p.stem for p in (DEFAULT_CONFIG_DIR / "model").glob("*.yaml"))


def meta_count(cfg: ModelConfig, seq_len: int) -> ModelCounts:
    """The counts read off a meta-device model (what ``count`` did before its closed form)."""
    with on_meta():
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters()
    )
    embedding = model.embed.weight.numel()
    active = total - experts * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    not_matmul = embedding + sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, RMSNorm | Router)
        for p in m.parameters()
    )
    not_matmul += sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias"))
    matmul = active - not_matmul + (embedding if cfg.tie_embeddings else 0)  # a tied head
    matmul += cfg.mtp_depth * cfg.vocab_size * cfg.d_model  # each MTP depth's pass through it
    blocks = cfg.n_layers + cfg.mtp_depth
    # causal attention over the query/key heads and the value heads (latent attention's are
    # narrower: its module's v_dim)
    attn = model.layers["0"].attn
    v_width = getattr(attn, "v_dim", cfg.head_dim)
    flops = 6 * matmul + 3 * blocks * seq_len * cfg.n_heads * (cfg.head_dim + v_width)
    return ModelCounts(total, active, matmul, experts, embedding, flops)


@pytest.mark.parametrize("name", MODELS)
def test_closed_form_counts_equal_the_meta_model_of_each_named_model(name):
    m = compose_run([f"model={name}"]).model
    assert count(m, 128) == meta_count(m, 128)


@pytest.mark.parametrize(
    "changes",
    [
        {"n_kv_heads": 1, "n_shared_experts": 2},
        {"n_experts": 3, "top_k": 3, "n_layers": 1, "vocab_size": 7},
        {"d_model": 96, "n_heads": 3, "n_kv_heads": 3, "expert_hidden": 40},
        {"head_dim": 24, "n_kv_heads": 2, "qk_norm": "head", "attention_bias": "qkvo"},
        {"qk_norm": "none", "attention_bias": "qkv", "rotary_fraction": 0.5},
        {"n_dense_layers": 1, "dense_hidden": 48, "n_shared_experts": 1, "tie_embeddings": True},
        {"n_expert_groups": 4, "top_k_groups": 2, "router": "sigmoid", "expert_bias": True},
        {"mtp_depth": 2, "n_shared_experts": 1},
        {"mtp_depth": 1, "n_dense_layers": 1, "dense_hidden": 48, "tie_embeddings": True},
        {"qk_norm": "none", "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
        | {"v_head_dim": 16},
        {"qk_norm": "none", "kv_lora_rank": 8, "q_lora_rank": 12, "qk_rope_head_dim": 4}
        | {"qk_nope_head_dim": 12, "v_head_dim": 20, "mtp_depth": 1},
    ],
)
def test_closed_form_counts_equal_the_meta_model_of_odd_shapes(changes):
    base = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_experts=8, top_k=2, expert_hidden=32)
    m = dataclasses.replace(base, **changes)
    assert count(m, 32) == meta_count(m, 32)


# ---- sizes that cannot be real -------------------------------------------------------------


@pytest.mark.parametrize(
    "override, value",
    [("model.n_layers", 100_000_000), ("model.n_experts", 10**9), ("train.seed", 2**70)],
)
def test_sizes_and_seeds_no_run_can_hold_are_refused_naming_the_limit(override, value, capsys):
    assert main(["info", "model=tiny", f"{override}={value}"]) == 2
    err = capsys.readouterr().out
    assert f"{override}={value}" in err and "at most" in err and "Traceback" not in err


def test_info_counts_a_huge_model_without_building_it(capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("moe info built a model")

    monkeypatch.setattr(Transformer, "__init__", refuse)
    assert main(["info", "model=1t", "model.n_layers=4096", "model.n_experts=65536"]) == 0
    assert "total parameters" in capsys.readouterr().out


def no_model(monkeypatch) -> None:
    """Building any model but the planner's one block (on the meta device) fails the test."""
    build = Transformer.__init__

    def one_layer_only(self, cfg):
        assert cfg.n_layers == 1, "a model was built"
        build(self, cfg)

    monkeypatch.setattr(Transformer, "__init__", one_layer_only)


def hf_folder(path: Path, **sizes: int) -> Path:
    """An HF OLMoE folder: the tiny model's config.json with ``sizes`` changed, no weights."""
    config = {
        "model_type": "olmoe",
        "vocab_size": 64,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "intermediate_size": 16,
        **sizes,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize(
    "key, value, field",
    [("num_experts", 10**9, "model.n_experts"), ("num_hidden_layers", 10**8, "model.n_layers")],
)
def test_from_hf_refuses_sizes_no_model_has_before_reading(key, value, field, tmp_path, capsys):
    src = hf_folder(tmp_path / "hf", **{key: value})
    assert main(["convert", "from-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().out
    assert f"{field}={value}" in err and "at most" in err
    assert not (tmp_path / "out").exists()


def test_conversion_larger_than_memory_or_disk_is_refused_before_reading(tmp_path):
    src = hf_folder(tmp_path / "hf")
    (src / "model.safetensors").write_bytes(b"\0" * 1000)
    with pytest.raises(InsufficientResourcesError, match=r"2,000 bytes .* has 1,500 bytes"):
        check_conversion(src, tmp_path / "out", 500, memory=1500, disk=10**9)
    with pytest.raises(InsufficientResourcesError, match=r"1,000 bytes .* has 999 bytes"):
        check_conversion(src, tmp_path / "out", 500, memory=10**9, disk=999)
    check_conversion(src, tmp_path / "out", 500, memory=2000, disk=1000)
    assert not (tmp_path / "out").exists()


def test_from_hf_refuses_a_config_its_weight_files_cannot_hold(tmp_path, capsys):
    # Within every limit, yet 4096 x 65536 experts: checking their tensors one by one took
    # minutes; the files' size (a few bytes) answers at once.
    src = hf_folder(tmp_path / "hf", num_hidden_layers=4096, num_experts=65536)
    (src / "model.safetensors").write_bytes(b"\0" * 1000)
    assert main(["convert", "from-hf", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert f"{src / 'config.json'} describes " in err and "hold 1,000 bytes" in err
    assert not (tmp_path / "out").exists()


# ---- runs larger than the machine ----------------------------------------------------------


def test_memory_check_takes_the_machines_memory_as_a_value():
    run = compose_run(["model=tiny"])
    need = sum(s.total for s in plan(run).stages)
    check_memory(run, host_bytes=need, gpu_bytes=None)
    with pytest.raises(InsufficientResourcesError, match=rf"needs {need:,} bytes .* has 1,000 "):
        check_memory(run, host_bytes=1000, gpu_bytes=None)
    gpus = f"cluster.gpus_per_node={run.cluster.procs_per_node}"
    on_gpu = plan(compose_run(["model=tiny", gpus])).memory.total
    with pytest.raises(InsufficientResourcesError, match=rf"needs {on_gpu:,} bytes .* per GPU"):
        check_memory(run, host_bytes=10**15, gpu_bytes=1000)
    check_memory(run, host_bytes=1000, gpu_bytes=on_gpu)  # a GPU run holds its model there
    # every process of this host counts: at CP=2 two ranks each hold the whole model
    cp2 = compose_run(["model=tiny", "parallel.cp=2", "cluster.procs_per_node=2"])
    need = 2 * sum(s.total for s in plan(cp2).stages)
    check_memory(cp2, host_bytes=need, gpu_bytes=None)
    layout = rf"pp 1 x dp 1 x cp 2 x ep 1 needs {need:,}"
    with pytest.raises(InsufficientResourcesError, match=layout):
        check_memory(cp2, host_bytes=need - 1, gpu_bytes=None)


def test_async_saves_host_copy_counts_against_the_hosts_memory():
    # background saves keep each rank's checkpoint bytes in host memory for the run's life
    run = compose_run(["model=tiny", "train.async_checkpoint=true"])
    p = plan(run)
    staged = p.checkpoint.staged_per_node
    assert staged == p.checkpoint.per_node > 0
    assert plan(compose_run(["model=tiny"])).checkpoint.staged_per_node == 0
    need = sum(s.total for s in p.stages) + staged
    check_memory(run, host_bytes=need, gpu_bytes=None)
    with pytest.raises(InsufficientResourcesError, match="with the host copy async saves keep"):
        check_memory(run, host_bytes=need - 1, gpu_bytes=None)
    # on GPUs the copy is pinned: at most three quarters of the host's memory
    gpus = f"cluster.gpus_per_node={run.cluster.procs_per_node}"
    on_gpu = plan(compose_run(["model=tiny", gpus])).memory.total
    check_memory(run, host_bytes=staged * 4 // 3 + 3, gpu_bytes=on_gpu)
    with pytest.raises(InsufficientResourcesError) as err:
        check_memory(run, host_bytes=staged, gpu_bytes=on_gpu)
    assert str(err.value) == (
        "train.async_checkpoint=true keeps a pinned host copy of every rank's checkpoint, "
        f"{staged:,} bytes ({staged / 2**30:,.1f} GiB) on this node, more than three quarters "
        f"of its {staged:,} bytes ({staged / 2**30:,.1f} GiB) of memory: set "
        "train.async_checkpoint=false or spread the run over more nodes."
    )
    assert "async saves keep a host copy of" in plan_text(p)


def test_train_refuses_a_model_larger_than_this_machine_before_building_it(
    tmp_path, capsys, monkeypatch
):
    no_model(monkeypatch)
    out = tmp_path / "run"
    assert main(["train", "model=1t", f"out_dir={out}"]) == 2
    err = capsys.readouterr().out
    assert "model 1t" in err and "bytes" in err and "GiB" in err and "Traceback" not in err
    assert not out.exists()


# ---- data and overrides that do not fit the run --------------------------------------------


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
    }


def token_data(tmp_path: Path, vocab_size: int = 256, seed: int = 0) -> Path:
    """4000 train and 700 validation tokens below 256, the manifest recording ``vocab_size``."""
    rng = np.random.default_rng(seed)
    splits = {s: rng.integers(0, 256, n) for s, n in (("train", 4000), ("validation", 700))}
    return write_token_dir(tmp_path / "data", splits, 1000, dtype="uint16", vocab_size=vocab_size)


def token_run(data: Path, out: Path, *extra: str) -> list[str]:
    return [
        *BASE,
        "model.n_layers=2",
        "data.kind=tokens",
        f"data.dir={data}",
        f"out_dir={out}",
        *extra,
    ]


@pytest.mark.parametrize(
    "override, sentence",
    [
        (
            "train.lr=é",
            "Hydra takes a value with spaces or non-ASCII letters only in quotes, as "
            "in train.lr='é'.",
        ),
        ("é=1", "its key 'é' is not allowed, Hydra takes keys of ASCII letters"),
    ],
)
def test_unquoted_unicode_in_an_override_is_one_sentence_naming_it(override, sentence, capsys):
    assert main(["info", "model=tiny", override]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert f"the override '{override}' does not parse" in err and sentence in err
    assert "LexerNoViableAlt" not in err


@pytest.mark.parametrize(
    "drop, named",
    [
        (("splits",), "lacks splits (a mapping)"),
        (("tokenizer", "vocab_size"), "lacks tokenizer.vocab_size (an integer)"),
        (("splits", "validation", "tokens"), "lacks splits.validation.tokens (an integer)"),
        (("splits", "train", "shards", 0, "file"), "lacks splits.train.shards[0].file (a string)"),
    ],
)
def test_a_manifest_missing_keys_is_refused_naming_the_key(drop, named, tmp_path, capsys):
    data = token_data(tmp_path)
    manifest = json.loads((data / "manifest.json").read_text())
    inner = manifest
    for key in drop[:-1]:
        inner = inner[key]
    del inner[drop[-1]]
    (data / "manifest.json").write_text(json.dumps(manifest))
    before = snapshot(data)
    out = tmp_path / "run"
    assert main(["train", *token_run(data, out)]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert f"{data / 'manifest.json'} {named}, so it is not a manifest moe tokenize wrote" in err
    assert snapshot(data) == before and not out.exists()


def test_a_manifest_vocabulary_beyond_the_model_names_the_models_size(
    tmp_path, capsys, monkeypatch
):
    data = token_data(tmp_path, vocab_size=8192)  # model=tiny has 4096; data.* says nothing
    no_model(monkeypatch)
    out = tmp_path / "run"
    assert main(["train", *token_run(data, out)]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert "model.vocab_size=4096 is not allowed: at least the 8192 tokens of the tokenizer " in err
    assert str(data / "manifest.json") in err and "bpe_vocab_size" not in err
    assert not out.exists()


def test_eval_batches_beyond_the_validation_split_are_refused_before_step_0(
    tmp_path, capsys, monkeypatch
):
    data = token_data(tmp_path)  # 700 // 33 = 21 validation sequences: 10 micro-batches of 2
    no_model(monkeypatch)
    out = tmp_path / "run"
    args = ["train", *token_run(data, out, "train.eval_every=1", "train.eval_batches=11")]
    assert main(args) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert "train.eval_batches=11 is not allowed: at most 10, the micro-batches of" in err
    assert str(data / "manifest.json") in err and not out.exists()


@pytest.mark.slow
def test_resuming_into_another_seq_len_or_data_is_refused_and_keeps_the_checkpoint(
    tmp_path, capsys
):
    data = token_data(tmp_path)
    out = tmp_path / "run"
    assert main(["train", *token_run(data, out, "train.steps=2")]) == 0
    before = snapshot(out)
    capsys.readouterr()
    assert main(["train", *token_run(data, out, "train.steps=4", "train.seq_len=16")]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert (
        "was trained on other data or another sequence length (seq_len is 32 there, 16 here)" in err
    )
    (tmp_path / "other").mkdir()
    other = token_data(tmp_path / "other", seed=1)
    assert main(["train", *token_run(other, out, "train.steps=4")]) == 2
    err = capsys.readouterr().out.replace("\n", "")
    assert "(the data manifest's sha256 is " in err and "Traceback" not in err
    assert snapshot(out) == before


def test_a_cpu_pipeline_refuses_a_model_larger_than_this_machine_before_launching():
    from flows.launch import check_launchable

    class Launcher:
        @staticmethod
        def check(run):
            raise AssertionError("the launch was prepared")

    run = compose_run(["model=1t", "cluster=local-cpu", "cluster.procs_per_node=1"])
    with pytest.raises(InsufficientResourcesError, match=r"model 1t .* of memory on this machine"):
        check_launchable(run, Launcher, logging.getLogger("test"))
