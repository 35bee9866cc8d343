"""Grouped GEMM over expert segments: ``y[rows of g] = x[rows of g] @ w[g]``.

``offs`` holds the cumulative end row of each group (int32, on the device), so the grouped
product never needs the group sizes on the host. The fast path is ``torch._grouped_mm``; where
it cannot run (dtype, alignment, device generation) a per-group loop computes the same function.
Only the loop reads ``offs`` on the host.

On CUDA, where ``quack-kernels`` is installed (the ``[gpu]`` extra; sm90 and newer, bf16), QuACK's
variable-length GEMMs (``grouped_gemm_quack``) are a second fast path. Which one runs is the
caller's ``backend`` argument (``parallel.expert_gemm``, which the model's experts hold in their
``Kernels``): ``torch``, ``quack``, or ``auto`` (the default): QuACK where it runs, else torch.
Measured on one H200 (benchmarks/RESULTS.md): the OLMoE-1B-7B MoE layer's grouped GEMMs
take 6.91 ms with QuACK against 7.22 with torch per forward + backward, and
QuACK's weight gradients are 1.4x torch's at 128 experts; one product at one shape (the
gate+up forward, uniform groups, alone) is 5 % slower.

``gathered_grouped_mm`` is the grouped product on token rows gathered by a slot map, with no
expert-ordered copy of them (the MoE layer's gate+up projection): QuACK reads the rows through
an index inside its GEMMs (``gathers_in_gemm``); elsewhere its reference indexes, then runs
``grouped_mm``'s products.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from moe_kernels._triton import in_references_only
from moe_kernels.slot_permute import _check_rows, _sum_over_slots, unmapped_rows_possible

_GROUPED_MM = getattr(torch, "_grouped_mm", None)
BACKENDS = ("auto", "torch", "quack")


@functools.cache
def quack_installed() -> bool:
    return importlib.util.find_spec("quack") is not None


@functools.cache
def _sm90_or_newer(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def check_backend(backend: str) -> None:
    """Refuses a backend name that is not one of ``BACKENDS``."""
    if backend not in BACKENDS:
        raise ValueError(f"grouped GEMM backend {backend!r}: one of {', '.join(BACKENDS)}")


def _quack_runs(x: torch.Tensor, backend: str) -> bool:
    """Whether the products on ``x`` take QuACK's GEMMs under ``backend``."""
    if backend == "torch" or x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return quack_installed() and _sm90_or_newer(x.device.index or 0)


def _aligned(t: torch.Tensor) -> bool:
    """``_grouped_mm`` needs a 16-byte aligned base and non-unit strides of 16-byte multiples."""
    if t.data_ptr() % 16:
        return False
    return all((s * t.element_size()) % 16 == 0 for s in t.stride() if s != 1)


def runs_on_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether grouped products of ``dtype`` operands run on CUDA ``device`` without reading
    the host, so a CUDA graph can capture them: bf16 on sm90 and newer (torch's or QuACK's
    kernels). Elsewhere on CUDA the per-group reference loop reads the group ends."""
    if _GROUPED_MM is None or device.type != "cuda" or dtype != torch.bfloat16:
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major >= 9


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands on this machine."""
    if _GROUPED_MM is None or x.dtype != w.dtype:
        return False
    if x.device.type == "cuda":
        if not runs_on_device(x.device, x.dtype):
            return False
    elif x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16):
            return False
    else:
        return False
    return _aligned(x) and _aligned(w)


def grouped_mm_reference(
    x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """Per-group loop (host reads ``offs``): the definition the fast path must equal."""
    ends = offs_G.tolist()
    out = x_MK.new_zeros(x_MK.shape[0], w_GKN.shape[-1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[start:end] = x_MK[start:end] @ w_GKN[g]
        start = end
    return out


def grouped_mm_wgrad_reference(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """``dw[g] = x[rows of g]^T @ dy[rows of g]`` by a per-group loop."""
    ends = offs_G.tolist()
    out = x_MK.new_zeros(len(ends), x_MK.shape[1], dy_MN.shape[1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[g] = x_MK[start:end].t() @ dy_MN[start:end]
        start = end
    return out


def _forward(
    x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor, backend: str
) -> torch.Tensor:
    if not grouped_mm_supported(x_MK, w_GKN):
        return grouped_mm_reference(x_MK, w_GKN, offs_G)
    if _quack_runs(x_MK, backend):
        from moe_kernels import grouped_gemm_quack as quack

        return quack.grouped_mm(x_MK, w_GKN, offs_G)
    return _GROUPED_MM(x_MK, w_GKN, offs=offs_G)


def _stored_transposed(w_GKN: torch.Tensor) -> bool:
    """A [G, K, N] view of a weight stored [G, N, K] (the experts' layout)."""
    return w_GKN.stride(-2) == 1 and w_GKN.stride(-1) != 1


def grouped_mm_wgrad(
    x_MK: torch.Tensor,
    dy_MN: torch.Tensor,
    offs_G: torch.Tensor,
    w_GKN: torch.Tensor,
    backend: str = "auto",
) -> torch.Tensor:
    """The weight gradient in the memory layout of ``w_GKN``.

    A weight stored as [G, N, K] and used transposed (the experts' case) gets ``dy^T @ x`` per
    group, contiguous [G, N, K], returned as its transposed view: autograd then hands the
    parameter a gradient in its own layout and stores it as is, instead of copying a
    transposed [G, K, N] gradient (one strided pass over all expert weights per layer).
    """
    quack = None
    if _quack_runs(x_MK, backend):
        from moe_kernels import grouped_gemm_quack as quack
    if _stored_transposed(w_GKN):
        dy_NM = dy_MN.t()
        if grouped_mm_supported(dy_NM, x_MK):
            if quack is not None:
                return quack.grouped_wgrad(x_MK, dy_MN, offs_G, transposed=True).transpose(-2, -1)
            return _GROUPED_MM(dy_NM, x_MK, offs=offs_G).transpose(-2, -1)
    x_KM = x_MK.t()
    if grouped_mm_supported(x_KM, dy_MN):
        if quack is not None:
            return quack.grouped_wgrad(x_MK, dy_MN, offs_G)
        return _GROUPED_MM(x_KM, dy_MN, offs=offs_G)
    return grouped_mm_wgrad_reference(x_MK, dy_MN, offs_G)


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor, backend: str
    ) -> torch.Tensor:
        ctx.save_for_backward(x_MK, w_GKN, offs_G)
        ctx.backend = backend
        return _forward(x_MK, w_GKN, offs_G, backend)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # type: ignore[override]
        x_MK, w_GKN, offs_G = ctx.saved_tensors
        # A gradient arriving from a broadcast (e.g. ``y.sum()``) has zero strides, which the
        # grouped kernels reject: give them a dense one.
        dy_MN = dy_MN.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = _forward(dy_MN, w_GKN.transpose(-2, -1), offs_G, ctx.backend)
        if ctx.needs_input_grad[1]:
            dw = grouped_mm_wgrad(x_MK, dy_MN, offs_G, w_GKN, ctx.backend).to(w_GKN.dtype)
        return dx, dw, None, None


def grouped_mm(
    x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor, *, backend: str = "auto"
) -> torch.Tensor:
    """Differentiable grouped product.

    x_MK: rows sorted by group; w_GKN: one [K, N] matrix per group (any strides);
    offs_G: int32 cumulative row ends on the device of ``x_MK``, the last equal to M;
    backend: which fast path runs on CUDA (module doc), for all three products.
    """
    if offs_G.dtype != torch.int32:
        raise TypeError(f"offs_G must be int32 cumulative ends, got {offs_G.dtype}")
    check_backend(backend)
    return _GroupedMM.apply(x_MK, w_GKN, offs_G, backend)


def gathers_in_gemm(x_TD: torch.Tensor, backend: str = "auto") -> bool:
    """Whether ``gathered_grouped_mm`` reads the rows of ``x_TD`` inside the GEMM (QuACK's
    ``A_idx``; see ``_quack_runs``; never inside ``references_only()``, so the unfused model
    permutes). Elsewhere it runs its reference (index, then the grouped product), which writes
    the same copy a permute does: callers take it only to test it."""
    if in_references_only():
        return False
    return _quack_runs(x_TD, backend) and x_TD.stride(-1) == 1 and _aligned(x_TD)


def _with_zero_row(x_TD: torch.Tensor, zero_row: bool) -> torch.Tensor:
    """``x_TD`` and, where some rows are unmapped, a zero row T for them to read."""
    return torch.cat([x_TD, x_TD.new_zeros(1, x_TD.shape[1])]) if zero_row else x_TD


def _gathered_wgrad(
    a_TD: torch.Tensor,
    idx_M: torch.Tensor,
    dy_MN: torch.Tensor,
    offs_G: torch.Tensor,
    w_GKN: torch.Tensor,
    in_gemm: bool,
    backend: str,
) -> torch.Tensor:
    """``grouped_mm_wgrad(a_TD[idx_M], dy_MN, offs_G, w_GKN)``, without the gathered copy where
    QuACK runs (the same output layout: [G, N, K] storage for a transposed weight)."""
    if not in_gemm:
        return grouped_mm_wgrad(a_TD[idx_M], dy_MN, offs_G, w_GKN, backend)
    from moe_kernels import grouped_gemm_quack as quack

    if _stored_transposed(w_GKN):
        return quack.gathered_wgrad(a_TD, idx_M, dy_MN, offs_G, transposed=True).transpose(-2, -1)
    return quack.gathered_wgrad(a_TD, idx_M, dy_MN, offs_G)


class _GatheredGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_TD: torch.Tensor,
        idx_M: torch.Tensor,
        w_GKN: torch.Tensor,
        offs_G: torch.Tensor,
        slot_TK: torch.Tensor,
        zero_row: bool,
        backend: str,
    ) -> torch.Tensor:
        a_TD = _with_zero_row(x_TD, zero_row)
        ctx.backend = backend
        ctx.in_gemm = (
            gathers_in_gemm(a_TD, backend)
            and grouped_mm_supported(a_TD, w_GKN)
            and idx_M.is_contiguous()
            and _aligned(idx_M)
        )
        # What backward needs: the token rows (alive anyway as the layer's input), never the
        # [M, D] gathered rows.
        ctx.save_for_backward(a_TD, idx_M, w_GKN, offs_G, slot_TK)
        if ctx.in_gemm:
            from moe_kernels import grouped_gemm_quack as quack

            return quack.gathered_mm(a_TD, idx_M, w_GKN, offs_G)
        return _forward(a_TD[idx_M], w_GKN, offs_G, backend)

    @staticmethod
    def backward(ctx, dy_MN: torch.Tensor):  # type: ignore[override]
        a_TD, idx_M, w_GKN, offs_G, slot_TK = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()  # see _GroupedMM.backward
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # The input gradient of each slot's row, then each token's rows summed (the
            # permute's own backward: deterministic, fp32 sums, unmapped rows never read).
            dy_MK = _forward(dy_MN, w_GKN.transpose(-2, -1), offs_G, ctx.backend)
            dx = _sum_over_slots(dy_MK, slot_TK)
        if ctx.needs_input_grad[2]:
            dw = _gathered_wgrad(a_TD, idx_M, dy_MN, offs_G, w_GKN, ctx.in_gemm, ctx.backend)
            dw = dw.to(w_GKN.dtype)
        return dx, None, dw, None, None, None, None


def gathered_grouped_mm(
    x_TD: torch.Tensor,
    idx_M: torch.Tensor,
    w_GKN: torch.Tensor,
    offs_G: torch.Tensor,
    slot_TK: torch.Tensor,
    *,
    every_row_mapped: bool | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``grouped_mm(permute_to_slots(x_TD, slot_TK, M), w_GKN, offs_G)`` without the permuted
    copy: row m of group g is ``x_TD[idx_M[m]] @ w_GKN[g]``, and backward keeps ``x_TD``.

    idx_M: int32 [M], each slot's token (``moe_kernels.slot_permute.slot_tokens``), T on rows no
    valid slot maps to (padding), which read a zero row: their outputs are 0 and they add
    nothing to the weight gradient, whatever gradient arrives there. slot_TK: the slot map
    ``idx_M`` was made from; the input gradient sums each token's slot rows over it.
    ``every_row_mapped`` as for ``permute_to_slots``: where rows may be unmapped, the zero row
    costs one copy of ``x_TD`` (1/K of the permuted rows); where every row is said to be
    mapped there is none, and a broken promise reads past ``x_TD`` (an index error on the
    CPU). ``backend`` as for ``grouped_mm``. Differentiable in ``x_TD`` and ``w_GKN``; no host
    read.
    """
    if idx_M.dtype != torch.int32 or idx_M.dim() != 1:
        raise TypeError(f"idx_M must be a 1-D int32 row index, got {idx_M.dtype} {idx_M.dim()}-D")
    if offs_G.dtype != torch.int32:
        raise TypeError(f"offs_G must be int32 cumulative ends, got {offs_G.dtype}")
    if slot_TK.dim() != 2 or slot_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"slot_TK {tuple(slot_TK.shape)} must be [T, K] for the {x_TD.shape[0]} rows of x_TD"
        )
    n_rows = idx_M.shape[0]
    _check_rows(slot_TK, n_rows, every_row_mapped)
    zero_row = unmapped_rows_possible(slot_TK, n_rows, every_row_mapped)
    check_backend(backend)
    return _GatheredGroupedMM.apply(x_TD, idx_M, w_GKN, offs_G, slot_TK, zero_row, backend)
