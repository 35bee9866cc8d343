"""Expert grouped GEMMs through QuACK (``quack-kernels``: CuTe-DSL GEMMs for Hopper and newer),
the ``pip install -e '.[gpu]'`` extra: variable-length grouped GEMMs over the same int32
cumulative row ends the rest of ``kernels.grouped_gemm`` takes (prefixed with a 0 here: QuACK
wants ``cu_seqlens`` of G + 1 entries), no host read.

- ``grouped_mm``: ``y[rows of g] = x[rows of g] @ w[g]`` (rows past the last end untouched);
- ``grouped_wgrad``: ``x[rows of g]^T @ dy[rows of g]`` as [G, K, N], or with ``transposed``
  ``dy^T @ x`` as [G, N, K] (the layout of a weight stored [G, N, K] and used transposed);
- ``gathered_mm`` / ``gathered_wgrad``: the same two products with row m of ``x`` read as
  ``x[idx_M[m]]`` inside the GEMM (QuACK's ``A_idx``: the forward gathers A's rows, the
  varlen-K weight gradient A's columns, for A given as ``x^T``), so no expert-ordered copy of
  the token rows is ever written.

Default (untuned) tile configs: the autotuner picked slower ones in a measured run and costs
minutes per shape. Imported only where ``kernels.grouped_gemm`` selects it (CUDA, sm90+,
package installed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quack.gemm_interface import gemm


def _cu(offs_G: torch.Tensor) -> torch.Tensor:
    return F.pad(offs_G, (1, 0))


def grouped_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    return gemm(x_MK, w_GKN, cu_seqlens_m=_cu(offs_G), tuned=False)


def grouped_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor, transposed: bool = False
) -> torch.Tensor:
    if transposed:
        return gemm(dy_MN.t(), x_MK, cu_seqlens_k=_cu(offs_G), tuned=False)
    return gemm(x_MK.t(), dy_MN, cu_seqlens_k=_cu(offs_G), tuned=False)


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
