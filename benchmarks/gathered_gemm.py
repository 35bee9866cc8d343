"""The experts' gate+up GEMM on gathered token rows against today's permute + grouped GEMM, on
one GPU (issue 16, lever 1).

    python benchmarks/gathered_gemm.py --out benchmarks/results

Per case (16,384 tokens, d_model 2048, expert hidden 1024, bf16), from the same slot map
(``expert_slots``, not timed) to the same [M, 2 x hidden] projection:

- permute: ``permute_to_slots`` writes each token row into its K expert-ordered slots, then
  ``grouped_mm`` (the layer's path today; backward keeps the [M, d_model] copy);
- gathered: ``slot_tokens`` then ``gathered_grouped_mm``: QuACK reads each slot's token row
  through the index inside its GEMMs (``A_idx``), forward and weight gradient; backward keeps
  only the token rows.

Cases: 64 experts top-8 (OLMoE-1B-7B) and 128 experts top-4, each with learned-like routing
(softmax top-k over random logits plus a per-expert bias drawn once, so a few experts are
popular as in a trained router; ``--skew`` its spread) and uniform routing (every expert the
same count, tokens in random order). Both paths are checked equal first (bf16 tolerance:
output and the gradients of x and w); then forward alone and forward + backward (one
``autograd.grad`` into x and w with a fixed upstream gradient) are timed with CUDA events
(``timing.cuda_times_ms``: median of ``--iters`` after ``--warmup``), and the bytes each path
holds for backward after its forward are measured. ``--expert-gemm`` picks the grouped-GEMM
backend of both (default ``auto``: QuACK where installed); where the gathered GEMM cannot run
in QuACK the gathered path is its reference (index, then the grouped product) and the output
says so. One line per case, and a JSON file in ``--out`` (a folder).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, when imported elsewhere

from report import save, stamp
from timing import cuda_times_ms

from moe_kernels import grouped_gemm
from moe_kernels.grouped_gemm import gathered_grouped_mm, gathers_in_gemm, grouped_mm
from moe_kernels.routing import expert_slots
from moe_kernels.slot_permute import permute_to_slots, slot_tokens

BF16 = torch.bfloat16
MIB = 1 << 20
DEVICE = "cuda"


def route(T: int, E: int, K: int, kind: str, skew: float, gen: torch.Generator) -> torch.Tensor:
    """experts_TK (int64, on the GPU): ``learned`` = top-k of random logits plus a per-expert
    bias ~ N(0, skew^2); ``uniform`` = every expert T*K/E times, K distinct per token, tokens
    in random order."""
    if kind == "learned":
        logits_TE = torch.randn(T, E, device=DEVICE, generator=gen)
        bias_E = torch.randn(E, device=DEVICE, generator=gen) * skew
        return torch.topk(logits_TE + bias_E, K, dim=-1).indices
    if kind == "uniform":
        if (T * K) % E:
            raise SystemExit(f"uniform routing needs tokens x top-k divisible by {E} experts")
        experts_TK = (torch.arange(T * K, device=DEVICE) % E).view(T, K)
        return experts_TK[torch.randperm(T, device=DEVICE, generator=gen)]
    raise SystemExit(f"--routings: unknown routing {kind!r} (learned, uniform)")


def check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Both accumulate the same bf16 products in fp32 and round once: about a bf16 ulp apart."""
    scale = ref.float().abs().max().item()
    try:
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=1.6e-2, atol=2**-8 * max(scale, 1e-30)
        )
    except AssertionError as err:
        raise SystemExit(f"{name}: gathered and permuted paths disagree\n{err}") from None


def held_for_backward(fn: Callable[[], torch.Tensor]) -> int:
    """Bytes a forward leaves allocated besides its output (what autograd keeps for backward)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    y = fn()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - y.untyped_storage().nbytes()
    del y
    return held


def run_case(args: argparse.Namespace, K: int, E: int, kind: str) -> dict:
    T, D, F = args.tokens, args.d_model, args.hidden
    gen = torch.Generator(device=DEVICE).manual_seed(args.seed)
    experts_TK = route(T, E, K, kind, args.skew, gen)
    slots = expert_slots(experts_TK, E)
    counts = slots.counts_E.tolist()
    x_TD = torch.randn(T, D, device=DEVICE, generator=gen).to(BF16).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * F, D, device=DEVICE, generator=gen) * 0.02).to(BF16)
    w_gate_up.requires_grad_()
    dy_MN = torch.randn(slots.n_rows, 2 * F, device=DEVICE, generator=gen).to(BF16)
    w_GKN = w_gate_up.transpose(-2, -1)  # the experts' layout: stored [E, 2F, D]

    def permuted() -> torch.Tensor:
        x_MD = permute_to_slots(x_TD, slots.slot_TK, slots.n_rows)
        return grouped_mm(x_MD, w_GKN, slots.offs_E, backend=args.expert_gemm)

    def gathered() -> torch.Tensor:
        idx_M = slot_tokens(slots.slot_TK, slots.n_rows)
        return gathered_grouped_mm(
            x_TD, idx_M, w_GKN, slots.offs_E, slots.slot_TK, backend=args.expert_gemm
        )

    paths = {"permute": permuted, "gathered": gathered}
    name = f"E={E} top-{K} {kind}"
    outs = {}
    for p, fn in paths.items():
        y = fn()
        outs[p] = (y.detach(), *torch.autograd.grad(y, (x_TD, w_gate_up), dy_MN))
    for label, got, ref in zip(("y", "dx", "dw"), outs["gathered"], outs["permute"], strict=True):
        check(f"{name} {label}", got, ref)
    del outs, y

    row = dict(tokens=T, topk=K, experts=E, routing=kind, d_model=D, hidden=F, M=slots.n_rows)
    row |= dict(min_count=min(counts), max_count=max(counts), mean_count=T * K / E)
    flops = 2 * slots.n_rows * D * 2 * F  # one product; forward + backward is three
    for p, fn in paths.items():
        fwd = statistics.median(cuda_times_ms(fn, args.warmup, args.iters))
        both = statistics.median(
            cuda_times_ms(
                lambda fn=fn: torch.autograd.grad(fn(), (x_TD, w_gate_up), dy_MN),
                args.warmup,
                args.iters,
            )
        )
        row[f"{p}_fwd_ms"], row[f"{p}_fwd_bwd_ms"] = fwd, both
        row[f"{p}_fwd_bwd_tflops"] = 3 * flops / (both * 1e-3) / 1e12
        row[f"{p}_held_mib"] = held_for_backward(fn) / MIB
    row["fwd_speedup"] = row["permute_fwd_ms"] / row["gathered_fwd_ms"]
    row["fwd_bwd_speedup"] = row["permute_fwd_bwd_ms"] / row["gathered_fwd_bwd_ms"]
    print(
        f"{name:<24} fwd {row['permute_fwd_ms']:.3f} -> {row['gathered_fwd_ms']:.3f} ms"
        f" ({row['fwd_speedup']:.2f}x)  fwd+bwd {row['permute_fwd_bwd_ms']:.3f} ->"
        f" {row['gathered_fwd_bwd_ms']:.3f} ms ({row['fwd_bwd_speedup']:.2f}x,"
        f" {row['gathered_fwd_bwd_tflops']:.0f} TFLOP/s)  held for backward"
        f" {row['permute_held_mib']:.0f} -> {row['gathered_held_mib']:.0f} MiB"
        f"  (counts {min(counts)}..{max(counts)})",
        flush=True,
    )
    return row


def commit_id() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gpu_tag(name: str) -> str:
    """``h200`` from "NVIDIA H200", for the file name; else the name's letters and digits."""
    found = re.search(r"\b([ABHL]\d{2,3})\b", name)
    return found.group(1).lower() if found else re.sub(r"[^a-z0-9]+", "", name.lower())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="folder for JSON")
    p.add_argument("--cases", default="8:64,4:128", help="top-k:experts, comma-separated")
    p.add_argument("--routings", default="learned,uniform")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024, help="expert hidden size")
    p.add_argument("--skew", type=float, default=1.0, help="std of the learned routing's bias")
    p.add_argument("--expert-gemm", choices=grouped_gemm.BACKENDS, default="auto")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="", help="default: git rev-parse --short HEAD")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.iters < 10:
        raise SystemExit(f"--iters {args.iters}: at least 10 timed runs")
    commit = args.commit or commit_id()
    probe = torch.empty(1, args.d_model, device="cuda", dtype=BF16)
    in_gemm = gathers_in_gemm(probe, args.expert_gemm)
    impl = "quack A_idx" if in_gemm else "reference (index + grouped GEMM)"
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}  torch {torch.__version__}  commit {commit}  expert_gemm={args.expert_gemm}")
    print(f"gathered path: {impl}; median of {args.iters} runs after {args.warmup} warm-up")
    rows = []
    for case in args.cases.split(","):
        K, E = (int(v) for v in case.split(":"))
        for kind in args.routings.split(","):
            rows.append(run_case(args, K, E, kind))
            torch.cuda.empty_cache()
    result = {
        "benchmark": "gathered_gemm",
        **stamp(commit, gpu=gpu),
        "gathered_impl": impl,
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "rows": rows,
    }
    try:
        result["quack"] = importlib.metadata.version("quack-kernels")
    except importlib.metadata.PackageNotFoundError:
        result["quack"] = None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gathered_gemm_{gpu_tag(gpu)}_{commit}.json"
    save(result, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
