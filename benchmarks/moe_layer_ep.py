"""One MoE layer forward + backward at OLMoE-1B-7B shapes, EP=1 vs EP=2 (GPU).

Launch on a machine with 2 GPUs:
    torchrun --standalone --nproc-per-node 2 benchmarks/moe_layer_ep.py --out results.json

Each rank routes its own 16,384 tokens (learned routing from a random router: skewed as at
initialization, the same random inputs on every variant) through 64 experts, top-8, expert
hidden 1024, d_model 2048, bf16. EP=1: every GPU holds all 64 experts and runs alone. EP=2:
each GPU holds 32 experts and tokens travel through the all-to-all dispatcher. Reported per
GPU: median step time (CUDA events after warm-up), tokens/s/GPU, model TFLOP/s (6 x active
expert matmul parameters per token), and the share of the step the GPU spends in NCCL kernels
(from a profile of a few steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from datetime import date

import torch
import torch.distributed as dist
from timing import cuda_times_ms

from moe_core.config import ModelConfig
from moe_core.model.moe import Experts, MoE
from moe_core.parallel.dispatch import AllToAllDispatcher

CFG = ModelConfig(d_model=2048, n_heads=16, n_experts=64, top_k=8, expert_hidden=1024)
TOKENS = 16384


def build(ep: int, group, ep_rank: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(CFG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    if ep > 1:
        n_local = CFG.n_experts // ep
        full = moe.experts
        local = Experts(n_local, CFG.d_model, CFG.expert_hidden)
        sl = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
        with torch.no_grad():
            local.w_gate_up.copy_(full.w_gate_up[sl])
            local.w_down.copy_(full.w_down[sl])
        local.expert_offset = ep_rank * n_local
        moe.experts = local
        moe.dispatcher = AllToAllDispatcher(group, ep, n_local)
    return moe.cuda().to(torch.bfloat16)


def time_steps(
    moe: MoE, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int
) -> list[float]:
    def step() -> None:
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [grad, torch.ones_like(aux)])

    return cuda_times_ms(step, warmup, iters)


def profile_steps(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, list]:
    """(share of GPU kernel time in NCCL kernels, the 12 costliest kernels per step)."""
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            y, aux = moe(x)
            torch.autograd.backward([y, aux], [grad, torch.ones_like(aux)])
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    total = sum(e.device_time for e in events)
    nccl = sum(e.device_time for e in events if "nccl" in e.name.lower())
    per_kernel: dict[str, float] = {}
    for e in events:
        per_kernel[e.name[:90]] = per_kernel.get(e.name[:90], 0.0) + e.device_time / steps / 1e3
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:12]
    return (nccl / total if total else 0.0), top


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--commit", default="unknown", help="the commit measured")
    args = parser.parse_args()

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(1, TOKENS, CFG.d_model, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    flops_per_token = 6 * CFG.top_k * 3 * CFG.d_model * CFG.expert_hidden

    results = {}
    for ep in (1, world):
        group = dist.group.WORLD if ep > 1 else None
        moe = build(ep, group, rank if ep > 1 else 0)
        times = time_steps(moe, x, grad, args.warmup, args.iters)
        med = statistics.median(times)
        share, top = profile_steps(moe, x, grad)
        row = {
            "ep": ep,
            "median_ms": med,
            "tokens_per_s_per_gpu": TOKENS / (med / 1e3),
            "model_tflops_per_gpu": TOKENS * flops_per_token / (med / 1e3) / 1e12,
            "nccl_time_share": share,
            "top_kernels_ms_per_step": top,
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        results[f"ep{ep}"] = gathered
        del moe
        torch.cuda.empty_cache()

    if rank == 0:
        report = {
            "benchmark": "moe_layer_ep",
            "date": str(date.today()),
            "gpu": torch.cuda.get_device_name(),
            "gpus": world,
            "commit": args.commit,
            "torch": torch.__version__,
            "shape": {
                "tokens_per_gpu": TOKENS,
                "d_model": 2048,
                "experts": 64,
                "top_k": 8,
                "expert_hidden": 1024,
            },
            "routing": "learned (random router init)",
            "precision": "bf16",
            "results": results,
        }
        ep1 = statistics.mean(r["tokens_per_s_per_gpu"] for r in results["ep1"])
        epn = statistics.mean(r["tokens_per_s_per_gpu"] for r in results[f"ep{world}"])
        report["ep_over_ep1"] = epn / ep1
        print(f"{'layout':<8}{'ms':>10}{'tokens/s/GPU':>16}{'TFLOP/s/GPU':>14}{'NCCL share':>12}")
        for key, rows in results.items():
            for r in rows:
                print(
                    f"{key:<8}{r['median_ms']:>10.2f}{r['tokens_per_s_per_gpu']:>16,.0f}"
                    f"{r['model_tflops_per_gpu']:>14.1f}{r['nccl_time_share']:>12.1%}"
                )
        print(f"EP={world} per-GPU throughput / EP=1: {report['ep_over_ep1']:.3f}")
        for key, rows in results.items():
            print(f"costliest GPU kernels, {key}, rank 0 (ms per step):")
            for name, ms in rows[0]["top_kernels_ms_per_step"]:
                print(f"  {ms:8.3f}  {name}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
