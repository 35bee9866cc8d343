"""Router losses against straightforward re-implementations; the expert-bias update balances."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import small_config

from moe_core.model.moe import Router, router_logits


def naive_lb_loss(probs_TE: torch.Tensor, experts_TK: torch.Tensor) -> torch.Tensor:
    T, E = probs_TE.shape
    K = experts_TK.shape[1]
    total = torch.zeros(())
    for e in range(E):
        share = sum(int((experts_TK[t] == e).sum()) for t in range(T)) / (T * K)
        mean_prob = sum(probs_TE[t, e] for t in range(T)) / T
        total = total + share * mean_prob
    return E * total


def naive_z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    rows = [math.log(sum(math.exp(v) for v in row.tolist())) ** 2 for row in logits_TE]
    return torch.tensor(sum(rows) / len(rows))


def test_aux_and_z_loss_match_naive_implementations():
    torch.manual_seed(0)
    for kind, top_k in (("softmax", 2), ("softmax", 1), ("sigmoid", 3)):
        cfg = small_config(
            n_experts=6,
            top_k=top_k,
            router=kind,
            aux_loss_coef=0.3,
            z_loss_coef=0.07,
            aux_loss_reduction="sum",  # one layer's terms as they are
        )
        router = Router(cfg)
        torch.nn.init.normal_(router.weight, std=0.5)
        x = torch.randn(40, cfg.d_model)
        r = router(x)
        logits = x @ router.weight.t()
        scores = logits.softmax(-1) if kind == "softmax" else logits.sigmoid()
        share = scores if kind == "softmax" else scores / scores.sum(-1, keepdim=True)
        expected_top = scores.topk(top_k, dim=-1).indices
        assert torch.equal(r.experts_TK, expected_top)
        lb = naive_lb_loss(share, r.experts_TK)
        z = naive_z_loss(logits.double())
        torch.testing.assert_close(router.stat_lb, lb, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(router.stat_z.double(), z.double(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r.aux_loss, 0.3 * lb + 0.07 * z.float(), rtol=1e-5, atol=1e-6)


def test_lb_loss_gradient_flows_to_router_weights():
    cfg = small_config(z_loss_coef=0.0, aux_loss_coef=1.0)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    router(torch.randn(32, cfg.d_model)).aux_loss.backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_top_k_normalization():
    cfg = small_config(normalize_top_k=True, top_k=3)
    router = Router(cfg)
    torch.nn.init.normal_(router.weight, std=0.5)
    r = router(torch.randn(16, cfg.d_model))
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.ones(16))


def test_expert_bias_moves_load_toward_uniform_on_a_skewed_router():
    torch.manual_seed(0)
    cfg = small_config(n_experts=8, top_k=2, expert_bias=True, expert_bias_rate=0.002)
    router = Router(cfg)
    router.reset_buffers()
    torch.nn.init.normal_(router.weight, std=0.02)
    with torch.no_grad():
        router.weight[0] += 0.05  # experts 0 and 1 win for inputs with a positive mean
        router.weight[1] += 0.03
    gen = torch.Generator().manual_seed(1)

    def step() -> float:
        """Route a fresh batch, update the bias from its load; return max/mean load."""
        router.reset_stats()
        router(torch.randn(512, cfg.d_model, generator=gen) + 0.5)
        counts = router.stat_counts_E.clone()
        router.update_bias(counts)
        return float(counts.max() / counts.float().mean())

    before = step()
    history = [step() for _ in range(300)]
    late = sum(history[-50:]) / 50
    assert before > 3.0, f"the router is not skewed enough to test ({before:.2f})"
    assert late < 1.4, f"max/mean load {before:.2f} -> {late:.2f} (mean of the last 50 steps)"
    # The bias steers selection only: combine weights are still the unbiased scores.
    x = torch.randn(64, cfg.d_model) + 0.5
    r = router(x)
    probs = (x @ router.weight.t()).softmax(-1)
    torch.testing.assert_close(r.weights_TK, probs.gather(1, r.experts_TK))
    assert not torch.equal(r.experts_TK, probs.topk(2, dim=-1).indices)


@pytest.mark.gpu
def test_bf16_router_logits_equal_the_fp32_gemm_of_the_upcast_inputs_gpu():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4096, 2048, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(64, 2048, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    g = torch.randn(4096, 64, device="cuda", generator=gen)
    x.requires_grad_(), w.requires_grad_()
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    logits.backward(g)
    x32, w32 = x.detach().float(), w.detach().float()
    # Exact products, fp32 sums in another order: fp32 rounding of a length-2048 sum.
    torch.testing.assert_close(logits, x32 @ w32.t(), rtol=1e-5, atol=1e-5)
    # The backward rounds the logits' gradient to bf16 first (as every bf16 GEMM's input is);
    # with that rounding the fp32 products are exact again, so only the summation order and
    # the final rounding to bf16 differ.
    g16 = g.to(torch.bfloat16).float()
    torch.testing.assert_close(w.grad, (g16.t() @ x32).to(torch.bfloat16), rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(x.grad, (g16 @ w32).to(torch.bfloat16), rtol=1e-2, atol=1e-4)
