"""One MoE layer forward + backward at OLMoE-1B-7B shapes, EP=1 vs EP=N per dispatcher (GPU).

Launch on a machine with N GPUs:
    torchrun --standalone --nproc-per-node N benchmarks/moe_layer_ep.py --out results.json
    torchrun ... --dispatchers all_to_all,nvshmem_rowwise [--capacity-factor 1.25]

On one GPU (N = 1, or plain `python benchmarks/moe_layer_ep.py` without torchrun) the rowwise
dispatcher runs with one PE: its own overhead against the local path, with no link in between.
`--fp8` adds each layer again with FP8 experts (`moe_kernels.fp8`), same inputs; `--unfused` each
layer again with the experts' MLP unfused (`Kernels(fused_mlp=False)`: the SwiGLU
as its own pass instead of in QuACK's GEMM epilogues; the same where QuACK does not run).
`--experts 8,16,32,64,128 --top-k 4` sweeps the expert pool at fixed active parameters (each
count a layer of its own, expert hidden and top-k fixed), EP=1 against EP=N at each: the
pool-scaling claim made at scale (issue 21).

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
import dataclasses
import os
import statistics

import torch
import torch.distributed as dist
from report import save, stamp
from shapes import olmoe
from timing import cuda_times_ms

from moe_core.model.kernel_choice import Kernels
from moe_core.model.moe import Experts, MoE
from moe_core.parallel.dispatch import (
    AllToAllDispatcher,
    RowwiseDispatcher,
    RowwiseExchange,
    rowwise_capacity,
)
from moe_core.parallel.symmetric import CudaSymmetricHeap
from moe_kernels import expert_mlp

CFG = olmoe()
TOKENS = 16384


def build(cfg, ep: int, group, ep_rank: int, dispatcher: str, factor: float | None) -> MoE:
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    if dispatcher != "local":
        n_local = cfg.n_experts // ep
        full = moe.experts
        local = Experts(n_local, cfg.d_model, cfg.expert_hidden)
        sl = slice(ep_rank * n_local, (ep_rank + 1) * n_local)
        with torch.no_grad():
            local.w_gate_up.copy_(full.w_gate_up[sl])
            local.w_down.copy_(full.w_down[sl])
        local.expert_offset = ep_rank * n_local
        moe.experts = local
        if dispatcher == "all_to_all":
            moe.dispatcher = AllToAllDispatcher(group, ep, n_local)
        else:
            heap = CudaSymmetricHeap(group, torch.device("cuda"))
            rows, assignments = rowwise_capacity(cfg.n_experts, cfg.top_k, ep, TOKENS, factor)
            exchange = RowwiseExchange(
                heap, rows, assignments, cfg.d_model, cfg.top_k, torch.bfloat16
            )
            moe.dispatcher = RowwiseDispatcher(exchange, n_local)
    return moe.cuda().to(torch.bfloat16)


def time_steps(
    moe: MoE, x: torch.Tensor, grad: torch.Tensor, warmup: int, iters: int
) -> list[float]:
    def step() -> None:
        fresh_grads(moe, x)
        y, aux = moe(x)
        torch.autograd.backward([y, aux], [grad, torch.ones_like(aux)])

    return cuda_times_ms(step, warmup, iters)


def fresh_grads(moe: MoE, x: torch.Tensor) -> None:
    """As a training step's ``zero_grad(set_to_none=True)``: without it every step would add
    its weight gradients to the last one's (an extra pass over all expert weights' gradients,
    ~0.6 ms a step at OLMoE's 64 experts, counted in this benchmark before 2026-12-02)."""
    for t in (x, *moe.parameters()):
        t.grad = None


def profile_steps(moe: MoE, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, list]:
    """(share of GPU kernel time in NCCL kernels, the 12 costliest kernels per step)."""
    from torch.profiler import ProfilerActivity, profile

    steps = 3
    with profile(activities=[ProfilerActivity.CUDA], acc_events=True) as prof:
        for _ in range(steps):
            fresh_grads(moe, x)
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
    parser.add_argument("--dispatchers", default="all_to_all", help="comma-separated")
    parser.add_argument("--capacity-factor", type=float, default=None, help="rowwise buffers")
    parser.add_argument("--expert-gemm", choices=["auto", "torch", "quack"], default="torch")
    parser.add_argument("--fp8", action="store_true", help="also each layer with FP8 experts")
    parser.add_argument("--unfused", action="store_true", help="also each layer MLP unfused")
    parser.add_argument("--experts", default=str(CFG.n_experts), help="comma-separated counts")
    parser.add_argument("--top-k", type=int, default=CFG.top_k)
    args = parser.parse_args()
    try:
        counts = [int(e) for e in args.experts.split(",")]
    except ValueError:
        bad_list = f"--experts {args.experts!r} is not allowed: comma-separated counts."
        raise SystemExit(bad_list) from None
    gpus = int(os.environ.get("WORLD_SIZE", "1"))
    bad = [e for e in counts if e < 1 or e % gpus]
    if bad:  # before any process group or GPU memory
        raise SystemExit(f"--experts {bad} is not allowed: counts divisible by the {gpus} GPUs.")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local_rank)
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:  # plain `python`: one process on one GPU, its own store
        dist.init_process_group(
            "nccl",
            device_id=torch.device("cuda", local_rank),
            store=dist.HashStore(),
            rank=0,
            world_size=1,
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(1, TOKENS, CFG.d_model, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_()
    grad = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    flops_per_token = 6 * args.top_k * 3 * CFG.d_model * CFG.expert_hidden

    variants = [("ep1", 1, "local")]
    for name in args.dispatchers.split(","):
        if world > 1 or name == "nvshmem_rowwise":
            variants.append((f"ep{world}-{name}", world, name))
    results = {}
    if args.fp8:  # the same layers again with FP8 experts, same inputs
        variants += [(f"{key}-fp8", ep, name, True) for key, ep, name in variants]
    if args.unfused:
        variants += [(f"{v[0]}-unfused", *v[1:]) for v in variants if len(v) == 3]
    sweep = [
        (f"{e}e-{key}" if len(counts) > 1 else key, e, ep, dispatcher, *fp8)
        for e in counts
        for key, ep, dispatcher, *fp8 in variants
    ]
    for key, n_experts, ep, dispatcher, *fp8 in sweep:
        cfg = dataclasses.replace(CFG, n_experts=n_experts, top_k=args.top_k)
        moe = build(cfg, ep, dist.group.WORLD, rank, dispatcher, args.capacity_factor)
        kernels = Kernels(
            gemm=args.expert_gemm, fp8_experts=bool(fp8), fused_mlp=not key.endswith("-unfused")
        )
        moe.experts.kernels = kernels
        times = time_steps(moe, x, grad, args.warmup, args.iters)
        med = statistics.median(times)
        share, top = profile_steps(moe, x, grad)
        row = {
            "experts": n_experts,
            "top_k": args.top_k,
            "ep": ep,
            "dispatcher": dispatcher,
            "fp8_experts": bool(fp8),
            "mlp_fused": expert_mlp.fuses(
                x.view(-1, CFG.d_model),
                moe.experts.w_gate_up,
                moe.experts.w_down,
                backend=kernels.gemm,
                fused=kernels.fused_mlp,
            ),
            "median_ms": med,
            "tokens_per_s_per_gpu": TOKENS / (med / 1e3),
            "model_tflops_per_gpu": TOKENS * flops_per_token / (med / 1e3) / 1e12,
            "nccl_time_share": share,
            "top_kernels_ms_per_step": top,
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, row)
        results[key] = gathered
        del moe
        torch.cuda.empty_cache()

    if rank == 0:
        report = {
            "benchmark": "moe_layer_ep",
            **stamp(args.commit),
            "gpus": world,
            "shape": {
                "tokens_per_gpu": TOKENS,
                "d_model": CFG.d_model,
                "experts": counts,
                "top_k": args.top_k,
                "expert_hidden": CFG.expert_hidden,
            },
            "routing": "learned (random router init)",
            "precision": "bf16",
            "capacity_factor": args.capacity_factor,
            "expert_gemm": args.expert_gemm,
            "results": results,
        }

        def rate(rows: list[dict]) -> float:
            return statistics.mean(r["tokens_per_s_per_gpu"] for r in rows)

        def ep1_key(key: str) -> str:  # the same expert count's EP=1 layer
            return f"{key.split('-')[0]}-ep1" if len(counts) > 1 else "ep1"

        report["over_ep1"] = {
            key: rate(rows) / rate(results[ep1_key(key)]) for key, rows in results.items()
        }
        if len(counts) > 1:  # each layout against its own smallest pool
            report["pool_relative_to_first"] = {
                key: rate(rows) / rate(results[key.replace(key.split("-")[0], f"{counts[0]}e", 1)])
                for key, rows in results.items()
            }
        head = f"{'layout':<26}{'ms':>9}{'tokens/s/GPU':>15}{'TFLOP/s/GPU':>13}{'NCCL share':>12}"
        print(head)
        for key, rows in results.items():
            for r in rows:
                print(
                    f"{key:<26}{r['median_ms']:>9.2f}{r['tokens_per_s_per_gpu']:>15,.0f}"
                    f"{r['model_tflops_per_gpu']:>13.1f}{r['nccl_time_share']:>12.1%}"
                )
        for key, ratio in report["over_ep1"].items():
            print(f"{key} per-GPU throughput / EP=1: {ratio:.3f}")
        for key, rows in results.items():
            print(f"costliest GPU kernels, {key}, rank 0 (ms per step):")
            for name, ms in rows[0]["top_kernels_ms_per_step"]:
                print(f"  {ms:8.3f}  {name}")
        save(report, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
