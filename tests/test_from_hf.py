"""Continued pretraining from a public checkpoint (``init.from_hf=DIR``): the run's model comes
from the folder's config.json, its tokenizer from the folder; ``moe train`` (any layout) starts
from its weights and its first loss is the one ``transformers`` computes on the same batch; the
pipeline's init stage writes them as its step-0 checkpoint; its key follows the folder."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
import torch.nn.functional as F

from flows.layout import resolve
from flows.pretrain import stage_keys
from moe_core.compose import compose_dict, compose_run
from moe_core.config import ARCHITECTURE_FIELDS, ConfigError
from moe_core.convert import load_model
from moe_core.convert.hf import HFSource, config_from_hf
from moe_core.convert.load import fill_from_source
from moe_core.data.synthetic import SyntheticTokens
from moe_core.model.moe import Experts
from moe_core.train.init import write_initial_checkpoint
from moe_core.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")


def _randomized_(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    return model.eval()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A random Qwen3-MoE (per-head QK-norm, head_dim of its own, GQA) as save_pretrained
    writes it, and the model."""
    config = transformers.Qwen3MoeConfig(
        vocab_size=131, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, moe_intermediate_size=16, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _randomized_(transformers.AutoModelForCausalLM.from_config(config))
    folder = tmp_path_factory.mktemp("qwen3-tiny")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """A random GLM-4.5-style model: a dense first block, a shared expert, sigmoid routing with
    its correction bias, partial rotary, q/k/v biases."""
    config = transformers.Glm4MoeConfig(
        vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=40, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, n_shared_experts=1,
        attention_bias=True, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = _randomized_(transformers.AutoModelForCausalLM.from_config(config))
    folder = tmp_path_factory.mktemp("glm-tiny")
    model.save_pretrained(folder)
    return folder, model


def test_the_model_and_tokenizer_come_from_the_folder(qwen3):
    folder, _ = qwen3
    run = compose_run([f"init.from_hf={folder}", "model.aux_loss_coef=0.05"])
    theirs = config_from_hf(folder)
    for key in ARCHITECTURE_FIELDS:
        assert getattr(run.model, key) == getattr(theirs, key), key
    assert run.model.aux_loss_coef == 0.05  # a training-only field the user set stays
    assert run.model.z_loss_coef == theirs.z_loss_coef  # the rest follows the folder
    assert run.data.tokenizer == str(folder)
    assert run.out_dir == f"runs/{theirs.name}"
    given = compose_run([f"init.from_hf={folder}", "data.tokenizer=gpt2", "out_dir=runs/x"])
    assert given.data.tokenizer == "gpt2" and given.out_dir == "runs/x"


@pytest.mark.parametrize(
    "override, sentence",
    [
        (
            "model.d_model=64",
            "model.d_model=64 (from model.d_model) is not allowed with init.from_hf={f!r}, whose "
            "config.json says d_model=32: the architecture comes from the checkpoint, so leave "
            "it unset.",
        ),
        (
            "model=tiny",
            "model.vocab_size=4096 (from model=tiny) is not allowed with init.from_hf={f!r}, "
            "whose config.json says vocab_size=131: the architecture comes from the checkpoint, "
            "so leave it unset.",
        ),
    ],
)
def test_an_architecture_set_otherwise_is_refused_in_one_sentence(qwen3, override, sentence):
    folder, _ = qwen3
    with pytest.raises(ConfigError) as err:
        compose_run([f"init.from_hf={folder}", override])
    assert str(err.value) == sentence.format(f=str(folder))


def test_a_folder_that_is_no_checkpoint_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"has no config\.json"):
        compose_run([f"init.from_hf={tmp_path}"])
    with pytest.raises(ConfigError, match=r"init\.from_hf='' is not allowed"):
        compose_run(["init.from_hf=''"])


def test_moe_train_starts_from_the_weights_with_transformers_first_loss(qwen3, tmp_path):
    folder, hf = qwen3
    run = compose_run(
        [
            f"init.from_hf={folder}",
            "data=synthetic",
            "train.steps=1",
            "train.seq_len=16",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            "train.warmup_steps=1",
            "train.log_every=1",
            "train.checkpoint_at_end=false",
            "train.save_model=false",
            f"out_dir={tmp_path / 'run'}",
        ]
    )
    Trainer(run).fit()
    first = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    # the step's batch: synthetic sequences 0..3, inputs and next-token targets
    tokens = SyntheticTokens(run.model.vocab_size, run.data.branching, run.train.seed).sequences(
        0, 4, 16
    )
    with torch.no_grad():
        logits = hf(input_ids=tokens[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    assert first["step"] == 0
    assert abs(first["loss"] - float(expected)) < 1e-5, (first["loss"], float(expected))


def test_an_expert_parallel_shard_takes_its_own_experts(glm):
    folder, _ = glm
    source = HFSource(folder)
    full = load_model(folder)
    shard = load_model(folder)
    for block in shard.layers.values():
        if block.moe is not None:  # this rank's experts 4..7 of 8
            local = Experts(4, source.cfg.d_model, source.cfg.expert_hidden)
            local.expert_offset = 4
            block.moe.experts = local
    with torch.no_grad():
        for p in shard.parameters():
            p.zero_()
    fill_from_source(shard, source)
    for name, t in shard.state_dict().items():
        want = full.state_dict()[name]
        want = want[4:] if ".experts." in name else want
        assert torch.equal(t, want), name


def test_the_init_stage_writes_the_folders_weights_as_step_0(glm, tmp_path):
    folder, hf = glm
    run = compose_run([f"init.from_hf={folder}", f"out_dir={tmp_path / 'run'}"])
    step0 = write_initial_checkpoint(run, tmp_path / "ckpt")
    ours = load_model(step0)
    bias = ours.layers["1"].moe.router.expert_bias
    assert torch.equal(bias, hf.model.layers[1].mlp.gate.e_score_correction_bias)
    tokens = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens)[0], hf(input_ids=tokens).logits, atol=1e-5, rtol=0)


def test_the_init_key_follows_the_folder(qwen3, tmp_path):
    folder, _ = qwen3
    plain = resolve(compose_dict(["data=kjv"], config_name="pretrain-tiny"), tmp_path)
    start = resolve(compose_dict(["data=kjv", f"init.from_hf={folder}"]), tmp_path)
    keys = stage_keys(start)
    assert stage_keys(plain)["init"] != keys["init"]
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    again = stage_keys(start)
    assert again["init"] != keys["init"] and again["tokenize"] == keys["tokenize"]
    same = dataclasses.replace(start)
    assert stage_keys(same)["init"] == again["init"]
