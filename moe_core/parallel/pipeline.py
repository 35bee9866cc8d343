"""Pipeline parallelism: the layers split into chunks of whole blocks, 1F1B schedules.

``pp x virtual_stages`` chunks; chunk ``c`` holds layers ``[c * L / C, (c + 1) * L / C)`` and
lives on pipeline rank ``c % pp`` (so ``virtual_stages > 1`` interleaves); the last also holds
the multi-token-prediction modules. Each micro-batch's activations travel with the running
auxiliary loss, so router losses of every stage reach the loss at the last chunk and their
gradients flow back through the same messages; with MTP the first chunk's token embeddings
travel beside them (the MTP modules read them), and so their gradient comes back to the
embedding, added to the blocks' as in one process.

Our own schedule executor rather than ``torch.distributed.pipelining``: it is short, runs the
same on the torch versions we support (2.11 on the GPU machines, 2.13 on CPU), and gives exact
control over loss scaling and gradient accumulation, which the layout-parity tests need.

Messages are point-to-point. Every rank computes every rank's schedule, hence the order in
which each neighbour produces messages; a receiver reads a channel in that order and keeps
messages it does not need yet. Each direction between two ranks has its own process group,
so a pending send never queues in front of a receive (NCCL runs a group's P2P in order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_core.config import ParallelConfig
from moe_core.model.documents import Documents
from moe_core.model.transformer import Losses, Transformer, zero_losses
from moe_core.parallel.compile import loss_function
from moe_core.parallel.mesh import Mesh, rank_of
from moe_core.parallel.trace import TRACE


@dataclass(frozen=True)
class Action:
    kind: str  # "F" forward or "B" backward
    mb: int  # micro-batch
    chunk: int  # global chunk id


def chunk_layers(n_layers: int, n_chunks: int, chunk: int) -> range:
    per = n_layers // n_chunks
    return range(chunk * per, (chunk + 1) * per)


def rank_chunks(cfg: ParallelConfig, pp_rank: int) -> list[int]:
    return [pp_rank + i * cfg.pp for i in range(cfg.virtual_stages)]


def schedule_1f1b(pp: int, rank: int, n_mb: int) -> list[Action]:
    """Warm-up forwards, then alternate one forward and one backward, then drain backwards."""
    warmup = min(pp - rank - 1, n_mb)
    actions = [Action("F", i, rank) for i in range(warmup)]
    for i in range(n_mb - warmup):
        actions += [Action("F", warmup + i, rank), Action("B", i, rank)]
    actions += [Action("B", i, rank) for i in range(n_mb - warmup, n_mb)]
    return actions


def schedule_interleaved(pp: int, v: int, rank: int, n_mb: int) -> list[Action]:
    """Interleaved 1F1B over ``v`` chunks per rank (micro-batches in groups of ``pp``)."""
    total = n_mb * v

    def mb(k: int) -> int:
        return (k // (pp * v)) * pp + k % pp

    def fwd(k: int) -> Action:
        return Action("F", mb(k), ((k // pp) % v) * pp + rank)

    def bwd(k: int) -> Action:
        return Action("B", mb(k), (v - 1 - (k // pp) % v) * pp + rank)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    actions = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions += [fwd(warmup + i), bwd(i)]
    actions += [bwd(k) for k in range(total - warmup, total)]
    return actions


def schedule(
    cfg: ParallelConfig, pp_rank: int, n_mb: int, forward_only: bool = False
) -> list[Action]:
    if forward_only:  # evaluation: each chunk's forwards, chunk by chunk
        return [Action("F", mb, c) for c in rank_chunks(cfg, pp_rank) for mb in range(n_mb)]
    if cfg.pp_schedule == "1f1b":
        return schedule_1f1b(cfg.pp, pp_rank, n_mb)
    return schedule_interleaved(cfg.pp, cfg.virtual_stages, pp_rank, n_mb)


def p2p_groups(cfg: ParallelConfig, mesh: Mesh) -> dict[tuple[int, int], dist.ProcessGroup]:
    """One group per direction between neighbouring stages of this rank's pipeline column.

    Every rank creates every column's groups in the same order (``new_group`` is collective).
    """
    mine: dict[tuple[int, int], dist.ProcessGroup] = {}
    pairs = sorted(
        {(p, (p + 1) % cfg.pp) for p in range(cfg.pp)}
        | {((p + 1) % cfg.pp, p) for p in range(cfg.pp)}
    )
    for d in range(cfg.dp):
        for e in range(cfg.ep):
            for src, dst in pairs:
                ranks = [rank_of(cfg, src, d, e), rank_of(cfg, dst, d, e)]
                g = dist.new_group(sorted(ranks))
                if (d, e) == (mesh.dp_rank, mesh.ep_rank):
                    mine[(src, dst)] = g
    return mine


class PipelineRunner:
    """Runs one optimizer step's micro-batches through this rank's chunks."""

    def __init__(
        self,
        chunks: dict[int, Transformer],
        mesh: Mesh,
        groups: dict[tuple[int, int], dist.ProcessGroup],
        act_shape: tuple[int, ...],
        act_dtype: torch.dtype,
        autocast: torch.autocast,
        mtp_weight: torch.Tensor,
    ) -> None:
        self.chunks, self.mesh, self.groups = chunks, mesh, groups
        self.cfg = mesh.cfg
        self.n_chunks = self.cfg.pp * self.cfg.virtual_stages
        self.act_shape, self.act_dtype, self.autocast = act_shape, act_dtype, autocast
        self.loss_fn = loss_function(self.cfg.compile_on(mesh.device.type))
        self.mtp_weight = mtp_weight  # a device scalar the trainer sets every step
        # Hidden states (and, with MTP, the token embeddings) in every message, then the aux.
        self.n_acts = 2 if next(iter(chunks.values())).cfg.mtp_depth else 1

    def _owner(self, chunk: int) -> int:
        return chunk % self.cfg.pp

    def _outgoing(self, a: Action) -> tuple[str, int, int, int] | None:
        """(kind, mb, destination chunk, destination stage) of the message ``a`` produces."""
        if a.kind == "F" and a.chunk < self.n_chunks - 1:
            return ("act", a.mb, a.chunk + 1, self._owner(a.chunk + 1))
        if a.kind == "B" and a.chunk > 0:
            return ("grad", a.mb, a.chunk - 1, self._owner(a.chunk - 1))
        return None

    def _channel_orders(
        self, n_mb: int, forward_only: bool
    ) -> dict[int, list[tuple[str, int, int]]]:
        """For each source stage, the messages it sends this rank, in its send order."""
        me = self.mesh.pp_rank
        orders: dict[int, list[tuple[str, int, int]]] = {}
        for src in range(self.cfg.pp):
            for a in schedule(self.cfg, src, n_mb, forward_only):
                out = self._outgoing(a)
                if out is not None and out[3] == me:
                    orders.setdefault(src, []).append(out[:3])
        return orders

    def _send(self, key: tuple[str, int, int, int], tensors: list[torch.Tensor]) -> None:
        """Send ``n_acts`` activations (or their gradients) and then the aux loss (or its)."""
        dst_stage = key[3]
        group = self.groups[(self.mesh.pp_rank, dst_stage)]
        dst = self.mesh.pp_ranks[dst_stage]
        *acts, aux = tensors
        pair = f"pp {self.mesh.pp_rank}->{dst_stage}"
        TRACE.enter(f"send ({key[0]})", group=pair, nbytes=sum(a.nbytes for a in acts))
        for t in [*(a.contiguous() for a in acts), aux.reshape(1).float().contiguous()]:
            self._pending.append((dist.isend(t, dst=dst, group=group), t))

    def _recv(self, key: tuple[str, int, int], src_stage: int) -> list[torch.Tensor]:
        while key not in self._inbox:
            nxt = self._orders[src_stage][self._cursor[src_stage]]
            self._cursor[src_stage] += 1
            group = self.groups[(src_stage, self.mesh.pp_rank)]
            src = self.mesh.pp_ranks[src_stage]
            device = self.mesh.device
            message = [
                torch.empty(self.act_shape, dtype=self.act_dtype, device=device)
                for _ in range(self.n_acts)
            ]
            message.append(torch.empty(1, dtype=torch.float32, device=device))
            pair = f"pp {src_stage}->{self.mesh.pp_rank}"
            TRACE.enter(f"recv ({nxt[0]})", group=pair, nbytes=sum(t.nbytes for t in message))
            with TRACE.blocked():
                for t in message:
                    dist.recv(t, src=src, group=group)
            message[-1] = message[-1].reshape(())
            self._inbox[nxt] = message
        return self._inbox.pop(key)

    def run(
        self,
        batches: list[torch.Tensor],
        forward_only: bool = False,
        documents: list[Documents] | None = None,
    ) -> Losses:
        """Forward (and unless ``forward_only``, backward) every micro-batch; returns the sums
        of their losses over the micro-batches whose last chunk is here (zeros elsewhere; no
        MTP losses when ``forward_only``). ``documents``: each micro-batch's packed documents
        (every rank holds its micro-batches' tokens, so every stage has them)."""
        n_mb = len(batches)
        self._orders = self._channel_orders(n_mb, forward_only)
        self._inbox, self._pending = {}, []
        self._cursor = dict.fromkeys(self._orders, 0)
        saved: dict[tuple[int, int], tuple] = {}
        sums = zero_losses(self.mesh.device)
        last = self.n_chunks - 1
        for a in schedule(self.cfg, self.mesh.pp_rank, n_mb, forward_only):
            model = self.chunks[a.chunk]
            if a.kind == "F":
                tokens = batches[a.mb]
                TRACE.micro_batch = a.mb
                docs = None if documents is None else documents[a.mb]
                # inputs: [hidden states or tokens, embeddings (MTP; None on chunk 0), aux]
                if a.chunk == 0:
                    inputs: list = [tokens[:, :-1], None, None]
                else:
                    received = self._recv(("act", a.mb, a.chunk), self._owner(a.chunk - 1))
                    if not forward_only:
                        received = [t.requires_grad_() for t in received]
                    h, *e, aux = received
                    inputs = [h, e[0] if e else None, aux]
                x_in, e_in, aux_in = inputs
                with self.autocast:
                    h_out, aux_out, e_out = model.hidden(x_in, aux_in, e_in, docs)
                if a.chunk == last:
                    with self.autocast:
                        losses = model.losses(
                            h_out,
                            aux_out,
                            e_out,
                            tokens,
                            self.loss_fn,
                            mtp=not forward_only,
                            docs=docs,
                        )
                    sums = sums + losses.detach()
                    if not forward_only:
                        objective = losses.objective(self.mtp_weight) / n_mb
                        saved[(a.mb, a.chunk)] = (inputs, [objective], False)
                else:
                    outs = [h_out, *([e_out] if self.n_acts == 2 else []), aux_out]
                    self._send(self._outgoing(a), [t.detach() for t in outs])
                    if not forward_only:
                        saved[(a.mb, a.chunk)] = (inputs, outs, True)
            else:
                inputs, outs, sent_on = saved.pop((a.mb, a.chunk))
                grads = None
                if sent_on:  # the next chunk's gradients of what this one sent it
                    grads = self._recv(("grad", a.mb, a.chunk), self._owner(a.chunk + 1))
                    # a chunk of dense blocks alone adds no router loss: its aux needs none
                    kept = [i for i, t in enumerate(outs) if t.requires_grad]
                    outs, grads = [outs[i] for i in kept], [grads[i] for i in kept]
                torch.autograd.backward(outs, grads)
                if a.chunk > 0:
                    x_in, e_in, aux_in = inputs
                    sent = [x_in.grad, *([e_in.grad] if self.n_acts == 2 else []), aux_in.grad]
                    self._send(self._outgoing(a), sent)
        with TRACE.blocked():
            for work, _ in self._pending:
                work.wait()
        self._pending = []
        assert not saved and not self._inbox, "pipeline schedule left work behind"
        return sums
