"""The decoder: embedding, pre-norm blocks (attention + MoE, or attention + a dense SwiGLU for
the leading ``model.n_dense_layers``), final norm, LM head (or the embedding, tied).

Blocks carry the running auxiliary loss beside the hidden states, so the routers' losses reach
the final loss through any split of the layers (pipeline stages, activation recompute).
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import ModelConfig
from moe_core.model.attention import Attention, LatentAttention, RotaryEmbedding, YarnScaling
from moe_core.model.kernel_choice import Kernels
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, MoE, Router, SwiGLU
from moe_core.model.norm import RMSNorm


class Block(nn.Module):
    """Attention then the feed-forward: ``moe`` (routed experts), or ``mlp`` (a dense SwiGLU
    of ``model.dense_hidden``) for the leading ``model.n_dense_layers`` blocks. The feed-forward's
    norm keeps the name ``moe_norm`` in both, so every block's names share one pattern."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.latent else Attention(cfg)
        self.moe_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.moe: MoE | None = None
        self.mlp: SwiGLU | None = None
        if layer in cfg.moe_layers:
            self.moe = MoE(cfg)
        else:
            assert cfg.dense_hidden is not None
            self.mlp = SwiGLU(cfg.d_model, cfg.dense_hidden)

    def forward(
        self, h_BSD: torch.Tensor, aux: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), rope)
        if self.moe is None:
            return h_BSD + self.mlp(self.moe_norm(h_BSD)), aux  # type: ignore[misc]
        y_BSD, layer_aux = self.moe(self.moe_norm(h_BSD))
        return h_BSD + y_BSD, aux + layer_aux


class Transformer(nn.Module):
    """``forward(tokens) -> (logits, aux_loss)``.

    Pipeline stages keep a subset of ``layers`` (a dict, so names stay global) and drop
    ``embed`` / ``norm`` / ``lm_head`` (set to None); a stage without ``embed`` takes hidden
    states, one without ``lm_head`` returns them. With ``model.tie_embeddings`` there is no
    ``lm_head`` module: the logits read ``embed.weight`` (one parameter, one name), and the
    whole model is one stage (config refuses tied embeddings with pipeline parallelism).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head: nn.Linear | None = None
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, YarnScaling.of(cfg))

    def forward(
        self, x: torch.Tensor, aux: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(x) if self.embed is not None else x
        if aux is None:
            aux = torch.zeros((), dtype=torch.float32, device=h.device)
        rope = self.rope(h.shape[1], h.device)
        for block in self.layers.values():
            h, aux = block(h, aux, rope)
        if self.norm is not None:
            h = self.norm(h)
        if self.lm_head is not None:
            h = self.lm_head(h)
        elif self.cfg.tie_embeddings and self.embed is not None:
            h = F.linear(h, self.embed.weight)
        return h, aux

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Initialize as ``init_plan`` says (the one rule, also used by ``moe_core.train.init``
        to write an initial checkpoint without the model), buffers reset."""
        params = dict(self.named_parameters())
        for item in init_plan(self):
            t = params[item.name] if item.expert is None else params[item.name][item.expert]
            if item.fill is not None:
                t.fill_(item.fill)
            else:
                seeded_normal_(t, self.cfg.init_std, seed, item.key)
        for mod in self.modules():
            if isinstance(mod, Router):
                mod.reset_buffers()


@dataclass(frozen=True)
class InitItem:
    """One tensor to initialize: parameter ``name`` (``expert``: its slice ``[expert]`` of a
    stacked expert weight), to a constant ``fill`` (1 for norm weights, 0 for biases) or, where
    ``fill`` is None, N(0, init_std) from a generator seeded by the run's seed and ``key``, the
    tensor's global name."""

    name: str
    expert: int | None
    key: str
    fill: float | None


def init_plan(model: Transformer) -> list[InitItem]:
    """Norm weights 1, biases 0, every other weight N(0, init_std), in parameter order. Each
    tensor (each expert's slice, for stacked experts) draws from its own generator seeded by its
    global name (experts by their global index), so any sharding of the model (pipeline stages,
    expert-parallel slices, one tensor at a time) initializes to the same values."""
    experts = {
        id(p): (mod_name, p_name, mod.expert_offset)
        for mod_name, mod in model.named_modules()
        if isinstance(mod, Experts)
        for p_name, p in mod.named_parameters(recurse=False)
    }
    plan = []
    for name, p in model.named_parameters():
        if id(p) in experts:
            mod_name, p_name, offset = experts[id(p)]
            for e in range(p.shape[0]):
                plan.append(InitItem(name, e, f"{mod_name}.{p_name}[{offset + e}]", None))
        else:
            fill = 1.0 if name.endswith("norm.weight") else 0.0 if name.endswith(".bias") else None
            plan.append(InitItem(name, None, name, fill))
    return plan


def seeded_normal_(t: torch.Tensor, std: float, seed: int, key: str) -> None:
    if t.is_meta:
        return
    g = torch.Generator(device=t.device)
    g.manual_seed((seed * 0x9E3779B1 + zlib.crc32(key.encode())) % (1 << 63))
    t.normal_(0.0, std, generator=g)


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu", seed: int = 0) -> Transformer:
    """Construct on the meta device, allocate on ``device``, initialize once (fp32)."""
    with on_meta():
        model = Transformer(cfg)
    if torch.device(device).type != "meta":
        model.to_empty(device=device)
        model.init_weights(seed)
    return model


def apply_kernels(model: nn.Module, kernels: Kernels) -> None:
    """Hand one model its kernel choice: every ``Attention`` and ``Experts`` holds ``kernels``
    (``moe_core.model.kernel_choice``), in place, before the model is compiled."""
    for m in model.modules():
        if isinstance(m, (Attention, LatentAttention, Experts)):
            m.kernels = kernels


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's full (unsharded) shape under ``cfg``, read off a meta-device model."""
    with on_meta():
        return {name: tuple(p.shape) for name, p in Transformer(cfg).named_parameters()}


def state_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's state dict under ``cfg`` (its parameters and persistent
    buffers: the routers' expert bias), in state-dict order, read off a meta-device model."""
    with on_meta():
        return {name: tuple(t.shape) for name, t in Transformer(cfg).state_dict().items()}


def shape_mismatch(
    found: Mapping[str, Sequence[int]], expected: Mapping[str, Sequence[int]]
) -> str | None:
    """The first difference between two ``name -> shape`` maps (in ``expected``'s order), as
    "NAME is (a, b) there, (c, d) here"; None when they agree."""
    for name, shape in expected.items():
        if name not in found:
            return f"{name} {tuple(shape)} is missing there"
        if tuple(found[name]) != tuple(shape):
            return f"{name} is {tuple(found[name])} there, {tuple(shape)} here"
    extra = sorted(set(found) - set(expected))
    if extra:
        return f"{extra[0]} {tuple(found[extra[0]])} is there but not in this model"
    return None


def lm_loss(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; targets of -100 are ignored."""
    return F.cross_entropy(
        logits_BSV.float().reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1)
    )
