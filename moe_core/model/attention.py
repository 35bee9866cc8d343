"""Causal self-attention with rotary embeddings, QK-norm and grouped-query heads.

The block options of the families (``ModelConfig``): QK-norm over the whole projection (OLMoE),
per head (Qwen3, GLM-4.5) or none (Mixtral); a ``head_dim`` of its own; RoPE on the leading
``rotary_dim`` dimensions of each head (GLM-4.5 rotates half), the rest passed through; biases
on q, k, v (and o).

The attention core is torch's SDPA (cuDNN on Hopper) or, with ``kernels.attention == "flash4"``
(the module's ``Kernels``, from ``parallel.attention`` through ``parallelize``), FlashAttention 4's
CuTe kernels (``flash-attn-4``, the ``[gpu]`` extra): on one H200 at OLMoE-1B-7B's shape, forward +
backward 1.76 ms against SDPA's 2.03 ms (benchmarks/RESULTS.md); it runs bf16 and fp16 only, so
fp32 compute takes SDPA. Its call runs eagerly (a graph break in a compiled block, as the token
dispatch is): its kernels are compiled by CuTe's own compiler.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import ModelConfig
from moe_core.model.eager import eager
from moe_core.model.kernel_choice import Kernels
from moe_core.model.norm import RMSNorm


class RotaryEmbedding(nn.Module):
    """fp32 cos/sin tables, built lazily on the device of use (so meta-device builds, dtype
    casts and ``to_empty`` never touch them) and cached for the longest length seen."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _build(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.theta ** (exponent / self.head_dim))
        pos = torch.arange(seq_len, dtype=torch.float32, device=device)
        freqs_SH = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
        return freqs_SH.cos(), freqs_SH.sin()

    def forward(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        tables = self._tables
        if tables is None or tables[0].device != device or tables[0].shape[0] < seq_len:
            tables = self._tables = self._build(seq_len, device)
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


@eager
def _flash4(q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor) -> torch.Tensor:
    from flash_attn.cute import flash_attn_func

    out = flash_attn_func(q_BSHd, k_BSHd, v_BSHd, causal=True)
    return out[0] if isinstance(out, tuple) else out


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

    def forward(self, x_BSD: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        q, k = self.q_proj(x_BSD), self.k_proj(x_BSD)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)  # type: ignore[misc]
        q_BSHd = q.view(B, S, self.n_heads, self.head_dim)
        k_BSHd = k.view(B, S, self.n_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q_BSHd, k_BSHd = self.q_norm(q_BSHd), self.k_norm(k_BSHd)  # type: ignore[misc]
        v = self.v_proj(x_BSD).view(B, S, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos_Sr, sin_Sr = rope
        q = apply_rotary(q_BSHd.transpose(1, 2), cos_Sr.to(q.dtype), sin_Sr.to(q.dtype))
        k = apply_rotary(k_BSHd.transpose(1, 2), cos_Sr.to(k.dtype), sin_Sr.to(k.dtype))
        half = q.dtype in (torch.bfloat16, torch.float16)
        if self.kernels.attention == "flash4" and q.is_cuda and half:
            o_BSHd = _flash4(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
            return self.o_proj(o_BSHd.reshape(B, S, -1))
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )
        return self.o_proj(o.transpose(1, 2).reshape(B, S, -1))
