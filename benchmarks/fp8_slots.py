"""FP8 row operands written by their producers (issue 41, item 2) at OLMoE-1B-7B's MoE layer
on one GPU: the permute that quantizes token rows into their slots against the permute and a
quantizer reading its copy back, the same for the sum's backward (dy), and the experts' MLP
between permute and sum as one op (``fp8_routed_mlp``) against the composition it replaces.

    python benchmarks/fp8_slots.py --out results.json

One micro-batch of 4 x 4096 tokens, top-8 of 64 experts routed from random logits, bf16. Each
pair's outputs are checked equal (bytes; the layer's output and every gradient) before timing;
the candidates of a pair are timed interleaved (CUDA events, median of ``--iters`` after
``--warmup``); the layer's peak is the allocator's high-water mark over one forward and
backward above what was allocated before it.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms

from moe_kernels import slot_permute_triton
from moe_kernels.fp8 import fp8_expert_mlp, fp8_routed_mlp, quantize_rowwise, quantize_to_slots
from moe_kernels.routing import expert_slots
from moe_kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots


def timed(phases, warmup: int, iters: int) -> dict[str, float]:
    times = cuda_phase_times_ms(phases, warmup, iters)
    return {name: statistics.median(ms) for name, ms in times.items()}


def equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4 * 4096)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    cfg = olmoe()
    T, D, F, E, K = args.tokens, cfg.d_model, cfg.expert_hidden, cfg.n_experts, cfg.top_k
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(bf16)

    logits = torch.randn(T, E, device="cuda", generator=gen)
    weights_TK, experts_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    slots = expert_slots(experts_TK, E)
    slot_TK, n_rows, offs_E = slots.slot_TK, slots.n_rows, slots.offs_E
    x_TD, dy_TD = randn(T, D), randn(T, D)
    results: dict[str, dict] = {}

    # the forward's producer: permute, then quantize the copy / quantize into the slots
    def before_x():
        return quantize_rowwise(permute_to_slots(x_TD, slot_TK, n_rows))

    def now_x():
        return quantize_to_slots(x_TD, slot_TK, n_rows)[:2]

    assert all(equal(a, b) for a, b in zip(before_x(), now_x(), strict=True))
    results["x rows"] = timed([("before", before_x), ("now", now_x)], args.warmup, args.iters)

    # the backward's: the sum's backward writes dy into the slots, bf16 kept for the weight
    # gradient, and the E4M3 rows for the input gradient
    def before_dy():
        rows = slot_permute_triton.scatter_rows(dy_TD, slot_TK, n_rows)
        return (*quantize_rowwise(rows), rows)

    def now_dy():
        return quantize_to_slots(dy_TD, slot_TK, n_rows, keep_rows=True)

    assert all(equal(a, b) for a, b in zip(before_dy(), now_dy(), strict=True))
    results["dy rows"] = timed([("before", before_dy), ("now", now_dy)], args.warmup, args.iters)

    # the layer's experts between permute and sum, forward and backward
    w_gu = randn(E, 2 * F, D, scale=0.02).requires_grad_()
    w_d = randn(E, D, F, scale=0.02).requires_grad_()
    x = x_TD.clone().requires_grad_()
    w_TK = weights_TK.clone().requires_grad_()
    leaves = (x, w_gu, w_d, w_TK)

    def before_layer():
        x_MD = permute_to_slots(x, slot_TK, n_rows)
        y_MD = fp8_expert_mlp(x_MD, w_gu, w_d, offs_E, slot_weights(w_TK, slot_TK, n_rows))
        y = sum_from_slots(y_MD, slot_TK)
        return (y, *torch.autograd.grad(y, leaves, dy_TD))

    def now_layer():
        weight_M = slot_weights(w_TK, slot_TK, n_rows)
        y = fp8_routed_mlp(x, slot_TK, n_rows, w_gu, w_d, offs_E, weight_M)
        return (y, *torch.autograd.grad(y, leaves, dy_TD))

    assert all(equal(a, b) for a, b in zip(before_layer(), now_layer(), strict=True))
    layer = timed([("before", before_layer), ("now", now_layer)], args.warmup, args.iters)
    for name, fn in (("before", before_layer), ("now", now_layer)):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        layer[f"{name}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    results["layer fwd+bwd"] = layer
    for name, r in results.items():
        r["speedup"] = r["before"] / r["now"]
        print(name, json.dumps(r))
    report = {
        "benchmark": "fp8_slots",
        **stamp(args.commit),
        "shape": {"tokens": T, "d_model": D, "expert_hidden": F, "experts": E, "top_k": K},
        "results": results,
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
