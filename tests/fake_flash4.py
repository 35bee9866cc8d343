"""A CPU stand-in for the two ``flash-attn-4`` entry points that
``benchmarks/baselines/flash4_op.py`` calls (``flash_attn.cute.interface._flash_attn_fwd`` and
``_flash_attn_bwd``), written from their
documented semantics (causal softmax attention with scale 1/sqrt(head_dim), the log-sum-exp
returned per [batch, head, query]; grouped-query heads share k and v), in fp32, so the ops'
wiring (layouts, which gradient goes where, autograd, tracing) is exercised where the library
cannot run. The GPU tests hold the real library to SDPA.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterator

import torch


def _scores(q_BSHd: torch.Tensor, k_BSHd: torch.Tensor) -> torch.Tensor:
    """Causal, scaled scores [B, H, S, S] in fp32, k's heads repeated for grouped queries."""
    H, Hkv, d = q_BSHd.shape[2], k_BSHd.shape[2], q_BSHd.shape[3]
    q = q_BSHd.float().transpose(1, 2)
    k = k_BSHd.float().transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    s = q @ k.transpose(-1, -2) / d**0.5
    S = s.shape[-1]
    causal = torch.ones(S, S, dtype=torch.bool, device=s.device).tril()
    return s.masked_fill(~causal, float("-inf"))


def _attend(q_BSHd: torch.Tensor, k_BSHd: torch.Tensor, v_BSHd: torch.Tensor) -> torch.Tensor:
    H, Hkv = q_BSHd.shape[2], k_BSHd.shape[2]
    v = v_BSHd.float().transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
    return (_scores(q_BSHd, k_BSHd).softmax(-1) @ v).transpose(1, 2)


def _flash_attn_fwd(q, k, v, causal=False, return_lse=False, **_):
    assert causal and return_lse, "kernels.flash4 asks for causal attention and its lse"
    for t in (q, k, v):
        assert t.stride(-1) == 1, "the library takes a contiguous last dimension"
    out = _attend(q, k, v).to(q.dtype).contiguous()  # the library allocates it contiguous
    lse = _scores(q, k).logsumexp(-1)
    return out, lse, None, None, None


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, **_):
    """The softmax attention's gradients by hand (custom ops run below autograd, so the
    stand-in cannot ask autograd for them): dV = P^T dO, dS = P (dO V^T - rowsum(dO O)),
    dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d), summed over the queries sharing a k, v head."""
    assert causal and softmax_scale is None
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    H, Hkv, d = q.shape[2], k.shape[2], q.shape[3]
    p = (_scores(q, k) - lse[..., None]).exp()  # [B, H, S, S]
    q32, do, o = (t.float().transpose(1, 2) for t in (q, dout, out))
    k32, v32 = (t.float().transpose(1, 2).repeat_interleave(H // Hkv, dim=1) for t in (k, v))
    ds = p * (do @ v32.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq = ds @ k32 / d**0.5
    dk = ds.transpose(-1, -2) @ q32 / d**0.5
    dv = p.transpose(-1, -2) @ do

    def per_kv_head(g: torch.Tensor) -> torch.Tensor:  # [B, H, S, d] -> [B, S, Hkv, d]
        return g.unflatten(1, (Hkv, H // Hkv)).sum(2).transpose(1, 2)

    grads = (dq.transpose(1, 2), per_kv_head(dk), per_kv_head(dv))
    # The library allocates each gradient ``empty_like`` its (aligned) input.
    return tuple(torch.empty_like(t).copy_(g) for g, t in zip(grads, (q, k, v), strict=True))


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """Inside: ``import flash_attn.cute.interface`` finds the stand-in."""
    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = _flash_attn_fwd, _flash_attn_bwd
    cute = types.ModuleType("flash_attn.cute")
    cute.interface = interface
    root = types.ModuleType("flash_attn")
    root.cute = cute
    names = {"flash_attn": root, "flash_attn.cute": cute, "flash_attn.cute.interface": interface}
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(names)
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
