"""The FP8 experts' four grouped GEMMs (issue 41, item 3) at OLMoE-1B-7B's shapes on one GPU:
``torch._scaled_grouped_mm`` (what ``moe_kernels.fp8`` calls today) against QuACK's sm90 GEMM
on the same E4M3 operands with the rowwise scales in its epilogue
(``grouped_gemm_quack.fp8_scaled_mm``) in a few tile configurations, and the bf16 grouped GEMMs
of the same products (torch's and QuACK's) beside them.

    python benchmarks/fp8_gemm.py --out results.json

Per micro-batch size (``--tokens``, a comma list): top-8 of 64 experts routed from random
logits (``--skew`` sharpens them: learned routing is uneven), the products of one MoE layer
(gate+up and down forward, the down and gate+up input gradients), operands quantized by
``moe_kernels.fp8``'s quantizers. Every QuACK output is checked against torch's FP8 output
(largest difference over the output's largest magnitude, recorded) before timing; the
candidates of a product are timed interleaved (CUDA events, median of ``--iters`` after
``--warmup``) and reported as ms and TFLOP/s (2 M N K).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms

from moe_kernels.fp8 import quantize_columnwise, quantize_rowwise
from moe_kernels.routing import expert_slots


def configs() -> dict[str, object]:
    from quack.gemm_config import GemmConfig

    def c(m: int, n: int, pingpong: bool, cm: int, cn: int) -> GemmConfig:
        return GemmConfig(
            tile_m=m,
            tile_n=n,
            pingpong=pingpong,
            cluster_m=cm,
            cluster_n=cn,
            is_dynamic_persistent=False,
        )

    return {
        "quack fp8 default": None,
        "quack fp8 128x128 pp 1x2": c(128, 128, True, 1, 2),
        "quack fp8 256x128 coop 2x1": c(256, 128, False, 2, 1),
    }


def products(tokens: int, skew: float, gen: torch.Generator):
    """The four products of one MoE layer: name -> (bf16 A [M, K], bf16 B [G, N, K], offs)."""
    cfg = olmoe()
    D, F, E, K = cfg.d_model, cfg.expert_hidden, cfg.n_experts, cfg.top_k
    logits = torch.randn(tokens, E, device="cuda", generator=gen) * skew
    _, experts_TK = torch.softmax(logits, -1).topk(K, dim=-1)
    offs_E = expert_slots(experts_TK, E).offs_E
    M = tokens * K

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    w_gate_up, w_down = randn(E, 2 * F, D) * 0.02, randn(E, D, F) * 0.02
    return offs_E, {
        "gate+up forward": (randn(M, D), w_gate_up, "rows"),
        "down forward": (randn(M, F), w_down, "rows"),
        "down input grad": (randn(M, D), w_down, "cols"),
        "gate+up input grad": (randn(M, 2 * F), w_gate_up, "cols"),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,16384", help="tokens per micro-batch, comma list")
    p.add_argument("--skew", type=float, default=1.0, help="router logits' scale")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    from quack.gemm_interface import gemm

    from moe_kernels.grouped_gemm_quack import fp8_scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    results: dict[str, dict] = {}
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs_E, prods = products(tokens, args.skew, gen)
        cu = torch.nn.functional.pad(offs_E, (1, 0))
        for name, (a_MK, b_GNK, which) in prods.items():
            qa, sa = quantize_rowwise(a_MK)
            if which == "rows":
                G, N, K = b_GNK.shape
                qb, sb = quantize_rowwise(b_GNK.reshape(G * N, K))
                qb, sb = qb.view(G, N, K), sb.view(G, N)
                w_GKN = b_GNK.mT
            else:  # the input gradient's operand: the weight quantized over its N
                qb, sb = quantize_columnwise(b_GNK)
                w_GKN = b_GNK
            M, K, N = a_MK.shape[0], a_MK.shape[1], qb.shape[1]

            def torch_fp8(qa=qa, sa=sa, qb=qb, sb=sb, offs_E=offs_E):
                return torch._scaled_grouped_mm(qa, qb.mT, sa, sb, offs=offs_E, out_dtype=bf16)

            ref = torch_fp8()
            phases = [("torch fp8", torch_fp8)]
            row: dict[str, object] = {"M": M, "N": N, "K": K, "errors": {}, "refused": {}}
            for label, config in configs().items():

                def quack_fp8(qa=qa, sa=sa, qb=qb, sb=sb, config=config, offs_E=offs_E):
                    return fp8_scaled_mm(qa, sa, qb, sb, offs_E, bf16, config)

                try:
                    out = quack_fp8()
                except Exception as e:  # a tile shape the kernel does not take
                    row["refused"][label] = f"{type(e).__name__}: {str(e)[:160]}"
                    continue
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                row["errors"][label] = err
                assert err < 2e-2, f"{name} {label}: {err}"
                phases.append((label, quack_fp8))
            a_ctg, w_ctg = a_MK.contiguous(), w_GKN

            def torch_bf16(a=a_ctg, w=w_ctg, offs_E=offs_E):
                return torch._grouped_mm(a, w, offs=offs_E)

            def quack_bf16(a=a_ctg, w=w_ctg, cu=cu):
                return gemm(a, w, cu_seqlens_m=cu, tuned=False)

            phases += [("torch bf16", torch_bf16), ("quack bf16", quack_bf16)]
            times = cuda_phase_times_ms(phases, args.warmup, args.iters)
            ms = {label: statistics.median(t) for label, t in times.items()}
            row["ms"] = ms
            row["tflops"] = {label: 2 * M * N * K / t / 1e9 for label, t in ms.items()}
            results[f"{tokens} tokens, {name}"] = row
            best = min((t, label) for label, t in ms.items() if label.startswith("quack fp8"))
            print(
                f"{tokens} {name}: torch fp8 {ms['torch fp8']:.3f} ms, best quack fp8 "
                f"{best[0]:.3f} ({best[1]}), torch bf16 {ms['torch bf16']:.3f}, "
                f"quack bf16 {ms['quack bf16']:.3f}; refused {list(row['refused'])}",
                flush=True,
            )
    out = {"benchmark": "fp8_gemm", **stamp(args.commit), "skew": args.skew, "results": results}
    save(out, args.out)


if __name__ == "__main__":
    main()
