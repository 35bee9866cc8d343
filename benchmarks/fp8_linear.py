"""FP8 dense projections (``moe_kernels.fp8.fp8_linear``) against bf16 ``nn.Linear`` at
OLMoE-1B-7B's shapes on one GPU, forward + backward, as the model runs them:

- ``attention in``: RMSNorm then the q, k and v projections (compiled, as a block is), the
  three outputs summed so one backward covers them;
- ``attention out``: the o projection (compiled);
- ``lm_head``: the final norm's output through the LM head (eager, as the model runs it).

    python benchmarks/fp8_linear.py --out results.json

Each case builds one bf16 module and an FP8 twin sharing its weights, runs both on the same
random input and output gradient, and times them interleaved (one of each per iteration, CUDA
events after warm-up, median). Reported: ms per variant, the speed-up, and the FP8 output's
and input gradient's relative error against bf16 (``||a - b|| / ||b||``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics

import torch
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms
from torch import nn

from moe_core.model.fp8 import FP8Linear
from moe_core.model.norm import RMSNorm

CFG = olmoe()
TOKENS = 16384  # micro-batch 4 x 4096


class NormQKV(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = RMSNorm(d, 1e-5)
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return self.q(h) + self.k(h) + self.v(h)


def fp8_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` (shared parameters) with every ``nn.Linear`` as ``FP8Linear``."""
    if isinstance(module, nn.Linear):
        return FP8Linear.from_linear(module, tensor_cores=True)
    twin = copy.copy(module)
    twin._modules = {name: fp8_twin(child) for name, child in module.named_children()}
    return twin


def cases() -> list[tuple[str, nn.Module, int, bool]]:
    d, v = CFG.d_model, CFG.vocab_size
    return [
        ("attention in (norm + q, k, v)", NormQKV(d), d, True),
        ("attention out (o)", nn.Linear(d, d, bias=False), d, True),
        ("lm_head", nn.Linear(d, v, bias=False), d, False),
    ]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_case(name, module, d_in, compiled, warmup, iters) -> dict:
    module = module.to("cuda", torch.bfloat16)
    for p in module.parameters():
        if p.ndim == 2:
            nn.init.normal_(p, std=0.02)
    variants = {"bf16": module, "fp8": fp8_twin(module)}
    if compiled:
        variants = {k: torch.compile(m) for k, m in variants.items()}
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(TOKENS, d_in, device="cuda", dtype=torch.bfloat16, generator=g)
    x.requires_grad_(True)
    with torch.no_grad():
        n_out = module(x).shape[-1]
    dy = torch.randn(TOKENS, n_out, device="cuda", dtype=torch.bfloat16, generator=g)
    outs = {}
    for key, m in variants.items():
        x.grad = None
        y = m(x)
        y.backward(dy)
        outs[key] = (y.detach(), x.grad.clone())
    for p in module.parameters():
        p.grad = None

    def step(m):
        def fn():
            y = m(x)
            y.backward(dy)
            x.grad = None
            for p in module.parameters():
                p.grad = None

        return fn

    times = cuda_phase_times_ms([(k, step(m)) for k, m in variants.items()], warmup, iters)
    ms = {k: statistics.median(v) for k, v in times.items()}
    row = {
        "case": name,
        "tokens": TOKENS,
        "compiled": compiled,
        "ms": ms,
        "fp8_speedup": ms["bf16"] / ms["fp8"],
        "rel_err_out": rel(outs["fp8"][0], outs["bf16"][0]),
        "rel_err_dx": rel(outs["fp8"][1], outs["bf16"][1]),
    }
    print(json.dumps(row))
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--commit-note", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    rows = [run_case(*c, args.warmup, args.iters) for c in cases()]
    result = {
        "benchmark": "fp8_linear",
        **stamp(args.commit),
        "commit_note": args.commit_note,
        "warmup": args.warmup,
        "iters": args.iters,
        "cases": rows,
    }
    save(result, args.out)


if __name__ == "__main__":
    main()
