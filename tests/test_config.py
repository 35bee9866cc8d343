"""Every named model composes, builds on meta and is counted; bad values fail in one sentence."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from moe_core.cli import main
from moe_core.compose import DEFAULT_CONFIG_DIR, compose_run
from moe_core.config import ConfigError, ModelConfig, RunConfig
from moe_core.config_dict import from_dict
from moe_core.model import Transformer
from moe_core.model.flops import count
from moe_core.train.trainer import Trainer
from moe_kernels.grouped_gemm import runs_on_device

MODELS = sorted(p.stem for p in (DEFAULT_CONFIG_DIR / "model").glob("*.yaml"))


def test_all_named_sizes_exist():
    families = ["deepseek-v2-lite", "deepseek-v3", "glm-4.5-air", "mixtral-8x7b", "qwen3-30b-a3b"]
    ours = ["1t", "47b", "olmoe-1b-7b", "small-64e", "small-mla", "tiny"]
    assert sorted([*ours, *families]) == MODELS


@pytest.mark.parametrize("name", MODELS)
def test_model_composes_builds_on_meta_and_prints_counts(name, capsys):
    run = compose_run([f"model={name}"])
    assert run.model.name == name
    with torch.device("meta"):
        model = Transformer(run.model)
    counts = count(run.model)
    assert counts.total_params == sum(p.numel() for p in model.parameters())
    assert main(["info", f"model={name}"]) == 0
    out = capsys.readouterr().out
    assert f"{counts.total_params:,}" in out and f"{counts.flops_per_token:,}" in out


def test_olmoe_counts_match_the_published_model_and_peer_flops():
    counts = count(compose_run(["model=olmoe-1b-7b"]).model)
    assert abs(counts.total_params / 6.92e9 - 1) < 0.01  # OLMoE-1B-7B: 6.9B total
    assert abs(counts.active_params / 1.28e9 - 1) < 0.01  # 1.3B active
    assert counts.flops_per_token == 7_865_892_864  # the peer benchmark's figure, same convention


# The families' published sizes (billions, total and active) and what they count: "all", every
# parameter; "no embeddings", without the embedding and the LM head; "no lookup": every parameter
# in the total, the active count without the embedding table (a token reads one row of it).
# Each total is within 0.5 %; each active count within 2 %, as published to two figures (Qwen3's
# 3.35B is given as 3.3B), V2-Lite's within 2.5 % (2.45B here, given as 2.4B).
PUBLISHED = {
    "qwen3-30b-a3b": ("all", 30.5, 3.3),  # Qwen's model card; 29.9B total without embeddings
    "mixtral-8x7b": ("all", 46.7, 12.9),  # Mistral's announcement
    # GLM-4.5's report (Table 1), without its multi-token-prediction layer, which is not built
    "glm-4.5-air": ("no embeddings", 106, 12),
    # DeepSeek-V3's report (671B total, 37B activated), without its multi-token prediction
    "deepseek-v3": ("no lookup", 671, 37),
    "deepseek-v2-lite": ("no lookup", 15.7, 2.4),  # DeepSeek-V2's report
}


@pytest.mark.parametrize("name", PUBLISHED)
def test_named_families_count_their_published_sizes(name):
    convention, total, active = PUBLISHED[name]
    m = compose_run([f"model={name}"]).model
    counts = count(m)
    ends = {"all": 0, "no lookup": 0}.get(convention, 2 * counts.embedding_params)
    lookup = counts.embedding_params if convention == "no lookup" else ends
    assert not m.tie_embeddings
    assert abs((counts.total_params - ends) / (total * 1e9) - 1) < 0.005, counts.total_params
    tolerance = 0.025 if name == "deepseek-v2-lite" else 0.02
    assert abs((counts.active_params - lookup) / (active * 1e9) - 1) < tolerance
    if name == "qwen3-30b-a3b":  # its card gives the count without embeddings too
        no_ends = counts.total_params - 2 * counts.embedding_params
        assert abs(no_ends / 29.9e9 - 1) < 0.005


def test_info_shows_the_block_options_a_model_sets(capsys, monkeypatch):
    """``moe info`` names each block option where it differs from the defaults (OLMoE's block),
    and adds nothing for a model that sets none."""
    from rich.console import Console

    import moe_core.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=400))
    expected = {
        "glm-4.5-air": "head_dim 128, no QK-norm, RoPE on 64 of 128 head dims, biases on q/k/v, "
        "first 1 layer dense (SwiGLU hidden 10944), sigmoid router, top-k weights renormalized, "
        "expert bias (aux-loss-free balancing)",
        "qwen3-30b-a3b": "head_dim 128, QK-norm per head, top-k weights renormalized",
        "mixtral-8x7b": "no QK-norm, top-k weights renormalized",
    }
    for name, options in expected.items():
        assert main(["info", f"model={name}"]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"│ block +│ {re.escape(options)} +│", out), name
    tied = ["model=tiny", "model.tie_embeddings=true", "model.n_expert_groups=2"]
    assert main(["info", *tied, "model.top_k_groups=2", "model.routed_scale=2.5"]) == 0
    out = capsys.readouterr().out
    assert "experts from the best 2 of 2 groups, routed output x 2.5, tied embeddings" in out
    assert main(["info", "model=deepseek-v3", "model.mtp_depth=1"]) == 0
    out = capsys.readouterr().out
    assert "latent attention (q rank 1536, kv rank 512, heads 128 + 64 rotary, v 128)" in out
    assert "YaRN x 40 from 4096" in out and "1 MTP depth (loss weight 0.3, 0.1 from 68% of" in out
    assert main(["info", "model=olmoe-1b-7b"]) == 0
    assert "block" not in capsys.readouterr().out


def test_1t_lands_on_the_reference_size():
    counts = count(compose_run(["model=1t"]).model)
    assert abs(counts.total_params / 1.2e12 - 1) < 0.02, counts.total_params
    assert abs(counts.active_params / 58.36e9 - 1) < 0.02, counts.active_params


def test_flops_follow_the_convention_by_hand():
    cfg = ModelConfig(
        vocab_size=100,
        d_model=16,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        n_experts=4,
        top_k=2,
        expert_hidden=8,
        n_shared_experts=1,
        max_seq_len=32,
    )
    attn = 16 * 16 * 2 + 16 * 8 * 2  # q, o full; k, v one kv head of 8
    experts_active = 2 * 3 * 16 * 8
    shared = 3 * 16 * 8
    head = 100 * 16
    matmul = 2 * (attn + experts_active + shared) + head
    assert count(cfg).flops_per_token == 6 * matmul + 6 * 2 * 32 * 16
    assert count(cfg, seq_len=8).flops_per_token == 6 * matmul + 6 * 2 * 8 * 16


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.top_k=9", "model.top_k=9 is not allowed: at most model.n_experts (8)"),
        ("model.n_heads=5", "model.n_heads=5 is not allowed: it must divide model.d_model (128)"),
        (
            "model.n_kv_heads=3",
            "model.n_kv_heads=3 is not allowed: it must divide model.n_heads (4)",
        ),
        ("model.d_model=0", "model.d_model=0 is not allowed: it must be positive"),
        ("model.expert_hidden=-4", "model.expert_hidden=-4 is not allowed: it must be positive"),
        ("model.router=topk", "model.router='topk' is not allowed: one of 'softmax', 'sigmoid'"),
        ("model.n_layers=two", "model.n_layers='two' is not allowed: an integer"),
        ("+model.n_expert=4", "model.n_expert is not a known option"),
        ("train.seq_len=512", "train.seq_len=512 is not allowed: at most model.max_seq_len (256)"),
        (
            "model=huge",
            "model='huge' is not allowed: one of 1t, 47b, deepseek-v2-lite, deepseek-v3, "
            "glm-4.5-air, mixtral-8x7b, olmoe-1b-7b, qwen3-30b-a3b, small-64e, small-mla, tiny",
        ),
        (
            "precision.optimizer=bf16",
            "precision.optimizer='bf16' is not allowed: fp32 with precision.params=fp32",
        ),
        (
            "precision.params=bf16",
            "precision.compute='fp32' is not allowed: bf16 with precision.params=bf16",
        ),
        (
            "precision.compute=fp16",
            "precision.compute='fp16' is not allowed: one of 'fp32', 'bf16'",
        ),
        ("train.dtype=bf16", "train.dtype='bf16' is not allowed: it moved to precision.compute"),
        (
            "+parallel.param_dtype=bf16",
            "parallel.param_dtype='bf16' is not allowed: it moved to precision.params",
        ),
    ],
)
def test_invalid_values_fail_with_one_sentence(override, message, capsys):
    with pytest.raises(ConfigError) as err:
        compose_run([override])
    text = str(err.value)
    assert message in text and "\n" not in text
    assert main(["info", override]) == 2
    assert message.split(" is ")[0] in capsys.readouterr().out


def test_from_dict_keeps_types_and_defaults():
    run = from_dict(RunConfig, {"model": {"d_model": 64, "n_heads": 4}, "train": {"lr": 1}})
    assert run.model.n_kv_heads == 4 and run.train.lr == 1.0 and isinstance(run.train.lr, float)


def test_missing_config_dir_is_explained(tmp_path: Path):
    with pytest.raises(ConfigError, match=r"has no config\.yaml"):
        compose_run([], tmp_path)


def test_compile_is_on_by_default_on_cuda_only():
    default = compose_run([]).parallel
    assert default.compile is None
    assert default.compile_on("cuda") and not default.compile_on("cpu")
    off = compose_run(["parallel.compile=false"]).parallel
    on = compose_run(["parallel.compile=true"]).parallel
    assert not off.compile_on("cuda") and on.compile_on("cpu")


def test_cuda_graphs_are_on_by_default_in_one_process_and_for_rowwise_ep_on_cuda_only():
    ep = ["parallel.ep=2", "train.micro_batch_size=4"]
    rowwise = compose_run([*ep, "parallel.dispatcher=nvshmem_rowwise"]).parallel
    one = compose_run([]).parallel
    for on in (rowwise, one):
        assert on.cuda_graph_on("cuda") and not on.cuda_graph_on("cpu")
    for other in (ep, ["parallel.dp=2", "train.micro_batch_size=4"], ["parallel.pp=2"]):
        assert not compose_run(other).parallel.cuda_graph_on("cuda"), other
    assert not compose_run(["parallel.cuda_graph=false"]).parallel.cuda_graph_on("cuda")
    assert compose_run(["parallel.cuda_graph=true", "precision=bf16"]).parallel.cuda_graph_on(
        "cuda"
    )


def test_cuda_graphs_stay_off_where_the_experts_read_the_host_and_asking_is_refused():
    # fp32 weights (the default precision) or a GPU before sm90 run the experts' per-group
    # reference loop, which reads the group ends on the host: a graph capture would fail there
    why = "precision.params=fp32 on compute capability 9.0"
    default = compose_run([]).parallel
    assert default.cuda_graph_on("cuda") and not default.cuda_graph_on("cuda", host_reads=why)
    with pytest.raises(ConfigError) as err:
        bf16 = compose_run(["parallel.cuda_graph=true", "precision=bf16"])
        bf16.parallel.cuda_graph_on("cuda", host_reads=why)
    assert str(err.value) == (
        "parallel.cuda_graph=true needs the experts' grouped GEMMs to run without reading the "
        "host (bf16 weights on compute capability 9.0 or newer), and this run has "
        "precision.params=fp32 on compute capability 9.0; set it to false or null."
    )
    # what the config alone tells is refused before any process starts: fp32 weights, and
    # rows no multiple of 8 wide, read the host on every GPU
    with pytest.raises(ConfigError) as err:
        compose_run(["parallel.cuda_graph=true"])
    assert str(err.value) == (
        "parallel.cuda_graph=True is not allowed: false or null with precision.params=fp32 "
        "(the experts' grouped GEMMs run their per-group loop, which reads the host)."
    )
    with pytest.raises(ConfigError) as err:
        compose_run(["parallel.cuda_graph=true", "precision=bf16", "model.expert_hidden=250"])
    assert str(err.value) == (
        "parallel.cuda_graph=True is not allowed: false or null with model.d_model=128 and "
        "model.expert_hidden=250 (the experts' grouped GEMMs run their per-group loop, which "
        "reads the host, unless both are multiples of 8)."
    )
    # on a CPU no grouped product is a GPU kernel
    assert not runs_on_device(torch.device("cpu"), torch.bfloat16)


def test_the_experts_host_reads_name_each_reason_their_grouped_gemms_take_the_loop(monkeypatch):
    # on an sm90 GPU (the capability faked: no GPU here) bf16 experts run grouped kernels, which
    # need 16-byte row strides: a d_model or expert_hidden that is no multiple of 8 (bf16) runs
    # the per-group loop, as fp32 weights do; FP8 experts' weight gradients are bf16 products
    from moe_core.train.trainer import expert_host_reads

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    gpu = torch.device("cuda", 0)
    bf16 = ["model=tiny", "precision=bf16"]
    assert expert_host_reads(compose_run(bf16), gpu) == ""
    assert expert_host_reads(compose_run(bf16), torch.device("cpu")) == ""
    assert expert_host_reads(compose_run(["model=tiny"]), gpu) == (
        "precision.params=fp32 on compute capability 9.0"
    )
    odd = compose_run([*bf16, "model.d_model=100", "model.n_heads=2", "model.n_kv_heads=2"])
    assert expert_host_reads(odd, gpu) == (
        "model.d_model=100 and model.expert_hidden=256, not both multiples of 8 (the grouped "
        "kernels' 16-byte row strides)"
    )
    odd = compose_run([*bf16, "model.expert_hidden=250", "precision.fp8_parts=[experts]"])
    assert "model.expert_hidden=250" in expert_host_reads(odd, gpu)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert expert_host_reads(compose_run(bf16), gpu) == (
        "precision.params=bf16 on compute capability 8.0"
    )


def test_cuda_graphs_asked_for_on_cpu_are_refused_before_training(tmp_path):
    with pytest.raises(ConfigError) as err:
        graphs = ["model=tiny", "precision=bf16", "parallel.cuda_graph=true"]
        Trainer(compose_run([*graphs, f"out_dir={tmp_path}"]))
    assert str(err.value) == (
        "parallel.cuda_graph=true needs CUDA GPUs, and this run is on cpu; set it to false or null."
    )
    assert not (tmp_path / "checkpoints").exists()


def test_precision_presets_set_weights_compute_and_optimizer_state():
    presets = {name: compose_run([f"precision={name}"]) for name in ("fp32", "bf16", "pure-bf16")}
    got = {
        name: (r.precision.params, r.precision.compute, r.precision.optimizer)
        for name, r in presets.items()
    }
    assert got == {
        "fp32": ("fp32", "fp32", "fp32"),
        "bf16": ("bf16", "bf16", "fp32"),
        "pure-bf16": ("bf16", "bf16", "bf16"),
    }


def test_gpu_kernel_libraries_asked_for_without_the_package_or_a_gpu_are_refused(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("the refusals are for machines without a GPU")
    with pytest.raises(ConfigError) as err:
        Trainer(compose_run(["model=tiny", "parallel.expert_gemm=quack", f"out_dir={tmp_path}"]))
    assert str(err.value) == (
        "parallel.expert_gemm='quack' needs quack-kernels (pip install -e '.[gpu]') and a "
        "Hopper or newer GPU, which this cpu run lacks; use 'auto' or 'torch'."
    )
    with pytest.raises(ConfigError) as err:
        Trainer(compose_run(["model=tiny", "parallel.attention=flash4", f"out_dir={tmp_path}"]))
    assert str(err.value) == (
        "parallel.attention='flash4' needs flash-attn-4 (pip install -e '.[gpu]') and a "
        "Hopper or newer GPU, which this cpu run lacks; use 'auto' or 'sdpa'."
    )
    assert not (tmp_path / "checkpoints").exists()
    with pytest.raises(ConfigError, match=r"parallel\.expert_gemm='fast' is not allowed"):
        compose_run(["parallel.expert_gemm=fast"])


def test_gathered_rows_are_refused_where_no_dispatcher_would_gather():
    with pytest.raises(ConfigError) as err:
        compose_run(["parallel.gather_rows=true"])
    assert str(err.value) == (
        "parallel.gather_rows=True is not allowed: false unless parallel.expert_gemm=quack "
        "(QuACK gathers)."
    )
    with pytest.raises(ConfigError, match=r"^parallel\.gather_rows=True is not allowed: false "):
        compose_run(["parallel=ep2", "parallel.expert_gemm=quack", "parallel.gather_rows=true"])
    assert compose_run(["parallel.expert_gemm=quack", "parallel.gather_rows=true"]).parallel


def test_a_token_source_given_to_the_synthetic_data_section_is_refused():
    for key in ("dir", "path", "hub"):
        with pytest.raises(ConfigError) as err:
            compose_run(["model=tiny", f"data.{key}=EMPTY"])
        assert str(err.value) == (
            f"data.{key}='EMPTY' is not allowed with the synthetic data section, which reads no "
            "files: choose token data (data=kjv, data=files or data=hub) to train on them."
        )
    assert compose_run(["data=kjv", "data.dir=somewhere"]).data.dir == "somewhere"


def test_no_group_yaml_repeats_a_dataclass_default():
    """A YAML lists only what it changes (defaults live in the dataclasses). A key may equal its
    default only where it must be present: the option's ``name``, a key another YAML
    interpolates (``${model.vocab_size}``), or one clearing what the file it extends sets."""

    import yaml

    from moe_core.compose import DEFAULT_CONFIG_DIR
    from moe_core.config import RunConfig
    from moe_core.config_dict import to_dict

    defaults = to_dict(RunConfig())
    conf = DEFAULT_CONFIG_DIR
    texts = "\n".join(p.read_text() for p in conf.rglob("*.yaml"))
    interpolated = set(re.findall(r"\$\{(\w+\.\w+)\}", texts))
    repeated = []
    for group in defaults:
        if not isinstance(defaults[group], dict) or not (conf / group).is_dir():
            continue
        for path in sorted((conf / group).glob("*.yaml")):
            data = yaml.safe_load(path.read_text()) or {}
            parents = [
                yaml.safe_load((conf / group / f"{p}.yaml").read_text()) or {}
                for p in data.get("defaults", [])
                if p != "_self_"
            ]
            # a default of None that validation derives from other fields (model.head_dim,
            # n_kv_heads) is its own: a value there is not the derived one repeated
            declared = {f.name: f.default for f in dataclasses.fields(getattr(RunConfig(), group))}
            for key, value in data.items():
                if key in ("defaults", "name") or key not in defaults[group]:
                    continue
                default = None if declared.get(key, 0) is None else defaults[group][key]
                if value != default or f"{group}.{key}" in interpolated:
                    continue
                if any(key in parent and parent[key] != value for parent in parents):
                    continue
                repeated.append(f"{path.relative_to(conf)}: {key}")
    assert not repeated, f"these repeat the dataclass default; delete them: {repeated}"


def test_hub_data_without_a_dataset_name_is_refused():
    """files.yaml once set ``hub: null``, which OmegaConf let win over hub.yaml's mandatory
    ``???``: ``data=hub`` then composed with no dataset at all."""
    from moe_core.compose import compose_run
    from moe_core.config import ConfigError

    with pytest.raises(ConfigError, match=r"^data\.hub has no value: give one as an override"):
        compose_run(["data=hub"])
    assert compose_run(["data=hub", "data.hub=org/corpus"]).data.hub == "org/corpus"


def test_dtype_names_are_the_keys_of_the_one_dtype_map():
    from typing import get_args

    from moe_core.config import Dtype
    from moe_core.model.dtypes import DTYPES

    assert sorted(get_args(Dtype)) == sorted(DTYPES)


def test_old_precision_keys_in_a_saved_config_are_refused_naming_the_new_key(tmp_path, capsys):
    """``moe train --config`` of a resolved JSON written before the precision section."""
    import json

    from moe_core.config_dict import MOVED_TO_PRECISION

    for old, new in MOVED_TO_PRECISION.items():
        section, key = old.split(".")
        value = ["experts"] if key == "fp8_parts" else "mx" if key == "fp8_scaling" else "bf16"
        with pytest.raises(ConfigError) as err:
            from_dict(RunConfig, {section: {key: value}})
        assert str(err.value).startswith(f"{old}={value!r} is not allowed: it moved to {new} ")
    saved = tmp_path / "run.json"
    saved.write_text(json.dumps({"model": {"name": "tiny"}, "train": {"dtype": "bf16"}}))
    assert main(["train", "--config", str(saved)]) == 2
    assert "train.dtype='bf16' is not allowed: it moved to precision.compute" in " ".join(
        capsys.readouterr().out.split()
    )


def test_checkpoints_written_before_the_precision_section_still_read(monkeypatch):
    """A checkpoint's trainer state holds the config of the run that wrote it; old runs kept
    precision in train and parallel (``upgrade_saved`` moves it), new ones read unchanged."""
    import moe_core.convert.checkpoint as ckpt
    from moe_core.config import PrecisionConfig
    from moe_core.config_dict import to_dict

    new = to_dict(compose_run(["model=tiny", "precision=mxfp8"]))
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in new.items()}
    del old["precision"]
    old["train"] |= {"dtype": "bf16", "optimizer_dtype": "bf16"}
    old["parallel"] |= {"param_dtype": "bf16", "fp8_parts": ["experts"], "fp8_scaling": "mx"}
    for saved in (old, new):
        monkeypatch.setattr(ckpt, "trainer_state", lambda path, saved=saved: {"config": saved})
        run = ckpt.checkpoint_config("step_00000001")
        assert run.precision == PrecisionConfig("bf16", "bf16", "bf16", ["experts"], "mx")
        assert to_dict(run) == new


def test_data_dir_defaults_to_out_dir_data_in_one_place():
    """The dataclasses set data.dir's default (``<out_dir>/data``); no YAML restates it."""
    from moe_core.compose import compose_dict

    for data in (["data=kjv"], ["data=kjv-gpt2"], ["data=files", "data.path=x"], []):
        assert "dir" not in (compose_dict(data).get("data") or {})
    assert compose_run(["data=kjv", "out_dir=elsewhere"]).data.dir == "elsewhere/data"


def test_deepseek_v3_with_its_mtp_depth_counts_what_its_checkpoint_holds():
    """DeepSeek-V3's checkpoint holds 685B parameters: the 671B model and its 14B MTP layer,
    which keeps copies of the embedding and LM head. Ours shares those (one MTP depth adds
    11.6B), and its export writes the copies: 684.5B on disk, within 0.5 %."""
    import math

    from moe_core.convert.families import DEEPSEEK_V3
    from moe_core.convert.hf import hf_items

    m = compose_run(["model=deepseek-v3", "model.mtp_depth=1"]).model
    with_mtp, without = count(m).total_params, count(compose_run(["model=deepseek-v3"]).model)
    on_disk = sum(math.prod(item.shape) for item in hf_items(DEEPSEEK_V3, m))
    copies = 2 * without.embedding_params
    bias = (58 + 1) * 256  # each MoE block's expert bias: a buffer here, a tensor on disk
    assert on_disk == with_mtp + copies + bias
    assert abs(on_disk / 685e9 - 1) < 0.005, on_disk
    assert abs((with_mtp - without.total_params + copies) / 14e9 - 1) < 0.05
