"""Causal attention on one GPU: PyTorch SDPA (the model's call, and each of its backends) against
FlashAttention 4's CuTe kernels (``flash-attn-4``), forward and forward + backward.

    python benchmarks/attention.py --commit $(git rev-parse --short HEAD) --out attn.json

OLMoE-1B-7B's shape by default (``shapes.olmoe()``): batch 4, sequence 4096, 16 heads of 128,
bf16, causal. Inputs are random normal, the same tensors for every implementation; each output
(and its gradients) is compared with SDPA's first. CUDA events after warm-up, the median of
``--iters`` runs (``timing.py``).
TFLOP/s counts the causal half: forward 2 * B * H * S^2 * (d + d_v) / 2, backward 2.5x that.
``--v-head-dim``: values (and outputs) of their own width, as multi-head latent attention's are
(DeepSeek-V3: ``--heads 128 --head-dim 192 --v-head-dim 128``); a backend that does not take
unequal widths is reported as such and skipped.

``--block``: the model's attention block instead (``moe_core.model.attention.Attention`` at the
shape's sizes, bf16, compiled, ``x + attention(x)`` forward + backward): SDPA, FlashAttention 4
as the model calls it (the library's ``flash_attn_func`` behind a compile boundary: a graph
break, the block input's gradients summed eagerly) and through custom ops
(``benchmarks/baselines/flash4_op.py``: one compiled graph), timed interleaved (one of each per
iteration).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.baselines
from report import save, stamp
from shapes import olmoe
from timing import cuda_phase_times_ms, cuda_times_ms


def sdpa(backend: SDPBackend | None) -> Callable[..., torch.Tensor]:
    """SDPA on [B, S, H, d] tensors (transposed to its [B, H, S, d]), as the model calls it."""

    def run(q, k, v):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        if backend is None:
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)

    return run


def flash4() -> Callable[..., torch.Tensor]:
    from flash_attn.cute import flash_attn_func

    def run(q, k, v):
        out = flash_attn_func(q, k, v, causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run


def block(args: argparse.Namespace) -> dict:
    """The compiled attention block three ways (module doc), interleaved."""
    import copy

    import moe_core.model.attention as attention
    from benchmarks.baselines.flash4_op import flash4_attention
    from moe_core.model.attention import Attention, RotaryEmbedding
    from moe_core.model.eager import seal
    from moe_core.model.kernel_choice import Kernels

    cfg = olmoe()
    torch.manual_seed(0)
    sdpa_block = Attention(cfg).cuda().to(torch.bfloat16)
    variants = {"sdpa": sdpa_block}
    for name in ("flash4", "flash4_op"):
        variants[name] = copy.deepcopy(sdpa_block)
        variants[name].kernels = Kernels(attention="flash4")
    seal()  # the model's compile boundaries, as apply_compile makes them
    model_call = attention._flash4
    core = {"sdpa": model_call, "flash4": model_call, "flash4_op": flash4_attention}
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)(args.seq, torch.device("cuda"))
    x = torch.randn(args.batch, args.seq, cfg.d_model, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    compiled = {name: torch.compile(m) for name, m in variants.items()}

    def run(name: str) -> list[torch.Tensor]:
        # The attention core the block's forward calls: Dynamo guards on it, so each variant
        # keeps its own compiled graphs.
        attention._flash4 = core[name]
        xi = x.detach().requires_grad_()
        y = xi + compiled[name](xi, rope)
        leaves = [xi, *variants[name].parameters()]
        return [y, *torch.autograd.grad(y, leaves, dy)]

    try:
        ref = run("sdpa")
        errors = {}
        for name in variants:
            got = run(name)
            errors[name] = max(
                ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                for a, b in zip(got, ref, strict=True)
            )
        phases = [(name, lambda name=name: run(name)) for name in variants]
        times = cuda_phase_times_ms(phases, args.warmup, args.iters)
    finally:
        attention._flash4 = model_call
    rows = []
    for name in variants:
        rows.append(
            dict(
                impl=name,
                fwd_bwd_ms=statistics.median(times[name]),
                max_rel_err_vs_sdpa=errors[name],
            )
        )
        print(f"{name:<20} fwd+bwd {rows[-1]['fwd_bwd_ms']:7.3f} ms   err {errors[name]:.1e}")
    return {
        "benchmark": "attention_block",
        "shape": dict(batch=args.batch, seq=args.seq, d_model=cfg.d_model, heads=cfg.n_heads),
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=olmoe().max_seq_len)
    p.add_argument("--heads", type=int, default=olmoe().n_heads)
    p.add_argument("--head-dim", type=int, default=olmoe().head_dim)
    p.add_argument("--v-head-dim", type=int, default=None, help="value heads (default: head-dim)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--block", action="store_true", help="the compiled attention block")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.block:
        result = block(args) | stamp(args.commit)
        print("RESULT " + json.dumps(result))
        save(result, args.out)
        return
    B, S, H, d = args.batch, args.seq, args.heads, args.head_dim
    dv = args.v_head_dim or d
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (
        torch.randn(B, S, H, width, device="cuda", generator=gen, dtype=torch.bfloat16)
        for width in (d, d, dv, dv)
    )
    fwd_flops = 2 * B * H * S * S * (d + dv) / 2
    impls = {
        "sdpa_default": sdpa(None),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
        "sdpa_flash2": sdpa(SDPBackend.FLASH_ATTENTION),
    }
    try:
        impls["flash_attn_4"] = flash4()
    except ImportError as err:
        print(f"flash-attn-4 not importable ({err}); measuring SDPA only")

    def grads(fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fn(*leaves)
        return (out, *torch.autograd.grad(out, leaves, do))

    ref = grads(impls["sdpa_default"])
    rows = []
    for name, fn in impls.items():
        try:
            got = grads(fn)
        except (RuntimeError, AssertionError, ValueError) as err:
            print(f"{name:<14} does not run this shape: {str(err).splitlines()[0][:160]}")
            rows.append(dict(impl=name, runs=False, why=str(err).splitlines()[0][:300]))
            continue
        err = max(
            ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip(got, ref, strict=True)
        )
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward(fn=fn, leaves=leaves):
            out = fn(*leaves)
            torch.autograd.grad(out, leaves, do)

        fwd_ms = statistics.median(cuda_times_ms(forward, args.warmup, args.iters))
        both_ms = statistics.median(cuda_times_ms(forward_backward, args.warmup, args.iters))
        rows.append(
            dict(
                impl=name,
                fwd_ms=fwd_ms,
                fwd_tflops=fwd_flops / fwd_ms / 1e9,
                fwd_bwd_ms=both_ms,
                fwd_bwd_tflops=3.5 * fwd_flops / both_ms / 1e9,
                bwd_tflops=2.5 * fwd_flops / max(both_ms - fwd_ms, 1e-9) / 1e9,
                max_rel_err_vs_sdpa=err,
            )
        )
        print(
            f"{name:<14} fwd {fwd_ms:7.3f} ms {rows[-1]['fwd_tflops']:6.0f} TF/s   "
            f"fwd+bwd {both_ms:7.3f} ms {rows[-1]['fwd_bwd_tflops']:6.0f} TF/s   err {err:.1e}"
        )
    result = {
        "benchmark": "attention",
        **stamp(args.commit),
        "shape": dict(
            batch=B, seq=S, heads=H, head_dim=d, v_head_dim=dv, causal=True, dtype="bf16"
        ),
        "rows": rows,
    }
    print("RESULT " + json.dumps(result))
    save(result, args.out)


if __name__ == "__main__":
    main()
