"""Export to Hugging Face OLMoE: same logits through transformers, exact round trip, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import small_config

from moe_core.config import ConfigError
from moe_core.convert.hf import INDEX, load_hf, save_hf
from moe_core.convert.native import load_model_dir, save_model_dir
from moe_core.model import build_model

CONFIGS = {
    "mha-top1": dict(n_heads=4, n_kv_heads=4, n_experts=4, top_k=1),
    "gqa-top2-normalized": dict(
        n_heads=8, n_kv_heads=2, n_experts=8, top_k=2, normalize_top_k=True
    ),
    "gqa-top8": dict(
        d_model=96,
        n_heads=6,
        n_kv_heads=3,
        n_experts=16,
        top_k=8,
        expert_hidden=48,
        n_layers=3,
        rope_theta=500000.0,
        norm_eps=1e-6,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformers_logits_match_and_round_trip_is_exact(name, tmp_path):
    from transformers import OlmoeForCausalLM

    cfg = small_config(**CONFIGS[name])
    model = build_model(cfg, seed=11).eval()
    with torch.no_grad():  # non-trivial norm weights, so a swapped norm would show
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    out = save_hf(model.state_dict(), cfg, tmp_path / "hf", max_shard_bytes=150_000)

    index = json.loads((out / INDEX).read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1, "the test should exercise sharding"
    assert all((out / s).is_file() for s in shards)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in index["weight_map"]

    hf = OlmoeForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, cfg.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, _ = model(tokens)
        theirs = hf(tokens).logits
    err = (ours - theirs).abs().max().item()
    assert err < 1e-4, f"max |logit difference| {err:.2e}"

    cfg_back, state_back = load_hf(out)
    assert cfg_back == cfg
    original = model.state_dict()
    assert set(state_back) == set(original)
    for key, t in original.items():
        assert torch.equal(state_back[key], t), key


def test_bf16_export_round_trips_bit_exactly(tmp_path):
    cfg = small_config()
    state = {k: v.to(torch.bfloat16) for k, v in build_model(cfg, seed=1).state_dict().items()}
    out = save_hf(state, cfg, tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    _, back = load_hf(out)
    assert all(
        torch.equal(back[k], v) and back[k].dtype == torch.bfloat16 for k, v in state.items()
    )


@pytest.mark.parametrize(
    "override, field",
    [
        (dict(n_shared_experts=1), "model.n_shared_experts"),
        (dict(router="sigmoid"), "model.router"),
        (dict(expert_bias=True), "model.expert_bias"),
    ],
)
def test_export_refuses_what_olmoe_cannot_express(override, field, tmp_path):
    cfg = small_config(**override)
    state = build_model(cfg).state_dict()
    with pytest.raises(ConfigError, match=field):
        save_hf(state, cfg, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    cfg = small_config()
    state = build_model(cfg).state_dict()
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(FileExistsError):
        save_hf(state, cfg, out)
    assert (out / "keep.txt").read_text() == "precious"
    save_hf(state, cfg, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / INDEX).is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "no temporary folders left behind"


def test_an_overwritten_model_folder_keeps_no_file_of_an_hf_export_it_replaces(tmp_path):
    """from-hf --overwrite onto an HF export: a shard and index left beside the new weights
    would make ``load_model`` read the old model, silently."""
    from moe_core.convert.load import load_model

    cfg = small_config()
    old, new = build_model(cfg, seed=1).state_dict(), build_model(cfg, seed=2).state_dict()
    out = save_hf(old, cfg, tmp_path / "out")
    save_model_dir(new, cfg, out, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors", "moe_core_config.json"]
    assert torch.equal(load_model(out).embed.weight, new["embed.weight"])


def test_overwriting_an_out_that_is_a_symlink_replaces_the_link_and_says_it_wrote(tmp_path):
    """The link is replaced, never followed (the folder it led to is left as it was), and the
    finished export is not reported as a failed write."""
    cfg = small_config()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "theirs.txt").write_text("theirs")
    (tmp_path / "hf").symlink_to(tmp_path / "elsewhere")
    out = save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "hf", overwrite=True)
    assert not out.is_symlink() and (out / INDEX).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "hf"]
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["theirs.txt"]


def test_tokenizer_files_are_copied(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "unrelated.bin").write_text("x")
    cfg = small_config()
    out = save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "hf", tokenizer_dir=tok)
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not (out / "unrelated.bin").exists()


def test_cli_converts_both_ways(tmp_path):
    from moe_core.cli import main

    cfg = small_config()
    state = build_model(cfg, seed=5).state_dict()
    save_model_dir(state, cfg, tmp_path / "ours")
    assert (
        main(
            [
                "convert",
                "to-hf",
                str(tmp_path / "ours"),
                str(tmp_path / "hf"),
                "--max-shard-size",
                "100KB",
                "--no-tokenizer",
            ]
        )
        == 0
    )
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    assert main(["convert", "from-hf", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    cfg_back, state_back = load_model_dir(tmp_path / "back")
    assert cfg_back == cfg and all(torch.equal(state_back[k], v) for k, v in state.items())
    hf = str(tmp_path / "hf")
    assert main(["convert", "to-hf", str(tmp_path / "ours"), hf, "--no-tokenizer"]) == 2


def test_dtype_is_honoured_for_a_model_folder_and_refused_for_from_hf(tmp_path, capsys):
    """--dtype bf16 of a model folder wrote fp32 weights, silently; from-hf ignored it."""
    from safetensors import safe_open

    from moe_core.cli import main

    cfg = small_config()
    ours = save_model_dir(build_model(cfg, seed=5).state_dict(), cfg, tmp_path / "ours")
    hf = tmp_path / "hf"
    assert main(["convert", "to-hf", str(ours), str(hf), "--no-tokenizer", "--dtype", "bf16"]) == 0
    with safe_open(str(next(hf.glob("model-*.safetensors"))), "pt") as f:
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16
    assert main(["convert", "from-hf", str(hf), str(tmp_path / "back"), "--dtype", "fp32"]) == 2
    printed = capsys.readouterr().out.replace("\n", "")
    assert "--dtype is an option of moe convert to-hf only" in printed
    assert not (tmp_path / "back").exists()


def test_a_checkpoint_is_exported_in_shards_of_the_size_asked(tmp_path):
    """--max-shard-size holds for a training checkpoint as for a model folder."""
    from moe_core.cli import main
    from moe_core.config import RunConfig, TrainConfig
    from moe_core.train.init import write_initial_checkpoint

    run = RunConfig(model=small_config(), train=TrainConfig(seq_len=32), out_dir=str(tmp_path))
    step = write_initial_checkpoint(run, tmp_path / "checkpoints")
    argv = ["convert", "to-hf", str(step), str(tmp_path / "hf"), "--no-tokenizer"]
    assert main([*argv, "--max-shard-size", "100KB"]) == 0
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1


def _train_one_step(out, extra):
    from helpers import BASE

    from moe_core.compose import compose_run
    from moe_core.train.trainer import Trainer

    args = [*BASE, "train.steps=1", "train.checkpoint_every=1", f"out_dir={out}", *extra]
    Trainer(compose_run(args)).fit(show_progress=False)
    return out / "checkpoints" / "step_00000001"


@pytest.mark.slow
def test_to_hf_takes_the_runs_own_tokenizer_and_refuses_where_there_is_none(tmp_path, capsys):
    """Without --tokenizer, the tokenizer files come from the data folder the run trained on
    (found through its checkpoint, from the checkpoint or the model folder beside it); a run on
    synthetic tokens has none, which is said in one sentence (and --no-tokenizer writes the
    weights alone)."""
    import numpy as np
    from helpers import write_token_dir

    from moe_core.cli import main

    data = write_token_dir(
        tmp_path / "data",
        {"train": np.arange(4000) % 4000, "validation": np.arange(600) % 4000},
        shard_tokens=1 << 12,
        vocab_size=4096,
    )
    ckpt = _train_one_step(tmp_path / "run", ["data.kind=tokens", f"data.dir={data}"])
    for src in (ckpt, tmp_path / "run" / "model"):
        out = tmp_path / f"hf-{src.name}"
        assert main(["convert", "to-hf", str(src), str(out)]) == 0
        assert (out / "tokenizer.json").read_bytes() == (data / "tokenizer.json").read_bytes()

    synthetic = _train_one_step(tmp_path / "synthetic", [])
    capsys.readouterr()
    assert main(["convert", "to-hf", str(synthetic), str(tmp_path / "none")]) == 2
    said = capsys.readouterr().out
    assert "trained on synthetic tokens, which have no tokenizer: give --tokenizer DIR" in said
    assert not (tmp_path / "none").exists()
    assert main(["convert", "to-hf", str(synthetic), str(tmp_path / "w"), "--no-tokenizer"]) == 0
    assert not (tmp_path / "w" / "tokenizer.json").exists()


def test_exported_folders_and_weights_follow_the_users_umask(tmp_path):
    import os
    import stat

    cfg = small_config()
    state = build_model(cfg).state_dict()
    previous = os.umask(0o022)
    try:
        hf = save_hf(state, cfg, tmp_path / "hf")
        ours = save_model_dir(state, cfg, tmp_path / "ours")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(hf.stat().st_mode) == 0o755
    for f in [*hf.iterdir(), ours / "model.safetensors"]:
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
