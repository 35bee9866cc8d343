"""``PeerRows``, the operand of the rowwise moves (``moe_kernels.rowwise``), in a leaf of its own so
that their Triton kernels (``moe_kernels.rowwise_triton``) take it without importing the module that
launches them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PeerRows:
    """One symmetric allocation as rows: every rank's [capacity + 1, F] view (index = rank) and
    their base addresses (int64, on the buffers' device)."""

    views: list[torch.Tensor]
    ptrs_P: torch.Tensor

    @property
    def capacity(self) -> int:
        return self.views[0].shape[0] - 1
