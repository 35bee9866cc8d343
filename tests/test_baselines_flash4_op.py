"""FlashAttention 4 as custom ops (``benchmarks/baselines/flash4_op.py``), on CPU with a
stand-in for the library (``fake_flash4``): the output and every gradient equal SDPA's, with
grouped-query heads and transposed (non-contiguous) inputs; ``torch.compile`` traces the op
without a graph break; the ops' fake (meta) implementations agree with the real ones
(``torch.library.opcheck``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from fake_flash4 import installed

from benchmarks.baselines.flash4_op import flash4_attention, flash4_bwd, flash4_fwd

B, S, H, D = 2, 16, 4, 8


def _inputs(kv_heads: int, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v as [B, S, H, d] views of [B, H, S, d] tensors (as the model passes them)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, S, D, generator=gen)
    k, v = (torch.randn(B, kv_heads, S, D, generator=gen) for _ in range(2))
    return [t.transpose(1, 2).requires_grad_() for t in (q, k, v)]


def _sdpa(q_BSHd, k_BSHd, v_BSHd) -> torch.Tensor:
    q, k, v = (t.transpose(1, 2) for t in (q_BSHd, k_BSHd, v_BSHd))
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa).transpose(1, 2)


@pytest.mark.parametrize("kv_heads", [H, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flash4_op_equals_sdpa_with_every_gradient(kv_heads, compiled):
    fn = torch.compile(flash4_attention, backend="aot_eager", fullgraph=True)
    fn = fn if compiled else flash4_attention
    dy = torch.randn(B, S, H, D, generator=torch.Generator().manual_seed(9))
    results = []
    with installed():
        for attend in (_sdpa, fn):
            q, k, v = _inputs(kv_heads)
            y = attend(q, k, v)
            results.append((y, *torch.autograd.grad(y, (q, k, v), dy)))
    for name, got, ref in zip(["out", "dq", "dk", "dv"], results[1], results[0], strict=True):
        assert got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)


def test_flash4_ops_pass_opcheck():
    """Schemas, fake implementations (shapes and dtypes under tracing) and autograd
    registration, checked by PyTorch's own op tester against the implementations."""
    with installed():
        q, k, v = _inputs(2)
        torch.library.opcheck(flash4_fwd, (q, k, v))
        out, lse = flash4_fwd(q.detach(), k.detach(), v.detach())
        dout = torch.randn_like(out)
        args = (dout, q.detach(), k.detach(), v.detach(), out, lse)
        torch.library.opcheck(flash4_bwd, args)
