"""GPU micro-benchmark of the MoE routing / permutation / SwiGLU kernels against the PyTorch path.

Each op runs twice on the same random inputs: the PyTorch path (the argsort baseline's
permutation and index_copy + bmm combine, SwiGLU in plain torch, the torch.topk router) and the
Triton kernels (the library's slot permute and SwiGLU; the router top-k and weighted combine
baselines of ``benchmarks/baselines``). Both outputs are checked against each other once, then
each is timed with ``timing.cuda_times_ms``: warm-up, then the median (and 10th / 90th
percentiles) of many runs, with the L2 cache flushed before every run. Bandwidth is the op's
minimal traffic (each tensor read or written once) over the median time, next to a measured
device-to-device copy.

    python benchmarks/moe_ops.py --out benchmarks/moe_kernels_h200.json

Defaults are OLMoE-1B-7B (``shapes.olmoe()``): 16384 tokens, d_model 2048, 64 experts, top-8,
expert hidden 1024, bf16, learned-like routing from random logits (``--routing skewed`` tilts
them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # timing.py, when imported elsewhere

from report import save
from shapes import olmoe
from timing import cuda_times_ms

from benchmarks.baselines.argsort_permute import (
    combine_rows,
    cumulative_offsets,
    expert_order,
    permute_rows,
)
from benchmarks.baselines.router_topk import topk_softmax
from benchmarks.baselines.weighted_combine import combine_from_slots
from moe_kernels.grouped_gemm import grouped_mm
from moe_kernels.routing import expert_counts, expert_slots
from moe_kernels.slot_permute import permute_to_slots
from moe_kernels.swiglu import swiglu


@dataclass
class Row:
    op: str
    passes: str  # "fwd" or "fwd+bwd"
    impl: str  # "torch" or "triton"
    ms: float  # median
    p10_ms: float
    p90_ms: float
    bytes: int  # minimal traffic of the op (0: not a bandwidth-bound op)
    gbps: float


class Timer:
    """``timing.cuda_times_ms`` with the L2 cache flushed before every run (outside its events):
    these ops are memory-bound, so each run reads its inputs from device memory."""

    def __init__(self, warmup: int, iters: int, flush_bytes: int) -> None:
        self.warmup, self.iters = warmup, iters
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda")

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        """(median, p10, p90) milliseconds of ``fn`` on the current stream."""
        ms = sorted(cuda_times_ms(fn, self.warmup, self.iters, before=self.flush.zero_))
        n = len(ms)
        return statistics.median(ms), ms[n // 10], ms[min(n - 1, (9 * n) // 10)]


def fwd_bwd(fn: Callable[[], torch.Tensor], inputs: list[torch.Tensor], grad: torch.Tensor):
    """A closure running ``fn`` and its backward into ``inputs`` (grads returned, not stored)."""

    def run() -> None:
        torch.autograd.grad(fn(), inputs, grad)

    return run


def check(name: str, got: torch.Tensor, ref: torch.Tensor, tol: float = 2e-2) -> None:
    """Relative-norm agreement of the two paths; stops the benchmark if they disagree."""
    err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()
    if not err < tol:
        raise SystemExit(f"{name}: triton and torch disagree (relative error {err:.2e})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--dim", type=int, default=olmoe().d_model)
    p.add_argument("--experts", type=int, default=olmoe().n_experts)
    p.add_argument("--topk", type=int, default=olmoe().top_k)
    p.add_argument("--hidden", type=int, default=olmoe().expert_hidden)
    p.add_argument("--align", type=int, default=1, help="segment alignment of the slot path")
    p.add_argument("--routing", choices=["random", "skewed"], default="random")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="JSON results file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")

    T, D, E, K, Fh = args.tokens, args.dim, args.experts, args.topk, args.hidden
    M, bf16, dev = T * K, torch.bfloat16, "cuda"
    torch.manual_seed(args.seed)
    timer = Timer(args.warmup, args.iters, flush_bytes=256 << 20)
    rows: list[Row] = []

    def record(op: str, passes: str, impl: str, fn: Callable[[], object], nbytes: int) -> None:
        ms, p10, p90 = timer(fn)
        gbps = nbytes / (ms * 1e-3) / 1e9 if nbytes else 0.0
        rows.append(Row(op, passes, impl, ms, p10, p90, nbytes, gbps))

    # Inputs: router logits (random, optionally tilted towards a few experts), token rows,
    # expert weights; the same tensors feed both paths.
    logits_TE = torch.randn(T, E, device=dev)
    if args.routing == "skewed":
        logits_TE += torch.linspace(-4.0, 4.0, E, device=dev)
    logits_TE.requires_grad_()
    x_TD = torch.randn(T, D, device=dev, dtype=bf16).requires_grad_()
    w_gate_up = (torch.randn(E, 2 * Fh, D, device=dev, dtype=bf16) * 0.02).requires_grad_()
    w_down = (torch.randn(E, D, Fh, device=dev, dtype=bf16) * 0.02).requires_grad_()
    with torch.no_grad():
        weights_TK, experts_TK, _ = topk_softmax(logits_TE, K)
    weights_TK.requires_grad_()
    slots = expert_slots(experts_TK, E, args.align)
    slot_TK, n_rows = slots.slot_TK, slots.n_rows
    order_M = expert_order(experts_TK)
    el = 2  # bytes per bf16 element

    # Copy bandwidth: the roofline for these memory-bound ops.
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    record("copy 1 GiB", "fwd", "torch", lambda: dst.copy_(src), 2 * src.numel())
    src = dst = torch.empty(0, device=dev)  # release the 2 GiB

    # Router top-k.
    def torch_topk():
        probs = torch.softmax(logits_TE, -1)
        _, ex = torch.topk(probs, K, dim=-1)
        return probs.gather(1, ex), ex, probs

    g_w = torch.randn(T, K, device=dev)
    check("topk weights", topk_softmax(logits_TE, K)[0], torch_topk()[0])
    topk_bytes = T * E * 4 * 2 + T * K * (4 + 8)
    record("router topk", "fwd", "torch", torch_topk, topk_bytes)
    record("router topk", "fwd", "triton", lambda: topk_softmax(logits_TE, K), topk_bytes)
    record("router topk", "fwd+bwd", "torch", fwd_bwd(lambda: torch_topk()[0], [logits_TE], g_w), 0)
    record(
        "router topk",
        "fwd+bwd",
        "triton",
        fwd_bwd(lambda: topk_softmax(logits_TE, K)[0], [logits_TE], g_w),
        0,
    )

    # Routing metadata: counts, offsets and the permutation.
    def torch_routing():
        counts = expert_counts(experts_TK, E)
        return expert_order(experts_TK), cumulative_offsets(counts)

    if not torch.equal(slots.counts_E, expert_counts(experts_TK, E)):
        raise SystemExit("routing metadata: triton and torch counts disagree")
    routing_bytes = 2 * M * 8  # read the expert ids, write the slots (or the order)
    record("routing metadata", "fwd", "torch", torch_routing, routing_bytes)
    record(
        "routing metadata",
        "fwd",
        "triton",
        lambda: expert_slots(experts_TK, E, args.align),
        routing_bytes,
    )

    # Permute (dispatch): read T rows, write M rows; backward reads M rows, writes T.
    permute_bytes = (T + M) * D * el
    g_MD = torch.randn(n_rows, D, device=dev, dtype=bf16)
    check(
        "permute",
        permute_to_slots(x_TD, slot_TK, n_rows)[slot_TK.reshape(-1)],
        permute_rows(x_TD, order_M, K)[torch.argsort(order_M)],
    )
    record("permute", "fwd", "torch", lambda: permute_rows(x_TD, order_M, K), permute_bytes)
    record(
        "permute", "fwd", "triton", lambda: permute_to_slots(x_TD, slot_TK, n_rows), permute_bytes
    )
    record(
        "permute",
        "fwd+bwd",
        "torch",
        fwd_bwd(lambda: permute_rows(x_TD, order_M, K), [x_TD], g_MD[:M]),
        2 * permute_bytes,
    )
    record(
        "permute",
        "fwd+bwd",
        "triton",
        fwd_bwd(lambda: permute_to_slots(x_TD, slot_TK, n_rows), [x_TD], g_MD),
        2 * permute_bytes,
    )

    # Combine: read M rows, write T; backward reads T rows and M rows (for the weight grad),
    # writes M rows.
    y_MD = torch.randn(n_rows, D, device=dev, dtype=bf16).requires_grad_()
    # the same rows in the argsort layout: row m holds the output of assignment order_M[m]
    y_sorted_MD = y_MD.detach()[slot_TK.reshape(-1)[order_M]].requires_grad_()
    dy_TD = torch.randn(T, D, device=dev, dtype=bf16)
    check(
        "combine",
        combine_from_slots(y_MD, slot_TK, weights_TK),
        combine_rows(y_sorted_MD, order_M, weights_TK),
    )
    combine_bytes = (T + M) * D * el

    def torch_combine():
        return combine_rows(y_sorted_MD, order_M, weights_TK)

    def triton_combine():
        return combine_from_slots(y_MD, slot_TK, weights_TK)

    combine_bwd_bytes = combine_bytes + (T + 2 * M) * D * el
    record("combine", "fwd", "torch", torch_combine, combine_bytes)
    record("combine", "fwd", "triton", triton_combine, combine_bytes)
    torch_grads = fwd_bwd(torch_combine, [y_sorted_MD, weights_TK], dy_TD)
    record("combine", "fwd+bwd", "torch", torch_grads, combine_bwd_bytes)
    triton_grads = fwd_bwd(triton_combine, [y_MD, weights_TK], dy_TD)
    record("combine", "fwd+bwd", "triton", triton_grads, combine_bwd_bytes)

    # SwiGLU: read 2F, write F per row; backward reads 2F + F, writes 2F.
    h_M2F = torch.randn(M, 2 * Fh, device=dev, dtype=bf16).requires_grad_()
    da_MF = torch.randn(M, Fh, device=dev, dtype=bf16)

    def torch_swiglu():
        gate, up = h_M2F.chunk(2, dim=-1)
        return F.silu(gate) * up

    check("swiglu", swiglu(h_M2F), torch_swiglu())
    swiglu_bytes = M * 3 * Fh * el
    swiglu_bwd_bytes = swiglu_bytes + M * 5 * Fh * el
    record("swiglu", "fwd", "torch", torch_swiglu, swiglu_bytes)
    record("swiglu", "fwd", "triton", lambda: swiglu(h_M2F), swiglu_bytes)
    record("swiglu", "fwd+bwd", "torch", fwd_bwd(torch_swiglu, [h_M2F], da_MF), swiglu_bwd_bytes)
    triton_swiglu = fwd_bwd(lambda: swiglu(h_M2F), [h_M2F], da_MF)
    record("swiglu", "fwd+bwd", "triton", triton_swiglu, swiglu_bwd_bytes)

    # The whole expert path of one MoE layer, router logits to combined output.
    def torch_layer():
        weights, experts, _ = torch_topk()
        order = expert_order(experts)
        offs = cumulative_offsets(expert_counts(experts, E))
        h = grouped_mm(permute_rows(x_TD, order, K), w_gate_up.transpose(-2, -1), offs)
        gate, up = h.chunk(2, dim=-1)
        y = grouped_mm(F.silu(gate) * up, w_down.transpose(-2, -1), offs)
        return combine_rows(y, order, weights)

    def triton_layer():
        weights, experts, _ = topk_softmax(logits_TE, K)
        slot, _, offs, rows_n = expert_slots(experts, E, args.align)
        h = grouped_mm(permute_to_slots(x_TD, slot, rows_n), w_gate_up.transpose(-2, -1), offs)
        y = grouped_mm(swiglu(h), w_down.transpose(-2, -1), offs)
        return combine_from_slots(y, slot, weights)

    check("moe layer", triton_layer(), torch_layer())
    leaves = [logits_TE, x_TD, w_gate_up, w_down]
    record("moe experts layer", "fwd", "torch", torch_layer, 0)
    record("moe experts layer", "fwd", "triton", triton_layer, 0)
    record("moe experts layer", "fwd+bwd", "torch", fwd_bwd(torch_layer, leaves, dy_TD), 0)
    record("moe experts layer", "fwd+bwd", "triton", fwd_bwd(triton_layer, leaves, dy_TD), 0)

    copy_gbps = rows[0].gbps
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(
        f"T={T} D={D} E={E} K={K} F={Fh} align={args.align} routing={args.routing}"
        f"  (median of {args.iters}, L2 flushed)"
    )
    header = ["op", "pass", "impl", "ms", "p10", "p90", "GB/s", "% copy", "speedup"]
    print(f"{header[0]:<20}{header[1]:<9}{header[2]:<8}" + "".join(f"{h:>9}" for h in header[3:]))
    by_key = {(r.op, r.passes, r.impl): r for r in rows}
    for r in rows:
        base = by_key.get((r.op, r.passes, "torch"))
        speedup = f"{base.ms / r.ms:.2f}x" if base and r.impl == "triton" else ""
        gbps = f"{r.gbps:.0f}" if r.bytes else ""
        frac = f"{100 * r.gbps / copy_gbps:.1f}%" if r.bytes else ""
        times = f"{r.ms:9.3f}{r.p10_ms:9.3f}{r.p90_ms:9.3f}"
        print(f"{r.op:<20}{r.passes:<9}{r.impl:<8}{times}{gbps:>9}{frac:>9}{speedup:>9}")

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "copy_gbps": copy_gbps,
        "rows": [asdict(r) for r in rows],
    }
    save(result, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
