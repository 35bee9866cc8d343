"""One training step of our model on one GPU (forward, backward, AdamW), measured like the peer.

    python benchmarks/train_step.py --mbs 4 --routing learned --out step.json
    python benchmarks/train_step.py --experts-sweep 8,16,32,64,128 --out pool.json

Same conventions as the peer kit's Olmo-core benchmark, so the two compare side by side:
OLMoE-1B-7B shape (d 2048, 16 layers, 16 heads, 64 experts top-8, expert hidden 1024, vocab
50304), sequence 4096, random token ids from a fixed seed, bf16 parameters, torch fused AdamW,
SDPA attention; 3 warm-up steps, then the median of CUDA-event-timed steps. Routing: ``learned``
(the router from its random init), ``skewed`` (router rows biased so a few experts win), or
``uniform`` (assignments forced round-robin over the experts, weights from the router).
``--experts-sweep``: one MoE layer forward + backward per expert count at top-4 with expert
hidden fixed, so the active parameters stay fixed: throughput relative to the first count.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import date

import torch
from timing import cuda_times_ms

from moe_core.config import ModelConfig
from moe_core.model import build_model, lm_loss
from moe_core.model.flops import count
from moe_core.model.moe import MoE, Router, Routing

SHAPE = dict(d_model=2048, n_layers=16, n_heads=16, n_experts=64, top_k=8, expert_hidden=1024)
PEAK = 989.4


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


def train_step(args: argparse.Namespace) -> dict:
    cfg = ModelConfig(vocab_size=50304, **SHAPE)
    torch.manual_seed(0)
    model = build_model(cfg, "cuda", seed=0)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    force_routing(model, args.routing)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(1234)
    tokens = torch.randint(
        0, cfg.vocab_size, (args.mbs, args.seq + 1), device="cuda", generator=gen
    )

    def step() -> None:
        logits, aux = model(tokens[:, :-1])
        (lm_loss(logits, tokens[:, 1:]) + aux).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    torch.cuda.reset_peak_memory_stats()
    times = cuda_times_ms(step, args.warmup, args.iters)
    ms = statistics.median(times)
    tps = args.mbs * args.seq / (ms / 1e3)
    flops = count(cfg, args.seq).flops_per_token
    return {
        "benchmark": "train_step",
        "routing": args.routing,
        "mbs": args.mbs,
        "seq": args.seq,
        "median_ms": ms,
        "tokens_per_s": tps,
        "model_tflops": tps * flops / 1e12,
        "mfu": tps * flops / 1e12 / PEAK,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "flops_per_token": flops,
    }


def pool_sweep(args: argparse.Namespace) -> dict:
    rows = []
    T = args.mbs * args.seq
    for n_experts in [int(e) for e in args.experts_sweep.split(",")]:
        cfg = ModelConfig(
            d_model=2048, n_heads=16, n_experts=n_experts, top_k=4, expert_hidden=1024
        )
        torch.manual_seed(0)
        moe = MoE(cfg).cuda()
        with torch.no_grad():
            for p in moe.parameters():
                p.normal_(0.0, 0.02)
        moe = moe.to(torch.bfloat16)
        gen = torch.Generator(device="cuda").manual_seed(7)
        x = torch.randn(1, T, 2048, device="cuda", generator=gen).to(torch.bfloat16)
        x.requires_grad_()
        g = torch.randn(x.shape, device="cuda", generator=gen).to(torch.bfloat16)

        def step(moe=moe, x=x, g=g) -> None:
            y, aux = moe(x)
            torch.autograd.backward([y, aux], [g, torch.ones_like(aux)])

        ms = statistics.median(cuda_times_ms(step, args.warmup, args.iters))
        rows.append({"experts": n_experts, "median_ms": ms, "tokens_per_s": T / (ms / 1e3)})
        del moe
        torch.cuda.empty_cache()
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["relative_to_first"] = r["tokens_per_s"] / base
    return {"benchmark": "expert_pool_scaling", "top_k": 4, "tokens": T, "rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--routing", choices=["learned", "skewed", "uniform"], default="learned")
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--experts-sweep", default="", help="e.g. 8,16,32,64,128 (one MoE layer)")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    result = pool_sweep(args) if args.experts_sweep else train_step(args)
    result |= {
        "date": str(date.today()),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "commit": args.commit,
    }
    print("RESULT " + json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
