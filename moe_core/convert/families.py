"""The Hugging Face model families moe_core writes and reads, one typed description each.

A family is one stock ``transformers`` class: ``OlmoeForCausalLM``, ``Qwen3MoeForCausalLM``,
``MixtralForCausalLM``, ``Glm4MoeForCausalLM`` or ``DeepseekV3ForCausalLM``. Its description
says how our ``ModelConfig`` maps to its config.json and back, what its tensors are called on
disk (per expert, as ``save_pretrained`` writes them), and which of our options it cannot
express. Export takes the one family that computes exactly what a config computes
(``choose_family``: the attention, QK-norm and router's scores tell them apart, so at most one
can), or refuses in one sentence naming the nearest; import reads the family that
config.json's ``model_type`` names. The folder I/O is in ``convert.hf``.

Router losses differ: moe_core adds a load-balancing term per MoE layer (``aux_loss_coef * E *
sum_e f_e P_e``, summed or averaged over the layers) and a z-loss; ``transformers`` pools one
load-balancing term over all MoE layers and has no z-loss (GLM-4.5 has neither).
``hf_aux_coef`` converts the coefficient so both give the router the same gradient at uniform
routing, and ``export_note`` names what does not carry over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from moe_core.config import ConfigError, ModelConfig

# (our option, its value, what the class needs instead) for each option a family cannot express
Need = tuple[str, Any, str]

REQUIRED = object()  # a config.json key that has no default: the file must give it
LAYERS = "layers"  # the kind of a list of layer numbers (Qwen3's mlp_only_layers)
_KINDS: dict[Any, str] = {
    int: "an integer",
    float: "a number",
    bool: "true or false",
    str: "a string",
    LAYERS: "a list of layer numbers",
}

_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj")


def _attention(biases: tuple[str, ...], qk_norm: bool) -> dict[str, str]:
    """Our attention tensors -> their names in every family (``self_attn``, as Llama's)."""
    keys = {
        f"layers.{{i}}.attn.{p}.weight": f"model.layers.{{i}}.self_attn.{p}.weight" for p in _PROJ
    }
    for p in biases:
        keys[f"layers.{{i}}.attn.{p}.bias"] = f"model.layers.{{i}}.self_attn.{p}.bias"
    if qk_norm:
        for n in ("q_norm", "k_norm"):
            keys[f"layers.{{i}}.attn.{n}.weight"] = f"model.layers.{{i}}.self_attn.{n}.weight"
    return keys


_SHELL = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.moe_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
}


def _swiglu(ours: str, theirs: str) -> dict[str, str]:
    """A dense SwiGLU's three projections: ours ``{ours}.w_gate`` ..., theirs ``gate_proj`` ..."""
    return {
        f"layers.{{i}}.{ours}.w_{p}.weight": f"model.layers.{{i}}.{theirs}.{p}_proj.weight"
        for p in ("gate", "up", "down")
    }


# a leading dense block's SwiGLU (Qwen3's mlp_only_layers, GLM's first_k_dense_replace)
_DENSE = _swiglu("mlp", "mlp")


def _show(value: Any) -> str:
    """A value as a config override spells it (true/false, strings quoted)."""
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value)


def hf_aux_coef(cfg: ModelConfig) -> float:
    """``router_aux_loss_coef`` that gives HF's load-balancing loss our gradient at uniform routing.

    HF (``load_balancing_loss_func``) pools the L MoE layers: ``E * sum_e fbar_e Pbar_e`` with
    ``fbar_e`` the assignments to e over all layers / (L T) (summing to K) and ``Pbar_e`` the
    mean probability of e over all layers' T tokens, so d(coef_hf * loss)/d p_lte =
    ``coef_hf E fbar_e / (L T)``, ``coef_hf K / (L T)`` at uniform routing (fbar_e = K/E). Ours
    per layer, ``c E sum_e f_e P_e`` with f_e summing to 1, gives ``c E f_e / T`` = ``c / T``,
    where c is aux_loss_coef (sum over layers) or aux_loss_coef / L (mean). Equal when
    ``coef_hf = c L / K``.
    """
    layers = len(cfg.moe_layers) if cfg.aux_loss_reduction == "sum" else 1
    return cfg.aux_loss_coef * layers / cfg.top_k


def aux_coef_from_hf(coef_hf: float, top_k: int) -> float:
    """``hf_aux_coef`` inverted for ``aux_loss_reduction="mean"`` (what an import writes: like
    HF's, a coefficient that does not grow with depth)."""
    return coef_hf * top_k


class HFConfigReader:
    """config.json's values for one family: each checked for the type its class gives it (one
    sentence naming the key, the value and the file otherwise), or the class's default where
    the file leaves it out."""

    def __init__(self, path: Path, raw: dict[str, Any], family: Family) -> None:
        self.path, self.raw, self.family = path, raw, family
        self.notes: list[str] = []  # what the import drops, said once (export_note's twin)

    def get(self, keys: str | tuple[str, ...], kind: Any) -> Any:
        """The first of ``keys`` (aliases: older and newer spellings) the file gives."""
        names = (keys,) if isinstance(keys, str) else keys
        for key in names:
            if self.raw.get(key) is not None:
                return self.check(key, self.raw[key], kind)
        default = self.family.defaults.get(names[0], REQUIRED)
        if default is REQUIRED:
            a = "an" if self.family.title[0] in "AEIOU" else "a"
            raise ConfigError(
                f"{self.path} has no {names[0]}, which {a} {self.family.title} config.json must "
                f"give ({_KINDS[kind]})."
            )
        return default

    def check(self, key: str, value: Any, kind: Any) -> Any:
        if kind is LAYERS:
            fits = isinstance(value, list) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in value
            )
        elif kind is str:
            fits = isinstance(value, str)
        else:
            fits = isinstance(value, bool) == (kind is bool) and isinstance(value, (int, float))
            fits = fits and (kind is not int or isinstance(value, int))
            fits = fits and (kind is not float or math.isfinite(value))
        if not fits:
            raise ConfigError(f"{key}={value!r} in {self.path} is not allowed: {_KINDS[kind]}.")
        return float(value) if kind is float else value

    def refuse(self, key: str, value: Any, allowed: str) -> None:
        raise ConfigError(f"{key}={value!r} in {self.path} is not supported: {allowed}.")

    def only(self, key: str, kind: Any, allowed: Any) -> None:
        """Refuse ``key`` unless it is ``allowed`` (or absent, where the class's default is)."""
        value = self.get(key, kind)
        if value != allowed:
            self.refuse(key, value, f"only {allowed!r}")

    def rope_parameters(self) -> dict[str, Any]:
        """``rope_scaling`` (older files) or ``rope_parameters``, as ``transformers`` 5 reads
        them (a mapping, or nothing)."""
        rope = self.raw.get("rope_scaling") or self.raw.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_parameters={rope!r} in {self.path} is not allowed: a mapping.")
        return rope

    def rope(self, yarn: bool = False) -> tuple[float, float | None]:
        """(rope_theta, partial_rotary_factor or None), as ``transformers`` 5 gathers them:
        ``rope_parameters``, then the top-level keys, then the class's default; any RoPE but
        the default one (scaled, YaRN, ...) is refused, YaRN too unless ``yarn``."""
        rope = self.rope_parameters()
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in ("default", "yarn") or (kind == "yarn" and not yarn):
            also = " and YaRN" if yarn else ""
            raise ConfigError(
                f"rope_type={kind!r} in {self.path} is not supported: moe_core computes only the "
                f"default RoPE (no scaling){also} for {self.family.title}, so the model would "
                "compute something else."
            )
        theta = rope.get("rope_theta", self.raw.get("rope_theta"))
        theta = (
            self.family.default_theta if theta is None else self.check("rope_theta", theta, float)
        )
        fraction = rope.get("partial_rotary_factor", self.raw.get("partial_rotary_factor"))
        if fraction is not None:
            fraction = self.check("partial_rotary_factor", fraction, float)
        return theta, fraction


@dataclass(frozen=True, eq=False)
class Family:
    """One stock ``transformers`` class: what it is called, its tensors' names on disk and the
    config.json keys it gives a default (the class's own defaults, held equal to them by
    tests/test_families.py). Subclasses map the configs both ways and list what it cannot
    express."""

    title: str  # as its authors write it
    model_type: str
    hf_class: str  # the *ForCausalLM class export writes
    config_class: str
    moe: str  # the MoE block's module name inside a layer
    experts: tuple[str, str, str]  # one expert's gate, up and down projections on disk
    keys: dict[str, str]  # our tensor ({i}: the layer) -> its name on disk
    defaults: dict[str, Any]
    fp32_keys: frozenset[str] = frozenset()  # kept in fp32 whatever the weights' dtype
    default_theta: float = 10000.0
    # an MTP depth's own tensors (``mtp.{k}.`` left out) -> their names on disk ({i}: the layer
    # it is there, n_layers + k); its block's are ``keys``' at that layer
    mtp_keys: dict[str, str] = field(default_factory=dict)
    has_aux_loss: ClassVar[bool] = True  # a router_aux_loss_coef in its config

    def expert_key(self, layer: int, expert: int, proj: int) -> str:
        """An expert's projection on disk (proj: 0 gate, 1 up, 2 down)."""
        return f"model.layers.{layer}.{self.moe}.experts.{expert}.{self.experts[proj]}.weight"

    def needs(self, cfg: ModelConfig) -> list[Need]:
        """Our options this class cannot express for ``cfg``, each with what it needs."""
        raise NotImplementedError

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config class's keyword arguments that compute what ``cfg`` computes."""
        raise NotImplementedError

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        """Our ``ModelConfig`` fields for the config.json ``r`` reads."""
        raise NotImplementedError

    def hf_only(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        """Tensors the class holds that ``cfg``'s model has not, written as zeros (they change
        nothing it computes)."""
        return []

    # -- the parts every family shares ----------------------------------------------------

    def _hf_common(self, cfg: ModelConfig) -> dict[str, Any]:
        fields: dict[str, Any] = dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            hidden_act="silu",
            max_position_embeddings=cfg.max_seq_len,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            rms_norm_eps=cfg.norm_eps,
            num_experts_per_tok=cfg.top_k,
            initializer_range=cfg.init_std,
            tie_word_embeddings=cfg.tie_embeddings,
        )
        if cfg.d_model % cfg.n_heads == 0 and cfg.head_dim == cfg.d_model // cfg.n_heads:
            del fields["head_dim"]  # the class's own: hidden / heads, as its files leave it
        if self.has_aux_loss:
            fields["router_aux_loss_coef"] = hf_aux_coef(cfg)
        return fields

    def _model_common(self, r: HFConfigReader, yarn: bool = False) -> dict[str, Any]:
        r.only("hidden_act", str, "silu")
        d_model, n_heads = r.get("hidden_size", int), r.get("num_attention_heads", int)
        head_dim = r.get("head_dim", int)
        if head_dim is None and n_heads > 0:
            head_dim = d_model // n_heads  # the classes' rounding: down
        top_k = r.get("num_experts_per_tok", int)
        theta, _ = r.rope(yarn)
        fields: dict[str, Any] = dict(
            vocab_size=r.get("vocab_size", int),
            d_model=d_model,
            n_layers=r.get("num_hidden_layers", int),
            n_heads=n_heads,
            n_kv_heads=r.get("num_key_value_heads", int) or n_heads,
            head_dim=head_dim,
            top_k=top_k,
            max_seq_len=r.get("max_position_embeddings", int),
            rope_theta=theta,
            norm_eps=r.get("rms_norm_eps", float),
            init_std=r.get("initializer_range", float),
            tie_embeddings=r.get("tie_word_embeddings", bool),
            z_loss_coef=0.0,  # no stock class has a router z-loss
            aux_loss_coef=0.0,
            aux_loss_reduction="mean",
        )
        if self.has_aux_loss:
            fields["aux_loss_coef"] = aux_coef_from_hf(r.get("router_aux_loss_coef", float), top_k)
        return fields

    @staticmethod
    def _plain_router(cfg: ModelConfig) -> list[Need]:
        """What a softmax top-k router without extras (OLMoE, Qwen3, Mixtral) cannot do."""
        needs: list[Need] = []
        if cfg.router != "softmax":
            needs.append(("router", cfg.router, "'softmax'"))
        if cfg.expert_bias:
            needs.append(("expert_bias", True, "false (it selects experts without a bias)"))
        if cfg.n_expert_groups != 1:
            needs.append(("n_expert_groups", cfg.n_expert_groups, "1 (no group-limited routing)"))
        if cfg.routed_scale != 1.0:
            needs.append(("routed_scale", cfg.routed_scale, "1.0 (no routed scaling factor)"))
        if cfg.n_shared_experts:
            needs.append(("n_shared_experts", cfg.n_shared_experts, "0 (no shared expert)"))
        return needs

    @staticmethod
    def _full_rotary(cfg: ModelConfig) -> list[Need]:
        if cfg.rotary_fraction != 1.0:
            return [("rotary_fraction", cfg.rotary_fraction, "1.0 (RoPE on the whole head)")]
        return []

    @staticmethod
    def _plain_attention(cfg: ModelConfig) -> list[Need]:
        """What a family of q/k/v/o projections, unscaled RoPE and no multi-token prediction
        cannot do."""
        needs: list[Need] = []
        if cfg.latent:
            needs.append(("kv_lora_rank", cfg.kv_lora_rank, "None (no latent attention)"))
        if cfg.rope_scaling != "none":
            needs.append(("rope_scaling", cfg.rope_scaling, "'none' (RoPE unscaled)"))
        if cfg.mtp_depth:
            needs.append(("mtp_depth", cfg.mtp_depth, "0 (no multi-token prediction)"))
        return needs

    def row_order(self, cfg: ModelConfig, name: str, interleaved: bool = True) -> list[int] | None:
        """For our tensor ``name`` (``{i}`` for the layer), the order of its rows on disk (row
        ``m`` there is our row ``order[m]``), where the class lays them out otherwise (rotary
        rows ``interleaved``); None: the same rows in the same order."""
        return None


_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, eq=False)
class Olmoe(Family):
    """OLMoE: QK-norm over the whole projection, softmax top-k, no dense blocks."""

    def needs(self, cfg: ModelConfig) -> list[Need]:
        needs: list[Need] = []
        if cfg.qk_norm != "projection":
            needs.append(("qk_norm", cfg.qk_norm, "'projection'"))
        if cfg.d_model % cfg.n_heads or cfg.head_dim != cfg.d_model // cfg.n_heads:
            needs.append(("head_dim", cfg.head_dim, "d_model / n_heads (its QK-norm spans it)"))
        needs += self._full_rotary(cfg) + self._plain_attention(cfg)
        if cfg.attention_bias == "qkv":
            needs.append(("attention_bias", "qkv", "'none' or 'qkvo'"))
        if cfg.n_dense_layers:
            needs.append(("n_dense_layers", cfg.n_dense_layers, "0 (every block has experts)"))
        return needs + self._plain_router(cfg)

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return self._hf_common(cfg) | dict(
            intermediate_size=cfg.expert_hidden,
            num_experts=cfg.n_experts,
            norm_topk_prob=cfg.normalize_top_k,
            attention_bias=cfg.attention_bias == "qkvo",
            clip_qkv=None,
        )

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        fields = self._model_common(r)
        if r.raw.get("head_dim") not in (None, fields["d_model"] // max(fields["n_heads"], 1)):
            r.refuse("head_dim", r.raw["head_dim"], "only hidden_size / num_attention_heads")
        if r.raw.get("clip_qkv") is not None:
            r.refuse("clip_qkv", r.raw["clip_qkv"], "only None (no clipping)")
        fields["head_dim"] = None  # hidden / heads, which must divide (ModelConfig says so)
        return fields | dict(
            n_experts=r.get(("num_experts", "num_local_experts"), int),
            expert_hidden=r.get("intermediate_size", int),
            normalize_top_k=r.get("norm_topk_prob", bool),
            attention_bias="qkvo" if r.get("attention_bias", bool) else "none",
            qk_norm="projection",
        )


@dataclass(frozen=True, eq=False)
class Qwen3Moe(Family):
    """Qwen3-MoE: per-head QK-norm, softmax top-k, optional q/k/v/o biases, dense blocks where
    ``mlp_only_layers`` (or ``decoder_sparse_step``) says, which we hold only when leading."""

    def needs(self, cfg: ModelConfig) -> list[Need]:
        needs: list[Need] = []
        if cfg.qk_norm != "head":
            needs.append(("qk_norm", cfg.qk_norm, "'head'"))
        needs += self._full_rotary(cfg) + self._plain_attention(cfg)
        if cfg.attention_bias == "qkv":
            needs.append(("attention_bias", "qkv", "'none' or 'qkvo'"))
        return needs + self._plain_router(cfg)

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return self._hf_common(cfg) | dict(
            intermediate_size=cfg.dense_hidden or cfg.expert_hidden,
            moe_intermediate_size=cfg.expert_hidden,
            num_experts=cfg.n_experts,
            norm_topk_prob=cfg.normalize_top_k,
            attention_bias=cfg.attention_bias == "qkvo",
            decoder_sparse_step=1,
            mlp_only_layers=list(range(cfg.n_dense_layers)),
            use_sliding_window=False,
        )

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        fields = self._model_common(r)
        r.only("use_sliding_window", bool, False)
        n_layers, n_experts = fields["n_layers"], r.get(("num_experts", "num_local_experts"), int)
        step, only = r.get("decoder_sparse_step", int), r.get("mlp_only_layers", LAYERS)
        if step < 1:
            r.refuse("decoder_sparse_step", step, "a positive integer")
        sparse = [
            i for i in range(n_layers) if i not in only and n_experts > 0 and (i + 1) % step == 0
        ]
        n_dense = n_layers - len(sparse)
        if sparse != list(range(n_dense, n_layers)):
            r.refuse(
                "mlp_only_layers",
                only,
                f"moe_core's dense blocks are the leading ones, so only [0, 1, ..., n - 1] with "
                f"decoder_sparse_step=1 (here decoder_sparse_step={step})",
            )
        return fields | dict(
            n_experts=n_experts,
            expert_hidden=r.get("moe_intermediate_size", int),
            n_dense_layers=n_dense,
            dense_hidden=r.get("intermediate_size", int) if n_dense else None,
            normalize_top_k=r.get("norm_topk_prob", bool),
            attention_bias="qkvo" if r.get("attention_bias", bool) else "none",
            qk_norm="head",
        )


@dataclass(frozen=True, eq=False)
class Mixtral(Family):
    """Mixtral: no QK-norm, no biases, softmax top-k always renormalized over the k."""

    def needs(self, cfg: ModelConfig) -> list[Need]:
        needs: list[Need] = []
        if cfg.qk_norm != "none":
            needs.append(("qk_norm", cfg.qk_norm, "'none'"))
        needs += self._full_rotary(cfg) + self._plain_attention(cfg)
        if cfg.attention_bias != "none":
            needs.append(("attention_bias", cfg.attention_bias, "'none'"))
        if cfg.n_dense_layers:
            needs.append(("n_dense_layers", cfg.n_dense_layers, "0 (every block has experts)"))
        if not cfg.normalize_top_k:
            needs.append(("normalize_top_k", False, "true (it renormalizes over the top k)"))
        return needs + self._plain_router(cfg)

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        return self._hf_common(cfg) | dict(
            intermediate_size=cfg.expert_hidden,
            num_local_experts=cfg.n_experts,
            router_jitter_noise=0.0,
            sliding_window=None,
        )

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        fields = self._model_common(r)
        if r.raw.get("sliding_window") is not None:
            r.refuse("sliding_window", r.raw["sliding_window"], "only None (full attention)")
        jitter = r.get("router_jitter_noise", float)
        if jitter:
            r.notes.append(f"router_jitter_noise={jitter} (training-time noise moe_core has not)")
        return fields | dict(
            n_experts=r.get(("num_local_experts", "num_experts"), int),
            expert_hidden=r.get("intermediate_size", int),
            normalize_top_k=True,
            qk_norm="none",
        )


@dataclass(frozen=True, eq=False)
class Glm4Moe(Family):
    """GLM-4.5: sigmoid scores with a selection-only bias, group-limited top-k, routed scaling,
    a shared expert, leading dense blocks, q/k/v biases, per-head QK-norm or none, RoPE on a
    leading share of each head; no router loss. Its saved folders may hold multi-token
    prediction layers after the last block, which moe_core does not import."""

    has_aux_loss: ClassVar[bool] = False

    def needs(self, cfg: ModelConfig) -> list[Need]:
        needs: list[Need] = []
        if cfg.qk_norm == "projection":
            needs.append(("qk_norm", "projection", "'head' or 'none'"))
        if cfg.attention_bias == "qkvo":
            needs.append(("attention_bias", "qkvo", "'none' or 'qkv' (no o_proj bias)"))
        if cfg.router != "sigmoid":
            needs.append(("router", cfg.router, "'sigmoid'"))
        return needs + self._plain_attention(cfg)

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        fields = self._hf_common(cfg)
        fields["rope_parameters"]["partial_rotary_factor"] = cfg.rotary_fraction
        return fields | dict(
            intermediate_size=cfg.dense_hidden or cfg.expert_hidden,
            moe_intermediate_size=cfg.expert_hidden,
            n_routed_experts=cfg.n_experts,
            n_shared_experts=cfg.n_shared_experts,
            routed_scaling_factor=cfg.routed_scale,
            n_group=cfg.n_expert_groups,
            topk_group=cfg.top_k_groups,
            first_k_dense_replace=cfg.n_dense_layers,
            norm_topk_prob=cfg.normalize_top_k,
            use_qk_norm=cfg.qk_norm == "head",
            attention_bias=cfg.attention_bias == "qkv",
            num_nextn_predict_layers=0,  # no MTP layer is written: engines should not look
        )

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        fields = self._model_common(r)
        _, fraction = r.rope()
        n_dense = r.get("first_k_dense_replace", int)
        return fields | dict(
            n_experts=r.get(("n_routed_experts", "num_local_experts"), int),
            expert_hidden=r.get("moe_intermediate_size", int),
            n_shared_experts=r.get("n_shared_experts", int),
            n_dense_layers=n_dense,
            dense_hidden=r.get("intermediate_size", int) if n_dense > 0 else None,
            router="sigmoid",
            expert_bias=True,  # e_score_correction_bias: always there, zeros where untrained
            routed_scale=r.get("routed_scaling_factor", float),
            n_expert_groups=r.get("n_group", int),
            top_k_groups=r.get("topk_group", int),
            normalize_top_k=r.get("norm_topk_prob", bool),
            qk_norm="head" if r.get("use_qk_norm", bool) else "none",
            attention_bias="qkv" if r.get("attention_bias", bool) else "none",
            rotary_fraction=0.5 if fraction is None else fraction,
        )

    def mtp_layers(self, r: HFConfigReader) -> int:
        """How many multi-token prediction layers config.json says follow the last block."""
        return r.get(("num_nextn_predict_layers", "num_mtp_layers"), int)

    def hf_only(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        return _bias_and_shared_zeros(cfg)


def _bias_and_shared_zeros(cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
    """What GLM's and DeepSeek's MoE blocks always hold and ``cfg`` may not: the selection
    bias (zeros: no bias) and a shared expert (of width 0: none)."""
    extra: list[tuple[str, tuple[int, ...]]] = []
    D, width = cfg.d_model, cfg.n_shared_experts * cfg.expert_hidden
    for i in [*cfg.moe_layers, *range(cfg.n_layers, cfg.n_layers + cfg.mtp_depth)]:
        if not cfg.expert_bias:
            extra.append((f"model.layers.{i}.mlp.gate.e_score_correction_bias", (cfg.n_experts,)))
        if not width:
            shared = f"model.layers.{i}.mlp.shared_experts"
            extra += [
                (f"{shared}.gate_proj.weight", (0, D)),
                (f"{shared}.up_proj.weight", (0, D)),
                (f"{shared}.down_proj.weight", (D, 0)),
            ]
    return extra


def interleaved_rope_rows(n_before: int, rope: int, heads: int, n_after: int = 0) -> list[int]:
    """Row order on disk of a projection whose heads each end in ``rope`` rotary rows that
    DeepSeek lays out as interleaved pairs (x0, x1), (x2, x3), ... where we rotate halves: row
    ``2j`` there is our row ``j``, row ``2j + 1`` our row ``rope/2 + j`` (the same rotation,
    exactly; ``n_before`` non-rotary rows lead each head, ``n_after`` rows follow them all)."""
    half, width = rope // 2, n_before + rope
    order: list[int] = []
    for h in range(heads):
        base = h * width
        order += range(base, base + n_before)
        order += [base + n_before + m // 2 + (m % 2) * half for m in range(rope)]
    return order + list(range(heads * width, heads * width + n_after))


@dataclass(frozen=True, eq=False)
class DeepseekV3(Family):
    """DeepSeek-V3: multi-head latent attention (YaRN where configured), sigmoid scores with a
    selection-only bias, group-limited top-k, routed scaling, shared experts, leading dense
    blocks; no router loss. Its rotary rows are interleaved on disk (``rope_interleave``, as
    DeepSeek's own checkpoints are): export and import permute them (``row_order``), which
    changes no value. Multi-token prediction layers after the last block are the model's MTP
    depths (``mtp_keys``; ``transformers`` loads the model without them)."""

    has_aux_loss: ClassVar[bool] = False

    def needs(self, cfg: ModelConfig) -> list[Need]:
        needs: list[Need] = []
        if not cfg.latent:
            needs.append(("kv_lora_rank", None, "a rank (multi-head latent attention)"))
        if cfg.router != "sigmoid":
            needs.append(("router", cfg.router, "'sigmoid'"))
        return needs

    def row_order(self, cfg: ModelConfig, name: str, interleaved: bool = True) -> list[int] | None:
        if not interleaved:
            return None
        assert cfg.qk_rope_head_dim is not None and cfg.qk_nope_head_dim is not None
        rope, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        if name in ("layers.{i}.attn.q_proj.weight", "layers.{i}.attn.q_b_proj.weight"):
            return interleaved_rope_rows(nope, rope, cfg.n_heads)
        if name == "layers.{i}.attn.kv_a_proj.weight":
            assert cfg.kv_lora_rank is not None
            return interleaved_rope_rows(cfg.kv_lora_rank, rope, 1)
        return None

    def hf_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        fields = self._hf_common(cfg)
        fields.pop("head_dim", None)  # the class sets its own (the rotary part)
        if cfg.rope_scaling == "yarn":
            fields["rope_parameters"] |= dict(
                rope_type="yarn",
                factor=cfg.yarn_factor,
                original_max_position_embeddings=cfg.yarn_original_max_seq_len,
                beta_fast=cfg.yarn_beta_fast,
                beta_slow=cfg.yarn_beta_slow,
                mscale=cfg.yarn_mscale,
                mscale_all_dim=cfg.yarn_mscale_all_dim,
            )
        return fields | dict(
            intermediate_size=cfg.dense_hidden or cfg.expert_hidden,
            moe_intermediate_size=cfg.expert_hidden,
            n_routed_experts=cfg.n_experts,
            n_shared_experts=cfg.n_shared_experts,
            routed_scaling_factor=cfg.routed_scale,
            n_group=cfg.n_expert_groups,
            topk_group=cfg.top_k_groups,
            first_k_dense_replace=cfg.n_dense_layers,
            norm_topk_prob=cfg.normalize_top_k,
            q_lora_rank=cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim,
            qk_nope_head_dim=cfg.qk_nope_head_dim,
            v_head_dim=cfg.v_head_dim,
            rope_interleave=True,
            attention_bias=False,
            num_nextn_predict_layers=cfg.mtp_depth,
        )

    def model_fields(self, r: HFConfigReader) -> dict[str, Any]:
        fields = self._model_common(r, yarn=True)
        rope = r.rope_parameters()
        r.only("attention_bias", bool, False)
        for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if r.raw.get(key) not in (None, allowed):  # DeepSeek's own files say these
                r.refuse(key, r.raw[key], f"only {allowed!r}")
        if r.raw.get("moe_layer_freq") not in (None, 1):
            r.refuse(
                "moe_layer_freq",
                r.raw["moe_layer_freq"],
                "only 1 (every block after the dense ones)",
            )
        n_dense = r.get("first_k_dense_replace", int)
        yarn: dict[str, Any] = {}
        if rope.get("rope_type", rope.get("type")) == "yarn":
            if rope.get("truncate", True) is not True or rope.get("attention_factor") is not None:
                key = "truncate" if rope.get("truncate", True) is not True else "attention_factor"
                r.refuse(key, rope[key], "only YaRN as DeepSeek-V3 configures it (unset)")
            factor = rope.get("factor")
            original = rope.get("original_max_position_embeddings")
            yarn = dict(
                rope_scaling="yarn",
                yarn_factor=r.check("factor", factor, float),
                yarn_original_max_seq_len=r.check(
                    "original_max_position_embeddings", original, int
                ),
                yarn_beta_fast=r.check("beta_fast", rope.get("beta_fast") or 32.0, float),
                yarn_beta_slow=r.check("beta_slow", rope.get("beta_slow") or 1.0, float),
                yarn_mscale=r.check("mscale", rope.get("mscale") or 0.0, float),
                yarn_mscale_all_dim=r.check(
                    "mscale_all_dim", rope.get("mscale_all_dim") or 0.0, float
                ),
            )
        q_rank = r.raw.get("q_lora_rank", r.family.defaults["q_lora_rank"])
        n_heads = fields["n_heads"]
        if r.raw.get("num_key_value_heads") not in (None, n_heads):
            r.refuse("num_key_value_heads", r.raw["num_key_value_heads"], f"only {n_heads}")
        return (
            fields
            | yarn
            | dict(
                head_dim=None,
                n_kv_heads=None,
                qk_norm="none",
                n_experts=r.get(("n_routed_experts", "num_local_experts"), int),
                expert_hidden=r.get("moe_intermediate_size", int),
                n_shared_experts=r.get("n_shared_experts", int),
                n_dense_layers=n_dense,
                dense_hidden=r.get("intermediate_size", int) if n_dense > 0 else None,
                router="sigmoid",
                expert_bias=True,  # e_score_correction_bias: always there, zeros where untrained
                routed_scale=r.get("routed_scaling_factor", float),
                n_expert_groups=r.get("n_group", int),
                top_k_groups=r.get("topk_group", int),
                normalize_top_k=r.get("norm_topk_prob", bool),
                q_lora_rank=None if q_rank is None else r.check("q_lora_rank", q_rank, int),
                kv_lora_rank=r.get("kv_lora_rank", int),
                qk_rope_head_dim=r.get("qk_rope_head_dim", int),
                qk_nope_head_dim=r.get("qk_nope_head_dim", int),
                v_head_dim=r.get("v_head_dim", int),
                mtp_depth=self.mtp_layers(r),
            )
        )

    def interleaved(self, r: HFConfigReader | None) -> bool:
        """Whether the folder's rotary rows are interleaved: DeepSeek's layout, which export
        writes; a config.json may say ``rope_interleave: false`` (rotated halves, ours)."""
        return r is None or r.get("rope_interleave", bool)

    def mtp_layers(self, r: HFConfigReader) -> int:
        """How many multi-token prediction layers config.json says follow the last block."""
        return r.get(("num_nextn_predict_layers", "num_mtp_layers"), int)

    def hf_only(self, cfg: ModelConfig) -> list[tuple[str, tuple[int, ...]]]:
        return _bias_and_shared_zeros(cfg)


_COMMON_DEFAULTS = dict(
    head_dim=None, initializer_range=0.02, tie_word_embeddings=False, hidden_act="silu"
)

OLMOE = Olmoe(
    title="OLMoE",
    model_type="olmoe",
    hf_class="OlmoeForCausalLM",
    config_class="OlmoeConfig",
    moe="mlp",
    experts=_EXPERT_PROJS,
    keys=_SHELL
    | _attention(_PROJ, qk_norm=True)
    | {"layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight"},
    defaults=_COMMON_DEFAULTS
    | dict(
        num_key_value_heads=None,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        norm_topk_prob=False,
        router_aux_loss_coef=0.01,
        attention_bias=False,
        clip_qkv=None,
    ),
)
QWEN3_MOE = Qwen3Moe(
    title="Qwen3-MoE",
    model_type="qwen3_moe",
    hf_class="Qwen3MoeForCausalLM",
    config_class="Qwen3MoeConfig",
    moe="mlp",
    experts=_EXPERT_PROJS,
    keys=_SHELL
    | _attention(_PROJ, qk_norm=True)
    | _DENSE
    | {"layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight"},
    defaults=_COMMON_DEFAULTS
    | dict(
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rms_norm_eps=1e-6,
        norm_topk_prob=False,
        router_aux_loss_coef=0.001,
        attention_bias=False,
        intermediate_size=6144,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        use_sliding_window=False,
    ),
)
MIXTRAL = Mixtral(
    title="Mixtral",
    model_type="mixtral",
    hf_class="MixtralForCausalLM",
    config_class="MixtralConfig",
    moe="block_sparse_moe",
    experts=("w1", "w3", "w2"),
    keys=_SHELL
    | _attention((), qk_norm=False)
    | {"layers.{i}.moe.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight"},
    defaults=_COMMON_DEFAULTS
    | dict(
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        router_aux_loss_coef=0.001,
        router_jitter_noise=0.0,
    ),
    default_theta=1e6,
)
# GLM's and DeepSeek's MoE block: a sigmoid router with its correction bias, a shared expert
_SIGMOID_MOE = {
    "layers.{i}.moe.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.moe.router.expert_bias": "model.layers.{i}.mlp.gate.e_score_correction_bias",
} | _swiglu("moe.shared", "mlp.shared_experts")
GLM4_MOE = Glm4Moe(
    title="GLM-4.5",
    model_type="glm4_moe",
    hf_class="Glm4MoeForCausalLM",
    config_class="Glm4MoeConfig",
    moe="mlp",
    experts=_EXPERT_PROJS,
    keys=_SHELL | _attention(("q_proj", "k_proj", "v_proj"), qk_norm=True) | _DENSE | _SIGMOID_MOE,
    defaults=_COMMON_DEFAULTS
    | dict(
        num_key_value_heads=8,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        norm_topk_prob=True,
        attention_bias=False,
        intermediate_size=10944,
        n_shared_experts=1,
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        use_qk_norm=False,
        num_nextn_predict_layers=1,
    ),
    fp32_keys=frozenset(
        {"model.layers.{i}.mlp.gate.weight", "model.layers.{i}.mlp.gate.e_score_correction_bias"}
    ),
)

_MLA = {
    "layers.{i}.attn.q_proj.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.q_a_proj.weight": "model.layers.{i}.self_attn.q_a_proj.weight",
    "layers.{i}.attn.q_a_norm.weight": "model.layers.{i}.self_attn.q_a_layernorm.weight",
    "layers.{i}.attn.q_b_proj.weight": "model.layers.{i}.self_attn.q_b_proj.weight",
    "layers.{i}.attn.kv_a_proj.weight": "model.layers.{i}.self_attn.kv_a_proj_with_mqa.weight",
    "layers.{i}.attn.kv_a_norm.weight": "model.layers.{i}.self_attn.kv_a_layernorm.weight",
    "layers.{i}.attn.kv_b_proj.weight": "model.layers.{i}.self_attn.kv_b_proj.weight",
    "layers.{i}.attn.o_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
}
DEEPSEEK_V3 = DeepseekV3(
    title="DeepSeek-V3",
    model_type="deepseek_v3",
    hf_class="DeepseekV3ForCausalLM",
    config_class="DeepseekV3Config",
    moe="mlp",
    experts=_EXPERT_PROJS,
    keys=_SHELL | _MLA | _DENSE | _SIGMOID_MOE,
    mtp_keys={
        "enorm.weight": "model.layers.{i}.enorm.weight",
        "hnorm.weight": "model.layers.{i}.hnorm.weight",
        "eh_proj.weight": "model.layers.{i}.eh_proj.weight",
        "norm.weight": "model.layers.{i}.shared_head.norm.weight",
    },
    defaults=_COMMON_DEFAULTS
    | dict(
        head_dim=64,  # the class sets it to qk_rope_head_dim (we derive ours: None)
        num_key_value_heads=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        norm_topk_prob=True,
        attention_bias=False,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=8,
        topk_group=4,
        first_k_dense_replace=3,
        q_lora_rank=1536,
        rope_interleave=True,
        num_nextn_predict_layers=1,
    ),
    fp32_keys=GLM4_MOE.fp32_keys,
)

FAMILIES: tuple[Family, ...] = (OLMOE, QWEN3_MOE, MIXTRAL, GLM4_MOE, DEEPSEEK_V3)
BY_MODEL_TYPE = {f.model_type: f for f in FAMILIES}


def choose_family(cfg: ModelConfig) -> Family:
    """The one family whose class computes exactly what ``cfg`` computes; otherwise one
    sentence naming an option none expresses and the nearest class: the fewest options it
    cannot express, then one with ``cfg``'s QK-norm (the attention's shape), then the first in
    ``FAMILIES``."""
    needs = [
        (len(n), any(option == "qk_norm" for option, _, _ in n), i, n)
        for i, n in enumerate(f.needs(cfg) for f in FAMILIES)
    ]
    count, _, index, nearest = min(needs)
    if not count:
        return FAMILIES[index]
    (option, value, wanted), *rest = nearest
    also = f"; it also cannot express {', '.join('model.' + o for o, _, _ in rest)}" if rest else ""
    raise ConfigError(
        f"model.{option}={_show(value)} cannot be exported: no stock transformers class computes "
        f"this model, and the nearest, {FAMILIES[index].hf_class}, needs model.{option}={wanted}"
        f"{also}."
    )


def family_for(model_type: Any, where: Path) -> Family:
    """The family config.json's ``model_type`` names, or one sentence listing those read."""
    if not isinstance(model_type, str) or model_type not in BY_MODEL_TYPE:
        known = ", ".join(repr(t) for t in BY_MODEL_TYPE)
        raise ConfigError(
            f"model_type={model_type!r} in {where} is not supported: one of {known} "
            f"({', '.join(f.hf_class for f in FAMILIES)})."
        )
    return BY_MODEL_TYPE[model_type]


def export_note(cfg: ModelConfig, family: Family) -> str | None:
    """One line naming what of ``cfg``'s training objective the exported class does not carry
    (None when everything does)."""
    lost = []
    if not family.has_aux_loss and cfg.aux_loss_coef:
        lost.append(f"the load-balancing loss (model.aux_loss_coef={cfg.aux_loss_coef:g})")
    if cfg.z_loss_coef:
        lost.append(f"the router z-loss (model.z_loss_coef={cfg.z_loss_coef:g})")
    if cfg.expert_bias:
        lost.append(
            f"the expert-bias updates (model.expert_bias_rate={cfg.expert_bias_rate:g}; "
            "transformers never updates e_score_correction_bias)"
        )
    if not lost:
        return None
    carried = ""
    if family.has_aux_loss and cfg.aux_loss_coef:
        carried = (
            f"; its router_aux_loss_coef={hf_aux_coef(cfg):g} gives the load-balancing loss, "
            "which it pools over the layers, our gradient at uniform routing"
        )
    return f"not carried over to {family.hf_class}: {', '.join(lost)}{carried}."
