"""A CPU stand-in for the few ``quack-kernels`` entry points ``moe_kernels.grouped_gemm_quack``
calls, written from QuACK's documented semantics (its ``*_ref`` functions and epilogue library),
so the code around them (layouts, the interleaved gate/up pairs, the router-weight epilogues) is
exercised where QuACK cannot run. The GPU tests hold the real library to the same outputs.

Outputs QuACK allocates start as NaN here, so a caller reading rows the real kernels leave
unwritten (rows past the last group end) sees NaN instead of a plausible value.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """[first; second] along the non-contiguous dim -> [f0, s0, f1, s1, ...] (a copy)."""
    dim = -2 if t.stride(-1) == 1 else -1
    return t.unflatten(dim, (2, t.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def _deinterleave_into(out: torch.Tensor, logical: torch.Tensor) -> None:
    """Write the interleaved ``logical`` into ``out`` stored [first; second] along out's
    non-contiguous dim."""
    dim = -2 if out.stride(-1) == 1 else -1
    half = out.shape[dim] // 2
    out.narrow(dim, 0, half).copy_(_half(logical, dim, 0))
    out.narrow(dim, half, half).copy_(_half(logical, dim, 1))


def _half(t: torch.Tensor, dim: int, which: int) -> torch.Tensor:
    """Every other index along ``dim``, starting at ``which``."""
    idx = torch.arange(which, t.shape[dim], 2)
    return t.index_select(dim % t.dim(), idx)


def _segments(cu: torch.Tensor) -> list[tuple[int, int]]:
    ends = cu.tolist()
    return list(itertools.pairwise(ends))


def _untuned(tuned: bool, config) -> None:
    """The real entry points autotune when ``tuned`` and no ``config`` is given (minutes per
    shape, and slower picks in a measured run): every call here must avoid that."""
    assert not tuned or config is not None, "this call would autotune: pass tuned=False"


def _nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def _product(A, B, cu_seqlens_m, cu_seqlens_k, A_idx) -> torch.Tensor:
    """The fp32 accumulator of QuACK's varlen products (rows outside segments NaN)."""
    A, B = A.float(), B.float()
    if cu_seqlens_m is not None:
        rows = A_idx.shape[0] if A_idx is not None else A.shape[0]
        acc = _nan((rows, B.shape[-1]), torch.float32)
        for g, (s, e) in enumerate(_segments(cu_seqlens_m)):
            a = A[A_idx[s:e].long()] if A_idx is not None else A[s:e]
            acc[s:e] = a @ B[g]
        return acc
    assert cu_seqlens_k is not None
    segs = _segments(cu_seqlens_k)
    acc = torch.zeros(len(segs), A.shape[0], B.shape[-1])
    for g, (s, e) in enumerate(segs):
        a = A[:, A_idx[s:e].long()] if A_idx is not None else A[:, s:e]
        acc[g] = a @ B[s:e]
    return acc


def gemm(
    A,
    B,
    out=None,
    cu_seqlens_m=None,
    cu_seqlens_k=None,
    A_idx=None,
    concat_layout=None,
    tuned=True,
    config=None,
    **_,
):
    _untuned(tuned, config)
    concat_layout = concat_layout or ()
    if "A" in concat_layout:
        A = _interleave(A)
    if "B" in concat_layout:
        B = _interleave(B)
    acc = _product(A, B, cu_seqlens_m, cu_seqlens_k, A_idx)
    if out is None:
        out = _nan(acc.shape, A.dtype)
    if "out" in concat_layout:
        _deinterleave_into(out, acc.to(out.dtype))
    else:
        written = ~acc.isnan().all(-1, keepdim=True)
        out.copy_(torch.where(written, acc.to(out.dtype), out))
    return out


def gemm_act(
    A, B, activation=None, cu_seqlens_m=None, concat_layout=None, tuned=True, config=None, **_
):
    _untuned(tuned, config)
    assert activation == "swiglu"
    if "B" in (concat_layout or ()):
        B = _interleave(B)
    acc = _product(A, B, cu_seqlens_m, None, None)
    post = F.silu(acc[:, 0::2]) * acc[:, 1::2]
    return acc.to(A.dtype), post.to(A.dtype)


def gemm_dgated(
    A,
    B,
    PreAct,
    activation=None,
    colvec_scale=None,
    colvec_reduce=False,
    cu_seqlens_m=None,
    tuned=True,
    config=None,
    **_,
):
    _untuned(tuned, config)
    assert activation == "swiglu"
    acc = _product(A, B, cu_seqlens_m, None, None)  # dout of the activation, unscaled
    x, y = PreAct[:, 0::2].float(), PreAct[:, 1::2].float()
    scale = 1.0 if colvec_scale is None else colvec_scale.float().unsqueeze(1)
    dout = acc * scale
    sig = torch.sigmoid(x)
    out = x * sig * y
    dx = dout * y * sig * (1 + x * (1 - sig))
    dy = dout * x * sig
    d = torch.stack([dx, dy], dim=-1).flatten(-2).to(PreAct.dtype)
    results = [d, (out * scale).to(PreAct.dtype)]
    if colvec_reduce:
        results.append((out * acc).sum(-1))
    return tuple(results)


class ColVecLoad:
    """A column operand: one value per row of the product ((total_m,) under varlen)."""

    def __init__(self, name: str) -> None:
        self.name = name


class RowVecLoad:
    """A row operand: one value per column, a row per group ((groups, n)) under varlen."""

    def __init__(self, name: str) -> None:
        self.name = name


def _broadcast(v: torch.Tensor, op, cu_seqlens_m, rows: int) -> torch.Tensor:
    """The operand as the accumulator's [rows, n] (or [rows, 1]) broadcast: a column operand
    per row; a row operand [groups, n] per group's rows (rows outside groups NaN)."""
    if isinstance(op, RowVecLoad) or (op is None and v.dim() == 2):
        if v.dim() == 1:
            return v.float().unsqueeze(0)
        per_row = _nan((rows, v.shape[1]), torch.float32)
        for g, (s, e) in enumerate(_segments(cu_seqlens_m)):
            per_row[s:e] = v[g].float()
        return per_row
    return v.float().unsqueeze(1)


class _EpiMod:
    """``@gemm_epilogue`` stand-in for elementwise epilogues returning ``{"D": ...}``; operand
    kinds pinned by ``ops`` or, unpinned, rank-1 as columns and rank-2 as rows per group."""

    def __init__(self, fn, ops=None) -> None:
        self.fn, self.ops = fn, ops or {}

    def __call__(
        self, A, B, C=None, *, out=None, cu_seqlens_m=None, tuned=True, config=None, **operands
    ):
        _untuned(tuned, config)
        acc = _product(A, B, cu_seqlens_m, None, None)
        args = {
            k: _broadcast(v, self.ops.get(k), cu_seqlens_m, acc.shape[0])
            for k, v in operands.items()
        }
        d = self.fn(acc, **args)["D"]
        written = ~acc.isnan().all(-1, keepdim=True)
        dst = out["D"]
        dst.copy_(torch.where(written, d.to(dst.dtype), dst))
        return {"D": dst}


def gemm_epilogue(ops=None, **_):
    return lambda fn: _EpiMod(fn, ops)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``import quack...`` resolves to this stand-in inside (and a fresh
    ``moe_kernels.grouped_gemm_quack`` is imported against it). Where the real library was
    imported before (a GPU machine running CPU and GPU tests in one process), all of it is set
    aside meanwhile and put back after: its submodules, and the ``moe_kernels`` package's
    attribute, which ``from moe_kernels import grouped_gemm_quack`` reads before ``sys.modules``."""
    import moe_kernels

    ours = "moe_kernels.grouped_gemm_quack"
    saved = {n: m for n, m in sys.modules.items() if n == "quack" or n.startswith("quack.")}
    saved_ours = sys.modules.get(ours)
    attribute = moe_kernels.__dict__.get("grouped_gemm_quack")
    for n in saved:
        del sys.modules[n]
    root = types.ModuleType("quack")
    iface = types.ModuleType("quack.gemm_interface")
    iface.gemm, iface.gemm_act, iface.gemm_dgated = gemm, gemm_act, gemm_dgated
    epi = types.ModuleType("quack.epilogue")
    epi.gemm_epilogue = gemm_epilogue
    epi_ops = types.ModuleType("quack.epilogue.ops")
    epi_ops.ColVecLoad, epi_ops.RowVecLoad = ColVecLoad, RowVecLoad
    epi.ops = epi_ops
    config = types.ModuleType("quack.gemm_config")
    config.GemmConfig = lambda **fields: types.SimpleNamespace(**fields)
    root.gemm_interface, root.epilogue, root.gemm_config = iface, epi, config
    stand_ins = {"quack": root, "quack.gemm_interface": iface, "quack.epilogue": epi}
    stand_ins["quack.gemm_config"] = config
    stand_ins["quack.epilogue.ops"] = epi_ops
    sys.modules.update(stand_ins)
    sys.modules.pop(ours, None)
    moe_kernels.__dict__.pop("grouped_gemm_quack", None)
    try:
        yield
    finally:
        for n in [n for n in sys.modules if n == "quack" or n.startswith("quack.")]:
            del sys.modules[n]
        sys.modules.update(saved)
        sys.modules.pop(ours, None)
        moe_kernels.__dict__.pop("grouped_gemm_quack", None)
        if saved_ours is not None:
            sys.modules[ours] = saved_ours
        if attribute is not None:
            moe_kernels.grouped_gemm_quack = attribute
