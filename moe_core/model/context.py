"""Context parallelism (``parallel.cp``): each rank of a context-parallel group holds a slice of
every sequence, and attention reaches the other slices' keys and values through an all-gather.

Causal load balance: a sequence of S tokens is cut into ``2 x cp`` chunks of ``S / (2 cp)``, and
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (a head and a tail chunk). A query at
position ``p`` attends ``p + 1`` keys, so an early chunk alone would be cheap and a late one
dear; a head and its mirrored tail add up to the same number of query-key pairs on every rank
(``pairs_per_rank``).

Positions stay global: a rank's tokens keep the positions they have in the whole sequence
(RoPE), or with ``train.document_mask`` their positions within their documents, which are
computed on the whole micro-batch (every rank of the group reads the same one) and then
sliced.

The gather (``ContextShard.gather``): forward all-gathers the slices over the group and puts the
keys in sequence order; backward reduce-scatters their gradients, so each rank gets the sum of
every rank's gradient for its own keys. Both are plain collectives, which gloo and NCCL run.

Documents under context parallelism on FlashAttention 4 (``context_varlen``): a rank's queries
in one document and one chunk attend that document's keys up to their own position, which is
causal attention aligned at the bottom right between the segment's queries and the document's
keys up to the segment's end. Cut at document starts and chunk edges, the queries become
segments whose keys, picked from the gathered ones, lie segment after segment: one varlen call
with separate query and key ``cu_seqlens``. The layout is computed on the host beside the
documents (the kernel needs the segment counts and longest lengths as host values).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moe_core.model.documents import ContextVarlen, Documents
from moe_core.model.eager import eager

# Flat-tensor collectives under their current names (torch 2.13 renamed them; 2.11 has the old).
# Defined here, the lowest layer that collects (``parallel.mesh`` passes them on).
all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of ``2 x cp``) that rank ``rank`` holds: its head and its tail."""
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, head chunk then tail chunk ([S / cp])."""
    c = seq_len // (2 * cp)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_ids(cp, rank)])


def pairs_per_rank(seq_len: int, cp: int) -> list[int]:
    """Causal query-key pairs each rank's queries attend (what the balance equalizes)."""
    return [int((local_positions(seq_len, cp, r) + 1).sum()) for r in range(cp)]


def context_varlen(positions_BS: torch.Tensor, cp: int, rank: int) -> ContextVarlen:
    """Rank ``rank``'s varlen layout (``ContextVarlen``) from the whole micro-batch's positions
    within documents (``Documents.positions_BS``, host tensor [B, S]): pure host arithmetic."""
    B, S = positions_BS.shape
    c = S // (2 * cp)
    doc_pos_BQ = positions_BS.index_select(1, local_positions(S, cp, rank)).long()
    # a segment starts at each document start and at each chunk's first query
    starts_BQ = doc_pos_BQ == 0
    starts_BQ[:, ::c] = True
    first_N = starts_BQ.reshape(-1).nonzero().squeeze(1)
    len_q_N = torch.diff(first_N, append=torch.tensor([B * 2 * c]))
    # its keys also hold the document's keys before its first query (in an earlier chunk)
    len_k_N = len_q_N + doc_pos_BQ.reshape(-1)[first_N]
    # a (row, chunk) piece's keys: from the start of the document its first query is in to the
    # chunk's end; the segments' keys tile them in order
    lead_P = doc_pos_BQ[:, ::c].reshape(-1)
    chunk_end_P = torch.tensor([(i + 1) * c for i in chunk_ids(cp, rank)]).repeat(B)
    row_P = torch.arange(B).repeat_interleave(2)
    first_key_P = row_P * S + chunk_end_P - c - lead_P
    len_P = c + lead_P
    piece_T = torch.arange(2 * B).repeat_interleave(len_P)
    offset_P = torch.cumsum(len_P, 0) - len_P
    key_index_T = first_key_P[piece_T] + torch.arange(int(len_P.sum())) - offset_P[piece_T]

    def cumulative(len_N: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(len_N, 0)]).int()

    return ContextVarlen(
        cumulative(len_q_N),
        cumulative(len_k_N),
        int(len_q_N.max()),
        int(len_k_N.max()),
        key_index_T,
    )


def with_layout(docs: Documents, cp: int, rank: int) -> Documents:
    """``docs`` (host) with rank ``rank``'s varlen layout (``context_varlen``)."""
    return replace(docs, context=context_varlen(docs.positions_BS, cp, rank))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 (the sequence) in rank order, then into sequence order; the
    gradient reduce-scattered back in rank order."""

    @staticmethod
    def forward(ctx, x_S: torch.Tensor, shard: ContextShard) -> torch.Tensor:  # type: ignore[override]
        ctx.shard = shard
        x_S = x_S.contiguous()
        out = x_S.new_empty((x_S.shape[0] * shard.cp, *x_S.shape[1:]))
        all_gather_flat(out, x_S, group=shard.group)
        return out.index_select(0, shard.to_sequence(x_S.device))

    @staticmethod
    def backward(ctx, g_S: torch.Tensor):  # type: ignore[override]
        shard: ContextShard = ctx.shard
        g_rank = g_S.index_select(0, shard.to_rank_order(g_S.device)).contiguous()
        out = g_rank.new_empty((g_rank.shape[0] // shard.cp, *g_rank.shape[1:]))
        reduce_scatter_flat(out, g_rank, group=shard.group)
        return out, None


@eager
def _gather_sequence(x_S: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The gather run eagerly inside compiled blocks (a collective is a compile boundary, as
    the token dispatch is)."""
    return _GatherSequence.apply(x_S, shard)


@dataclass
class ContextShard:
    """This rank's place in its context-parallel group of ``cp`` ranks (``group``: None only
    for ``cp = 1``, where nothing is split) for sequences of ``seq_len`` tokens."""

    cp: int
    rank: int
    seq_len: int
    group: dist.ProcessGroup | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def chunk(self) -> int:
        return self.seq_len // (2 * self.cp)

    def positions(self, device: torch.device) -> torch.Tensor:
        """This rank's global positions ([S / cp], on ``device``)."""
        return self._cached("positions", device, lambda: local_positions(*self._at(self.rank)))

    def _at(self, rank: int) -> tuple[int, int, int]:
        return self.seq_len, self.cp, rank

    def _rank_order(self) -> torch.Tensor:
        """The global position of each gathered key, in rank order."""
        return torch.cat([local_positions(*self._at(r)) for r in range(self.cp)])

    def to_rank_order(self, device: torch.device) -> torch.Tensor:
        return self._cached("rank_order", device, self._rank_order)

    def to_sequence(self, device: torch.device) -> torch.Tensor:
        """Where each sequence position sits among the gathered keys (rank order)."""
        return self._cached("sequence", device, lambda: torch.argsort(self._rank_order()))

    def _cached(self, key: str, device: torch.device, make) -> torch.Tensor:
        t = self._cache.get((key, device))
        if t is None:
            t = self._cache[(key, device)] = make().to(device)
        return t

    def local(self, t_BS: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole-sequence tensor (sequence along dim 1)."""
        return t_BS.index_select(1, self.positions(t_BS.device))

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's slice of ``x`` along ``dim`` (the sequence), in sequence order
        (collective over the group; autograd reduce-scatters the gradient back)."""
        x_S = x.movedim(dim, 0)
        return _gather_sequence(x_S, self).movedim(0, dim)

    def documents(self, docs: Documents) -> Documents:
        """``docs`` of the whole micro-batch as this rank sees them: its tokens' positions, and
        the whole sequence's document starts beside its queries' global positions (the mask
        between its queries and the gathered keys, ``Documents.mask``)."""
        if docs.query_index_S is not None:  # already this rank's
            return docs
        return Documents(
            self.local(docs.positions_BS),
            docs.cu_seqlens_N,
            docs.max_len,
            key_positions_BS=docs.positions_BS,
            query_index_S=self.positions(docs.positions_BS.device),
            context=docs.context,
        )
