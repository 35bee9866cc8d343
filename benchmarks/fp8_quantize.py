"""The FP8 quantizers' block sizes (``moe_kernels.fp8_triton``) at OLMoE-1B-7B's shapes on one GPU:
each candidate against the others and against a plain copy of the same tensor.

    python benchmarks/fp8_quantize.py --out results.json

Rowwise (``quantize_rowwise``): the routed rows the expert GEMMs quantize per layer (x [M, D],
the SwiGLU output [M, F], the output gradient [M, D], the pre-activation gradient [M, 2F], M =
16,384 tokens x top-8) and the forward's weights ([G N, K]). Columnwise
(``quantize_columnwise``): both expert weights [G, N, K], quantized over N and stored
transposed. A rowwise candidate whose ``block_k`` covers the row reads it once (the kernel's
one-pass form); ``hw_cast: false`` rounds in fp32 before an exact cast (the interpreter's way)
instead of the GPU's conversion instruction. Every candidate's output is checked equal, byte for
byte, to the PyTorch reference's (``moe_kernels.fp8``) on the same tensor; the candidates of one
tensor are timed interleaved (one of each per iteration, CUDA events, median), and the rate
counts bf16 read once plus E4M3 written once.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms

from moe_kernels import fp8, fp8_triton

CFG = olmoe()
M = 16384 * CFG.top_k


def rowwise_cases() -> list[tuple[str, tuple[int, ...]]]:
    D, F, E = CFG.d_model, CFG.expert_hidden, CFG.n_experts
    return [
        ("x / dy [M, D]", (M, D)),
        ("swiglu out [M, F]", (M, F)),
        ("dh [M, 2F]", (M, 2 * F)),
        ("w_gate_up rows [E 2F, D]", (E * 2 * F, D)),
        ("w_down rows [E D, F]", (E * D, F)),
    ]


def columnwise_cases() -> list[tuple[str, tuple[int, ...]]]:
    D, F, E = CFG.d_model, CFG.expert_hidden, CFG.n_experts
    return [("w_gate_up [E, 2F, D]", (E, 2 * F, D)), ("w_down [E, D, F]", (E, D, F))]


def sweep(fn, ref, x: torch.Tensor, candidates: list[dict], warmup: int, iters: int) -> list[dict]:
    ref_q, ref_s = ref(x)
    phases = []
    for i, c in enumerate(candidates):
        q, s = fn(x, **c)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)), c
        assert torch.equal(s, ref_s), c
        phases.append((str(i), lambda c=c: fn(x, **c)))
    phases.append(("copy", lambda: x.clone()))
    times = cuda_phase_times_ms(phases, warmup, iters)
    moved = x.numel() * 3  # bf16 in, E4M3 out (scales aside)
    copy_ms = statistics.median(times["copy"])
    rows = []
    for i, c in enumerate(candidates):
        ms = statistics.median(times[str(i)])
        rows.append({**c, "ms": ms, "gb_per_s": moved / ms / 1e6})
    rows.sort(key=lambda r: r["ms"])
    return [{"copy_ms": copy_ms, "copy_gb_per_s": x.numel() * 4 / copy_ms / 1e6}, *rows]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: dict[str, list[dict]] = {}
    rowwise = [{}, {"hw_cast": False}] + [
        {"block_m": bm, "block_k": bk, "num_warps": w}
        for bm, bk, w in itertools.product([1, 2, 4, 8], [512, 1024, 2048], [4, 8])
        if bm * bk <= 8192
    ]
    for name, shape in rowwise_cases():
        x = torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)
        cands = [c for c in rowwise if c.get("block_k", 0) <= shape[1]]
        results["rowwise " + name] = sweep(
            fp8_triton.quantize_rowwise,
            fp8.quantize_rowwise_reference,
            x,
            cands,
            args.warmup,
            args.iters,
        )
        print(name, json.dumps(results["rowwise " + name][:4]))
        del x
    columnwise = [{}, {"hw_cast": False}] + [
        {"block_n": bn, "block_k": bk, "num_warps": w}
        for bn, bk, w in itertools.product([32, 64, 128], [16, 32, 64], [4, 8])
    ]
    for name, shape in columnwise_cases():
        w = (torch.randn(*shape, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        results["columnwise " + name] = sweep(
            fp8_triton.quantize_columnwise,
            fp8.quantize_columnwise_reference,
            w,
            columnwise,
            args.warmup,
            args.iters,
        )
        print(name, json.dumps(results["columnwise " + name][:4]))
        del w
    report = {
        "benchmark": "fp8_quantize",
        **stamp(args.commit),
        "results": results,
    }
    save(report, args.out)


if __name__ == "__main__":
    main()
