"""The decoder: embedding, pre-norm blocks (attention + MoE, or attention + a dense SwiGLU for
the leading ``model.n_dense_layers``), final norm, LM head (or the embedding, tied), and for
training the multi-token-prediction modules (``model.mtp_depth``, DeepSeek-V3's).

Blocks carry the running auxiliary loss beside the hidden states, so the routers' losses reach
the final loss through any split of the layers (pipeline stages, activation recompute).
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import ModelConfig
from moe_core.model.attention import Attention, LatentAttention, RotaryEmbedding, YarnScaling
from moe_core.model.context import ContextShard
from moe_core.model.documents import Documents
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
        if layer >= cfg.n_dense_layers:  # past the leading dense blocks (MTP blocks too)
            self.moe = MoE(cfg)
        else:
            assert cfg.dense_hidden is not None
            self.mlp = SwiGLU(cfg.d_model, cfg.dense_hidden)

    def forward(
        self,
        h_BSD: torch.Tensor,
        aux: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``docs``: attention within each packed document (``train.document_mask``)."""
        h_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), rope, docs)
        if self.moe is None:
            return h_BSD + self.mlp(self.moe_norm(h_BSD)), aux  # type: ignore[misc]
        y_BSD, layer_aux = self.moe(self.moe_norm(h_BSD))
        return h_BSD + y_BSD, aux + layer_aux


class MTPModule(nn.Module):
    """Multi-token-prediction depth ``k`` (DeepSeek-V3): the previous depth's hidden state at
    position i (the main model's last block output for k = 0, before the final norm) and the
    embedding of input token i + k + 1, each normed, concatenated (embedding first, the order of
    DeepSeek's checkpoints' ``eh_proj``), projected back to ``d_model`` and passed through one
    MoE block (global layer ``n_layers + k``: its own init keys and router statistics); ``norm``
    precedes the shared LM head (DeepSeek's ``shared_head.norm``)."""

    def __init__(self, cfg: ModelConfig, k: int) -> None:
        super().__init__()
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.d_model, cfg.d_model, bias=False)
        self.block = Block(cfg, cfg.n_layers + k)
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)

    def forward(
        self,
        h_BSD: torch.Tensor,
        e_BSD: torch.Tensor,
        aux: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's output (the next depth's input) and the running aux loss."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(e_BSD), self.hnorm(h_BSD)], dim=-1))
        return self.block(x_BSD, aux, rope, docs)


@dataclass
class Losses:
    """A micro-batch's training losses (or their sums over micro-batches): ``ce`` the next-token
    cross-entropy, ``aux`` the routers' losses (the MTP blocks' included), ``mtp_D`` each MTP
    depth's cross-entropy (empty without MTP or where it did not run)."""

    ce: torch.Tensor
    aux: torch.Tensor
    mtp_D: torch.Tensor

    def objective(self, mtp_weight: torch.Tensor | float) -> torch.Tensor:
        """What training minimizes: ``ce + aux + mtp_weight * mean_k(mtp_D[k])`` (DeepSeek-V3's
        ``lambda / D * sum_k``)."""
        total = self.ce + self.aux
        if self.mtp_D.numel():
            total = total + mtp_weight * self.mtp_D.mean()
        return total

    def detach(self) -> Losses:
        return Losses(self.ce.detach(), self.aux.detach(), self.mtp_D.detach())

    def __add__(self, other: Losses) -> Losses:
        """The sums (an empty ``mtp_D`` adds nothing: a sum starts from ``zero_losses``)."""
        if self.mtp_D.numel() and other.mtp_D.numel():
            mtp = self.mtp_D + other.mtp_D
        else:
            mtp = self.mtp_D if self.mtp_D.numel() else other.mtp_D
        return Losses(self.ce + other.ce, self.aux + other.aux, mtp)


def zero_losses(device: torch.device | str) -> Losses:
    zero = torch.zeros((), device=device)
    return Losses(zero, zero, torch.zeros(0, device=device))


def shifted(t_BS: torch.Tensor, by: int, fill: float) -> torch.Tensor:
    """``t`` moved ``by`` positions earlier along the sequence, its last ``by`` positions
    ``fill``: static shapes (a compiled step and CUDA graphs keep working)."""
    pad = t_BS.new_full((t_BS.shape[0], by, *t_BS.shape[2:]), fill)
    return torch.cat([t_BS[:, by:], pad], dim=1)


class Transformer(nn.Module):
    """``forward(tokens) -> (logits, aux_loss)`` (inference: never the MTP modules).

    Pipeline stages keep a subset of ``layers`` (a dict, so names stay global) and drop
    ``embed`` / ``norm`` / ``lm_head`` (set to None) and, but on the last stage, ``mtp``; a
    stage without ``embed`` takes hidden states, one without ``lm_head`` returns them. With
    ``model.tie_embeddings`` there is no ``lm_head`` module: the logits read ``embed.weight``
    (one parameter, one name), and the whole model is one stage (config refuses tied
    embeddings with pipeline parallelism). Training goes through ``hidden`` then ``losses``
    (the last stage), which runs the MTP modules.
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
        self.mtp: nn.ModuleDict | None = None
        if cfg.mtp_depth:
            self.mtp = nn.ModuleDict({str(k): MTPModule(cfg, k) for k in range(cfg.mtp_depth)})
        self.rope = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, YarnScaling.of(cfg))
        # parallel.cp > 1 (``apply_context``): ``hidden`` and ``losses`` take whole sequences
        # and keep this rank's slice of them
        self.context: ContextShard | None = None

    def forward(
        self, x: torch.Tensor, aux: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux, _ = self.hidden(x, aux)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h), aux

    def hidden(
        self,
        x: torch.Tensor,
        aux: torch.Tensor | None = None,
        e: torch.Tensor | None = None,
        docs: Documents | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """This stage's blocks over ``x`` (tokens where it holds ``embed``, else hidden
        states): the last block's output (before the final norm), the running aux loss, and
        the token embeddings the MTP modules read (``e`` passed on; None without MTP).
        ``docs``: the inputs' packed documents, each attended alone from position 0."""
        h = x
        if self.embed is not None:
            if self.context is not None:
                x = self.context.local(x)
            h = self.embed(x)
            e = h if self.cfg.mtp_depth else None
        if aux is None:
            aux = torch.zeros((), dtype=torch.float32, device=h.device)
        rope = self._rope(h, docs)
        if self.context is not None and docs is not None:
            docs = self.context.documents(docs)
        for block in self.layers.values():
            h, aux = block(h, aux, rope, docs)
        return h, aux, e

    def _rope(
        self, h_BSD: torch.Tensor, docs: Documents | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables of ``h``'s positions: 0 .. S - 1, each document's own
        (``docs``), or under context parallelism this rank's global ones."""
        if self.context is None:
            positions = None if docs is None else docs.positions_BS
            return self.rope(h_BSD.shape[1], h_BSD.device, positions)
        if docs is None:
            positions = self.context.positions(h_BSD.device)
        else:
            positions = self.context.documents(docs).positions_BS
        return self.rope(self.context.seq_len, h_BSD.device, positions)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head (or the tied embedding) over normed hidden states; a stage without
        the head returns them as they are."""
        if self.lm_head is not None:
            return self.lm_head(h)
        if self.cfg.tie_embeddings and self.embed is not None:
            return F.linear(h, self.embed.weight)
        return h

    def losses(
        self,
        h_BSD: torch.Tensor,
        aux: torch.Tensor,
        e_BSD: torch.Tensor | None,
        tokens_BS1: torch.Tensor,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        mtp: bool = True,
        docs: Documents | None = None,
    ) -> Losses:
        """The last stage's losses from ``hidden``'s outputs over ``tokens`` (``[B, S + 1]``:
        inputs and targets): the next-token loss and, with ``mtp`` (training), each MTP
        depth's. Depth k's position i reads the embedding of input i + k + 1 and predicts
        token i + k + 2; the last k + 1 positions have no such token (embedding 0, target
        ignored), and causal attention keeps them from the others."""
        targets_BS = tokens_BS1[:, 1:]
        if self.context is not None:
            targets_BS = self.context.local(targets_BS)
        assert self.norm is not None
        ce = loss_fn(self.head(self.norm(h_BSD)), targets_BS)
        if not mtp or self.mtp is None:
            return Losses(ce, aux, ce.new_zeros(0))
        assert e_BSD is not None, "MTP needs the token embeddings (hidden's third output)"
        rope = self._rope(h_BSD, docs)
        ces = []
        for k, module in enumerate(self.mtp.values()):
            e_k = shifted(e_BSD, k + 1, 0.0)
            h_BSD, aux = module(h_BSD, e_k, aux, rope, docs)
            ces.append(loss_fn(self.head(module.norm(h_BSD)), shifted(targets_BS, k + 1, -100)))
        return Losses(ce, aux, torch.stack(ces))

    def blocks(self) -> Iterator[tuple[int, Block]]:
        """This model's (or stage's) blocks by global layer index: ``layers``, then the MTP
        modules' blocks as layers ``n_layers + k``."""
        for i, block in self.layers.items():
            yield int(i), block  # type: ignore[misc]
        for k, module in (self.mtp or {}).items():
            yield self.cfg.n_layers + int(k), module.block

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


def apply_context(model: Transformer, shard: ContextShard) -> None:
    """Split ``model``'s sequences over a context-parallel group (``parallel.cp``), in place:
    the model slices its inputs and targets, attention gathers keys and values, routers
    count their load-balancing shares over the group's tokens."""
    model.context = shard
    for m in model.modules():
        if isinstance(m, (Attention, LatentAttention)):
            m.context = shard
        if isinstance(m, Router):
            m.context_group, m.context_size = shard.group, shard.cp


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
