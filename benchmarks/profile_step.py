"""Where a step's GPU time goes: kernel time by category and the top kernels, from the profiler.

    python benchmarks/profile_step.py --mbs 4 [--compile] --out profile.json
    python benchmarks/profile_step.py --moe-layer 128 --out layer.json   # one MoE layer, top-4
    python benchmarks/profile_step.py --trainer --mbs 4 --out trainer.json  # what moe train runs
    python benchmarks/profile_step.py --trainer --precision fp8 --micro-batches 4 \
        [--fp8-cache] --out fp8.json  # FP8 weights quantized once per step, or per call
    python benchmarks/profile_step.py --trainer --set model.n_experts=128 ...  # another shape

The step is ``train_step.py``'s (same model, inputs and options). Phases (forward, backward,
optimizer) are also timed apart with CUDA events, median of ``--iters`` steps after warm-up;
kernel times come from ``torch.profiler`` over ``--profile-steps`` further steps.

``--trainer`` profiles ``Trainer.train_step`` instead, the step ``moe train`` runs (OLMoE-1B-7B
width at ``--layers``, synthetic data, ``--precision``, ``--cuda-graph`` or the config's), in
this process, after ``--warmup`` steps; its step time is the wall time the trainer reports.
Either way the profile's GPU timeline is also read for idle time: the union of kernel intervals
against the span from the first kernel to the last, and the longest gaps with the kernels on
either side, which is where a host wait or a launch gap shows.

``--micro-batches`` (with ``--trainer``) accumulates gradients over that many micro-batches a
step; ``--fp8-cache`` runs ``--precision fp8`` with ``precision.fp8_weight_cache`` (the FP8
weight copies made once per step, ``moe_kernels.fp8_cache``), without it every expert GEMM call
quantizes its weight. The two runs side by side are the cache's measurement (step time, and the
"fp8 quantize" and "optimizer" categories).
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import re
import shutil
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from report import save, stamp
from timing import cuda_phase_times_ms
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile
from train_step import moe_layer_step, parser, train_step_parts

from moe_core.model.moe import Experts

CATEGORIES = [  # the first pattern a kernel's name matches names its category
    ("optimizer", r"multi_tensor|adam"),
    ("attention", r"flash|fmha|attention|sdpa"),
    # the permute and the sum's backward writing E4M3 rows (moe_kernels.fp8.quantize_to_slots)
    ("fp8 permute", r"^_scatter_quantize"),
    # moe_kernels.fp8_triton's, and Inductor's fused into the attention projections' inputs
    ("fp8 quantize", r"^_(swiglu_)?quantize|^triton_\w*_scaled_mm"),
    ("fp8 gemm", r"e4m3|f8f8|fp8|nvjet_sm90_qq"),  # CUTLASS's grouped and cuBLAS's FP8 GEMMs
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


def kernel_times_ms(fn: Callable[[], None], steps: int) -> tuple[dict[str, float], dict]:
    """Total GPU milliseconds per kernel name over ``steps`` runs of ``fn``, per step, and the
    GPU timeline's busy and idle time (``gpu_timeline``)."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        timeline = gpu_timeline(json.loads(trace.read_text())["traceEvents"], steps)
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
    return dict(times), timeline


def gpu_timeline(events: list[dict], steps: int, top: int = 12) -> dict:
    """Busy and idle GPU milliseconds per step from a Chrome trace's device events (kernels,
    copies, fills), and the ``top`` longest idle gaps with the work on either side."""
    device = sorted(
        (e["ts"], e["ts"] + e.get("dur", 0), e["name"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    if not device:
        return {}
    busy_us, gaps = 0.0, []
    start, end, last = device[0][0], device[0][1], device[0][2]
    for ts, te, name in device[1:]:
        if ts > end:
            busy_us += end - start
            gaps.append((ts - end, last, name))
            start = ts
        if te > end:
            end, last = te, name
    busy_us += end - start
    span_us = max(te for _, te, _ in device) - device[0][0]
    gaps.sort(key=lambda g: -g[0])
    return {
        "span_ms_per_step": span_us / 1e3 / steps,
        "busy_ms_per_step": busy_us / 1e3 / steps,
        "idle_ms_per_step": (span_us - busy_us) / 1e3 / steps,
        "gaps_over_50us_per_step": sum(g[0] > 50 for g in gaps) / steps,
        "longest_gaps": [
            {"us": round(us, 1), "after": a[:120], "before": b[:120]} for us, a, b in gaps[:top]
        ],
    }


def trainer_shape(args: argparse.Namespace) -> argparse.Namespace:
    """The run ``trainer_step.py`` launches with this script's options, on one GPU with
    synthetic data."""
    from trainer_step import run_shape

    return run_shape(
        **{
            **vars(args),
            "data": "synthetic",
            "micro_batches": args.micro_batches,
            "ep": 1,
            "dp": 1,
            "dispatcher": "all_to_all",
            "steps": args.iters + args.profile_steps,
        }
    )


def trainer_step_fn(args: argparse.Namespace) -> tuple[Callable[[], None], list[float]]:
    """``Trainer.train_step`` at OLMoE-1B-7B width (``moe train``'s step, built in-process),
    after ``args.warmup`` steps; the list collects the wall step times it reports (ms)."""
    from trainer_step import trainer_overrides

    from moe_core.compose import compose_run
    from moe_core.train.trainer import Trainer

    out = tempfile.mkdtemp()
    atexit.register(shutil.rmtree, out, True)
    overrides = trainer_overrides(trainer_shape(args), out, data_dir="")
    if args.fp8_cache:
        overrides.append("precision.fp8_weight_cache=true")
    trainer = Trainer(compose_run(overrides))
    if args.unfused_mlp:  # no run option: the experts' choice, before the first (compiled) step
        for m in (m for c in trainer.chunks.values() for m in c.modules()):
            if isinstance(m, Experts):
                m.kernels = dataclasses.replace(m.kernels, fused_mlp=False)
    for _ in range(args.warmup):
        trainer.train_step()
    step_ms: list[float] = []

    def step() -> None:
        step_ms.append(trainer.train_step().step_time_s * 1e3)

    return step, step_ms


def profile_parser() -> argparse.ArgumentParser:
    p = parser()
    p.add_argument("--moe-layer", type=int, default=0, help="experts of one MoE layer")
    p.add_argument("--top-k", type=int, default=4, help="the MoE layer's top-k")
    p.add_argument("--trainer", action="store_true", help="profile moe train's Trainer step")
    p.add_argument("--precision", default="pure-bf16", help="with --trainer")
    p.add_argument("--cuda-graph", choices=["true", "false"], help="with --trainer")
    p.add_argument("--fp8-parts", default="", help="with --trainer --precision fp8: the parts")
    p.add_argument("--micro-batches", type=int, default=1, help="with --trainer: a step's")
    p.add_argument("--fp8-cache", action="store_true", help="with --precision fp8: once a step")
    p.add_argument(
        "--set", action="append", default=[], help="with --trainer: a config override, repeatable"
    )
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--top", type=int, default=40)
    return p


def main() -> None:
    args = profile_parser().parse_args()
    if args.trainer:
        whole, step_ms = trainer_step_fn(args)
        for _ in range(args.iters):
            whole()
        phase_ms = {"trainer_step_wall": statistics.median(step_ms)}
    else:
        phases = (
            moe_layer_step(args, args.moe_layer, args.top_k)
            if args.moe_layer
            else train_step_parts(args)
        )

        def whole() -> None:
            for _, fn in phases:
                fn()

        samples = cuda_phase_times_ms(phases, args.warmup, args.iters)
        phase_ms = {name: statistics.median(v) for name, v in samples.items()}
    kernels, timeline = kernel_times_ms(whole, args.profile_steps)
    by_cat: dict[str, float] = defaultdict(float)
    for name, ms in kernels.items():
        by_cat[category(name)] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
    result = {
        "benchmark": "profile_trainer_step"
        if args.trainer
        else "profile_moe_layer"
        if args.moe_layer
        else "profile_train_step",
        "experts": args.moe_layer or None,
        "top_k": args.top_k if args.moe_layer else None,
        "mbs": args.mbs,
        "overrides": args.set,
        "compile": args.compile,
        "phase_ms": phase_ms,
        "step_ms": sum(phase_ms.values()),
        "kernel_ms_total": sum(kernels.values()),
        "kernel_ms_by_category": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
        "gpu_timeline": timeline,
        "top_kernels_ms": [
            {"kernel": k[:160], "ms": round(v, 3), "category": category(k)} for k, v in top
        ],
        **stamp(args.commit),
    }
    print(f"phases ms: {json.dumps({k: round(v, 2) for k, v in phase_ms.items()})}")
    print(f"kernel ms by category: {json.dumps({k: round(v, 2) for k, v in by_cat.items()})}")
    print(f"gpu timeline: {json.dumps(timeline)}")
    for row in result["top_kernels_ms"]:
        print(f"{row['ms']:9.3f}  {row['category']:16s} {row['kernel']}")
    save(result, args.out)


if __name__ == "__main__":
    main()
