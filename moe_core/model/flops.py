"""Parameter counts and model FLOPs per token, in closed form from the config (no model is
built, so any size answers at once; tests hold the formulas equal to a meta-device model's count).

Convention (design.md, Megatron's): model FLOPs per token = 6 x the matmul parameters a token
is multiplied by (attention projections, its top-k experts and the shared expert, the leading
dense blocks' MLPs, LM head) + 3 x layers x seq x (query heads x (head_dim + value head width))
for causal attention (6 x layers x seq x d_model where head_dim is d_model / n_heads; multi-head
latent attention's value heads are ``v_head_dim`` wide, its query/key heads ``head_dim``).
Router, norms, biases, embedding lookups and recompute are not counted. A tied LM head is one
parameter (the embedding) but still a matmul.
Each multi-token-prediction depth (``model.mtp_depth``; training only) adds its projection
``eh_proj``, one MoE block (its attention term too) and another pass through the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ModelConfig, attention_linear_shapes


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
    assert cfg.head_dim is not None
    seq_len = seq_len or cfg.max_seq_len
    d, n_layers, vocab = cfg.d_model, cfg.n_layers, cfg.vocab_size
    n_moe = len(cfg.moe_layers)
    n_dense = n_layers - n_moe
    q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    attention = sum(o * i for _, o, i in attention_linear_shapes(cfg))  # its projections
    v_dim = q_dim  # what attention's weighted sum of values spans, over the heads
    biases = {"none": 0, "qkv": q_dim + 2 * kv_dim, "qkvo": q_dim + 2 * kv_dim + d}
    qk_norm = {"none": 0, "head": 2 * cfg.head_dim, "projection": q_dim + kv_dim}[cfg.qk_norm]
    if cfg.kv_lora_rank is not None:  # latent attention: its value heads and latent norms
        assert cfg.v_head_dim is not None
        v_dim = cfg.n_heads * cfg.v_head_dim
        qk_norm = cfg.kv_lora_rank + (cfg.q_lora_rank or 0)
    norms = 2 * d + qk_norm  # attention and feed-forward norms, QK-norm (MLA: latent norms)
    layer_other = norms + biases[cfg.attention_bias]  # no FLOPs counted for these
    shared = 3 * d * cfg.n_shared_experts * cfg.expert_hidden
    expert = 3 * d * cfg.expert_hidden  # one routed expert's gate, up and down
    router = cfg.n_experts * d
    dense_mlp = 3 * d * (cfg.dense_hidden or 0)
    embedding, final_norm, head = vocab * d, d, d * vocab
    # MTP depths: each an MoE block with its two input norms, projection and output norm
    n_mtp = cfg.mtp_depth
    mtp_proj, mtp_norms = 2 * d * d, 3 * d
    n_moe_all, n_blocks = n_moe + n_mtp, n_layers + n_mtp
    experts = n_moe_all * cfg.n_experts * expert
    total = (
        embedding
        + n_blocks * (attention + layer_other)
        + n_moe_all * (router + shared)
        + experts
        + n_dense * dense_mlp
        + final_norm
        + (0 if cfg.tie_embeddings else head)
        + n_mtp * (mtp_proj + mtp_norms)
    )
    active = total - n_moe_all * (cfg.n_experts - cfg.top_k) * expert
    matmul_active = (
        n_blocks * attention
        + n_moe_all * (shared + cfg.top_k * expert)
        + n_dense * dense_mlp
        + (1 + n_mtp) * head
        + n_mtp * mtp_proj
    )
    # causal attention: q.k over q_dim and the weighted sum over v_dim, half the pairs, x 3
    flops = 6 * matmul_active + 3 * n_blocks * seq_len * (q_dim + v_dim)
    return ModelCounts(total, active, matmul_active, experts, embedding, flops)
