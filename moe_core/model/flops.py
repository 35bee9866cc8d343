"""Parameter counts and model FLOPs per token, read off a meta-device model (no memory).

Convention (design.md, Megatron's): model FLOPs per token = 6 x the matmul parameters a token
is multiplied by (attention projections, its top-k experts and the shared expert, LM head)
+ 6 x layers x seq x d_model for causal attention. Router, norms, embedding lookups and
recompute are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ModelConfig
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, Router
from moe_core.model.norm import RMSNorm
from moe_core.model.transformer import Transformer


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
    """Counts for ``cfg`` at ``seq_len`` (default: ``cfg.max_seq_len``)."""
    seq_len = seq_len or cfg.max_seq_len
    with on_meta():
        model = Transformer(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(
        p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters()
    )
    embedding = model.embed.weight.numel() if model.embed is not None else 0
    inactive = experts * (cfg.n_experts - cfg.top_k) // cfg.n_experts
    active = total - inactive
    not_matmul = embedding + sum(
        p.numel()
        for m in model.modules()
        if isinstance(m, RMSNorm | Router)
        for p in m.parameters()
    )
    matmul_active = active - not_matmul
    flops = 6 * matmul_active + 6 * cfg.n_layers * seq_len * cfg.d_model
    return ModelCounts(total, active, matmul_active, experts, embedding, flops)
