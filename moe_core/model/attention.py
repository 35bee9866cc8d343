"""Causal self-attention with rotary embeddings: grouped-query heads (``Attention``) or
multi-head latent attention (``LatentAttention``, DeepSeek-V2/V3).

The block options of the families (``ModelConfig``): QK-norm over the whole projection (OLMoE),
per head (Qwen3, GLM-4.5) or none (Mixtral); a ``head_dim`` of its own; RoPE on the leading
``rotary_dim`` dimensions of each head (GLM-4.5 rotates half), the rest passed through; biases
on q, k, v (and o); YaRN frequency scaling (``YarnScaling``).

The attention core is torch's SDPA (cuDNN on Hopper) or, with ``kernels.attention == "flash4"``
(the module's ``Kernels``, from ``parallel.attention`` through ``parallelize``), FlashAttention 4's
CuTe kernels (``flash-attn-4``, the ``[gpu]`` extra): on one H200 at OLMoE-1B-7B's shape, forward +
backward 1.76 ms against SDPA's 2.03 ms (benchmarks/RESULTS.md); it runs bf16 and fp16 only, so
fp32 compute takes SDPA. Its call runs eagerly (a graph break in a compiled block, as the token
dispatch is): its kernels are compiled by CuTe's own compiler.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import ModelConfig
from moe_core.model.context import ContextShard, chunk_ids
from moe_core.model.documents import ContextVarlen, Documents
from moe_core.model.eager import eager
from moe_core.model.kernel_choice import Kernels
from moe_core.model.norm import RMSNorm


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 without stretching)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    """YaRN as DeepSeek-V3 configures it (and ``transformers``' "yarn" rope type computes it):
    each frequency blends its interpolated value (divided by ``factor``) with its original one,
    by a ramp over the dimensions that turn between ``beta_fast`` and ``beta_slow`` times over
    ``original_max_seq_len`` positions (rounded outwards); the tables are scaled by
    ``table_scale``, and latent attention's softmax scale by ``softmax_factor``."""

    factor: float
    original_max_seq_len: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float

    @classmethod
    def of(cls, cfg: ModelConfig) -> YarnScaling | None:
        if cfg.rope_scaling != "yarn":
            return None
        return cls(
            cfg.yarn_factor,
            cfg.yarn_original_max_seq_len,
            cfg.yarn_beta_fast,
            cfg.yarn_beta_slow,
            cfg.yarn_mscale,
            cfg.yarn_mscale_all_dim,
        )

    @property
    def table_scale(self) -> float:
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)

    @property
    def softmax_factor(self) -> float:
        """What DeepSeek multiplies latent attention's ``1 / sqrt(head_dim)`` by."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    def inv_freq(self, base_inv_freq: torch.Tensor, dim: int, theta: float) -> torch.Tensor:
        def turns_dim(turns: float) -> float:  # the dimension that turns ``turns`` times
            return (
                dim
                * math.log(self.original_max_seq_len / (turns * 2 * math.pi))
                / (2 * math.log(theta))
            )

        low = max(math.floor(turns_dim(self.beta_fast)), 0)
        high = min(math.ceil(turns_dim(self.beta_slow)), dim - 1)
        high = high + 0.001 if low == high else high  # no division by zero
        i = torch.arange(dim // 2, dtype=torch.float32, device=base_inv_freq.device)
        interpolate = ((i - low) / (high - low)).clamp(0, 1)
        return base_inv_freq / self.factor * interpolate + base_inv_freq * (1 - interpolate)


class RotaryEmbedding(nn.Module):
    """fp32 cos/sin tables, built lazily on the device of use (so meta-device builds, dtype
    casts and ``to_empty`` never touch them) and cached for the longest length seen;
    ``scaling``: YaRN's frequencies and table scale."""

    def __init__(self, head_dim: int, theta: float, scaling: YarnScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _build(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))
        if self.scaling is not None:
            inv_freq = self.scaling.inv_freq(inv_freq, self.head_dim, self.theta)
        pos = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs_SH = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
        if self.scaling is not None:
            scale = self.scaling.table_scale
            return freqs_SH.cos() * scale, freqs_SH.sin() * scale
        return freqs_SH.cos(), freqs_SH.sin()

    def forward(
        self, seq_len: int, device: torch.device, positions_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of positions 0 .. seq_len - 1 ([S, r]), or of each input's ``positions``
        ([B, S, r]: positions restarting per document, ``Documents``)."""
        tables = self._tables
        if tables is None or tables[0].device != device or tables[0].shape[0] < seq_len:
            tables = self._tables = self._build(seq_len, device)
        if positions_BS is not None:
            return tables[0][positions_BS], tables[1][positions_BS]
        return tables[0][:seq_len], tables[1][:seq_len]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x_BHSd: torch.Tensor, cos_Sr: torch.Tensor, sin_Sr: torch.Tensor) -> torch.Tensor:
    """RoPE on the leading ``r`` dimensions of each head (r: the tables' width), halves rotated
    as Llama and the ``transformers`` MoE classes do; the trailing dimensions pass through."""
    r = cos_Sr.shape[-1]
    if r == x_BHSd.shape[-1]:
        return x_BHSd * cos_Sr + _rotate_half(x_BHSd) * sin_Sr
    x_rot, x_pass = x_BHSd[..., :r], x_BHSd[..., r:]
    return torch.cat((x_rot * cos_Sr + _rotate_half(x_rot) * sin_Sr, x_pass), dim=-1)


def flash4_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None and (
        importlib.util.find_spec("flash_attn.cute") is not None
    )


HALF = (torch.bfloat16, torch.float16)  # the dtypes FlashAttention 4 runs


@eager
def _flash4(
    q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q_BSHd, k_BSHd, v_BSHd, softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out


def _varlen(
    q_THd: torch.Tensor,
    k_THd: torch.Tensor,
    v_THe: torch.Tensor,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor],
    max_lens: tuple[int, int],
    scale: float | None,
) -> torch.Tensor:
    from flash_attn.cute import flash_attn_varlen_func

    out = flash_attn_varlen_func(
        q_THd,
        k_THd,
        v_THe,
        cu_seqlens_q=cu_seqlens[0],
        cu_seqlens_k=cu_seqlens[1],
        max_seqlen_q=max_lens[0],
        max_seqlen_k=max_lens[1],
        softmax_scale=scale,
        causal=True,
    )
    return out[0] if isinstance(out, tuple) else out


@eager
def _flash4_varlen(
    q_THd: torch.Tensor,
    k_THd: torch.Tensor,
    v_THe: torch.Tensor,
    docs: Documents,
    scale: float | None = None,
) -> torch.Tensor:
    """FlashAttention 4 over the documents of a flattened batch (T = B * S tokens). ``docs``
    is read here, outside any compiled region, so its document count and longest document
    never become part of a compiled graph."""
    cu, longest = docs.cu_seqlens_N, docs.max_len
    return _varlen(q_THd, k_THd, v_THe, (cu, cu), (longest, longest), scale)


@eager
def _flash4_context_varlen(
    q_BHSd: torch.Tensor,
    k_BHKd: torch.Tensor,
    v_BHKe: torch.Tensor,
    layout: ContextVarlen,
    scale: float | None = None,
) -> torch.Tensor:
    """FlashAttention 4 over a context-parallel rank's document segments (``ContextVarlen``):
    [B, S, H * e] out. Eager for the reason ``_flash4_varlen`` is; the picked keys (a key in a
    document that both of the rank's chunks reach is picked twice) have their gradients summed
    back by ``index_select``'s backward."""
    B, H, S, _ = q_BHSd.shape
    q_THd = q_BHSd.transpose(1, 2).reshape(B * S, H, -1)
    k_THd, v_THe = (
        x.transpose(1, 2).flatten(0, 1).index_select(0, layout.key_index) for x in (k_BHKd, v_BHKe)
    )
    cu = (layout.cu_seqlens_q, layout.cu_seqlens_k)
    out = _varlen(q_THd, k_THd, v_THe, cu, (layout.max_len_q, layout.max_len_k), scale)
    return out.reshape(B, S, -1)


def _causal(b, h, q_idx, kv_idx):
    """FlexAttention's causal mask: a query sees its own and earlier keys."""
    return kv_idx <= q_idx


@functools.cache
def _causal_block_mask(S: int, device: torch.device) -> Any:
    """The causal block mask of length ``S`` (the same for every layer and step)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(_causal, None, None, S, S, device=device)


@eager
def _flex_block_mask(docs: Documents | None, B: int, S: int, device: torch.device) -> Any:
    """FlexAttention's block mask: causal, and with ``docs`` within each document (blocks no
    query of which sees a key of are skipped: no S x S mask). Made once per micro-batch, by the
    first layer that asks, and kept on ``docs`` for the others; eager, as the mask's tensors are
    data to the compiled blocks, never part of their graphs."""
    if docs is None:
        return _causal_block_mask(S, device)
    if docs.block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        doc_BS = torch.cumsum(docs.positions_BS == 0, dim=1)

        def within_document(b, h, q_idx, kv_idx):
            return (doc_BS[b, q_idx] == doc_BS[b, kv_idx]) & (kv_idx <= q_idx)

        docs.block_mask = create_block_mask(
            within_document, B, None, S, S, device=device, _compile=device.type == "cuda"
        )
    return docs.block_mask


def _flex(
    q_BHSd: torch.Tensor,
    k_BHSd: torch.Tensor,
    v_BHSe: torch.Tensor,
    scale: float | None,
    docs: Documents | None,
) -> torch.Tensor:
    """FlexAttention under the causal (or documents') block mask, [B, S, H * e] out: compiled
    with the block that calls it (fused, skipping the masked blocks), else torch's unfused
    reference (the CPU's eager blocks)."""
    from torch.nn.attention.flex_attention import flex_attention

    B, H, S, _ = q_BHSd.shape
    mask = _flex_block_mask(docs, B, S, q_BHSd.device)
    gqa = k_BHSd.shape[1] != H
    o_BHSe = flex_attention(q_BHSd, k_BHSd, v_BHSe, block_mask=mask, scale=scale, enable_gqa=gqa)
    return o_BHSe.transpose(1, 2).reshape(B, S, -1)


def causal_attention(
    q_BHSd: torch.Tensor,
    k_BHSd: torch.Tensor,
    v_BHSe: torch.Tensor,
    kernels: Kernels,
    scale: float | None = None,
    docs: Documents | None = None,
) -> torch.Tensor:
    """The attention core, [B, S, H * e] out: FlashAttention 4 where ``kernels`` picks it and
    it runs (CUDA, 16-bit), FlexAttention where it picks that, else SDPA (grouped-query heads
    where k, v have fewer heads). With ``docs`` a query sees only earlier keys of its own
    document: FlashAttention 4's varlen kernels, FlexAttention's block mask of the documents,
    or SDPA under the explicit mask (the reference; S^2 memory)."""
    B, H, S, _ = q_BHSd.shape
    if kernels.attention == "flex":
        return _flex(q_BHSd, k_BHSd, v_BHSe, scale, docs)
    if kernels.attention == "flash4" and q_BHSd.is_cuda and q_BHSd.dtype in HALF:
        if docs is not None:
            t = (x.transpose(1, 2).reshape(B * S, x.shape[1], -1) for x in (q_BHSd, k_BHSd, v_BHSe))
            return _flash4_varlen(*t, docs, scale).reshape(B, S, -1)
        t = (x.transpose(1, 2) for x in (q_BHSd, k_BHSd, v_BHSe))
        return _flash4(*t, scale).reshape(B, S, -1)
    gqa = k_BHSd.shape[1] != H
    if docs is not None:
        o_BHSe = F.scaled_dot_product_attention(
            q_BHSd, k_BHSd, v_BHSe, attn_mask=docs.mask(), scale=scale, enable_gqa=gqa
        )
    else:
        o_BHSe = F.scaled_dot_product_attention(
            q_BHSd, k_BHSd, v_BHSe, is_causal=True, scale=scale, enable_gqa=gqa
        )
    return o_BHSe.transpose(1, 2).reshape(B, S, -1)


def context_attention(
    q_BHSd: torch.Tensor,
    k_BHKd: torch.Tensor,
    v_BHKe: torch.Tensor,
    kernels: Kernels,
    shard: ContextShard,
    scale: float | None = None,
    docs: Documents | None = None,
) -> torch.Tensor:
    """The attention core under context parallelism, [B, S, H * e] out: this rank's queries
    (its head chunk, then its tail chunk) against the whole sequence's keys and values (K = cp
    x S, in sequence order, ``ContextShard.gather``). Each chunk attends the keys up to its own
    end, causally aligned at the bottom right (its last query sees every one of them):
    FlashAttention 4's causal kernel where ``kernels`` picks it and it runs, else SDPA under
    that mask. With ``docs``: FlashAttention 4's varlen kernel over the rank's document
    segments (``context.context_varlen``) where it runs and the layout came with ``docs``, else
    one SDPA under the documents' mask between this rank's queries and every key."""
    B, H, S, _ = q_BHSd.shape
    gqa = k_BHKd.shape[1] != H
    flash = kernels.attention == "flash4" and q_BHSd.is_cuda and q_BHSd.dtype in HALF
    if docs is not None:
        mine = shard.documents(docs)
        if flash and mine.context is not None:
            return _flash4_context_varlen(q_BHSd, k_BHKd, v_BHKe, mine.context, scale)
        mask = mine.mask()
        o_BHSe = F.scaled_dot_product_attention(
            q_BHSd, k_BHKd, v_BHKe, attn_mask=mask, scale=scale, enable_gqa=gqa
        )
        return o_BHSe.transpose(1, 2).reshape(B, S, -1)
    c = shard.chunk
    outs = []
    for i, chunk in enumerate(chunk_ids(shard.cp, shard.rank)):
        end = (chunk + 1) * c
        q_c, k_c, v_c = q_BHSd[:, :, i * c : (i + 1) * c], k_BHKd[:, :, :end], v_BHKe[:, :, :end]
        if flash:
            t = (x.transpose(1, 2) for x in (q_c, k_c, v_c))
            outs.append(_flash4(*t, scale).reshape(B, c, -1))
            continue
        keys = torch.arange(end, device=q_BHSd.device)
        mask_cK = keys[None, :] <= keys[chunk * c :, None]
        o_BHce = F.scaled_dot_product_attention(
            q_c, k_c, v_c, attn_mask=mask_cK, scale=scale, enable_gqa=gqa
        )
        outs.append(o_BHce.transpose(1, 2).reshape(B, c, -1))
    return torch.cat(outs, dim=1)


class Attention(nn.Module):
    """q/k/v/o projections (biases as ``model.attention_bias`` says), QK-norm as
    ``model.qk_norm`` says (``q_norm``/``k_norm`` None without one), RoPE, causal attention."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        assert self.head_dim is not None
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        qkv_bias, o_bias = cfg.attention_bias != "none", cfg.attention_bias == "qkvo"
        self.q_proj = nn.Linear(cfg.d_model, q_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(cfg.d_model, kv_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.d_model, bias=o_bias)
        self.qk_norm = cfg.qk_norm
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm != "none":
            per_head = cfg.qk_norm == "head"
            self.q_norm = RMSNorm(self.head_dim if per_head else q_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim if per_head else kv_dim, cfg.norm_eps)
        self.kernels = Kernels()  # its ``attention`` field picks the core (module docstring)
        self.context: ContextShard | None = None  # parallel.cp > 1: this rank's sequence slice

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """``rope``: cos/sin tables, [S, r] or per input ([B, S, r], ``docs``' positions)."""
        B, S, _ = x_BSD.shape
        q, k = self.q_proj(x_BSD), self.k_proj(x_BSD)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q_BSHd = q.view(B, S, self.n_heads, self.head_dim)
        k_BSHd = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHd, k_BSHd = self.q_norm(q_BSHd), self.k_norm(k_BSHd)  # type: ignore[misc]
        v = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = (t.to(q.dtype).unsqueeze(-3) for t in rope)  # a heads axis: [(B,) 1, S, r]
        q = apply_rotary(q_BSHd.transpose(1, 2), cos, sin)
        k = apply_rotary(k_BSHd.transpose(1, 2), cos, sin)
        if self.context is not None:  # every rank's keys and values, then this rank's queries
            k, v = self.context.gather(k, 2), self.context.gather(v, 2)
            return self.o_proj(context_attention(q, k, v, self.kernels, self.context, docs=docs))
        return self.o_proj(causal_attention(q, k, v, self.kernels, docs=docs))


# DeepSeek's norms of the compressed query and key-value (its reference's RMSNorm default, and
# transformers' for these two whatever rms_norm_eps says)
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3; ``model.kv_lora_rank`` set).

    Queries: ``q_b_proj(q_a_norm(q_a_proj(x)))`` through a rank-``q_lora_rank`` compression, or
    ``q_proj(x)``. Keys and values: ``kv_a_proj(x)`` gives the compressed key-value of width
    ``kv_lora_rank`` (RMS-normed, then ``kv_b_proj`` expands it to each head's non-rotary key
    and value) and one rotary key of ``qk_rope_head_dim`` shared by every head. A query/key head
    is [non-rotary; rotary] (``head_dim`` wide), a value head ``v_head_dim``; the core takes
    the unequal widths as they are (FlashAttention 4's 192/128 kernels, or SDPA). RoPE rotates
    halves, as ``Attention`` does; checkpoints whose rotary rows are interleaved (DeepSeek's
    own) are permuted on import and export (``convert.families``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.kv_lora_rank is not None and cfg.qk_nope_head_dim is not None
        assert cfg.qk_rope_head_dim is not None and cfg.v_head_dim is not None
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.nope, self.rope, self.v_dim = (
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.v_head_dim,
        )
        self.kv_rank = cfg.kv_lora_rank
        D, H = cfg.d_model, cfg.n_heads
        q_dim = H * (self.nope + self.rope)
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_norm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(D, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_dim, bias=False)
        self.kv_a_proj = nn.Linear(D, self.kv_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.kv_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, D, bias=False)
        yarn = YarnScaling.of(cfg)
        self.scale = (self.nope + self.rope) ** -0.5 * (yarn.softmax_factor if yarn else 1.0)
        self.kernels = Kernels()  # its ``attention`` field picks the core (module docstring)
        # parallel.cp > 1: this rank's sequence slice; the compressed key-value and the rotary
        # key are gathered (kv_lora_rank + qk_rope_head_dim per token, not every head's keys
        # and values), then expanded for the whole sequence on every rank
        self.context: ContextShard | None = None

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        docs: Documents | None = None,
    ) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        H, nope, r = self.n_heads, self.nope, self.rope
        if self.q_proj is not None:
            q = self.q_proj(x_BSD)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_BSD)))  # type: ignore[misc]
        # token-major throughout ([B, S, H, .]), so the core's output is token-major too and
        # the o-projection reads it without a copy
        q_BSHd = q.view(B, S, H, nope + r)
        c_kv, k_rope = self.kv_a_proj(x_BSD).split([self.kv_rank, r], dim=-1)
        cos, sin = (t.to(q.dtype).unsqueeze(-2) for t in rope)  # a heads axis: [(B,) S, 1, r]
        q_rope_BSHr = apply_rotary(q_BSHd[..., nope:], cos, sin)
        k_rope_BS1r = apply_rotary(k_rope.view(B, S, 1, r), cos, sin)
        q_BSHd = torch.cat([q_BSHd[..., :nope], q_rope_BSHr], dim=-1)
        return self.o_proj(self.attend(q_BSHd, self.kv_a_norm(c_kv), k_rope_BS1r, docs))

    def attend(
        self,
        q_BSHd: torch.Tensor,
        c_kv_BSc: torch.Tensor,
        k_rope_BS1r: torch.Tensor,
        docs: Documents | None = None,
    ) -> torch.Tensor:
        """Keys and values expanded from the (normed) compressed key-value, then the core:
        [B, S, H * v_head_dim]. Selective recompute (``parallel.recompute``) runs this again in
        backward, so a block keeps q and the compressed key-value, not the expanded keys and
        values nor the core's own saved tensors."""
        B, _, H, _ = q_BSHd.shape
        nope, r = self.nope, self.rope
        if self.context is not None:
            c_kv_BSc, k_rope_BS1r = (
                self.context.gather(c_kv_BSc, 1),
                self.context.gather(k_rope_BS1r, 1),
            )
        S = c_kv_BSc.shape[1]  # the keys' length: the whole sequence's under context parallelism
        kv = self.kv_b_proj(c_kv_BSc).view(B, S, H, nope + self.v_dim)
        k_nope_BSHn, v_BSHv = kv.split([nope, self.v_dim], dim=-1)
        k_BSHd = torch.cat([k_nope_BSHn, k_rope_BS1r.expand(B, S, H, r)], dim=-1)
        q_BHSd, k_BHSd, v_BHSv = (t.transpose(1, 2) for t in (q_BSHd, k_BSHd, v_BSHv))
        if self.context is not None:
            return context_attention(
                q_BHSd, k_BHSd, v_BHSv, self.kernels, self.context, self.scale, docs
            )
        return causal_attention(q_BHSd, k_BHSd, v_BHSv, self.kernels, self.scale, docs)
