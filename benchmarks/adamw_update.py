"""The optimizer's update over OLMoE-1B-7B's parameters (one GPU, pure bf16): the trainer's
pass after every step's gradient norm (``ShardedAdamW.update`` on ``moe_kernels.adamw``), at
several program sizes.

    python benchmarks/adamw_update.py --out results.json

Parameters, gradients and both moments are random bf16 tensors with the model's parameter
shapes (built on the meta device from ``conf/model/olmoe-1b-7b.yaml``, 16 layers), as
``precision=pure-bf16`` keeps them: 14 bytes move per parameter (four read, three written).
Every variant runs the Triton kernel with a different program size (``--runs``: BLOCK x ITERS x
warps), one launch per tensor with the clip scale and apply flag the trainer passes. Each is
first checked bit-equal to the shipped size's result on one step from the same state, then
timed with CUDA events after warm-up, interleaved (one of each per iteration; median), on state
that every timed step keeps updating (the values stay finite: a small learning rate). The
rate is set against the GPU's measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from grad_norm import copy_time_ms
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms

from moe_core.model import Transformer
from moe_core.model.meta import on_meta
from moe_kernels import adamw_triton

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def make_state(shapes: list[torch.Size], seed: int) -> list[list[torch.Tensor]]:
    """``[p, g, m, v]`` per shape, bf16 on the GPU (``v`` non-negative)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(shape: torch.Size, scale: float) -> torch.Tensor:
        return (torch.randn(shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    return [[rand(s, 0.02), rand(s, 1e-3), rand(s, 1e-4), rand(s, 1e-3).abs()] for s in shapes]


def update(state, scalars, block: int, iters: int, warps: int) -> None:
    """One optimizer step over every tensor, as the trainer launches it."""
    lr, step, scale, apply = scalars
    for p, g, m, v in state:
        adamw_triton.adamw_step_(
            p, g, m, v, lr, step, scale, *HYPER.values(), apply=apply,
            block=block, iters=iters, num_warps=warps,
        )  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument(
        "--runs",
        default="4096x1x8,1024x1x4,2048x1x4,2048x1x8,4096x1x4,4096x2x8,4096x4x8,8192x1x8,"
        "8192x1x16,2048x4x4",
        help="BLOCK x ITERS x warps per variant; the first is the shipped size",
    )
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    with on_meta():
        model = Transformer(olmoe())
    shapes = [q.shape for q in model.parameters()]
    scalars = (
        torch.tensor(1e-6, device="cuda"),
        torch.tensor(10.0, device="cuda"),
        torch.tensor(0.5, device="cuda"),
        torch.tensor(True, device="cuda"),
    )
    runs = [tuple(map(int, r.split("x"))) for r in args.runs.split(",")]
    names = [f"triton_{b}x{i}_w{w}" for b, i, w in runs]

    # Equality: every size from the same state gives the shipped size's bits.
    small = [s for s in shapes if s.numel() < (1 << 26)][:8] + shapes[-3:]
    results = []
    for run in runs:
        state = make_state(small, seed=1)
        update(state, scalars, *run)
        results.append(torch.cat([t.flatten() for ts in state for t in ts]))
    equal = {name: torch.equal(res, results[0]) for name, res in zip(names, results, strict=True)}
    del results

    state = make_state(shapes, seed=0)
    n_params = sum(s.numel() for s in shapes)
    n_bytes = 14 * n_params
    copy_ms, copy_bytes = copy_time_ms(args.warmup, args.iters)
    phases = [
        (name, lambda run=run: update(state, scalars, *run))
        for name, run in zip(names, runs, strict=True)
    ]
    times = cuda_phase_times_ms(phases, args.warmup, args.iters)
    finite = all(torch.isfinite(t).all().item() for ts in state for t in ts)
    rows = {}
    for name in names:
        ms = statistics.median(times[name])
        rows[name] = {
            "ms": ms,
            "gb_per_s": n_bytes / ms / 1e6,  # read + written
            "bit_equal_to_shipped": equal[name],
        }
        print(name, json.dumps(rows[name]))
    report = {
        "benchmark": "adamw_update",
        "tensors": len(shapes),
        "parameters": n_params,
        "bytes_per_step": n_bytes,
        "copy_gb_per_s": copy_bytes / copy_ms / 1e6,  # read + written
        "state_finite_after": finite,
        "variants": rows,
        **stamp(args.commit),
    }
    print(json.dumps({k: v for k, v in report.items() if k != "variants"}))
    save(report, args.out)


if __name__ == "__main__":
    main()
