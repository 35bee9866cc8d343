"""The global gradient norm over OLMoE-1B-7B's gradients (one GPU, bf16): the trainer's pass
before every optimizer step (``ShardedAdamW.grad_norm``), and the alternatives.

    python benchmarks/grad_norm.py --out results.json

Gradients are random bf16 tensors with the model's parameter shapes (built on the meta device
from ``conf/model/olmoe-1b-7b.yaml``, 16 layers), the same for every variant. Each variant
returns the fp32 global L2 norm; all are checked against an fp64 reference, then timed with
CUDA events after warm-up, the variants interleaved (one of each per iteration, so clock drift
reaches all alike; median), against the time to read the bytes at the GPU's measured copy
bandwidth. The Triton pass (``moe_kernels.sum_squares``) is also timed at other program sizes
(``--runs``: BLOCK x ITERS pairs) over the large tensors.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms, cuda_times_ms

from moe_core.model import Transformer
from moe_core.model.meta import on_meta
from moe_core.parallel.optimizer import LARGE, global_norm
from moe_kernels import sum_squares_triton
from moe_kernels.sum_squares import sum_squares_reference


def foreach(grads: list[torch.Tensor]) -> torch.Tensor:
    """One ``torch._foreach_norm`` pass (the trainer before this benchmark)."""
    norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum().sqrt()


def per_tensor(grads: list[torch.Tensor]) -> torch.Tensor:
    """One ``torch.linalg.vector_norm`` reduction per tensor (``moe_kernels.sum_squares``'s
    reference)."""
    return sum_squares_reference(grads, torch.float32).sqrt()


def large_then_foreach(large_pass):
    """The norm as the trainer splits it (``optimizer.sum_of_squares``): ``large_pass`` over the
    tensors of at least ``LARGE`` elements, one ``_foreach_norm`` over the small ones."""

    def fn(grads: list[torch.Tensor]) -> torch.Tensor:
        large = [g for g in grads if g.numel() >= LARGE]
        small = [g for g in grads if g.numel() < LARGE]
        sq = (
            large_pass(large)
            + torch.stack(torch._foreach_norm(small, 2, dtype=torch.float32)).square().sum()
        )
        return sq.sqrt()

    return fn


def copy_time_ms(warmup: int, iters: int) -> tuple[float, int]:
    """Median ms of copying 2 GiB on the GPU, and the bytes it reads and writes."""
    src, dst = torch.empty(2, 1 << 30, device="cuda", dtype=torch.bfloat16)
    ms = statistics.median(cuda_times_ms(lambda: dst.copy_(src), warmup, iters))
    return ms, 2 * src.numel() * src.element_size()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--runs", default="2048x8,4096x4,4096x8,4096x16,8192x4,8192x8")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    with on_meta():
        model = Transformer(olmoe())
    gen = torch.Generator(device="cuda").manual_seed(0)
    grads = [
        torch.randn(q.shape, device="cuda", generator=gen).to(torch.bfloat16)
        for q in model.parameters()
    ]
    n_bytes = sum(g.numel() * g.element_size() for g in grads)
    ref = torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item()
    copy_ms, copy_bytes = copy_time_ms(args.warmup, args.iters)
    variants = {
        "foreach_norm": foreach,
        "vector_norm_per_tensor": per_tensor,
        # the trainer before the Triton pass
        "vector_norm_large_foreach_small": large_then_foreach(
            lambda large: sum_squares_reference(large, torch.float32)
        ),
        "moe_core": global_norm,
    }
    for run in args.runs.split(","):
        block, iters = map(int, run.split("x"))
        variants[f"triton_{block}x{iters}"] = large_then_foreach(
            lambda large, b=block, i=iters: sum_squares_triton.sum_squares(large, b, i)
        )
    phases = [(name, lambda fn=fn: fn(grads)) for name, fn in variants.items()]
    times = cuda_phase_times_ms(phases, args.warmup, args.iters)
    rows = {}
    for name, fn in variants.items():
        got = fn(grads).item()
        ms = statistics.median(times[name])
        rows[name] = {
            "ms": ms,
            "read_gb_per_s": n_bytes / ms / 1e6,
            "rel_err_vs_fp64": abs(got - ref) / ref,
        }
        print(name, json.dumps(rows[name]))
    report = {
        "benchmark": "grad_norm",
        "tensors": len(grads),
        "gradient_gib": n_bytes / 2**30,
        "copy_gb_per_s": copy_bytes / copy_ms / 1e6,  # bytes read + written per second
        "variants": rows,
        **stamp(args.commit),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}))
    save(report, args.out)


if __name__ == "__main__":
    main()
