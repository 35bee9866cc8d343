"""Rowwise moves between ranks' symmetric buffers: each token row written straight into the
rows of the ranks it visits (``put_rows``), and read back from them and summed (``gather_rows``).

A rank's receive buffer is the same-shaped [capacity + 1, F] allocation on every rank, which
this process can address on every rank (``PeerRows``: the views, and their base addresses as
an int64 table the kernels index). The routing prep is fused into the moves: token ``t`` goes
to rank ``p`` when ``slot_TP[t, p] >= 0`` (its place in the rank-major send order), at row
``slot_TP[t, p] + base_P[p]`` of p's buffer (``base_P``: where this rank's rows start on p,
less where they start in the send order); a row at or past ``capacity`` goes nowhere. The
last buffer row is a spare that the PyTorch references write such rows into; the Triton
kernels mask them.

Both moves handle one or two payloads in one pass (the token rows and their routing rows).
``gather_rows`` sums, per token, the rows of the ranks it visits in rank order in fp32: the
same order on every rank, deterministic, no atomics. Each is the other's adjoint. Triton runs
them on CUDA tensors (or under the interpreter: the CPU processes' shared-memory heaps are
addressable the same way); the references run elsewhere. Neither reads the host.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from moe_kernels._triton import use_triton
from moe_kernels.peer_rows import PeerRows as PeerRows  # named here too: the moves' operand type


def _dest(slot_TP: torch.Tensor, base_P: torch.Tensor, capacity: int, p: int) -> torch.Tensor:
    """Row of rank p's buffer for each token: its place there, or the spare row."""
    dest_T = slot_TP[:, p] + base_P[p]
    keep_T = (slot_TP[:, p] >= 0) & (dest_T >= 0) & (dest_T < capacity)
    return torch.where(keep_T, dest_T, capacity)


def put_rows_reference(
    rows: Sequence[torch.Tensor],
    peers: Sequence[PeerRows],
    slot_TP: torch.Tensor,
    base_P: torch.Tensor,
) -> None:
    for src, buf in zip(rows, peers, strict=True):
        for p, view in enumerate(buf.views):
            view.index_copy_(0, _dest(slot_TP, base_P, buf.capacity, p), src.to(view.dtype))


def gather_rows_reference(
    peers: Sequence[PeerRows], slot_TP: torch.Tensor, base_P: torch.Tensor
) -> list[torch.Tensor]:
    out = []
    for buf in peers:
        acc_TF = torch.zeros(
            slot_TP.shape[0],
            buf.views[0].shape[1],
            dtype=torch.promote_types(buf.views[0].dtype, torch.float32),
            device=slot_TP.device,
        )
        for p, view in enumerate(buf.views):
            dest_T = _dest(slot_TP, base_P, buf.capacity, p)
            acc_TF += torch.where((dest_T < buf.capacity)[:, None], view.index_select(0, dest_T), 0)
        out.append(acc_TF.to(buf.views[0].dtype))
    return out


def _check(rows_or_none: Sequence[torch.Tensor] | None, peers: Sequence[PeerRows], slot_TP) -> None:
    if not 1 <= len(peers) <= 2:
        raise ValueError(f"one or two payloads move together, got {len(peers)}")
    if any(len(b.views) != slot_TP.shape[1] for b in peers):
        raise ValueError(f"slot map for {slot_TP.shape[1]} ranks, buffers of another group")
    if len({b.capacity for b in peers}) > 1:
        raise ValueError("payloads that move together need buffers of the same rows")
    for i, buf in enumerate(peers):
        if rows_or_none is not None and rows_or_none[i].shape != (
            slot_TP.shape[0],
            buf.views[0].shape[1],
        ):
            raise ValueError(
                f"rows {tuple(rows_or_none[i].shape)} do not fit a slot map of "
                f"{slot_TP.shape[0]} tokens and buffers of width {buf.views[0].shape[1]}"
            )


def put_rows(
    rows: Sequence[torch.Tensor],
    peers: Sequence[PeerRows],
    slot_TP: torch.Tensor,
    base_P: torch.Tensor,
) -> None:
    """Row t of each payload into rank p's buffer at ``slot_TP[t, p] + base_P[p]`` for every
    rank it visits (see the module doc); nothing is written for rows past the capacity."""
    _check(rows, peers, slot_TP)
    if use_triton(slot_TP, *rows):
        from moe_kernels import rowwise_triton

        rowwise_triton.put_rows(rows, peers, slot_TP, base_P)
    else:
        put_rows_reference(rows, peers, slot_TP, base_P)


def gather_rows(
    peers: Sequence[PeerRows], slot_TP: torch.Tensor, base_P: torch.Tensor
) -> list[torch.Tensor]:
    """Per payload, ``out[t] = sum_p rows of rank p's buffer at t's place there`` over the ranks
    t visits (rank order, fp32 sum, the buffers' dtype): ``put_rows``'s adjoint."""
    _check(None, peers, slot_TP)
    if use_triton(slot_TP):
        from moe_kernels import rowwise_triton

        return rowwise_triton.gather_rows(peers, slot_TP, base_P)
    return gather_rows_reference(peers, slot_TP, base_P)
