"""The four Hugging Face families both ways (``moe_core.convert.families``): a random
``transformers`` model of each, saved as ``save_pretrained`` writes it, imports and exports
back bit-exactly and computes the same logits and greedy tokens as ours; a model of ours
exports to the one class that computes it, which ``transformers`` loads and agrees with; what no
class expresses is refused in one sentence; the load-balancing coefficient keeps its gradient."""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path

import pytest
import torch
from helpers import small_config
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_core.config import ConfigError, ModelConfig
from moe_core.convert import load_model
from moe_core.convert.families import FAMILIES, GLM4_MOE, choose_family
from moe_core.convert.hf import load_hf, save_hf
from moe_core.convert.native import save_model_dir
from moe_core.errors import CheckpointError
from moe_core.model import build_model
from moe_core.model.documents import documents_of

transformers = pytest.importorskip("transformers")
# GLM's class builds its shared expert at width 0 where a model has none
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")

_SHAPE = dict(vocab_size=97, hidden_size=32, num_hidden_layers=3, num_attention_heads=4)

# (config class, its keyword arguments): odd vocabularies, head_dim not hidden / heads, GQA,
# leading dense blocks, shared experts, groups, biases, tied embeddings
HF_CASES = {
    "olmoe-bias-gqa-tied": (
        "OlmoeConfig",
        dict(**_SHAPE, num_key_value_heads=2, intermediate_size=16, num_experts=4,
             num_experts_per_tok=2, attention_bias=True, tie_word_embeddings=True,
             norm_topk_prob=True),
    ),
    "olmoe-plain": (
        "OlmoeConfig",
        dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
             intermediate_size=12, num_experts=5, num_experts_per_tok=3),
    ),
    "qwen3-dense-lead-bias-tied": (
        "Qwen3MoeConfig",
        dict(**_SHAPE, num_key_value_heads=2, head_dim=12, intermediate_size=40,
             moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[0],
             attention_bias=True, tie_word_embeddings=True, norm_topk_prob=True),
    ),
    "qwen3-plain": (
        "Qwen3MoeConfig",
        dict(vocab_size=101, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=3, moe_intermediate_size=20, num_experts=8,
             num_experts_per_tok=3, rope_theta=1e6),
    ),
    "mixtral-gqa-head-dim-tied": (
        "MixtralConfig",
        dict(**_SHAPE, num_key_value_heads=2, head_dim=10, intermediate_size=16,
             num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True),
    ),
    "mixtral-top1": (
        "MixtralConfig",
        dict(vocab_size=61, hidden_size=40, num_hidden_layers=2, num_attention_heads=5,
             num_key_value_heads=5, intermediate_size=24, num_local_experts=3,
             num_experts_per_tok=1),
    ),
    "glm-groups-shared-dense-qk-norm": (
        "Glm4MoeConfig",
        dict(**_SHAPE, num_key_value_heads=2, head_dim=12, intermediate_size=40,
             moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
             topk_group=2, first_k_dense_replace=1, n_shared_experts=1, attention_bias=True,
             use_qk_norm=True, routed_scaling_factor=2.5),
    ),
    "glm-two-shared-unnormalized-tied": (
        "Glm4MoeConfig",
        dict(**_SHAPE, num_key_value_heads=4, head_dim=16, moe_intermediate_size=12,
             n_routed_experts=6, num_experts_per_tok=2, first_k_dense_replace=0,
             n_shared_experts=2, norm_topk_prob=False, tie_word_embeddings=True,
             partial_rotary_factor=0.25),
    ),
    "glm-no-shared-two-dense": (
        "Glm4MoeConfig",
        dict(vocab_size=61, hidden_size=24, num_hidden_layers=3, num_attention_heads=2,
             num_key_value_heads=1, intermediate_size=30, moe_intermediate_size=8,
             n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,
             n_shared_experts=0),
    ),
    "deepseek-q-lora-groups-dense-yarn": (
        "DeepseekV3Config",
        dict(**_SHAPE, num_key_value_heads=4, q_lora_rank=12, kv_lora_rank=10,
             qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, intermediate_size=40,
             moe_intermediate_size=16, n_routed_experts=8,
             num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
             n_shared_experts=1, routed_scaling_factor=2.5, max_position_embeddings=64,
             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                              "original_max_position_embeddings": 16, "beta_fast": 32,
                              "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),
    ),
    "deepseek-full-q-no-shared-tied-halves": (
        "DeepseekV3Config",
        dict(vocab_size=61, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, q_lora_rank=None, kv_lora_rank=8, qk_rope_head_dim=6,
             qk_nope_head_dim=4, v_head_dim=7, moe_intermediate_size=8, n_routed_experts=4,
             num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=0,
             n_shared_experts=0, norm_topk_prob=False, tie_word_embeddings=True,
             rope_interleave=False),
    ),
    "deepseek-yarn-mscale": (
        "DeepseekV3Config",
        dict(**_SHAPE, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=8,
             qk_nope_head_dim=8, v_head_dim=8, intermediate_size=24, moe_intermediate_size=8,
             n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
             first_k_dense_replace=2, n_shared_experts=2, max_position_embeddings=32,
             rope_parameters={"rope_type": "yarn", "rope_theta": 500.0, "factor": 8.0,
                              "original_max_position_embeddings": 4, "beta_fast": 16,
                              "beta_slow": 2, "mscale": 0.707, "mscale_all_dim": 0.5}),
    ),
}  # fmt: skip

# config.json's keys that describe what the model computes (intermediate_size only where a
# dense block or every expert uses it; num_nextn_predict_layers is written 0: no MTP layer)
_ARCHITECTURE = [
    "model_type",
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "num_experts_per_tok",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_intermediate_size",
    "norm_topk_prob",
    "attention_bias",
    "mlp_only_layers",
    "decoder_sparse_step",
    "n_shared_experts",
    "routed_scaling_factor",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "use_qk_norm",
    "clip_qkv",
    "sliding_window",
    "use_sliding_window",
    "initializer_range",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
]


def _randomized_(model: torch.nn.Module) -> torch.nn.Module:
    """Every weight moved off its init (norms off 1, biases off 0), the GLM correction bias
    small and random, so a swapped or dropped tensor shows in the logits."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                b.copy_(torch.randn(b.shape, generator=g) * 0.01)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(HF_CASES))
def hf_case(request, tmp_path_factory):
    """(name, a random transformers model, the folder save_pretrained wrote for it)."""
    config_class, kwargs = HF_CASES[request.param]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**kwargs)
    model = _randomized_(transformers.AutoModelForCausalLM.from_config(config))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return request.param, model, folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as fh:
            out |= {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    return out


def _tokens(vocab: int, batch: int = 2, length: int = 11) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(2))


@torch.no_grad()
def _greedy(model, tokens: torch.Tensor, new: int) -> torch.Tensor:
    for _ in range(new):
        logits, _ = model(tokens)
        tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
    return tokens


def _interleaved(tensors: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """A DeepSeek folder's tensors with the rotary rows of each head (rotated halves: x_0 ..
    x_{r/2-1}, then their partners) laid out as interleaved pairs (x_0, x_{r/2}), ..."""
    rope, nope = config["qk_rope_head_dim"], config["qk_nope_head_dim"]
    out = dict(tensors)
    for key, t in tensors.items():
        if key.endswith(("q_proj.weight", "q_b_proj.weight")):
            lead, heads = nope, config["num_attention_heads"]
        elif key.endswith("kv_a_proj_with_mqa.weight"):
            lead, heads = config["kv_lora_rank"], 1
        else:
            continue
        rows = t.view(heads, lead + rope, -1)
        pairs = rows[:, lead:].view(heads, 2, rope // 2, -1).transpose(1, 2)
        out[key] = torch.cat([rows[:, :lead], pairs.reshape(heads, rope, -1)], 1).view_as(t)
    return out


def test_an_hf_folder_imports_and_exports_back_bit_exactly(hf_case, tmp_path):
    name, _, src = hf_case
    cfg, state = load_hf(src)
    out = save_hf(state, cfg, tmp_path / "back", max_shard_bytes=20_000)
    theirs, back = _tensors(src), _tensors(out)
    assert len(list(out.glob("*.safetensors"))) > 1, "the test should exercise sharding"
    assert set(back) == set(theirs)
    original, written = (json.loads((f / "config.json").read_text()) for f in (src, out))
    if original.get("rope_interleave") is False:  # export writes DeepSeek's interleaved rows
        assert written["rope_interleave"] is True
        theirs = _interleaved(theirs, original)
    for key, t in theirs.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key
    uses_intermediate = cfg.n_dense_layers or original["model_type"] in ("olmoe", "mixtral")
    for key in _ARCHITECTURE + ["intermediate_size"] * bool(uses_intermediate):
        if key in original:
            assert written.get(key) == original[key], f"{name}: {key}"
    if "router_aux_loss_coef" in original:
        assert math.isclose(written["router_aux_loss_coef"], original["router_aux_loss_coef"])


def test_an_imported_model_computes_the_logits_transformers_computes(hf_case):
    _, hf, src = hf_case
    ours = load_model(src)
    tokens = _tokens(hf.config.vocab_size)
    with torch.no_grad():
        err = (ours(tokens)[0] - hf(tokens).logits).abs().max().item()
    assert err < 1e-5, f"max |logit difference| {err:.2e}"


def test_packed_documents_compute_what_transformers_computes_under_their_mask(hf_case):
    """``train.document_mask``: our varlen-style documents against the stock class given the
    same documents as its position ids and a 4-D block-diagonal causal mask."""
    _, hf, src = hf_case
    ours = load_model(src)
    tokens = _tokens(hf.config.vocab_size, length=24)
    eos = int(tokens[0, 5])
    tokens[0, 13], tokens[1, 9] = eos, eos  # documents end at 5, 13 and 9: uneven in each row
    docs = documents_of(tokens, eos)
    with torch.no_grad():
        packed = ours.head(ours.norm(ours.hidden(tokens, docs=docs)[0]))
        theirs = hf(tokens, position_ids=docs.positions_BS, attention_mask=docs.mask()).logits
        unmasked = hf(tokens).logits
    err = (packed - theirs).abs().max().item()
    assert err < 1e-5, f"max |logit difference| {err:.2e}"
    assert (packed - unmasked).abs().max().item() > 1e-3  # the documents did change the logits


def test_an_imported_model_generates_the_greedy_tokens_transformers_does(hf_case):
    _, hf, src = hf_case
    ours, tokens = load_model(src), _tokens(hf.config.vocab_size, batch=1, length=6)
    with torch.no_grad():
        theirs = hf.generate(tokens, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(_greedy(ours, tokens, 5), theirs)


# Models of ours, one per family, with the options that family alone expresses
OUR_CASES = {
    "olmoe": dict(n_kv_heads=2, attention_bias="qkvo", tie_embeddings=True, normalize_top_k=True),
    "qwen3": dict(
        qk_norm="head", head_dim=12, n_kv_heads=2, n_layers=3, n_dense_layers=1, dense_hidden=40,
        attention_bias="qkvo", aux_loss_reduction="mean", vocab_size=97,
    ),
    "mixtral": dict(qk_norm="none", normalize_top_k=True, n_kv_heads=1, head_dim=20, top_k=1),
    "glm": dict(
        qk_norm="head", rotary_fraction=0.5, attention_bias="qkv", router="sigmoid",
        expert_bias=True, n_expert_groups=4, top_k_groups=2, top_k=3, routed_scale=2.5,
        n_shared_experts=1, n_layers=3, n_dense_layers=1, dense_hidden=48, normalize_top_k=True,
    ),
    "glm-no-qk-norm": dict(qk_norm="none", router="sigmoid", tie_embeddings=True, top_k=1),
}  # fmt: skip
_HF_CLASS = {"olmoe": "OlmoeForCausalLM", "qwen3": "Qwen3MoeForCausalLM", "mixtral": "Mixtral"}


@pytest.mark.parametrize("name", sorted(OUR_CASES))
def test_an_exported_model_computes_in_transformers_what_ours_computes(name, tmp_path):
    cfg = small_config(d_model=48, n_heads=4, expert_hidden=24, **OUR_CASES[name])
    model = _randomized_(build_model(cfg, seed=3))
    out = save_hf(model.state_dict(), cfg, tmp_path / "hf")
    written = json.loads((out / "config.json").read_text())["architectures"]
    assert written == [choose_family(cfg).hf_class]
    assert written[0].startswith(_HF_CLASS.get(name, "Glm4Moe"))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), f"transformers did not load every tensor: {info}"
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        err = (model(tokens)[0] - hf.eval()(tokens).logits).abs().max().item()
        theirs = hf.generate(tokens[:1, :6], max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert err < 1e-5, f"max |logit difference| {err:.2e}"
    assert torch.equal(_greedy(model, tokens[:1, :6], 5), theirs)


@pytest.mark.parametrize(
    "override, option, nearest",
    [
        (dict(qk_norm="none"), "model.normalize_top_k=false", "MixtralForCausalLM"),
        (dict(qk_norm="head", n_shared_experts=1), "model.n_shared_experts=1", "Qwen3Moe"),
        (dict(rotary_fraction=0.5), "model.rotary_fraction=0.5", "OlmoeForCausalLM"),
        (dict(attention_bias="qkv"), "model.attention_bias='qkv'", "OlmoeForCausalLM"),
        (
            dict(qk_norm="none", router="sigmoid", attention_bias="qkvo"),
            "model.attention_bias='qkvo'",
            "Glm4MoeForCausalLM",
        ),
    ],
)
def test_a_model_no_class_computes_is_refused_naming_the_option_and_nearest_class(
    override, option, nearest, tmp_path
):
    cfg = small_config(**override)
    with pytest.raises(ConfigError) as err:
        save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "hf")
    text = str(err.value)
    assert text.startswith(f"{option} cannot be exported: no stock transformers class")
    assert f"the nearest, {nearest}" in text and text.count(". ") == 0 and "\n" not in text
    assert not (tmp_path / "hf").exists()


def test_at_most_one_family_computes_any_config():
    """The export's rule is deterministic: the QK-norm and the scores tell the classes apart."""
    for qk_norm, router, bias, normalize in itertools.product(
        ("projection", "head", "none"), ("softmax", "sigmoid"), ("none", "qkv", "qkvo"), (0, 1)
    ):
        cfg = small_config(
            qk_norm=qk_norm, router=router, attention_bias=bias, normalize_top_k=bool(normalize)
        )
        assert sum(not f.needs(cfg) for f in FAMILIES) <= 1, cfg


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.model_type)
def test_a_family_fills_what_config_json_leaves_out_as_its_class_does(family):
    default = getattr(transformers, family.config_class)()
    for key, ours in family.defaults.items():
        theirs = getattr(default, key, None)
        if key == "num_key_value_heads" and ours is None:  # None: as many as the heads
            theirs = None if theirs == default.num_attention_heads else theirs
        assert ours == theirs, f"{family.config_class}.{key}: {theirs!r}, not {ours!r}"
    assert family.default_theta == default.rope_parameters["rope_theta"]
    if family is GLM4_MOE:
        assert default.rope_parameters["partial_rotary_factor"] == 0.5


def _hf_folder(tmp_path: Path, case: str) -> Path:
    config_class, kwargs = HF_CASES[case]
    config = getattr(transformers, config_class)(**kwargs)
    folder = tmp_path / "hf"
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize(
    "case, change, sentence",
    [
        (
            "qwen3-plain",
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
            "rope_type='yarn' in {cfg} is not supported: moe_core computes only the default RoPE",
        ),
        (
            "olmoe-plain",
            {"rope_scaling": {"type": "linear", "factor": 2.0}},
            "rope_type='linear' in {cfg} is not supported",
        ),
        (
            "qwen3-dense-lead-bias-tied",
            {"mlp_only_layers": [1]},
            "mlp_only_layers=[1] in {cfg} is not supported: moe_core's dense blocks are the "
            "leading ones",
        ),
        (
            "qwen3-dense-lead-bias-tied",
            {"decoder_sparse_step": 2, "mlp_only_layers": []},
            "mlp_only_layers=[] in {cfg} is not supported: moe_core's dense blocks are the",
        ),
        ("qwen3-plain", {"use_sliding_window": True}, "use_sliding_window=True in {cfg} is not"),
        ("mixtral-top1", {"sliding_window": 64}, "sliding_window=64 in {cfg} is not supported"),
        ("mixtral-top1", {"hidden_act": "gelu"}, "hidden_act='gelu' in {cfg} is not supported"),
        ("glm-no-shared-two-dense", {"n_group": "4"}, "n_group='4' in {cfg} is not allowed: an "),
        ("mixtral-top1", {"model_type": "deepseek_v2"}, "model_type='deepseek_v2' in {cfg} is "),
        ("mixtral-top1", {"model_type": ["mixtral"]}, "model_type=['mixtral'] in {cfg} is not"),
    ],
)
def test_an_hf_config_moe_core_cannot_compute_is_refused_in_one_sentence(
    case, change, sentence, tmp_path
):
    src = _hf_folder(tmp_path, case)
    raw = json.loads((src / "config.json").read_text()) | change
    (src / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as err:
        load_hf(src)
    assert sentence.format(cfg=src / "config.json") in str(err.value)
    assert "\n" not in str(err.value)


def test_glm_multi_token_prediction_layers_are_left_out_and_said_so(tmp_path, caplog):
    src = _hf_folder(tmp_path, "glm-no-shared-two-dense")
    weights = load_file(str(src / "model.safetensors"))
    mtp = {k.replace("layers.2.", "layers.3."): t.clone() for k, t in weights.items() if ".2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(24, 48)
    save_file(weights | mtp, str(src / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING):
        cfg, state = load_hf(src)
    assert cfg.n_layers == 3 and not any(k.startswith("layers.3.") for k in state)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and f"{len(mtp)} tensors of the multi-token prediction" in said[0]
    raw = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(raw | {"num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.eh_proj\.weight .* is there but"):
        load_hf(src)


def _identical_moe_layers(cfg: ModelConfig) -> torch.nn.Module:
    """Our model where every MoE layer routes the same tokens the same way (attention and
    experts add nothing, one router weight everywhere, small: near-uniform routing), so HF's
    load-balancing counts pooled over the layers equal each layer's, as at uniform routing."""
    model = build_model(cfg, seed=4)
    router = torch.randn(cfg.n_experts, cfg.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for block in model.layers.values():
            block.attn.o_proj.weight.zero_()
            ffn = block.mlp.w_down.weight if block.moe is None else block.moe.experts.w_down
            ffn.zero_()
            if block.moe is not None:
                block.moe.router.weight.copy_(router * 0.05)
    return model


@pytest.mark.parametrize(
    "options",
    [
        dict(aux_loss_reduction="sum"),
        dict(aux_loss_reduction="mean", top_k=3),
        dict(qk_norm="head", n_dense_layers=1, dense_hidden=40, aux_loss_reduction="sum"),
        dict(qk_norm="none", normalize_top_k=True, aux_loss_reduction="mean"),
    ],
)
def test_the_exported_load_balancing_coefficient_gives_the_routers_our_gradient(options, tmp_path):
    cfg = small_config(n_layers=4, z_loss_coef=0.0, aux_loss_coef=0.01, **options)
    model = _identical_moe_layers(cfg)
    out = save_hf(model.state_dict(), cfg, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    coef = hf.config.router_aux_loss_coef
    assert coef != cfg.aux_loss_coef, "the conversion should not be the identity here"
    tokens = _tokens(cfg.vocab_size, batch=4, length=16)
    model(tokens)[1].backward()
    (coef * hf(tokens, output_router_logits=True).aux_loss).backward()
    for i in cfg.moe_layers:
        ours = model.layers[str(i)].moe.router.weight.grad
        theirs = hf.model.layers[i].mlp.gate.weight.grad  # Mixtral's too, in memory
        assert ours.abs().max() > 0
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-9)


def test_export_says_in_one_line_what_does_not_carry_over(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = small_config(z_loss_coef=0.002)
        save_hf(build_model(cfg).state_dict(), cfg, tmp_path / "olmoe")
        glm = small_config(qk_norm="none", router="sigmoid", expert_bias=True, z_loss_coef=0.0)
        save_hf(build_model(glm).state_dict(), glm, tmp_path / "glm")
        quiet = small_config(z_loss_coef=0.0)
        save_hf(build_model(quiet).state_dict(), quiet, tmp_path / "quiet")
    olmoe, glm4 = (r.getMessage() for r in caplog.records)
    assert olmoe.startswith("not carried over to OlmoeForCausalLM: the router z-loss")
    # aux_loss_coef 0.01 averaged over the layers (the default), top-2: 0.01 / 2
    assert "model.z_loss_coef=0.002" in olmoe and "router_aux_loss_coef=0.005 " in olmoe
    assert glm4.startswith("not carried over to Glm4MoeForCausalLM: the load-balancing loss")
    assert "model.expert_bias_rate=0.001" in glm4 and "z-loss" not in glm4


def test_load_model_reads_our_model_folder_and_refuses_anything_else(tmp_path):
    cfg = small_config(qk_norm="head", router="sigmoid", expert_bias=True)
    model = _randomized_(build_model(cfg, seed=6))
    folder = save_model_dir(model.state_dict(), cfg, tmp_path / "ours")
    loaded = load_model(folder, dtype=torch.bfloat16)
    assert (
        loaded.embed.weight.dtype == loaded.layers["0"].moe.experts.w_down.dtype == torch.bfloat16
    )
    router = loaded.layers["0"].moe.router
    assert router.weight.dtype == router.expert_bias.dtype == torch.float32
    assert torch.equal(router.weight, model.layers["0"].moe.router.weight)
    assert torch.equal(
        loaded.layers["1"].moe.router.expert_bias, model.layers["1"].moe.router.expert_bias
    )
    with pytest.raises(CheckpointError, match="is no model folder moe_core reads"):
        load_model(tmp_path)


def test_load_model_reads_a_training_checkpoint(tmp_path):
    from moe_core.config import RunConfig, TrainConfig
    from moe_core.train.init import write_initial_checkpoint

    cfg = small_config(qk_norm="none", router="sigmoid", expert_bias=True)
    run = RunConfig(model=cfg, train=TrainConfig(seq_len=32, seed=7), out_dir=str(tmp_path))
    loaded = load_model(write_initial_checkpoint(run, tmp_path / "checkpoints")).state_dict()
    initialized = build_model(cfg, seed=7).state_dict()
    assert set(loaded) == set(initialized)
    assert all(torch.equal(loaded[k], t) for k, t in initialized.items())


def test_the_cli_converts_a_foreign_family_both_ways(tmp_path):
    from moe_core.cli import main

    src = _hf_folder(tmp_path, "glm-groups-shared-dense-qk-norm")
    assert main(["convert", "from-hf", str(src), str(tmp_path / "ours")]) == 0
    back = tmp_path / "back"
    assert main(["convert", "to-hf", str(tmp_path / "ours"), str(back), "--no-tokenizer"]) == 0
    written = json.loads((back / "config.json").read_text())
    assert written["architectures"] == ["Glm4MoeForCausalLM"]
    theirs, ours = _tensors(src), _tensors(back)
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], t) for k, t in theirs.items())


def test_a_bf16_glm_folder_keeps_its_router_fp32_both_ways(tmp_path):
    """transformers keeps GLM's router weight and correction bias fp32 in a bf16 model; they
    import as they are and export as fp32 again, the rest bf16, bit for bit."""
    config_class, kwargs = HF_CASES["glm-groups-shared-dense-qk-norm"]
    config = getattr(transformers, config_class)(**kwargs)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    _randomized_(hf).save_pretrained(tmp_path / "hf")
    theirs = _tensors(tmp_path / "hf")
    router = {k for k in theirs if ".mlp.gate." in k}
    assert router and {theirs[k].dtype for k in router} == {torch.float32}
    assert {t.dtype for k, t in theirs.items() if k not in router} == {torch.bfloat16}
    cfg, state = load_hf(tmp_path / "hf")
    back = _tensors(save_hf(state, cfg, tmp_path / "back"))
    assert set(back) == set(theirs)
    assert all(back[k].dtype == t.dtype and torch.equal(back[k], t) for k, t in theirs.items())


def test_deepseek_multi_token_prediction_layers_export_and_import_bit_exactly(tmp_path):
    """An MTP depth goes out as the extra layer DeepSeek's checkpoints carry (its norms,
    projection, block, output norm and copies of the embedding and LM head; transformers loads
    the model without it and computes our logits) and comes back bit-exactly; a copy unequal to
    the model's embedding is refused, since our MTP shares it."""
    cfg = small_config(
        n_layers=3, n_kv_heads=None, qk_norm="none", kv_lora_rank=16, q_lora_rank=24,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=12, router="sigmoid",
        expert_bias=True, n_dense_layers=1, dense_hidden=80, n_shared_experts=1,
        n_expert_groups=4, top_k_groups=2, normalize_top_k=True, routed_scale=2.5, mtp_depth=1,
    )  # fmt: skip
    model = _randomized_(build_model(cfg, seed=3))
    state = model.state_dict()
    out = save_hf(state, cfg, tmp_path / "hf")
    written = _tensors(out)
    mtp = {k for k in written if k.startswith("model.layers.3.")}
    own = {"enorm", "hnorm", "eh_proj", "shared_head.norm", "shared_head.head", "embed_tokens"}
    assert {f"model.layers.3.{n}.weight" for n in own} <= mtp
    assert "model.layers.3.self_attn.kv_a_proj_with_mqa.weight" in mtp
    assert "model.layers.3.mlp.experts.7.down_proj.weight" in mtp
    assert torch.equal(written["model.layers.3.embed_tokens.weight"], state["embed.weight"])
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = _tokens(cfg.vocab_size)
    with torch.no_grad():
        err = (model(tokens)[0] - hf(tokens).logits).abs().max().item()
    assert err < 1e-5, f"max |logit difference| {err:.2e}"

    back_cfg, back = load_hf(out)
    assert back_cfg.mtp_depth == 1 and set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name
    again = _tensors(save_hf(back, back_cfg, tmp_path / "again"))
    assert set(again) == set(written)
    assert all(torch.equal(again[k], t) for k, t in written.items())

    shard = next(out.glob("*.safetensors"))
    tensors = load_file(str(shard))
    if "model.layers.3.embed_tokens.weight" not in tensors:
        shard = next(f for f in out.glob("*.safetensors") if f != shard)
        tensors = load_file(str(shard))
    tensors["model.layers.3.embed_tokens.weight"][0, 0] += 1.0
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (out / "moe_core_config.json").unlink()  # read as a folder DeepSeek wrote
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight unequal to model\.embed"):
        load_hf(out)
