"""Packed documents in a micro-batch (``train.document_mask``): attention stays inside each
document and positions restart at each one, so a document trains as it would alone.

A document starts at the first input of each row and after every EOS (the EOS ends the
document it follows). The layout is computed on the host, from the micro-batch before it is
copied to the GPU: the varlen attention kernels need the document boundaries as a list whose
length is the number of documents, and deriving that on the GPU would cost a host sync per
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Documents:
    """``positions_BS``: each input's position within its document; ``cu_seqlens_N``: where
    each document starts in the batch flattened row after row, then ``B * S`` (int32, the
    varlen kernels' ``cu_seqlens``); ``max_len``: the longest document."""

    positions_BS: torch.Tensor
    cu_seqlens_N: torch.Tensor
    max_len: int

    def to(self, device: torch.device, non_blocking: bool = False) -> Documents:
        return Documents(
            self.positions_BS.to(device, non_blocking=non_blocking),
            self.cu_seqlens_N.to(device, non_blocking=non_blocking),
            self.max_len,
        )

    def pin_memory(self) -> Documents:
        return Documents(
            self.positions_BS.pin_memory(), self.cu_seqlens_N.pin_memory(), self.max_len
        )

    def mask(self) -> torch.Tensor:
        """[B, 1, S, S] boolean: query i sees key j when j <= i in the same document (for
        attention cores without varlen support; S^2 memory per row)."""
        doc_BS = torch.cumsum(self.positions_BS == 0, dim=1)
        S = doc_BS.shape[1]
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=doc_BS.device).tril()
        return ((doc_BS[:, :, None] == doc_BS[:, None, :]) & causal_SS)[:, None]


def documents_of(inputs_BS: torch.Tensor, eos_id: int) -> Documents:
    """The documents of a micro-batch's inputs (its tokens without the last target)."""
    B, S = inputs_BS.shape
    starts_BS = torch.zeros(B, S, dtype=torch.bool)
    starts_BS[:, 0] = True
    starts_BS[:, 1:] = inputs_BS[:, :-1].cpu() == eos_id
    index = torch.arange(B * S)
    starts = starts_BS.reshape(-1)
    # each input's document start: the latest start at or before it
    first = torch.cummax(torch.where(starts, index, 0), dim=0).values
    begin = index[starts]
    cu_seqlens = torch.cat([begin, torch.tensor([B * S])]).to(torch.int32)
    return Documents(
        (index - first).reshape(B, S),
        cu_seqlens,
        int((cu_seqlens[1:] - cu_seqlens[:-1]).max()),
    )
