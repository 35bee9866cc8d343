"""Expert grouped GEMMs through QuACK (``quack-kernels``: CuTe-DSL GEMMs for Hopper and newer),
the ``pip install -e '.[gpu]'`` extra: variable-length grouped GEMMs over the same int32
cumulative row ends the rest of ``kernels.grouped_gemm`` takes (prefixed with a 0 here: QuACK
wants ``cu_seqlens`` of G + 1 entries), no host read.

- ``grouped_mm``: ``y[rows of g] = x[rows of g] @ w[g]`` (rows past the last end untouched);
- ``grouped_wgrad``: ``x[rows of g]^T @ dy[rows of g]`` as [G, K, N], or with ``transposed``
  ``dy^T @ x`` as [G, N, K] (the layout of a weight stored [G, N, K] and used transposed).

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
