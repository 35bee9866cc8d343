"""Symmetric memory: every rank of a group holds a buffer of the same size, and every rank can
read and write every other rank's buffer directly (no collective moves the data).

One interface, two heaps:

- ``CudaSymmetricHeap``: torch's symmetric memory on the GPUs of one machine (NVLink peers).
  A peer's buffer is a device tensor that any kernel (PyTorch's or Triton's) writes and reads;
  ``barrier`` is a device-side barrier on the current stream: no host synchronization.
  Chosen over nvshmem4py (measured on one H200, ``benchmarks/symmetric_memory.py``: the same
  copy rate, 20 vs 19 us barriers) because it needs no package beyond torch, is bootstrapped by
  the process group the run already has, and hands back plain tensors any op can use, where
  nvshmem4py moves data only between its own tensors and needs its own bootstrap and a heap
  sized up front.
- ``SharedMemoryHeap``: CPU processes of one machine. Each rank's buffer is a shared-memory file
  that every rank maps, so a store by one process lands in another's buffer, as on the GPU;
  ``barrier`` is the group's (gloo) barrier. The files are unlinked as soon as every rank has
  mapped them: nothing is left behind, whatever happens to the processes later.

Ordering contract for users of a buffer: a rank writes peers' buffers only between two barriers
that every rank of the group passes, and reads what others wrote only after the second one.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from moe_core.config import ConfigError
from moe_core.parallel.trace import TRACE
from moe_kernels.rowwise import PeerRows


class SymmetricBuffer:
    """One symmetric allocation: ``local`` (this rank's) and ``peer(r)`` (rank r's), flat;
    ``rows(width)`` the view the rowwise kernels take (with every rank's base address, made
    here once: a kernel never builds it from the host)."""

    def __init__(self, peers: list[torch.Tensor], rank: int) -> None:
        self._peers, self.rank = peers, rank
        self.ptrs_P = torch.tensor(
            [t.data_ptr() for t in peers], dtype=torch.int64, device=peers[rank].device
        )

    def rows(self, width: int) -> PeerRows:
        return PeerRows([t.view(-1, width) for t in self._peers], self.ptrs_P)

    def rows_of(self, dtype: torch.dtype, n_rows: int, width: int) -> PeerRows:
        """The first ``n_rows`` rows of ``width`` elements of ``dtype`` (the allocation's bytes
        read as another type, from its start: FP8 rows in a buffer of bf16 ones)."""
        views = [t.view(dtype)[: n_rows * width].view(n_rows, width) for t in self._peers]
        return PeerRows(views, self.ptrs_P)

    @property
    def local(self) -> torch.Tensor:
        return self._peers[self.rank]

    def peer(self, rank: int) -> torch.Tensor:
        return self._peers[rank]


class SymmetricHeap(Protocol):
    rank: int  # in the group
    size: int  # ranks in the group
    device: torch.device

    def buffer(self, numel: int, dtype: torch.dtype) -> SymmetricBuffer:
        """A new buffer of ``numel`` elements on every rank (collective: every rank calls it)."""
        ...

    def barrier(self) -> None:
        """Every rank's writes before it are visible to every rank after it."""
        ...


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def check_one_machine(group: dist.ProcessGroup | None) -> None:
    """Refuse a group whose ranks are on several machines (no memory is shared between them)."""
    if group is None:
        return
    hosts: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise ConfigError(
            f"parallel.dispatcher='nvshmem_rowwise' is not allowed across machines: the "
            f"expert-parallel group spans {len(set(hosts))} hosts; use 'all_to_all' or an "
            "expert-parallel size that fits on one machine."
        )


class SharedMemoryHeap:
    """Symmetric buffers for CPU processes of one machine (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = _group_rank_size(group)
        self.device = torch.device("cpu")
        check_one_machine(group)
        self._count = 0

    def buffer(self, numel: int, dtype: torch.dtype) -> SymmetricBuffer:
        # rank 0 makes a private folder in shared memory; every rank adds its file; every rank
        # maps every file; then the files go (the mappings keep the memory).
        folder: list[str | None] = [None]
        if self.rank == 0:
            root = "/dev/shm" if Path("/dev/shm").is_dir() else None
            folder[0] = tempfile.mkdtemp(prefix="moe_core-symm-", dir=root)
        if self.group is not None:
            dist.broadcast_object_list(folder, group_src=0, group=self.group)
        assert folder[0] is not None
        path = Path(folder[0]) / f"{self._count}-{{rank}}"
        self._count += 1
        mine = torch.from_file(str(path).format(rank=self.rank), True, numel, dtype=dtype)
        mine.zero_()
        self.barrier()
        peers = [
            mine
            if r == self.rank
            else torch.from_file(str(path).format(rank=r), True, numel, dtype=dtype)
            for r in range(self.size)
        ]
        self.barrier()
        os.unlink(str(path).format(rank=self.rank))
        self.barrier()
        if self.rank == 0:
            os.rmdir(folder[0])
        return SymmetricBuffer(peers, self.rank)

    def barrier(self) -> None:
        if self.group is not None:
            with TRACE.blocked():
                dist.barrier(group=self.group)


class CudaSymmetricHeap:
    """Symmetric buffers on the GPUs of one machine through torch's symmetric memory."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        # We use no multicast objects; creating them is off (it can take a host's GPUs down
        # on some virtualized machines, and nothing here needs it).
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self._symm = symm_mem
        self.group = group if group is not None else dist.group.WORLD
        self.rank, self.size = _group_rank_size(self.group)
        self.device = device
        check_one_machine(group)
        try:
            self._barrier_handle = self._rendezvous(1, torch.int32)[1]
        except RuntimeError as e:
            raise ConfigError(
                "parallel.dispatcher='nvshmem_rowwise' needs torch's symmetric memory between "
                f"these GPUs, which failed here ({str(e).splitlines()[0][:160]}); use "
                "'all_to_all'."
            ) from e

    def _rendezvous(self, numel: int, dtype: torch.dtype):
        t = self._symm.empty(numel, dtype=dtype, device=self.device)
        return t, self._symm.rendezvous(t, self.group)

    def buffer(self, numel: int, dtype: torch.dtype) -> SymmetricBuffer:
        mine, handle = self._rendezvous(numel, dtype)
        mine.zero_()
        peers = [
            mine if r == self.rank else handle.get_buffer(r, (numel,), dtype)
            for r in range(self.size)
        ]
        self.barrier()
        return SymmetricBuffer(peers, self.rank)

    def barrier(self) -> None:
        self._barrier_handle.barrier(channel=0)


def symmetric_heap(group: dist.ProcessGroup | None, device: torch.device) -> SymmetricHeap:
    """The heap for ``device``: torch's symmetric memory on CUDA, shared memory on the CPU."""
    if device.type == "cuda":
        return CudaSymmetricHeap(group, device)
    return SharedMemoryHeap(group)
