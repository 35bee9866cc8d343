"""The ``pp x dp x cp x ep`` process layout and its process groups.

Rank order puts ``ep`` innermost (expert-parallel peers are neighbours, e.g. NVLink peers: the
all-to-all of every MoE layer is the heaviest traffic), then ``cp`` (a key/value all-gather
every attention layer), then ``dp`` (one gradient reduction per step), then ``pp`` (point to
point between stages): ``rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * ep + ep_rank``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_core.config import ConfigError, ParallelConfig
from moe_core.model.context import all_gather_flat, reduce_scatter_flat

__all__ = ["Mesh", "all_gather_flat", "build_mesh", "init_distributed", "reduce_scatter_flat"]

Group = dist.ProcessGroup | None  # None: the default group (or no process group at all)


@dataclass
class Mesh:
    """This rank's coordinates and the groups it takes part in (None where the size is 1)."""

    cfg: ParallelConfig
    rank: int = 0
    pp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    cp_rank: int = 0
    ep_group: Group = None  # same stage, dp and cp rank: exchanges tokens
    expert_dp_group: Group = None  # same stage and ep rank: reduces expert weights (dp x cp)
    dense_dp_group: Group = None  # same stage: reduces dense weights (dp x cp x ep ranks)
    cp_group: Group = None  # same stage, dp and ep rank: shares sequences (gathers keys)
    pp_ranks: list[int] = field(default_factory=lambda: [0])  # global rank of each stage
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def data_rank(self) -> int:
        """Which slice of the batch this rank reads (0 .. dp x ep - 1)."""
        return self.dp_rank * self.cfg.ep + self.ep_rank

    @property
    def distributed(self) -> bool:
        return self.cfg.world_size > 1


def gather_experts(local: torch.Tensor, mesh: Mesh) -> torch.Tensor:
    """Every expert of a stacked expert tensor (experts along dim 0) from this rank's slice:
    the slices of the expert-parallel group in rank order (collective over it); the tensor
    itself without expert parallelism. The one place expert state is gathered (the trainer's
    model export and the optimizer's full state)."""
    if mesh.ep_group is None:
        return local
    parts = [torch.empty_like(local) for _ in range(mesh.cfg.ep)]
    dist.all_gather(parts, local.contiguous(), group=mesh.ep_group)
    return torch.cat(parts, dim=0)


def rank_of(cfg: ParallelConfig, pp_rank: int, dp_rank: int, ep_rank: int, cp_rank: int = 0) -> int:
    return ((pp_rank * cfg.dp + dp_rank) * cfg.cp + cp_rank) * cfg.ep + ep_rank


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_world_size(cfg: ParallelConfig, world_size: int) -> None:
    """Before any process-group work: the launcher's world must be the configured layout."""
    if world_size != cfg.world_size:
        raise ConfigError(
            f"the layout pp={cfg.pp} x dp={cfg.dp} x cp={cfg.cp} x ep={cfg.ep} needs "
            f"{cfg.world_size} processes, but {world_size} were launched; launch "
            f"{cfg.world_size} (e.g. torchrun --nproc-per-node N) or change parallel.pp/dp/cp/ep."
        )


def build_mesh(cfg: ParallelConfig) -> Mesh:
    """Create every group (all ranks call new_group for all groups, in one order)."""
    gpu = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    if cfg.world_size == 1:
        return Mesh(cfg, device=gpu or torch.device("cpu"))
    rank = dist.get_rank()
    ep_rank = rank % cfg.ep
    cp_rank = (rank // cfg.ep) % cfg.cp
    dp_rank = (rank // (cfg.ep * cfg.cp)) % cfg.dp
    pp_rank = rank // (cfg.ep * cfg.cp * cfg.dp)
    mesh = Mesh(cfg, rank, pp_rank, dp_rank, ep_rank, cp_rank)
    here = (pp_rank, dp_rank, cp_rank, ep_rank)
    coords = [
        (p, d, c, e)
        for p in range(cfg.pp)
        for d in range(cfg.dp)
        for c in range(cfg.cp)
        for e in range(cfg.ep)
    ]

    def groups(same: tuple[int, ...]) -> Group:
        """Make every group of ranks that agree with each other on the axes ``same`` (in
        one order on all ranks); the one holding this rank, None if it is this rank alone."""
        mine: Group = None
        keys = sorted({tuple(x[i] for i in same) for x in coords})
        for key in keys:
            members = [x for x in coords if tuple(x[i] for i in same) == key]
            g = dist.new_group([rank_of(cfg, p, d, e, c) for p, d, c, e in members])
            if key == tuple(here[i] for i in same) and len(members) > 1:
                mine = g
        return mine

    # pp, dp, cp, ep = axes 0, 1, 2, 3
    mesh.ep_group = groups((0, 1, 2))
    mesh.expert_dp_group = groups((0, 3))
    mesh.dense_dp_group = groups((0,))
    mesh.cp_group = groups((0, 1, 3))
    mesh.pp_ranks = [rank_of(cfg, p, dp_rank, ep_rank, cp_rank) for p in range(cfg.pp)]
    if gpu is not None and (dist.get_backend() == "nccl" or cfg.backend == "gloo"):
        mesh.device = gpu  # gloo on GPUs (parallel.backend): CUDA tensors through gloo
    return mesh


def init_distributed(cfg: ParallelConfig) -> Mesh:
    """Validate the launch, start the process group (NCCL on GPU, gloo on CPU), build groups."""
    world = env_world_size()
    check_world_size(cfg, world)
    if world > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            if cfg.backend == "gloo":  # ranks may share a GPU (several per GPU)
                torch.cuda.set_device(local_rank % torch.cuda.device_count())
                dist.init_process_group("gloo")
            else:
                torch.cuda.set_device(local_rank)
                dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        else:
            dist.init_process_group("gloo")
    return build_mesh(cfg)
