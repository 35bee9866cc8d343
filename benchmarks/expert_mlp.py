"""The experts' SwiGLU MLP fused into QuACK's GEMM epilogues (``kernels.expert_mlp``) against
the unfused ops, and the tile configurations of its epilogue GEMMs (one H200 or other sm90+).

    python benchmarks/expert_mlp.py --out results.json [--configs]

The op: forward + backward on 16,384 tokens of d_model 2048 through experts of hidden 1024,
64 experts top-8 (OLMoE-1B-7B) and 128 experts top-4 (the pool sweep's largest), learned-like
skewed routing (counts drawn from a random router), router weights on, the same random inputs
for every variant; median of CUDA-event timings after warm-up (``timing.cuda_times_ms``).
``--configs`` also times each epilogue GEMM alone under candidate QuACK tile configurations
(tile M x N, pingpong or cooperative, cluster, dynamic scheduler), to pick the pinned ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date

import torch
from shapes import olmoe
from timing import cuda_times_ms

from kernels import expert_mlp, grouped_gemm

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
    expert_mlp.set_fused(fused)
    args = [ops[k] for k in ("x", "w_gate_up", "w_down", "offs", "weight")]
    assert expert_mlp.fuses(*args[:3]) == fused

    def step() -> None:
        y = expert_mlp.expert_mlp(*args)
        y.backward(ops["dy"])

    try:
        return statistics.median(cuda_times_ms(step, warmup, iters))
    finally:
        expert_mlp.set_fused(True)


def candidate_configs() -> list:
    from quack.gemm_config import GemmConfig

    shapes = [
        (128, 192, True, 2, 1),  # QuACK's sm90 default
        (128, 128, True, 2, 1),
        (128, 128, True, 1, 2),
        (128, 256, False, 2, 1),
        (256, 128, False, 2, 1),
        (256, 192, False, 2, 1),
    ]
    return [
        GemmConfig(
            tile_m=m, tile_n=n, pingpong=pp, cluster_m=cm, cluster_n=cn, is_dynamic_persistent=False
        )
        for m, n, pp, cm, cn in shapes
    ]


def sweep_configs(ops: dict, warmup: int, iters: int) -> list[dict]:
    """Each epilogue GEMM of the fused op alone, per candidate config (and scheduler)."""
    from quack.gemm_interface import gemm_act, gemm_dgated

    from kernels import grouped_gemm_quack as quack

    x, wgu, wd = ops["x"].detach(), ops["w_gate_up"].detach(), ops["w_down"].detach()
    cu = torch.nn.functional.pad(ops["offs"], (1, 0))
    scale = ops["weight"].detach().float().clone()
    h, a = quack.swiglu_mm(x, wgu, ops["offs"])
    dy = ops["dy"]
    F_ = wd.shape[-1]
    flops = {
        "gate_up_swiglu": 2 * x.shape[0] * x.shape[1] * 2 * F_,
        "down_dswiglu": 2 * x.shape[0] * x.shape[1] * F_,
        "down_scaled": 2 * x.shape[0] * x.shape[1] * F_,
    }
    rows = []
    for cfg in candidate_configs():
        for dynamic in (False, True):
            kernels = {
                "gate_up_swiglu": lambda cfg=cfg, dyn=dynamic: gemm_act(
                    x,
                    wgu.mT,
                    activation="swiglu",
                    cu_seqlens_m=cu,
                    concat_layout=("B",),
                    config=cfg,
                    dynamic_scheduler=dyn,
                ),
                "down_dswiglu": lambda cfg=cfg, dyn=dynamic: gemm_dgated(
                    dy,
                    wd,
                    h,
                    activation="swiglu",
                    colvec_scale=scale,
                    colvec_reduce=True,
                    cu_seqlens_m=cu,
                    config=cfg,
                    dynamic_scheduler=dyn,
                ),
                "down_scaled": lambda cfg=cfg, dyn=dynamic: quack._scale_rows(
                    a, wd.mT, cu_seqlens_m=cu, config=cfg, dynamic_scheduler=dyn, scale_M=scale
                ),
            }
            for name, fn in kernels.items():
                try:
                    ms = statistics.median(cuda_times_ms(fn, warmup, iters))
                    err = None
                except Exception as e:  # a config a kernel cannot take: recorded, not fatal
                    ms, err = None, f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(
                    {
                        "kernel": name,
                        "tile": f"{cfg.tile_m}x{cfg.tile_n}",
                        "pingpong": cfg.pingpong,
                        "cluster": f"{cfg.cluster_m}x{cfg.cluster_n}",
                        "dynamic_scheduler": dynamic,
                        "ms": ms,
                        "tflops": None if ms is None else flops[name] / ms / 1e9,
                        "error": err,
                    }
                )
                print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--configs", action="store_true", help="also sweep epilogue GEMM configs")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    grouped_gemm.set_backend("quack")
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
        if args.configs and n_experts == CFG.n_experts:
            results[key]["configs"] = sweep_configs(ops, args.warmup, args.iters)
    report = {
        "benchmark": "expert_mlp",
        "date": str(date.today()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": args.commit,
        "tokens": TOKENS,
        "d_model": CFG.d_model,
        "expert_hidden": CFG.expert_hidden,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
