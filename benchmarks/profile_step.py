"""Where a step's GPU time goes: kernel time by category and the top kernels, from the profiler.

    python benchmarks/profile_step.py --mbs 4 [--compile] --out profile.json
    python benchmarks/profile_step.py --moe-layer 128 --out layer.json   # one MoE layer, top-4

The step is ``train_step.py``'s (same model, inputs and options). Phases (forward, backward,
optimizer) are also timed apart with CUDA events, median of ``--iters`` steps after warm-up;
kernel times come from ``torch.profiler`` over ``--profile-steps`` further steps.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import defaultdict
from collections.abc import Callable

import torch
from timing import cuda_phase_times_ms
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from train_step import moe_layer_step, parser, train_step_parts

CATEGORIES = [
    ("optimizer", r"multi_tensor|adam"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas|sm90_|sm100_|_mm_"),
    ("moe triton", r"^_(block_rank|scan|finalize|permute|combine|gather|scatter|swiglu)"),
    ("inductor triton", r"^triton_"),
    ("copy / fill", r"copy|memcpy|memset|fill|Memcpy|Memset"),
    ("reduction", r"reduce|softmax|norm|cross_entropy|nll|logsumexp|topk|sort|scan"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|gather|scatter"),
]


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


def kernel_times_ms(fn: Callable[[], None], steps: int) -> dict[str, float]:
    """Total GPU milliseconds per kernel name over ``steps`` runs of ``fn``, per step."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        # Kernels only: CPU-side ranges (autograd Functions) and the GPU mirrors of annotated
        # ranges (Optimizer.step) also carry the device time of the kernels inside them and
        # would count it twice; "Command Buffer Full" is the host waiting for launch slots.
        if evt.device_type != DeviceType.CUDA or evt.is_user_annotation:
            continue
        if evt.key.startswith("Command Buffer Full"):
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        times[evt.key] += us / 1e3 / steps
    return dict(times)


def main() -> None:
    p = parser()
    p.add_argument("--moe-layer", type=int, default=0, help="experts of one MoE layer")
    p.add_argument("--top-k", type=int, default=4, help="the MoE layer's top-k")
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    args = p.parse_args()
    if args.moe_layer:
        phases = moe_layer_step(args, args.moe_layer, args.top_k)
    else:
        phases = train_step_parts(args)

    def whole() -> None:
        for _, fn in phases:
            fn()

    samples = cuda_phase_times_ms(phases, args.warmup, args.iters)
    phase_ms = {name: statistics.median(v) for name, v in samples.items()}
    kernels = kernel_times_ms(whole, args.profile_steps)
    by_cat: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_cat[category(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    result = {
        "benchmark": "profile_moe_layer" if args.moe_layer else "profile_train_step",
        "experts": args.moe_layer or None,
        "top_k": args.top_k if args.moe_layer else None,
        "mbs": args.mbs,
        "compile": args.compile,
        "phase_ms": phase_ms,
        "step_ms": sum(phase_ms.values()),
        "kernel_ms_total": sum(kernels.values()),
        "kernel_ms_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [
            {"kernel": k[:160], "ms": round(v, 3), "category": category(k)} for k, v in top
        ],
        "commit": args.commit,
        "gpu": torch.cuda.get_device_name(),
    }
    print(f"phases ms: {json.dumps({k: round(v, 2) for k, v in phase_ms.items()})}")
    print(f"kernel ms by category: {json.dumps({k: round(v, 2) for k, v in by_cat.items()})}")
    for row in result["top_kernels_ms"]:
        print(f"{row['ms']:9.3f}  {row['category']:16s} {row['kernel']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
