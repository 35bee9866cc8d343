"""Compile every Triton kernel (the library's and the baselines') for an sm_90 (H100/H200)
target, without a GPU.

Run in a process where TRITON_INTERPRET is unset (``@triton.jit`` then builds real kernels).
Lowering runs Triton's front end, which rejects code the interpreter runs happily (e.g. a
variable whose dtype changes inside an ``if`` body). Prints one line per compiled variant and
exits non-zero listing the failures.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/baselines

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from benchmarks.baselines import grouped_gemm_triton, router_topk_triton, weighted_combine_triton
from moe_kernels import adamw_triton, fp8_triton, routing_triton, slot_permute_triton, swiglu_triton

TARGET = GPUTarget("cuda", 90, 32)
E4M3_CAST = "cvt.rn.satfinite.e4m3x2.f32"


def variants(flags: dict[str, list]) -> list[dict]:
    """Every combination of the listed constexpr values."""
    keys = list(flags)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*flags.values())]


def cases() -> list[tuple[JITFunction, dict[str, str], dict]]:
    """(kernel, pointer types by argument name, constexprs): the variants the wrappers launch."""
    sp, rt = slot_permute_triton, routing_triton
    out = []
    for act in ("*bf16",):  # the activation dtype changes no control flow: one is enough
        blocks = {"BLOCK_T": [4], "BLOCK_D": [1024]}
        ptrs = {"x_ptr": act, "slot_ptr": "*i64", "out_ptr": act, "used_ptr": "*i8"}
        for c in variants({"K": [8], "MARK_USED": [False, True], **blocks}):
            out.append((sp._scatter_rows, ptrs, c))
        ptrs = {"src_ptr": act, "slot_ptr": "*i64", "out_ptr": act}
        for c in variants({"K": [8], **blocks}):
            out.append((sp._gather_rows, ptrs, c))
        ptrs = {"src_ptr": act, "slot_ptr": "*i64", "w_ptr": "*fp32", "out_ptr": act}
        for c in variants({"K": [8], **blocks}):
            out.append((weighted_combine_triton._weighted_gather_rows, ptrs, c))
        ptrs = {
            "dy_ptr": act,
            "y_ptr": act,
            "slot_ptr": "*i64",
            "w_ptr": "*fp32",
            "dy_rows_ptr": act,
            "dw_ptr": "*fp32",
            "used_ptr": "*i8",
        }
        flags = {"K": [8], "K_PAD": [8], "NEED_DW": [False, True], "MARK_USED": [False, True]}
        for c in variants({**flags, **blocks}):
            out.append((weighted_combine_triton._combine_backward, ptrs, c))
        ptrs = {"out_ptr": act, "used_ptr": "*i8"}
        out.append((sp._zero_unused_rows, ptrs, {"BLOCK_R": 16, "BLOCK_D": 256}))
        blocks = {"HAS_W": [False, True], "BLOCK_M": [4], "BLOCK_F": [1024]}
        ptrs = {"h_ptr": act, "w_ptr": "*fp32", "a_ptr": act}
        for c in variants(blocks):
            out.append((swiglu_triton._swiglu_forward, ptrs, c))
        ptrs = {"h_ptr": act, "w_ptr": "*fp32", "da_ptr": act, "dh_ptr": act, "dw_ptr": "*fp32"}
        ptrs["a_ptr"] = act
        ptrs |= {"q_ptr": "*fp8e4nv", "qs_ptr": "*fp32"}
        for c in variants({**blocks, "EMIT_A": [False, True], "QUANTIZE": [False]}):
            out.append((swiglu_triton._swiglu_backward, ptrs, c))
        for c in variants({**blocks, "EMIT_A": [True], "QUANTIZE": [True], "HW_CAST": [True]}):
            out.append((swiglu_triton._swiglu_backward, ptrs, c))
        fp8 = {"FP8_MAX": [fp8_triton.E4M3_MAX], "AMAX_FLOOR": [fp8_triton.AMAX_FLOOR]}
        ptrs = {"x_ptr": act, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        rows = {"BLOCK_M": [1], "BLOCK_K": [2048], **fp8}
        # the fp32 rounding (the interpreter's, shared by every quantizer) compiled once
        for c in variants({**rows, "ONE_PASS": [True, False], "HW_CAST": [True]}):
            out.append((fp8_triton._quantize_rows, ptrs, c))
        out.append(
            (
                fp8_triton._quantize_rows,
                ptrs,
                {**variants(rows)[0], "ONE_PASS": True, "HW_CAST": False},
            )
        )
        fp8["HW_CAST"] = [True]
        ptrs = {"x_ptr": act, "slot_ptr": "*i64", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        ptrs |= {"rows_ptr": act, "used_ptr": "*i8"}
        flags = {"K": [8], "KEEP_ROWS": [False, True], "MARK_USED": [False, True]}
        flags |= {"BLOCK_T": [1], "BLOCK_D": [2048], "ONE_PASS": [True, False], **fp8}
        for c in variants(flags):
            out.append((fp8_triton._scatter_quantize_rows, ptrs, c))
        ptrs = {"w_ptr": act, "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        for c in variants({"BLOCK_N": [64], "BLOCK_K": [16], **fp8}):
            out.append((fp8_triton._quantize_columns_transposed, ptrs, c))
        ptrs = {"h_ptr": act, "w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
        for c in variants({"HAS_W": [False, True], "BLOCK_M": [2], "BLOCK_F": [1024], **fp8}):
            out.append((fp8_triton._swiglu_quantize_rows, ptrs, c))
        gg = grouped_gemm_triton
        ptrs = {"x_ptr": act, "w_ptr": act, "y_ptr": act, "offs_ptr": "*i32"}
        fixed = {"G_PAD": 64, "GROUP_M": gg.GROUP_M, "UPCAST": False}
        blocks = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}
        for c in variants({"EVEN_K": [False, True], "EVEN_N": [False, True]}):
            out.append((gg._grouped_mm_kernel, ptrs, {**fixed, **c, **blocks}))
        ptrs = {"a_ptr": act, "b_ptr": act, "c_ptr": act, "offs_ptr": "*i32"}
        blocks = {"UPCAST": False, "BLOCK_M": 64, "BLOCK_P": 128, "BLOCK_Q": 128}
        for c in variants({"EVEN_P": [False, True], "EVEN_Q": [False, True]}):
            out.append((gg._grouped_wgrad_kernel, ptrs, {**c, **blocks}))
    e = {"E_PAD": 64}
    ptrs = {"experts_ptr": "*i64", "slot_ptr": "*i64", "hist_ptr": "*i32"}
    out.append((rt._block_rank, ptrs, {"BLOCK_A": 256, **e}))
    ptrs = {"hist_ptr": "*i32", "starts_ptr": "*i32", "counts_ptr": "*i64", "offs_ptr": "*i32"}
    out.append((rt._scan, ptrs, {"ALIGN": 16, "BLOCK_B": 128, **e}))
    ptrs = {"experts_ptr": "*i64", "slot_ptr": "*i64", "hist_ptr": "*i32", "starts_ptr": "*i32"}
    out.append((rt._finalize, ptrs, {"BLOCK_A": 256, **e}))
    topk = {"K": [8], "K_PAD": [8], "NORMALIZE": [False, True], "BLOCK_T": [64], "E_PAD": [64]}
    ptrs = {
        "logits_ptr": "*fp32",
        "bias_ptr": "*fp32",
        "probs_ptr": "*fp32",
        "weights_ptr": "*fp32",
        "experts_ptr": "*i64",
    }
    for c in variants({"HAS_BIAS": [False, True], **topk}):
        out.append((router_topk_triton._topk_softmax_forward, ptrs, c))
    ptrs = {
        "probs_ptr": "*fp32",
        "experts_ptr": "*i64",
        "dprobs_ptr": "*fp32",
        "dweights_ptr": "*fp32",
        "dlogits_ptr": "*fp32",
    }
    for c in variants(topk):
        out.append((router_topk_triton._topk_softmax_backward, ptrs, c))
    # (master, gradient, moments, model copy): fp32 weights, pure bf16, fp32 masters of bf16
    # weights with bf16 (autograd's) or fp32 (bucketed) gradients
    for p, g, mv, copy in (
        ("*fp32", "*fp32", "*fp32", None),
        ("*bf16", "*bf16", "*bf16", None),
        ("*fp32", "*bf16", "*fp32", "*bf16"),
        ("*fp32", "*fp32", "*fp32", "*bf16"),
    ):
        ptrs = {"p_ptr": p, "g_ptr": g, "m_ptr": mv, "v_ptr": mv, "out_ptr": copy or p}
        ptrs |= {"lr_ptr": "*fp32", "step_ptr": "*fp32", "scale_ptr": "*fp32", "apply_ptr": "*i1"}
        ptrs |= {k: "fp32" for k in ("beta1", "beta2", "log2_beta1", "log2_beta2", "eps")}
        ptrs["weight_decay"] = "fp32"
        flags = {"HAS_SCALE": [False, True], "HAS_OUT": [copy is not None]}
        flags |= {"BLOCK": [adamw_triton.BLOCK], "ITERS": [adamw_triton.ITERS]}
        # The trainer always passes its skip flag (a bool tensor); calls without one (the
        # benchmarks' AdamW) are checked in one dtype case: the flag adds no dtype-dependent code.
        flags["HAS_APPLY"] = [True, False] if p == g == "*bf16" else [True]
        for c in variants(flags):
            out.append((adamw_triton._adamw, ptrs, c))
        if copy is None and p != "*bf16":
            continue  # the fused FP8 rows: bf16 weights, in place or written from fp32 masters
        ptrs |= {"q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        flags = {"HAS_SCALE": [True], "HAS_OUT": [copy is not None], "HAS_APPLY": [True]}
        flags |= {"BLOCK_M": [1], "BLOCK_K": [2048], "ONE_PASS": [True, False]}
        flags |= {"FP8_MAX": [fp8_triton.E4M3_MAX], "AMAX_FLOOR": [fp8_triton.AMAX_FLOOR]}
        flags["HW_CAST"] = [True]
        for c in variants(flags):
            out.append((adamw_triton._adamw_rows, ptrs, c))
    return out


def compile_one(fn: JITFunction, ptrs: dict[str, str], constexprs: dict) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = ptrs[name]  # a KeyError here means the case list is stale
        else:
            signature[name] = ptrs.get(name, "i32")  # scalars: i32 unless the case says
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    ptx = triton.compile(src, target=TARGET, options={"num_warps": 4}).asm["ptx"]
    # moe_kernels.fp8's rounding (nearest, ties to even; no value past 448 by then) from the GPU's
    # conversion: the instruction must be the round-to-nearest one
    if constexprs.get("HW_CAST") and E4M3_CAST not in ptx:
        raise AssertionError(f"no {E4M3_CAST} in the PTX")


def main() -> int:
    failures = []
    for fn, ptrs, constexprs in cases():
        label = f"{fn.__name__} {ptrs.get('x_ptr', '')} {constexprs}"
        try:
            compile_one(fn, ptrs, constexprs)
            print("ok", label)
        except Exception as exc:  # report every failing variant, not just the first
            failures.append(f"{label}: {type(exc).__name__}: {exc}")
    for line in failures:
        print("FAILED", line, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
