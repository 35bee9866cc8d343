"""One training step of our model on one GPU (forward, backward, AdamW), measured like the peer.

    python benchmarks/train_step.py --mbs 4 --routing learned --out step.json
    python benchmarks/train_step.py --experts-sweep 8,16,32,64,128 --out pool.json

Same conventions as the peer kit's Olmo-core benchmark, so the two compare side by side:
OLMoE-1B-7B shape (``conf/model/olmoe-1b-7b.yaml`` through the config loader: d 2048, 16
layers, 16 heads, 64 experts top-8, expert hidden 1024, vocab 50304), sequence 4096, random
token ids from a fixed seed, bf16 parameters, torch fused AdamW, SDPA attention; 3 warm-up
steps, then the median of CUDA-event-timed steps (``timing.py``); MFU over the device's peak
(``moe_core.hardware.PEAK_BF16_TFLOPS``). ``--compile`` compiles the blocks and the loss
(``parallel.compile``); ``--optimizer moe_core`` takes the fused AdamW kernel through
``benchmarks/baselines/adamw.py`` instead of torch's (same math, same bf16 moments), and with
``--optimizer-dtype fp32`` keeps fp32 master weights and moments (the trainer's default
precision). ``--layers`` changes the depth (8 layers fit with fp32 masters). Routing: ``learned``
(the router from its random init), ``skewed`` (router rows biased so a few experts win), or
``uniform`` (assignments forced round-robin over the experts, weights from the router).
``--experts-sweep``: one MoE layer forward + backward per expert count at top-4 with expert
hidden fixed, so the active parameters stay fixed: throughput relative to the first count.
``--layer-vs-dense``: the OLMoE MoE layer forward + backward against dense GEMMs of its FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.baselines
from report import save, stamp
from shapes import olmoe
from timing import cuda_times_ms

from benchmarks.baselines.adamw import AdamW
from moe_core.config import ModelConfig
from moe_core.model import build_model
from moe_core.model.eager import seal
from moe_core.model.flops import count
from moe_core.model.kernel_choice import Kernels
from moe_core.model.moe import MoE, Router, Routing
from moe_core.model.transformer import apply_kernels
from moe_core.parallel.compile import apply_compile, loss_function
from moe_core.train.metrics import peak_tflops


def force_routing(model: torch.nn.Module, kind: str) -> None:
    """``uniform``: every expert gets the same number of assignments; ``skewed``: a few experts
    favoured by a bias on their router rows (learned routing, but far from balanced)."""
    for router in (m for m in model.modules() if isinstance(m, Router)):
        if kind == "skewed":
            with torch.no_grad():
                router.weight[:4] += 0.05 * router.weight[:4].sign()
        elif kind == "uniform":
            learned = router.forward

            def uniform(x_TD, _learned=learned, _r=router) -> Routing:
                r = _learned(x_TD)
                T, K = r.experts_TK.shape
                experts_TK = (torch.arange(T * K, device=x_TD.device) % _r.n_experts).view(T, K)
                counts_E = torch.full_like(r.counts_E, T * K // _r.n_experts)
                return Routing(experts_TK, r.weights_TK, counts_E, r.aux_loss)

            router.forward = uniform


Phases = list[tuple[str, Callable[[], None]]]


def run_phases(phases: Phases) -> Callable[[], None]:
    def step() -> None:
        for _, fn in phases:
            fn()

    return step


def model_config(args: argparse.Namespace) -> ModelConfig:
    return dataclasses.replace(olmoe(), n_layers=args.layers)


def train_step_parts(args: argparse.Namespace) -> Phases:
    """The benchmarked step on fixed random tokens as phases: forward (with the loss),
    backward, AdamW (fused, zeroing the gradients)."""
    cfg = model_config(args)
    torch.manual_seed(0)
    model = build_model(cfg, "cuda", seed=0)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    force_routing(model, args.routing)
    apply_kernels(model, kernel_choice(args))
    if args.compile:
        apply_compile(model)
    loss_fn = loss_function(args.compile)
    if args.optimizer == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    else:
        opt = AdamW(model.parameters(), lr=1e-4, master_weights=args.optimizer_dtype == "fp32")
    gen = torch.Generator(device="cuda").manual_seed(1234)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.mbs, args.seq + 1), device="cuda", generator=gen
    )
    loss: list[torch.Tensor] = []

    def forward() -> None:
        logits, aux = model(tokens[:, :-1])
        loss.append(loss_fn(logits, tokens[:, 1:]) + aux)

    def backward() -> None:
        loss.pop().backward()

    def optimizer() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    return [("forward", forward), ("backward", backward), ("optimizer", optimizer)]


def train_step(args: argparse.Namespace) -> dict:
    step = run_phases(train_step_parts(args))
    torch.cuda.reset_peak_memory_stats()
    times = cuda_times_ms(step, args.warmup, args.iters)
    ms = statistics.median(times)
    tps = args.mbs * args.seq / (ms / 1e3)
    flops = count(model_config(args), args.seq).flops_per_token
    peak = peak_tflops(torch.device("cuda"))
    return {
        "benchmark": "train_step",
        "routing": args.routing,
        "compile": args.compile,
        "optimizer": args.optimizer,
        "optimizer_dtype": args.optimizer_dtype if args.optimizer == "moe_core" else "bf16",
        "layers": args.layers,
        "mbs": args.mbs,
        "seq": args.seq,
        "median_ms": ms,
        "tokens_per_s": tps,
        "model_tflops": tps * flops / 1e12,
        "mfu": tps * flops / 1e12 / peak if peak else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "flops_per_token": flops,
    }


def moe_layer_step(args: argparse.Namespace, n_experts: int, top_k: int = 4) -> Phases:
    """One MoE layer (OLMoE's width and expert hidden, bf16) forward and backward on fixed
    random inputs: ``mbs * seq`` tokens."""
    cfg = dataclasses.replace(olmoe(), n_experts=n_experts, top_k=top_k)
    D = cfg.d_model
    torch.manual_seed(0)
    moe = MoE(cfg).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe = moe.to(torch.bfloat16)
    # the layer alone permutes its rows (no --gather-rows here: it measures the layer as built)
    apply_kernels(moe, dataclasses.replace(kernel_choice(args), gather_rows=False))
    if args.compile:
        seal()
        moe.compile()  # the router fuses, as inside a compiled block; dispatch stays eager
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(1, args.mbs * args.seq, D, device="cuda", generator=gen).to(torch.bfloat16)
    x.requires_grad_()
    g = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)
    out: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward() -> None:
        for t in (x, *moe.parameters()):  # as a training step's zero_grad(set_to_none=True)
            t.grad = None
        out.append(moe(x))

    def backward() -> None:
        y, aux = out.pop()
        torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])

    return [("forward", forward), ("backward", backward)]


def layer_vs_dense(args: argparse.Namespace) -> dict:
    """The OLMoE MoE layer (64 experts, top-8) forward + backward against dense GEMMs of the
    same FLOPs: the six products of a SwiGLU MLP's forward and backward over all ``T * K``
    routed rows with one weight (plain ``torch.mm``, no elementwise work)."""
    cfg = olmoe()
    T, K, D, Fh, E = args.mbs * args.seq, cfg.top_k, cfg.d_model, cfg.expert_hidden, cfg.n_experts
    layer_ms = statistics.median(
        cuda_times_ms(run_phases(moe_layer_step(args, E, K)), args.warmup, args.iters)
    )
    M = T * K
    gen = torch.Generator(device="cuda").manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen).to(torch.bfloat16)

    a_MD, w1_D2F, g_MF, w2_FD = rand(M, D), rand(D, 2 * Fh), rand(M, Fh), rand(Fh, D)
    dy_MD, dh_M2F = rand(M, D), rand(M, 2 * Fh)

    def dense() -> None:
        a_MD @ w1_D2F  # forward: gate+up, down
        g_MF @ w2_FD
        dy_MD @ w2_FD.t()  # backward: down's input and weight gradients, then gate+up's
        g_MF.t() @ dy_MD
        dh_M2F @ w1_D2F.t()
        a_MD.t() @ dh_M2F

    dense_ms = statistics.median(cuda_times_ms(dense, args.warmup, args.iters))
    flops = 6 * M * D * 3 * Fh
    return {
        "benchmark": "moe_layer_vs_dense",
        "tokens": T,
        "experts": E,
        "top_k": K,
        "layer_ms": layer_ms,
        "layer_tflops": flops / layer_ms / 1e9,
        "dense_gemm_ms": dense_ms,
        "dense_gemm_tflops": flops / dense_ms / 1e9,
        "layer_rate_vs_dense": dense_ms / layer_ms,
    }


def pool_sweep(args: argparse.Namespace) -> dict:
    rows = []
    T = args.mbs * args.seq
    for n_experts in [int(e) for e in args.experts_sweep.split(",")]:
        step = run_phases(moe_layer_step(args, n_experts))
        ms = statistics.median(cuda_times_ms(step, args.warmup, args.iters))
        rows.append({"experts": n_experts, "median_ms": ms, "tokens_per_s": T / (ms / 1e3)})
        del step
        torch.cuda.empty_cache()
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["relative_to_first"] = r["tokens_per_s"] / base
    return {"benchmark": "expert_pool_scaling", "top_k": 4, "tokens": T, "rows": rows}


def kernel_choice(args: argparse.Namespace) -> Kernels:
    """The model's ``Kernels`` from the kernel options, as ``parallelize.choose_kernels``
    resolves a run's (bf16 experts; ``--unfused-mlp`` where the parser has it)."""
    return Kernels(
        gemm=args.expert_gemm,
        attention=args.attention,
        gather_rows=args.gather_rows,
        fused_mlp=not getattr(args, "unfused_mlp", False),
    )


def add_kernel_options(p: argparse.ArgumentParser) -> None:
    """The kernel libraries a step runs on: the experts' grouped GEMMs and the attention core
    (``parallel.expert_gemm``, ``parallel.attention``)."""
    p.add_argument("--expert-gemm", choices=["auto", "torch", "quack"], default="auto")
    p.add_argument("--attention", choices=["sdpa", "flash4"], default="sdpa")
    p.add_argument("--gather-rows", action="store_true", help="parallel.gather_rows (QuACK)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--routing", choices=["learned", "skewed", "uniform"], default="learned")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=olmoe().max_seq_len)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="torch.compile blocks and the loss")
    p.add_argument(
        "--optimizer",
        choices=["torch", "moe_core"],
        default="torch",
        help="torch's fused AdamW or ours (moe_kernels.adamw); both keep moments in bf16",
    )
    p.add_argument(
        "--optimizer-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="with --optimizer moe_core: bf16 moments, or fp32 master weights and moments",
    )
    add_kernel_options(p)
    p.add_argument(
        "--unfused-mlp",
        action="store_true",
        help="the experts' SwiGLU as its own pass, not in QuACK's GEMM epilogues",
    )
    p.add_argument("--layers", type=int, default=olmoe().n_layers)
    p.add_argument("--layer-vs-dense", action="store_true", help="MoE layer vs dense GEMMs")
    p.add_argument("--experts-sweep", default="", help="e.g. 8,16,32,64,128 (one MoE layer)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.layer_vs_dense:
        result = layer_vs_dense(args)
    elif args.experts_sweep:
        result = pool_sweep(args)
    else:
        result = train_step(args)
    result |= {
        "expert_gemm": args.expert_gemm,
        "attention": args.attention,
        "gather_rows": args.gather_rows,
        "expert_mlp": "unfused" if args.unfused_mlp else "fused where QuACK runs",
        **stamp(args.commit),
    }
    print("RESULT " + json.dumps(result))
    save(result, args.out)


if __name__ == "__main__":
    main()
