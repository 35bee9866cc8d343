"""Documents under context parallelism on the GPU: FlashAttention 4's varlen kernel over a
rank's document segments (``context.context_varlen``, bottom-right causal per segment) gives
what SDPA under the rank's document mask gives (the reference, fp32), outputs and gradients,
for grouped-query heads and latent attention's unequal widths. Needs a GPU and flash-attn-4
(``pytest -m gpu``); the CPU tests check the layout and the call's wiring against an SDPA
stand-in for the kernel (tests/test_context_parallel.py)."""

from __future__ import annotations

import pytest
import torch

from moe_core.model.attention import context_attention
from moe_core.model.context import ContextShard, with_layout
from moe_core.model.documents import documents_of
from moe_core.model.kernel_choice import Kernels

pytestmark = pytest.mark.gpu
pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4")

S, EOS = 2048, 0


def _inputs(seed: int) -> torch.Tensor:
    """Two rows: one document across the whole first row, documents of 1 to 700 tokens in the
    second (they cross the chunks' edges unevenly)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (2, S), generator=gen)
    at = 0
    while (at := at + int(torch.randint(1, 700, (1,), generator=gen))) < S:
        tokens[1, at] = EOS
    return tokens


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    "kv_heads, qk_width, v_width", [(2, 128, 128), (8, 192, 128)], ids=["gqa", "latent-widths"]
)
def test_flash4_varlen_under_cp_equals_the_masked_reference(cp, kv_heads, qk_width, v_width):
    H, cuda = 8, torch.device("cuda")
    docs = documents_of(_inputs(cp), EOS)
    gen = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        shard = ContextShard(cp, rank, S)
        mine = with_layout(docs, cp, rank).to(cuda)
        q = torch.randn(2, H, S // cp, qk_width, generator=gen).to(cuda, torch.bfloat16)
        k = torch.randn(2, kv_heads, S, qk_width, generator=gen).to(cuda, torch.bfloat16)
        v = torch.randn(2, kv_heads, S, v_width, generator=gen).to(cuda, torch.bfloat16)
        dy = torch.randn(2, S // cp, H * v_width, generator=gen).to(cuda, torch.bfloat16)
        results = []
        for kernels, dtype in ((Kernels(), torch.float32), (Kernels(attention="flash4"), None)):
            xs = [x.to(dtype or x.dtype).requires_grad_() for x in (q, k, v)]
            y = context_attention(*xs, kernels, shard, qk_width**-0.5, mine)
            results.append((y, *torch.autograd.grad(y, xs, dy.to(y.dtype))))
        for got, ref in zip(results[1], results[0], strict=True):
            scale = ref.float().abs().max().item()
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= 2e-2 * scale + 1e-3, (rank, err, scale)
