"""Token dispatch + combine alone, per dispatcher, at 512 MiB of routed rows per rank (GPU).

    torchrun --standalone --nproc-per-node N benchmarks/ep_dispatch.py --out dispatch.json

Each rank routes 16,384 tokens (d_model 2048, bf16) top-8 over 64 experts with learned-looking
skew (softmax of random logits): 16,384 x 8 x 2048 x 2 bytes = 512 MiB of routed rows. The
experts are replaced by the identity (rows come back scaled by their router weight), so what is
timed is the metadata exchange, the rows there and back, and the sums: forward alone and
forward + backward, CUDA events after warm-up, median, per dispatcher in the same run
(``all_to_all``: NCCL with its host read; ``all_to_all_fp8``: the same with the token rows
sent as E4M3 and a scale each, ``precision.fp8_parts`` naming "dispatch"; ``nvshmem_rowwise``:
symmetric memory, dropless buffers unless ``--capacity-factor``). With one process only the
rowwise path runs (one PE).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
import torch.distributed as dist
from report import save, stamp
from shapes import olmoe
from timing import cuda_times_ms

from moe_core.model.moe import Routing
from moe_core.parallel.dispatch import (
    AllToAllDispatcher,
    RowwiseDispatcher,
    RowwiseExchange,
    rowwise_capacity,
)
from moe_core.parallel.symmetric import CudaSymmetricHeap
from moe_kernels.routing import expert_counts

T = 16384
D, E, K = olmoe().d_model, olmoe().n_experts, olmoe().top_k


class IdentityExperts:
    """Stands in for a rank's experts: each row back, scaled by its router weight."""

    def __init__(self, offset: int, n_local: int) -> None:
        self.expert_offset, self.n_experts = offset, n_local

    def __call__(self, x_MD, offs_E, weights_M):
        return x_MD * weights_M.to(x_MD.dtype).unsqueeze(1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dispatchers", default="all_to_all,all_to_all_fp8,nvshmem_rowwise")
    p.add_argument("--capacity-factor", type=float, default=None)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, P = dist.get_rank(), dist.get_world_size()
    El = E // P
    gen = torch.Generator(device="cuda").manual_seed(rank)
    w_TK, experts_TK = torch.topk(
        torch.softmax(torch.randn(T, E, generator=gen, device="cuda"), -1), K
    )
    x_TD = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
    dy_TD = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
    experts = IdentityExperts(rank * El, El)
    results = {}
    for name in args.dispatchers.split(","):
        if name.startswith("all_to_all") and P == 1:
            continue
        if name.startswith("all_to_all"):
            fp8_rows = {"all_to_all": False, "all_to_all_fp8": True}[name]
            dispatcher = AllToAllDispatcher(dist.group.WORLD, P, El, fp8_rows)
        else:
            rows, assignments = rowwise_capacity(E, K, P, T, args.capacity_factor)
            heap = CudaSymmetricHeap(dist.group.WORLD, torch.device("cuda", local))
            exchange = RowwiseExchange(heap, rows, assignments, D, K, torch.bfloat16)
            dispatcher = RowwiseDispatcher(exchange, El)

        def step(dispatcher=dispatcher, backward: bool = True) -> None:
            x = x_TD.detach().requires_grad_(backward)
            routing = Routing(experts_TK, w_TK, expert_counts(experts_TK, E), torch.zeros(()))
            y = dispatcher(x, routing, experts)
            if backward:
                y.backward(dy_TD)

        results[name] = {}
        for key, fn in (("forward", lambda: step(backward=False)), ("forward_backward", step)):
            ms = statistics.median(cuda_times_ms(fn, args.warmup, args.iters))
            everyone = [None] * P
            dist.all_gather_object(everyone, ms)
            results[name][key] = {"median_ms_per_rank": everyone, "median_ms": max(everyone)}
        del dispatcher
        torch.cuda.empty_cache()
    if rank == 0:
        report = {
            "benchmark": "ep_dispatch_combine",
            **stamp(args.commit),
            "gpus": P,
            "routed_mib_per_rank": T * K * D * 2 / 2**20,
            "capacity_factor": args.capacity_factor,
            "results": results,
        }
        print("RESULT " + json.dumps(report))
        save(report, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
