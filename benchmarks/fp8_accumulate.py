"""How torch's FP8 grouped GEMM accumulates, and what it costs (issue 41): the experts' four
FP8 products of one MoE layer (``fp8_gemm.products``: top-k routed from random logits, operands
quantized by ``moe_kernels.fp8``'s quantizers) through ``torch._scaled_grouped_mm``

- with fp32 promotion (``use_fast_accum=False``, ``precision.fp8_fast_accum=none``),
- with the tensor cores' fast accumulation (``use_fast_accum=True``),
- with promotion, the rows operand padded to 2,048 rows an expert (rows no group reads): torch
  picks the GEMM's tile configuration from the rows divided by the groups, so this shows what
  the larger problems' configuration would give at the same work (a diagnosis, not a path),

beside torch's bf16 grouped GEMM of the same product. Before timing, the padded output is
checked equal to the promoted one and the fast one's largest difference from it (relative to
its largest value) is recorded. CUDA events, interleaved, median of ``--iters`` after
``--warmup``; TFLOP/s count 2 M N K of the routed rows.

    python benchmarks/fp8_accumulate.py --out results.json
    python benchmarks/fp8_accumulate.py --set model.n_experts=128 --set model.top_k=16 \\
        --set model.expert_hidden=512 --out fine.json
"""

from __future__ import annotations

import statistics

import torch
from fp8_gemm import parser, products
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms

from moe_kernels.fp8 import quantize_columnwise, quantize_rowwise

PADDED_ROWS = 2048  # a group's rows from which torch takes its large problems' tiles


def operands(a_MK: torch.Tensor, b_GNK: torch.Tensor, which: str):
    """E4M3 operands and scales of one product, as ``moe_kernels.fp8`` makes them."""
    qa, sa = quantize_rowwise(a_MK)
    if which == "rows":
        G, N, K = b_GNK.shape
        qb, sb = quantize_rowwise(b_GNK.reshape(G * N, K))
        return qa, sa, qb.view(G, N, K), sb.view(G, N)
    qb, sb = quantize_columnwise(b_GNK)  # the input gradient's operand, over the weight's N
    return qa, sa, qb, sb


def main() -> None:
    args = parser().parse_args()
    cfg = olmoe(*args.set)
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    head = {"benchmark": "fp8_accumulate", **stamp(args.commit), "overrides": args.set}
    results: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs_E, prods = products(cfg, tokens, args.skew, gen)
        G = offs_E.shape[0]
        for name, (a_MK, b_GNK, which) in prods.items():
            qa, sa, qb, sb = operands(a_MK, b_GNK, which)
            M, K, N = qa.shape[0], qa.shape[1], qb.shape[1]
            Mp = max(M, PADDED_ROWS * G)
            qa_pad = torch.zeros(Mp, K, device="cuda", dtype=qa.dtype)
            qa_pad[:M] = qa
            sa_pad = torch.ones(Mp, device="cuda")
            sa_pad[:M] = sa
            a_ctg, w_GKN = a_MK.contiguous(), b_GNK.mT if which == "rows" else b_GNK

            def fp8(qa=qa, sa=sa, qb=qb, sb=sb, offs_E=offs_E, fast=False):
                return torch._scaled_grouped_mm(
                    qa, qb.mT, sa, sb, offs=offs_E, out_dtype=bf16, use_fast_accum=fast
                )

            def fp8_fast():
                return fp8(fast=True)

            def fp8_padded(qa=qa_pad, sa=sa_pad):
                return fp8(qa=qa, sa=sa)

            def torch_bf16(a=a_ctg, w=w_GKN, offs_E=offs_E):
                return torch._grouped_mm(a, w, offs=offs_E)

            ref, end = fp8().float(), int(offs_E[-1])
            fast_err = (fp8_fast().float() - ref)[:end].abs().max() / ref[:end].abs().max()
            padded_equal = torch.equal(fp8_padded()[:end].float(), ref[:end])
            phases = [
                ("fp8 promoted", fp8),
                ("fp8 fast", fp8_fast),
                ("fp8 promoted, rows padded", fp8_padded),
                ("bf16", torch_bf16),
            ]
            times = cuda_phase_times_ms(phases, args.warmup, args.iters)
            ms = {label: statistics.median(t) for label, t in times.items()}
            results[f"{tokens} tokens, {name}"] = {
                "M": M, "N": N, "K": K, "rows_per_expert": M / G, "padded_rows": Mp,
                "fast_max_rel_diff": fast_err.item(), "padded_equal": padded_equal,
                "ms": ms, "tflops": {k: 2 * M * N * K / v / 1e9 for k, v in ms.items()},
            }  # fmt: skip
            save({**head, "results": results}, args.out)  # each product as it lands
            print(
                f"{tokens} {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items())
                + f"; fast differs by {fast_err.item():.2e}, padded equal {padded_equal}",
                flush=True,
            )  # fmt: skip


if __name__ == "__main__":
    main()
