"""The FP8 experts' four grouped GEMMs (issue 41, item 3) at OLMoE-1B-7B's shapes on one GPU:
``torch._scaled_grouped_mm`` (what ``moe_kernels.fp8`` calls today) against QuACK's sm90 GEMM
on the same E4M3 operands with the rowwise scales in its epilogue
(``grouped_gemm_quack.fp8_scaled_mm``) in a few tile configurations, and the bf16 grouped GEMMs
of the same products (torch's and QuACK's) beside them.

    python benchmarks/fp8_gemm.py --out results.json
    python benchmarks/fp8_gemm.py --set model.n_experts=128 --set model.top_k=16 \
        --set model.expert_hidden=512 --out fine.json  # another shape

Per micro-batch size (``--tokens``, a comma list): top-8 of 64 experts routed from random
logits (``--skew`` sharpens them: learned routing is uneven), the products of one MoE layer
(gate+up and down forward, the down and gate+up input gradients), operands quantized by
``moe_kernels.fp8``'s quantizers; then the two weight gradients in FP8 against bf16
(``weight_grads``, issue 41 item 4). Every QuACK output is checked against torch's FP8 output
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

from moe_core.config import ModelConfig
from moe_kernels.fp8 import quantize_columnwise, quantize_rowwise
from moe_kernels.routing import expert_slots


def configs() -> dict[str, object]:
    from quack.gemm_config import GemmConfig

    from moe_kernels.grouped_gemm_quack import _tile_config

    return {
        "quack fp8 default": None,
        "quack fp8 128x128 pp 1x2": _tile_config(torch.device("cuda")),  # the fused MLP's pin
        "quack fp8 256x128 coop 2x1": GemmConfig(
            tile_m=256, tile_n=128, pingpong=False, cluster_m=2, cluster_n=1,
            is_dynamic_persistent=False,
        ),
    }  # fmt: skip


def _routed(cfg: ModelConfig, tokens: int, skew: float, gen: torch.Generator) -> torch.Tensor:
    """Each token's top-k experts of the shape's router from random logits, ``skew``-scaled."""
    logits = torch.randn(tokens, cfg.n_experts, device="cuda", generator=gen) * skew
    return torch.softmax(logits, -1).topk(cfg.top_k, dim=-1).indices


def products(cfg: ModelConfig, tokens: int, skew: float, gen: torch.Generator):
    """The four products of one MoE layer: name -> (bf16 A [M, K], bf16 B [G, N, K], offs)."""
    D, F, E, K = cfg.d_model, cfg.expert_hidden, cfg.n_experts, cfg.top_k
    offs_E = expert_slots(_routed(cfg, tokens, skew, gen), E).offs_E
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


def _per_group_columns(t_MN: torch.Tensor, offs_E: torch.Tensor):
    """``t`` quantized over each group's rows, one scale per (group, column): the operand a
    weight gradient contracting over the tokens takes, stored transposed ([N, M], contiguous
    along the tokens) as ``torch._scaled_grouped_mm`` wants it; scales [G * N]."""
    G = offs_E.shape[0]
    group_M = torch.repeat_interleave(
        torch.arange(G, device=t_MN.device), torch.diff(offs_E, prepend=offs_E.new_zeros(1))
    )
    amax_GN = torch.zeros(G, t_MN.shape[1], device=t_MN.device)
    amax_GN.index_reduce_(0, group_M, t_MN.float().abs(), "amax")
    scale_GN = amax_GN.clamp_min(2.0**-116) / 448.0
    q_MN = (t_MN.float() / scale_GN[group_M]).to(torch.float8_e4m3fn)
    return q_MN.t().contiguous(), scale_GN.reshape(-1).contiguous()


def weight_grads(
    cfg: ModelConfig, tokens: int, skew: float, gen: torch.Generator, args, results: dict
) -> None:
    """Item 4's question: the experts' two weight gradients (``dy[rows of g]^T @ x[rows of
    g]``, contracting over each expert's tokens) in FP8 (``torch._scaled_grouped_mm``'s 2-d x
    2-d form, per-(expert, column) scales over the tokens, group sizes rounded up to 16 rows as
    it requires) against the bf16 ones the FP8 experts run today (torch's and QuACK's, in the
    pinned tiles). The FP8 operands' transposing quantizer is not timed here: it is a pass over
    both operands that a real path adds."""
    from moe_kernels.grouped_gemm_quack import grouped_wgrad

    D, F, E = cfg.d_model, cfg.expert_hidden, cfg.n_experts
    counts_E = torch.bincount(_routed(cfg, tokens, skew, gen).flatten(), minlength=E)
    offs_E = torch.cumsum((counts_E + 15) // 16 * 16, 0).to(torch.int32)
    M = int(offs_E[-1])
    for name, N, Kd in (("down weight grad", D, F), ("gate+up weight grad", 2 * F, D)):
        dy_MN = torch.randn(M, N, device="cuda", generator=gen).to(torch.bfloat16)
        x_MK = torch.randn(M, Kd, device="cuda", generator=gen).to(torch.bfloat16)
        qdy_NM, sdy = _per_group_columns(dy_MN, offs_E)
        qx_KM, sx = _per_group_columns(x_MK, offs_E)

        def torch_fp8(qdy=qdy_NM, sdy=sdy, qx=qx_KM, sx=sx):
            return torch._scaled_grouped_mm(
                qdy, qx.t(), sdy, sx, offs=offs_E, out_dtype=torch.bfloat16
            )

        def torch_bf16(dy=dy_MN, x=x_MK):
            return torch._grouped_mm(dy.t(), x, offs=offs_E)

        def quack_bf16(dy=dy_MN, x=x_MK):
            return grouped_wgrad(x, dy, offs_E, transposed=True)

        ref = torch_bf16().float()
        row: dict[str, object] = {"M": M, "N": N, "K": Kd, "errors": {}, "refused": {}}
        phases = [("torch bf16", torch_bf16), ("quack bf16", quack_bf16)]
        try:
            out = torch_fp8().float()
            row["errors"]["torch fp8"] = ((out - ref).abs().max() / ref.abs().max()).item()
            phases.insert(0, ("torch fp8", torch_fp8))
        except Exception as e:  # a torch build without the 2-d x 2-d FP8 form
            row["refused"]["torch fp8"] = f"{type(e).__name__}: {str(e)[:160]}"
        times = cuda_phase_times_ms(phases, args.warmup, args.iters)
        ms = {label: statistics.median(t) for label, t in times.items()}
        row["ms"] = ms
        row["tflops"] = {label: 2 * M * N * Kd / t / 1e9 for label, t in ms.items()}
        results[f"{tokens} tokens, {name}"] = row
        print(
            f"{tokens} {name}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()), flush=True
        )


def parser() -> argparse.ArgumentParser:
    """The options of this script, and of ``fp8_accumulate.py`` (the same products)."""
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="8192,16384", help="tokens per micro-batch, comma list")
    p.add_argument("--skew", type=float, default=1.0, help="router logits' scale")
    p.add_argument(
        "--set", action="append", default=[], help="a model.* override of the shape, repeatable"
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    return p


def main() -> None:
    args = parser().parse_args()
    from quack.gemm_interface import gemm

    from moe_kernels.grouped_gemm_quack import fp8_scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = torch.bfloat16
    results: dict[str, dict] = {}
    cfg = olmoe(*args.set)
    head = {"benchmark": "fp8_gemm", **stamp(args.commit), "skew": args.skew, "overrides": args.set}
    for tokens in (int(t) for t in args.tokens.split(",")):
        offs_E, prods = products(cfg, tokens, args.skew, gen)
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
                if err >= 2e-2:  # a wrong product is recorded, not timed
                    row["refused"][label] = f"differs from torch's FP8 output by {err:.3g}"
                    continue
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
            save({**head, "results": results}, args.out)  # each product as it lands
            fp8s = [(t, label) for label, t in ms.items() if label.startswith("quack fp8")]
            best = min(fp8s) if fp8s else (float("nan"), "all refused")
            print(
                f"{tokens} {name}: torch fp8 {ms['torch fp8']:.3f} ms, best quack fp8 "
                f"{best[0]:.3f} ({best[1]}), torch bf16 {ms['torch bf16']:.3f}, "
                f"quack bf16 {ms['quack bf16']:.3f}; refused {list(row['refused'])}",
                flush=True,
            )
        weight_grads(cfg, tokens, args.skew, gen, args, results)
        save({**head, "results": results}, args.out)


if __name__ == "__main__":
    main()
