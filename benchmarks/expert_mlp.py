"""The experts' SwiGLU MLP fused into QuACK's GEMM epilogues (``moe_kernels.expert_mlp``) against
the unfused ops, and the tile configurations of its epilogue GEMMs (one H200 or other sm90+).

    python benchmarks/expert_mlp.py --out results.json [--configs]

The op: forward + backward on 16,384 tokens of d_model 2048 through experts of hidden 1024,
64 experts top-8 (OLMoE-1B-7B) and 128 experts top-4 (the pool sweep's largest), learned-like
skewed routing (counts drawn from a random router), router weights on, the same random inputs
for every variant; median of CUDA-event timings after warm-up (``timing.cuda_times_ms``).
``--configs`` also times each GEMM of the fused op alone (the three with epilogues and the
three plain ones of the backward: the interleaved gate+up input and weight gradients and the
down weight gradient) under candidate QuACK tile configurations (tile M x N, pingpong or
cooperative, cluster), at both shapes, to pick the pinned ones.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms, cuda_times_ms

from moe_kernels import expert_mlp

CFG = olmoe()
TOKENS = 16384


def routed_counts(n_experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """Expert counts of a random softmax router's top-k (skewed, as at initialization)."""
    x = torch.randn(TOKENS, CFG.d_model, device="cuda", generator=gen)
    w = torch.randn(n_experts, CFG.d_model, device="cuda", generator=gen) * 0.02
    top = (x @ w.t()).topk(top_k, dim=-1).indices
    return torch.bincount(top.flatten(), minlength=n_experts)


def operands(n_experts: int, top_k: int, seed: int = 0) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = routed_counts(n_experts, top_k, gen)
    M, D, F_ = int(counts.sum()), CFG.d_model, CFG.expert_hidden

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, device="cuda", generator=gen) * scale
        return t.to(torch.bfloat16).requires_grad_()

    return {
        "x": rand(M, D),
        "w_gate_up": rand(n_experts, 2 * F_, D, scale=0.02),
        "w_down": rand(n_experts, D, F_, scale=0.02),
        "offs": counts.cumsum(0).to(torch.int32),
        "weight": torch.rand(M, device="cuda", generator=gen).requires_grad_(),
        "dy": torch.randn(M, D, device="cuda", generator=gen).to(torch.bfloat16),
        "counts": counts,
    }


def time_op(ops: dict, fused: bool, warmup: int, iters: int) -> float:
    args = [ops[k] for k in ("x", "w_gate_up", "w_down", "offs", "weight")]
    choice = {"backend": "quack", "fused": fused}  # both paths on QuACK's grouped GEMMs
    assert expert_mlp.fuses(*args[:3], **choice) == fused

    def step() -> None:
        y = expert_mlp.expert_mlp(*args, **choice)
        y.backward(ops["dy"])

    return statistics.median(cuda_times_ms(step, warmup, iters))


def candidate_configs() -> list:
    from quack.gemm_config import GemmConfig

    shapes = [  # tile M, tile N, pingpong, cluster M, cluster N, dynamic persistent scheduler
        (128, 192, True, 2, 1, False),  # QuACK's sm90 default
        (128, 192, True, 2, 1, True),  # ... with the dynamic scheduler
        (128, 128, True, 1, 2, False),  # the pin
        (128, 128, True, 1, 2, True),
        (128, 128, True, 2, 1, False),
        (128, 256, False, 2, 1, False),
        (256, 128, False, 2, 1, False),
    ]
    return [
        GemmConfig(
            tile_m=m, tile_n=n, pingpong=pp, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=dyn
        )
        for m, n, pp, cm, cn, dyn in shapes
    ]


def sweep_configs(ops: dict, warmup: int, iters: int, rounds: int) -> list[dict]:
    """Each GEMM of the fused op alone, per candidate config (and scheduler): the median of
    ``iters x rounds`` timings taken with the configs interleaved (one of each per iteration).
    Timed config after config instead, the GPU's clocks drifted by up to 15 % between the first
    configs and the last (the 3-round sweep of 2026-12-02 in RESULTS.md)."""
    from quack.gemm_interface import gemm_act, gemm_dgated, gemm_tuned

    from moe_kernels import grouped_gemm_quack as quack

    x, wgu, wd = ops["x"].detach(), ops["w_gate_up"].detach(), ops["w_down"].detach()
    cu = torch.nn.functional.pad(ops["offs"], (1, 0))
    scale = ops["weight"].detach().float().clone()
    h, a = quack.swiglu_mm(x, wgu, ops["offs"])
    dy = ops["dy"]
    dh = torch.randn_like(h)
    G, F_ = wd.shape[0], wd.shape[-1]
    M, D = x.shape
    flops = dict.fromkeys(("gate_up_swiglu", "dgrad_gate_up", "wgrad_gate_up"), 4 * M * D * F_)
    flops |= dict.fromkeys(("down_dswiglu", "down_scaled", "wgrad_down"), 2 * M * D * F_)
    dx = x.new_empty(M, D)
    dw_gu, dw_d = wgu.new_empty(G, 2 * F_, D), wd.new_empty(G, D, F_)

    def gemm_calls(cfg) -> dict:
        return {
            "gate_up_swiglu": lambda: gemm_act(
                x, wgu.mT, activation="swiglu", cu_seqlens_m=cu, concat_layout=("B",), config=cfg
            ),
            "down_dswiglu": lambda: gemm_dgated(
                dy,
                wd,
                h,
                activation="swiglu",
                colvec_scale=scale,
                colvec_reduce=True,
                cu_seqlens_m=cu,
                config=cfg,
            ),
            "down_scaled": lambda: quack._scale_rows(
                a, wd.mT, cu_seqlens_m=cu, config=cfg, scale_M=scale
            ),
            "dgrad_gate_up": lambda: gemm_tuned.fn(
                dh, wgu, dx, cu_seqlens_m=cu, concat_layout=("B",), config=cfg
            ),
            "wgrad_gate_up": lambda: gemm_tuned.fn(
                dh.t(), x, dw_gu, cu_seqlens_k=cu, concat_layout=("out",), config=cfg
            ),
            "wgrad_down": lambda: gemm_tuned.fn(dy.t(), a, dw_d, cu_seqlens_k=cu, config=cfg),
        }

    configs = candidate_configs()
    rows = []
    for name in flops:
        phases, errors = [], {}
        for i, cfg in enumerate(configs):
            fn = gemm_calls(cfg)[name]
            try:
                fn()  # compiles; a config a kernel cannot take is recorded, not fatal
                phases.append((str(i), fn))
            except Exception as e:
                errors[i] = f"{type(e).__name__}: {str(e)[:160]}"
        # Every iteration runs each config once in turn: clock and power drift reach all alike.
        times = cuda_phase_times_ms(phases, warmup, iters * rounds)
        for i, cfg in enumerate(configs):
            ms = statistics.median(times[str(i)]) if str(i) in times else None
            rows.append(
                {
                    "kernel": name,
                    "tile": f"{cfg.tile_m}x{cfg.tile_n}",
                    "pingpong": cfg.pingpong,
                    "cluster": f"{cfg.cluster_m}x{cfg.cluster_n}",
                    "dynamic": cfg.is_dynamic_persistent,
                    "ms": ms,
                    "tflops": None if ms is None else flops[name] / ms / 1e9,
                    "error": errors.get(i),
                }
            )
            print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--configs", action="store_true", help="also sweep the GEMMs' tile configs")
    p.add_argument("--rounds", type=int, default=3, help="--configs: iterations x this")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    results = {}
    for n_experts, top_k in ((CFG.n_experts, CFG.top_k), (128, 4)):
        ops = operands(n_experts, top_k)
        fused = time_op(ops, True, args.warmup, args.iters)
        unfused = time_op(ops, False, args.warmup, args.iters)
        flops = 3 * 2 * ops["x"].shape[0] * CFG.d_model * 3 * CFG.expert_hidden
        key = f"{n_experts}e_top{top_k}"
        results[key] = {
            "rows": ops["x"].shape[0],
            "counts_min_max": [int(ops["counts"].min()), int(ops["counts"].max())],
            "fused_ms": fused,
            "unfused_ms": unfused,
            "fused_tflops": flops / fused / 1e9,
            "unfused_tflops": flops / unfused / 1e9,
            "speedup": unfused / fused,
        }
        print(key, json.dumps(results[key]))
        if args.configs:
            results[key]["configs"] = sweep_configs(ops, args.warmup, args.iters, args.rounds)
    report = {
        "benchmark": "expert_mlp",
        **stamp(args.commit),
        "tokens": TOKENS,
        "d_model": CFG.d_model,
        "expert_hidden": CFG.expert_hidden,
        "results": results,
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
