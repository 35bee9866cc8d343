"""Expert grouped GEMMs through QuACK (``quack-kernels``: CuTe-DSL GEMMs for Hopper and newer),
the ``pip install -e '.[gpu]'`` extra: variable-length grouped GEMMs over the same int32
cumulative row ends the rest of ``moe_kernels.grouped_gemm`` takes (prefixed with a 0 here: QuACK
wants ``cu_seqlens`` of G + 1 entries), no host read.

- ``grouped_mm``: ``y[rows of g] = x[rows of g] @ w[g]`` (rows past the last end untouched);
- ``grouped_wgrad``: ``x[rows of g]^T @ dy[rows of g]`` as [G, K, N], or with ``transposed``
  ``dy^T @ x`` as [G, N, K] (the layout of a weight stored [G, N, K] and used transposed);
- ``gathered_mm`` / ``gathered_wgrad``: the same two products with row m of ``x`` read as
  ``x[idx_M[m]]`` inside the GEMM (QuACK's ``A_idx``: the forward gathers A's rows, the
  varlen-K weight gradient A's columns, for A given as ``x^T``), so no expert-ordered copy of
  the token rows is ever written.

Untuned tile configs: the autotuner picked slower ones in a measured run and costs minutes per
shape. The fused expert MLP's six GEMMs, and the plain weight gradients of the same products
(the FP8 experts' and the unfused MLP's), take one pinned config where it was measured
(``_tile_config``); the plain forward GEMMs QuACK's default. Imported only where
``moe_kernels.grouped_gemm`` selects it (CUDA, sm90+, package installed).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from quack import gemm_interface
from quack.epilogue import gemm_epilogue
from quack.epilogue.ops import ColVecLoad, RowVecLoad
from quack.gemm_config import GemmConfig
from quack.gemm_interface import gemm, gemm_act, gemm_dgated

# QuACK's untuned GEMM entry, which takes a tile config (``gemm`` does not): internal, so looked
# up once and optional (``_pinned_gemm``).
_UNTUNED = getattr(getattr(gemm_interface, "gemm_tuned", None), "fn", None)


def _cu(offs_G: torch.Tensor) -> torch.Tensor:
    return F.pad(offs_G, (1, 0))


def grouped_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    return gemm(x_MK, w_GKN, cu_seqlens_m=_cu(offs_G), tuned=False)


def grouped_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    """In the pinned tiles (``_tile_config``): the fused MLP's weight gradients are these
    products at the expert shapes (``down_wgrad`` is this one, transposed)."""
    G, cu = offs_G.shape[0], _cu(offs_G)
    if transposed:
        out_GNK = x_MK.new_empty(G, dy_MN.shape[1], x_MK.shape[1])
        return _pinned_gemm(dy_MN.t(), x_MK, out_GNK, cu_seqlens_k=cu)
    out_GKN = x_MK.new_empty(G, x_MK.shape[1], dy_MN.shape[1])
    return _pinned_gemm(x_MK.t(), dy_MN, out_GKN, cu_seqlens_k=cu)


def gathered_mm(
    x_TK: torch.Tensor, idx_M: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """``y[m] = x[idx_M[m]] @ w[g]`` for the rows m of group g; ``idx_M`` int32 [M]."""
    return gemm(x_TK, w_GKN, cu_seqlens_m=_cu(offs_G), A_idx=idx_M, tuned=False)


def gathered_wgrad(
    x_TK: torch.Tensor,
    idx_M: torch.Tensor,
    dy_MN: torch.Tensor,
    offs_G: torch.Tensor,
    transposed: bool = False,
) -> torch.Tensor:
    """``x[idx_M[rows of g]]^T @ dy[rows of g]`` as [G, K, N]; with ``transposed`` the same
    values stored as a contiguous [G, N, K] (QuACK writes the transposed output itself: only
    ``A`` can be gathered, so ``dy^T @ x`` is not an option here)."""
    cu = _cu(offs_G)
    if not transposed:
        return gemm(x_TK.t(), dy_MN, cu_seqlens_k=cu, A_idx=idx_M, tuned=False)
    out_GNK = dy_MN.new_empty(offs_G.shape[0], dy_MN.shape[1], x_TK.shape[1])
    gemm(x_TK.t(), dy_MN, out=out_GNK.mT, cu_seqlens_k=cu, A_idx=idx_M, tuned=False)
    return out_GNK


@functools.cache
def _tile_config(device: torch.device) -> GemmConfig | None:
    """The tile configuration of the fused expert MLP's six GEMMs (``moe_kernels.expert_mlp``),
    pinned where measured: on sm90, 128 x 128 pingpong tiles in 1 x 2 clusters with the static
    scheduler. On one H200 at OLMoE-1B-7B's shapes (131,072 rows over 64 experts) and at 128
    experts top-4, each GEMM alone with seven candidate configs timed interleaved
    (``benchmarks/expert_mlp.py --configs``, RESULTS.md), it was the fastest or within 1 % of it
    for all six, against QuACK's sm90 default (128 x 192 pingpong, 2 x 1), in ms at 64 experts:
    gate+up with the SwiGLU 1.69 / 1.76, the SwiGLU backward 0.96 / 1.60, the row-scaled down
    0.84 / 0.86, the gate+up input gradient 1.66 / 1.74 and weight gradient 1.62 / 1.68, the
    down weight gradient 0.82 / 0.92 (QuACK's 192-wide tile pads its 1,024 columns by 1/9).
    The dynamic scheduler gained nothing. Elsewhere (unmeasured) QuACK's default."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return None
    return GemmConfig(
        tile_m=128, tile_n=128, pingpong=True, cluster_m=1, cluster_n=2, is_dynamic_persistent=False
    )


def _pinned_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, **kwargs) -> torch.Tensor:
    """QuACK's plain GEMM ``out = a @ b`` in the pinned tile config (``_tile_config``) through
    its untuned entry, which takes a config (``gemm`` does not); its default tiles where there
    is no pin or a QuACK release lacks that entry."""
    config = _tile_config(out.device)
    if config is None or _UNTUNED is None:
        gemm(a, b, out=out, tuned=False, **kwargs)
    else:
        _UNTUNED(a, b, out, config=config, **kwargs)
    return out


@gemm_epilogue()
def _scale_rows(acc, scale_M):
    """Row m of the product times ``scale_M[m]`` (a column vector: one value per row)."""
    return {"D": acc * scale_M}


# the operands' kinds pinned: QuACK infers a [groups, N] operand's kind from its shape, which
# is ambiguous where the rows number N (or the groups the rows)
@gemm_epilogue(ops={"scale_M": ColVecLoad("scale_M"), "scale_GN": RowVecLoad("scale_GN")})
def _scale_rows_and_columns(acc, scale_M, scale_GN):
    """The rowwise FP8 product's scales: row m times ``scale_M[m]``, column n of group g times
    ``scale_GN[g, n]`` (a [groups, N] row operand: one row per group of the varlen GEMM)."""
    return {"D": acc * scale_M * scale_GN}


def fp8_scaled_mm(
    qa_MK: torch.Tensor,
    sa_M: torch.Tensor,
    qb_GNK: torch.Tensor,
    sb_GN: torch.Tensor,
    offs_G: torch.Tensor,
    out_dtype: torch.dtype,
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """``(qa[rows of g] @ qb[g]^T) * sa[row] * sb[g, col]`` from E4M3 operands quantized over
    K (``moe_kernels.fp8``'s rowwise recipe), accumulated in fp32 (QuACK promotes the tensor
    cores' FP8 partial sums into fp32 registers) and written in ``out_dtype``: the product
    ``torch._scaled_grouped_mm`` computes, up to the order of the two scale products. ``config``:
    a tile configuration, else QuACK's sm90 default. Not on the training path: on one H200
    (QuACK 0.6.5) it ran at 336-386 TFLOP/s in the best tiles and 65-79 in the default ones,
    against 836-933 for torch's FP8 GEMM at the same gate+up shapes, the epilogue costing
    nothing (RESULTS.md, issues 41 and 42); ``benchmarks/fp8_gemm.py`` times it again."""
    y_MN = torch.empty(qa_MK.shape[0], qb_GNK.shape[1], dtype=out_dtype, device=qa_MK.device)
    _scale_rows_and_columns(
        qa_MK,
        qb_GNK.mT,
        out={"D": y_MN},
        cu_seqlens_m=_cu(offs_G),
        tuned=False,
        config=config,
        scale_M=sa_M,
        scale_GN=sb_GN,
    )
    return y_MN


def swiglu_mm(
    x_MK: torch.Tensor, w_G2FK: torch.Tensor, offs_G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x @ w[g]^T`` per group with the SwiGLU in the epilogue: returns the pre-activation
    [M, 2F] with gate and up interleaved by column (h[:, 0::2] gate, h[:, 1::2] up) and
    ``silu(gate) * up`` [M, F]. ``w_G2FK`` is the stored gate+up weight, gate rows first."""
    return gemm_act(
        x_MK,
        w_G2FK.mT,
        activation="swiglu",
        cu_seqlens_m=_cu(offs_G),
        concat_layout=("B",),
        tuned=False,
        config=_tile_config(x_MK.device),
        dynamic_scheduler=False,
    )


def row_scaled_mm(
    x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor, scale_M: torch.Tensor
) -> torch.Tensor:
    """``y[m] = scale_M[m] * (x[m] @ w[g])`` for the rows m of group g; ``scale_M`` fp32 [M]."""
    y_MN = x_MK.new_empty(x_MK.shape[0], w_GKN.shape[-1])
    cu = _cu(offs_G)
    config = _tile_config(x_MK.device)  # None: QuACK's default (tuned=False: no autotuning)
    _scale_rows(
        x_MK, w_GKN, out={"D": y_MN}, cu_seqlens_m=cu, tuned=False, config=config, scale_M=scale_M
    )
    return y_MN


def dswiglu_mm(
    dy_MN: torch.Tensor,
    w_GNF: torch.Tensor,
    h_M2F: torch.Tensor,
    offs_G: torch.Tensor,
    scale_M: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The backward of ``y = scale * (swiglu(h) @ w_down[g]^T)`` from ``dy``, with ``w_GNF`` the
    stored down weight [G, N, F]: ``da = dy @ w_GNF[g]`` stays in registers; returns the
    interleaved pre-activation gradient [M, 2F] (the scale folded in), ``scale * swiglu(h)``
    [M, F] recomputed (the down weight gradient's input) and, with a scale, its gradient
    ``sum_f swiglu(h) * da`` fp32 [M]."""
    out = gemm_dgated(
        dy_MN,
        w_GNF,
        h_M2F,
        activation="swiglu",
        colvec_scale=scale_M,
        colvec_reduce=scale_M is not None,
        cu_seqlens_m=_cu(offs_G),
        tuned=False,
        config=_tile_config(dy_MN.device),
        dynamic_scheduler=False,
    )
    dh_M2F, a_MF = out[0], out[1]
    return dh_M2F, a_MF, (out[2] if scale_M is not None else None)


def down_wgrad(a_MF: torch.Tensor, dy_MD: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """The down projection's weight gradient ``dy[rows of g]^T @ a[rows of g]`` in its stored
    [G, D, F] layout, in the pinned tiles."""
    return grouped_wgrad(a_MF, dy_MD, offs_G, transposed=True)


def interleaved_dgrad(
    dh_M2F: torch.Tensor, w_G2FK: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """``dx = dh @ w[g]`` per group for the interleaved ``dh`` of ``swiglu_mm`` and the stored
    (gate rows first) weight, in the pinned tiles."""
    dx_MK = dh_M2F.new_empty(dh_M2F.shape[0], w_G2FK.shape[-1])
    return _pinned_gemm(dh_M2F, w_G2FK, dx_MK, cu_seqlens_m=_cu(offs_G), concat_layout=("B",))


def interleaved_wgrad(
    x_MK: torch.Tensor, dh_M2F: torch.Tensor, offs_G: torch.Tensor
) -> torch.Tensor:
    """``dh[rows of g]^T @ x[rows of g]`` as the stored [G, 2F, K] layout (gate rows first) from
    the interleaved ``dh`` of ``swiglu_mm``, in the pinned tiles."""
    dw_G2FK = x_MK.new_empty(offs_G.shape[0], dh_M2F.shape[1], x_MK.shape[1])
    cu = _cu(offs_G)
    return _pinned_gemm(dh_M2F.t(), x_MK, dw_G2FK, cu_seqlens_k=cu, concat_layout=("out",))
