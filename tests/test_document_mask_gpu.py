"""Intra-document attention on the GPU: FlashAttention 4's varlen kernels and FlexAttention's
block mask (``parallel.attention=flex``) give what SDPA under the explicit document mask gives
(the reference), forward and gradients, for grouped-query and latent attention, eagerly and in
a compiled block whose micro-batches bring different numbers of documents."""

from __future__ import annotations

import copy

import pytest
import torch

from moe_core.config import ModelConfig
from moe_core.model.attention import Attention, LatentAttention, RotaryEmbedding
from moe_core.model.documents import documents_of
from moe_core.model.eager import seal
from moe_core.model.kernel_choice import Kernels

pytestmark = pytest.mark.gpu

S = 1024
EOS = 0

CONFIGS = {
    "gqa": dict(d_model=1024, n_heads=8, n_kv_heads=2, qk_norm="head", head_dim=128),
    "latent": dict(
        d_model=1024,
        n_heads=8,
        kv_lora_rank=256,
        q_lora_rank=384,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        qk_norm="none",
    ),
}


def _inputs(seed: int) -> torch.Tensor:
    """Two rows of tokens with EOS after documents of 1 to 600 tokens (a different count per
    seed)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 1000, (2, S), generator=gen)
    for row in tokens:
        at = 0
        while True:
            at += int(torch.randint(1, 600, (1,), generator=gen))
            if at >= S:
                break
            row[at] = EOS
    return tokens


@pytest.mark.parametrize("core", ["flash4", "flex"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_document_cores_equal_the_masked_reference(kind, compiled, core):
    if core == "flash4":
        pytest.importorskip("flash_attn.cute", reason="needs flash-attn-4")
    cfg = ModelConfig(max_seq_len=S, **CONFIGS[kind])
    torch.manual_seed(0)
    module = (LatentAttention if kind == "latent" else Attention)(cfg).cuda().to(torch.bfloat16)
    flash = copy.deepcopy(module)
    flash.kernels = Kernels(attention=core)
    rope_table = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
    seal()  # the model's compile boundaries (model.eager), as apply_compile does
    fn = torch.compile(flash) if compiled else flash
    torch._dynamo.reset()
    graphs = torch._dynamo.utils.counters["stats"]
    settled = None
    for seed in range(5):  # a new number of documents each time: no recompile per count
        if seed == 3:
            settled = graphs["unique_graphs"]
        docs = documents_of(_inputs(seed), EOS).to(torch.device("cuda"))
        rope = rope_table(S, torch.device("cuda"), docs.positions_BS)
        x = torch.randn(2, S, cfg.d_model, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        results = []
        for m, f in ((module, module), (flash, fn)):
            xi = x.clone().requires_grad_()
            y = f(xi, rope, docs)
            results.append((y, *torch.autograd.grad(y, [xi, *m.parameters()], dy)))
        for got, ref in zip(results[1], results[0], strict=True):
            scale = ref.float().abs().max().item()
            err = (got.float() - ref.float()).abs().max().item()
            assert err <= 2e-2 * scale + 1e-3, (kind, seed, err, scale)
    if compiled:  # after the first counts (one recompile makes them dynamic), no new graphs
        assert graphs["unique_graphs"] == settled, (settled, graphs["unique_graphs"])
