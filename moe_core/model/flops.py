"""Parameter counts and model FLOPs per token, in closed form from the config (no model is
built, so any size answers at once; tests hold the formulas equal to a meta-device model's count).

Convention (design.md, Megatron's): model FLOPs per token = 6 x the matmul parameters a token
is multiplied by (attention projections, its top-k experts and the shared expert, LM head)
+ 6 x layers x seq x d_model for causal attention. Router, norms, embedding lookups and
recompute are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ModelConfig


@dataclass(frozen=True)
class ModelCounts:
    total_params: int  # every parameter
    active_params: int  # parameters one token uses (top-k of the routed experts)
    matmul_active_params: int  # the active parameters that take part in FLOPs
    expert_params: int  # routed expert parameters, all experts
    embedding_params: int
    flops_per_token: int  # forward + backward, at seq_len

    def table(self) -> list[tuple[str, str]]:
        return [
            ("total parameters", _human(self.total_params)),
            ("active parameters", _human(self.active_params)),
            ("routed expert parameters", _human(self.expert_params)),
            ("embedding parameters", _human(self.embedding_params)),
            (
                "model FLOPs per token",
                f"{self.flops_per_token:,} ({self.flops_per_token / 1e9:.2f} G)",
            ),
        ]


def _human(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n:,} ({n / scale:.2f}{unit})"
    return f"{n:,}"


def count(cfg: ModelConfig, seq_len: int | None = None) -> ModelCounts:
    """Counts for ``cfg`` at ``seq_len`` (default: ``cfg.max_seq_len``), from the shapes the
    model's modules take (``transformer.Block``, ``attention.Attention``, ``moe.MoE``)."""
    seq_len = seq_len or cfg.max_seq_len
    d, n_layers, vocab = cfg.d_model, cfg.n_layers, cfg.vocab_size
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = 2 * d * q_dim + 2 * d * kv_dim  # q, o; k, v projections
    shared = 3 * d * cfg.n_shared_experts * cfg.expert_hidden
    expert = 3 * d * cfg.expert_hidden  # one routed expert's gate, up and down
    norms = 2 * d + q_dim + kv_dim  # attention and MoE norms, QK-norm
    router = cfg.n_experts * d
    embedding, final_norm, head = vocab * d, d, d * vocab
    experts = n_layers * cfg.n_experts * expert
    dense = n_layers * (attention + shared + norms + router)
    total = embedding + dense + experts + final_norm + head
    active = total - n_layers * (cfg.n_experts - cfg.top_k) * expert
    matmul_active = active - embedding - final_norm - n_layers * (norms + router)
    flops = 6 * matmul_active + 6 * n_layers * seq_len * d
    return ModelCounts(total, active, matmul_active, experts, embedding, flops)
