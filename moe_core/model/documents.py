"""Packed documents in a micro-batch (``train.document_mask``): attention stays inside each
document and positions restart at each one, so a document trains as it would alone.

A document starts at the first input of each row and after every EOS (the EOS ends the
document it follows). The layout is computed on the host, from the micro-batch before it is
copied to the GPU: the varlen attention kernels need the document boundaries as a list whose
length is the number of documents, and deriving that on the GPU would cost a host sync per
micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ContextVarlen:
    """One context-parallel rank's queries laid out for a varlen attention kernel
    (``context.context_varlen``): its queries cut into segments (each inside one document and
    one chunk, flattened row after row, head chunk then tail chunk), and for each segment the
    keys of its document up to the segment's end, picked from the gathered keys (flattened
    [B * S]) by ``key_index`` and laid out segment after segment. A segment's last query sees
    all its keys, the others causally before it: causal attention aligned at the bottom right.
    ``cu_seqlens_q``/``cu_seqlens_k``: where each segment starts, then the totals (int32);
    ``max_len_q``/``max_len_k``: the longest segments (host ints, so no sync)."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_len_q: int
    max_len_k: int
    key_index: torch.Tensor

    def _map(self, f) -> ContextVarlen:
        return ContextVarlen(
            f(self.cu_seqlens_q),
            f(self.cu_seqlens_k),
            self.max_len_q,
            self.max_len_k,
            f(self.key_index),
        )


@dataclass
class Documents:
    """``positions_BS``: each input's position within its document; ``cu_seqlens_N``: where
    each document starts in the batch flattened row after row, then ``B * S`` (int32, the
    varlen kernels' ``cu_seqlens``); ``max_len``: the longest document.

    Under context parallelism (``ContextShard.documents``) a rank holds some of each row's
    tokens: ``positions_BS`` are its tokens', ``query_index_S`` their places in the whole
    sequence, and ``key_positions_BS`` the whole sequence's positions (the gathered keys').
    ``context``: that rank's varlen layout, computed on the host (``context.with_layout``)."""

    positions_BS: torch.Tensor
    cu_seqlens_N: torch.Tensor
    max_len: int
    key_positions_BS: torch.Tensor | None = None
    query_index_S: torch.Tensor | None = None
    context: ContextVarlen | None = None
    # FlexAttention's block mask of these documents, made by the first layer that asks
    # (``attention._flex_block_mask``) and shared by the others
    block_mask: Any = field(default=None, repr=False, compare=False)

    def _map(self, f) -> Documents:
        optional = (self.key_positions_BS, self.query_index_S)
        return Documents(
            f(self.positions_BS),
            f(self.cu_seqlens_N),
            self.max_len,
            *(None if t is None else f(t) for t in optional),
            context=None if self.context is None else self.context._map(f),
        )

    def to(self, device: torch.device, non_blocking: bool = False) -> Documents:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> Documents:
        return self._map(lambda t: t.pin_memory())

    def mask(self) -> torch.Tensor:
        """[B, 1, S, K] boolean: query i sees key j when j is at or before i in the same
        document (for attention cores without varlen support; S x K memory per row). K = S but
        under context parallelism, where the keys are the whole sequence's."""
        keys_BK = self.positions_BS if self.key_positions_BS is None else self.key_positions_BS
        doc_BK = torch.cumsum(keys_BK == 0, dim=1)
        K = doc_BK.shape[1]
        query_S = self.query_index_S
        if query_S is None:
            query_S = torch.arange(K, device=doc_BK.device)
        doc_BS = doc_BK.index_select(1, query_S)
        causal_SK = torch.arange(K, device=doc_BK.device)[None, :] <= query_S[:, None]
        return ((doc_BS[:, :, None] == doc_BK[:, None, :]) & causal_SK)[:, None]


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
