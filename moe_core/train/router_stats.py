"""The routers' statistics over a training step: what they add to the step's reduction, the
expert-bias update they drive, the per-layer health that is logged, and the check that no
routed row was dropped.

Routers count assignments per expert and sum their load-balancing and z scores on the device
(``Router.stat_*``); the rowwise dispatchers count rows that found no room. This module reads
those counters into ``StepValues`` fields (device tensors, no host read), and after the step's
one host read turns the reduced table into the expert-bias update and ``router_health``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_core.config import RunConfig
from moe_core.model.moe import Router
from moe_core.model.transformer import Transformer
from moe_core.parallel.dispatch import (
    AllToAllDispatcher,
    ReceiveBufferOverflowError,
    RowwiseDispatcher,
)
from moe_core.parallel.mesh import Mesh
from moe_core.parallel.trace import TRACE
from moe_core.train.metrics import router_health


def routers_by_layer(modules: list[Transformer]) -> dict[str, Router]:
    """Every router of the chunks by its global layer index (as a string; an MTP module's
    block is layer ``n_layers + k``)."""
    return {
        str(layer): block.moe.router
        for chunk in modules
        for layer, block in chunk.blocks()
        if block.moe is not None
    }


def rowwise_exchanges(modules: list[torch.nn.Module]) -> list:
    """The distinct symmetric-memory exchanges of the chunks' rowwise dispatchers."""
    return list(
        {
            id(m.dispatcher.exchange): m.dispatcher.exchange
            for chunk in modules
            for m in chunk.modules()
            if isinstance(getattr(m, "dispatcher", None), RowwiseDispatcher)
        }.values()
    )


def all_to_all_dispatchers(modules: list[torch.nn.Module]) -> list[AllToAllDispatcher]:
    """The chunks' all-to-all dispatchers (one per MoE layer)."""
    return [
        m.dispatcher
        for chunk in modules
        for m in chunk.modules()
        if isinstance(getattr(m, "dispatcher", None), AllToAllDispatcher)
    ]


class RouterStats:
    """This rank's routers (``routers``, by layer), rowwise exchanges (``exchanges``) and
    all-to-all dispatchers (``dispatchers``)."""

    def __init__(self, cfg: RunConfig, mesh: Mesh, modules: list[Transformer]) -> None:
        self.cfg = cfg
        self.mesh = mesh
        self.device = mesh.device
        self.routers = routers_by_layer(modules)
        self.exchanges = rowwise_exchanges(modules)
        self.dispatchers = all_to_all_dispatchers(modules)

    def ep_rows(self) -> tuple[int, int]:
        """Rows the all-to-all dispatchers sent to other ranks and tokens they dispatched since
        the last call (then reset): host integers they keep from their split sizes."""
        counts = [d.take_counts() for d in self.dispatchers]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    def sums(self) -> dict[str, torch.Tensor]:
        """The step's summed scores (``lb``, ``z``) and the global router table, as the
        ``StepValues`` fields they fill (device tensors)."""
        zero = torch.zeros((), device=self.device)
        rs = list(self.routers.values())
        return {
            "lb": sum((r.stat_lb for r in rs), zero),
            "z": sum((r.stat_z for r in rs), zero),
            "router_table": self.table(),
        }

    def table(self) -> torch.Tensor:
        """[all layers, experts + 1]: this rank's layers' assignments per expert and summed
        load-balancing score in their global rows, zeros elsewhere (float64, on the device).
        Summed over all ranks, each row adds up the ranks that hold its layer."""
        E = self.cfg.model.n_experts
        if not self.routers:
            return torch.zeros(0, E + 1, device=self.device, dtype=torch.float64)
        m = self.cfg.model
        rows = m.n_layers + m.mtp_depth  # the MTP modules' blocks after the model's
        out = torch.zeros(rows, E + 1, device=self.device, dtype=torch.float64)
        for layer, r in self.routers.items():
            out[int(layer), :E] = r.stat_counts_E.double()
            out[int(layer), E] = r.stat_lb.double()
        return out

    def bias_rows(self, table: torch.Tensor) -> torch.Tensor:
        """[this rank's layers, 2 x experts]: each router's expert bias and the bias after this
        step's update from the reduced ``table`` (empty without the expert bias)."""
        if not self.routers or not self.cfg.model.expert_bias:
            return torch.zeros(0, 0, device=self.device, dtype=torch.float64)
        E = self.cfg.model.n_experts
        return torch.stack(
            [
                torch.cat([r.expert_bias, r.next_bias(table[int(layer), :E])])  # type: ignore[list-item]
                for layer, r in self.routers.items()
            ]
        ).double()

    def dropped(self) -> torch.Tensor:
        """Rows and assignments the rowwise dispatchers found no room for since the last read
        (then reset); a device value, read with the rest."""
        out = torch.zeros((), device=self.device)
        for ex in self.exchanges:
            out = out + ex.dropped.float()
            ex.dropped.zero_()
        return out

    def check_dropped(self, dropped: float, where: str) -> None:
        """Stop before anything is applied when routed tokens were dropped (never silently)."""
        if dropped > 0:
            factor = self.cfg.parallel.ep_capacity_factor
            raise ReceiveBufferOverflowError(
                f"{where}: {int(dropped)} routed token rows or expert assignments found no room "
                f"in the expert-parallel receive buffers (parallel.ep_capacity_factor={factor}); "
                "nothing of this step was applied: raise the factor, or set it to null for "
                "dropless dispatch, and resume."
            )

    def finish_step(
        self, bias: torch.Tensor, host_table: torch.Tensor, host_bias: torch.Tensor, applied: bool
    ) -> dict[str, dict[str, Any]]:
        """Per-layer router health over the step (``host_table``, ``host_bias``: the read-back
        table and bias rows); applies the expert-bias update (``bias``, on the device) when the
        step was applied, and resets the routers' counters. With ``pp > 1`` every rank gets
        every stage's layers (collective)."""
        if not self.routers:
            return {}
        E = self.cfg.model.n_experts
        n_scores = self.cfg.micro_batches * self.cfg.parallel.loss_ranks
        with_bias = self.cfg.model.expert_bias
        health = {}
        for i, (layer, r) in enumerate(self.routers.items()):
            if applied and with_bias:
                r.expert_bias.copy_(bias[i, E:])  # type: ignore[union-attr]
            row = host_table[int(layer)]
            layer_bias = None
            if with_bias:
                layer_bias = (host_bias[i, E:] if applied else host_bias[i, :E]).float()
            counts = row[:E].clone()
            score = float(row[E]) / n_scores
            health[f"layer_{layer}"] = router_health(
                counts, score, self.cfg.parallel.ep, layer_bias
            )
            r.reset_stats()
        if self.cfg.parallel.pp > 1:
            parts: list = [None] * dist.get_world_size()
            mine = health if (self.mesh.dp_rank, self.mesh.ep_rank) == (0, 0) else None
            with TRACE.blocked():
                dist.all_gather_object(parts, mine)
            health = {k: v for p in parts if p for k, v in p.items()}
        return dict(sorted(health.items(), key=lambda kv: int(kv[0].split("_")[1])))
