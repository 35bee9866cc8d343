"""Grouped GEMMs of the MoE experts on one GPU: ``torch._grouped_mm`` against our Triton kernels
and QuACK (``--impls triton,quack``).

    python benchmarks/grouped_gemm.py --commit $(git rev-parse --short HEAD) --out gg.json

Shapes: 16384 tokens at top-4 (M = 65536 rows) over 8, 16, 32, 64 and 128 experts, and at top-8
over 64 experts (M = 131072, OLMoE-1B-7B); for each, the gate+up projection (K = d_model 2048,
N = 2 x expert hidden 1024) and the down projection (K = 1024, N = 2048); group sizes uniform
(each row picks an expert at random) or skewed (Zipf-like: a few experts take most rows, in
random expert order). Per case, both implementations run:

- fwd: ``y = x @ w[g]`` with ``w`` the transpose of a contiguous [G, N, K] weight (the model's
  layout, stride(-2) == 1);
- dgrad: ``dx = dy @ w[g]^T``, i.e. the [G, N, K] weight as it is stored;
- wgrad: ``dw = x^T @ dy`` per group as [G, K, N]; wgrad_nk: transposed, as [G, N, K] (the
  layout of the weight's own gradient).

Outputs of the two are compared first (bf16 tolerance); then each is timed with CUDA events
(warm-up, then the median of ``--iters`` runs; the Triton kernels autotune in the check, before
any timing). TFLOP/s is 2 * M * K * N over the median; a dense ``torch.mm`` of the same FLOPs
(M x K @ K x N) is the reference rate. Inputs are random normal bf16 (never zero), the same
tensors for every implementation and both group-size distributions.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, when imported elsewhere

from report import save, stamp
from shapes import olmoe
from timing import cuda_times_ms

BF16 = torch.bfloat16
OPS = ["fwd", "dgrad", "wgrad", "wgrad_nk"]


def group_sizes(M: int, G: int, dist: str, seed: int) -> list[int]:
    """Rows per group summing to M: ``uniform`` draws each row's group uniformly; ``skewed``
    from p_g ~ 1 / rank^1.5 over a random order of the groups."""
    gen = torch.Generator().manual_seed(seed)
    p_G = torch.ones(G, dtype=torch.float64)
    if dist == "skewed":
        p_G = 1.0 / torch.arange(1, G + 1, dtype=torch.float64) ** 1.5
        p_G = p_G[torch.randperm(G, generator=gen)]
    rows_M = torch.multinomial(p_G, M, replacement=True, generator=gen)
    return torch.bincount(rows_M, minlength=G).tolist()


def randn(*shape: int, scale: float, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(BF16)


def check(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    """Triton vs torch: both accumulate the same bf16 products in fp32 (in different orders)
    and round once to bf16, so they agree to about a bf16 ulp of the output's scale."""
    scale = ref.float().abs().max().item()
    try:
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=1.6e-2, atol=2**-8 * max(scale, 1e-30)
        )
    except AssertionError as err:
        raise SystemExit(f"{name}: triton and torch._grouped_mm disagree\n{err}") from None


def median_ms(step: Callable[[], object], args: argparse.Namespace) -> float:
    return statistics.median(cuda_times_ms(step, args.warmup, args.iters))


def run_case(args: argparse.Namespace, topk: int, G: int, K: int, N: int, proj: str) -> list[dict]:
    """Every op and implementation for one (M, G, K, N) and both size distributions."""
    M = args.tokens * topk
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    x_MK, dy_MN = randn(M, K, scale=1.0, gen=gen), randn(M, N, scale=1.0, gen=gen)
    w_GNK = randn(G, N, K, scale=0.02, gen=gen)
    w_GKN = w_GNK.transpose(-2, -1)
    flops = 2 * M * K * N
    base = dict(tokens=args.tokens, topk=topk, experts=G, M=M, proj=proj, K=K, N=N)

    w_KN = randn(K, N, scale=0.02, gen=gen)
    dense_ms = median_ms(lambda: torch.mm(x_MK, w_KN), args)
    dense_tflops = flops / (dense_ms * 1e-3) / 1e12
    rows = [base | dict(dist="-", op="dense", impl="torch.mm", ms=dense_ms, tflops=dense_tflops)]

    for dist in args.dists.split(","):
        sizes = group_sizes(M, G, dist, args.seed)
        offs_G = torch.tensor(sizes).cumsum(0).to("cuda", torch.int32)
        top4 = sum(sorted(sizes)[-4:]) / M
        impls: dict[str, dict[str, Callable[[], torch.Tensor]]] = {
            "fwd": {"torch": lambda o=offs_G: torch._grouped_mm(x_MK, w_GKN, offs=o)},
            "dgrad": {"torch": lambda o=offs_G: torch._grouped_mm(dy_MN, w_GNK, offs=o)},
            "wgrad": {"torch": lambda o=offs_G: torch._grouped_mm(x_MK.t(), dy_MN, offs=o)},
            "wgrad_nk": {"torch": lambda o=offs_G: torch._grouped_mm(dy_MN.t(), x_MK, offs=o)},
        }
        for name, lib in libraries(args.impls).items():
            impls["fwd"][name] = lambda o=offs_G, m=lib: m.grouped_mm(x_MK, w_GKN, o)
            impls["dgrad"][name] = lambda o=offs_G, m=lib: m.grouped_mm(dy_MN, w_GNK, o)
            impls["wgrad"][name] = lambda o=offs_G, m=lib: m.grouped_wgrad(x_MK, dy_MN, o)
            impls["wgrad_nk"][name] = lambda o=offs_G, m=lib: m.grouped_wgrad(
                x_MK, dy_MN, o, transposed=True
            )
        for op in OPS:
            fns = impls[op]
            for impl, fn in fns.items():
                if impl != "torch":
                    check(f"{impl} {proj} E={G} top-{topk} {dist} {op}", fn(), fns["torch"]())
            for impl, fn in fns.items():
                ms = median_ms(fn, args)
                tflops = flops / (ms * 1e-3) / 1e12
                row = dict(dist=dist, top4_share=top4, min_group=min(sizes), max_group=max(sizes))
                row |= dict(op=op, impl=impl, ms=ms, tflops=tflops, of_dense=tflops / dense_tflops)
                rows.append(base | row)
    return rows


def libraries(names: str) -> dict[str, object]:
    """The implementations compared with ``torch._grouped_mm`` (``--impls``)."""
    out: dict[str, object] = {}
    for name in names.split(","):
        if name == "triton":
            from benchmarks.baselines import grouped_gemm_triton as lib
        elif name == "quack":
            from moe_kernels import grouped_gemm_quack as lib  # type: ignore[no-redef]
        else:
            raise SystemExit(f"--impls: unknown implementation {name!r} (triton, quack)")
        out[name] = lib
    return out


def print_table(rows: list[dict], impls: list[str]) -> None:
    """One line per (case, distribution, op): torch and each implementation, TFLOP/s, and
    each one's speed-up over torch."""
    dense = {(r["M"], r["experts"], r["proj"]): r for r in rows if r["op"] == "dense"}
    by_key = {(r["M"], r["experts"], r["proj"], r["dist"], r["op"], r["impl"]): r for r in rows}
    head = f"{'M':>7} {'E':>4} {'proj':<8}{'dist':<9}{'op':<9}{'torch TF/s':>11}"
    head += "".join(f"{i + ' TF/s':>12}{'x':>6}" for i in impls)
    print(head + f"{'dense TF/s':>11}")
    for r in rows:
        if r["impl"] != "torch" or r["op"] == "dense":
            continue
        d = dense[(r["M"], r["experts"], r["proj"])]
        line = f"{r['M']:>7} {r['experts']:>4} {r['proj']:<8}{r['dist']:<9}{r['op']:<9}"
        line += f"{r['tflops']:>11.0f}"
        for i in impls:
            t = by_key[(r["M"], r["experts"], r["proj"], r["dist"], r["op"], i)]
            line += f"{t['tflops']:>12.0f}{r['ms'] / t['ms']:>5.2f}x"
        print(line + f"{d['tflops']:>11.0f}")


def autotuned(tuner: object) -> dict[str, str]:
    """The config the Triton autotuner picked per key."""
    return {str(k): str(v) for k, v in getattr(tuner, "cache", {}).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument(
        "--cases", default="4:8,4:16,4:32,4:64,4:128,8:64", help="top-k:experts, comma-separated"
    )
    p.add_argument("--d-model", type=int, default=olmoe().d_model)
    p.add_argument("--hidden", type=int, default=olmoe().expert_hidden, help="expert hidden size")
    p.add_argument("--dists", default="uniform,skewed", help="group-size distributions")
    p.add_argument("--impls", default="triton", help="compared with torch: triton,quack")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="", help="JSON results file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    if args.iters < 20:
        raise SystemExit("--iters must be at least 20")
    D, F = args.d_model, args.hidden
    projections = {"gate_up": (D, 2 * F), "down": (F, D)}  # (K, N)
    rows: list[dict] = []
    for case in args.cases.split(","):
        topk, G = (int(v) for v in case.split(":"))
        for proj, (K, N) in projections.items():
            rows += run_case(args, topk, G, K, N, proj)
            torch.cuda.empty_cache()

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  commit {args.commit}")
    print(f"median of {args.iters} runs after {args.warmup} warm-up; TFLOP/s = 2MKN / time")
    print_table(rows, args.impls.split(","))
    result = {
        "benchmark": "grouped_gemm",
        **stamp(args.commit),
        "triton": __import__("triton").__version__,
        "config": vars(args),
        "rows": rows,
    }
    if "triton" in args.impls.split(","):
        from benchmarks.baselines import grouped_gemm_triton as ggt

        result["autotuned"] = {
            "grouped_mm": autotuned(ggt._grouped_mm_tuned),
            "grouped_wgrad": autotuned(ggt._grouped_wgrad_tuned),
        }
    if "quack" in args.impls.split(","):
        result["quack"] = __import__("importlib.metadata").metadata.version("quack-kernels")
    save(result, args.out)
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
