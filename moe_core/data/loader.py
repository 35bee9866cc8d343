"""The deterministic, resumable, data-parallel loader of fixed-length token instances.

Epoch ``e`` of the train split visits instances in the order of a seeded permutation
(``Permutation(n, seed, e)``); global micro-step ``m`` takes permuted positions
``[m * dp_size * micro_batch_size, (m + 1) * dp_size * micro_batch_size)`` and rank ``r`` the
``r``-th block of ``micro_batch_size`` of them, so ranks never overlap and the union of a step's
micro-batches is the same for every ``dp_size``. An epoch serves
``n // (dp_size * micro_batch_size)`` whole micro-steps, or with ``global_batch`` (the trainer's)
whole optimizer steps, the same for every ``dp_size``; the few instances beyond are left out of
that epoch (a different few each epoch). The validation split is read in order, one pass per
``iter()``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from moe_core.data.dataset import Instances, TokenDataset
from moe_core.data.errors import DataError
from moe_core.data.shuffle import Permutation

STATE_VERSION = 1


class TokenLoader:
    """Micro-batches ``int64 [micro_batch_size, seq_len + 1]`` of one rank, resumable exactly."""

    def __init__(
        self,
        data: str | Path | Instances,
        split: Literal["train", "validation"],
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        global_batch: int | None = None,
    ) -> None:
        """``global_batch``: instances per optimizer step (``train.global_batch_size``, a
        multiple of ``micro_batch_size x dp_size``); an epoch then serves whole steps, the same
        instances for every ``dp_size``, so a run resumed at another dp (``cluster.on_node_loss
        =shrink``) continues the same sequence across epoch ends. None: whole micro-steps."""
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} is not allowed: it must be > 0.")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"dp_rank={dp_rank} is not allowed with dp_size={dp_size}: it must be in "
                f"[0, dp_size) and dp_size > 0."
            )
        # A folder is ours (moe tokenize); any other format comes as its dataset (formats.py).
        if isinstance(data, str | Path):
            data = TokenDataset(data, split, seq_len)
        if data.split != split or data.seq_len != seq_len:
            raise ValueError(
                f"the dataset is the {data.split} split at seq_len={data.seq_len}, which is not "
                f"allowed for a {split} loader at seq_len={seq_len}."
            )
        self.dataset = data
        self.split, self.seq_len, self.seed = split, seq_len, seed
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.step_instances = micro_batch_size * dp_size
        unit = self.step_instances
        if global_batch and global_batch % unit == 0 and len(self.dataset) >= global_batch:
            unit = global_batch  # (less data than one step: whole micro-steps, as before)
        self.batches_per_epoch = len(self.dataset) // unit * (unit // self.step_instances)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"the {split} split of {self.dataset.root} holds "
                f"{len(self.dataset)} instances of {seq_len + 1} tokens, fewer than one "
                f"micro-batch on each of {dp_size} ranks ({self.step_instances}): tokenize more "
                "text or lower the sequence length or micro-batch size."
            )
        self.epoch = 0
        self.batch = 0  # the next micro-batch of this rank within the epoch

    @property
    def instances_per_epoch(self) -> int:
        """Instances this rank serves per epoch (every rank serves the same number)."""
        return self.batches_per_epoch * self.micro_batch_size

    def instance_indices(self, epoch: int, batch: int) -> np.ndarray:
        """The dataset instances of this rank's micro-batch ``batch`` in ``epoch``."""
        first = (batch * self.dp_size + self.dp_rank) * self.micro_batch_size
        positions = np.arange(first, first + self.micro_batch_size, dtype=np.int64)
        if self.split == "validation":
            return positions
        return Permutation(len(self.dataset), self.seed, epoch)(positions)

    def _next(self) -> torch.Tensor:
        batch_BT = self.dataset.batch(self.instance_indices(self.epoch, self.batch))
        self.batch += 1
        return torch.from_numpy(batch_BT)

    def __iter__(self) -> Iterator[torch.Tensor]:
        if self.split == "validation":
            if self.batch >= self.batches_per_epoch:
                self.batch = 0
            while self.batch < self.batches_per_epoch:
                yield self._next()
            return
        while True:
            if self.batch >= self.batches_per_epoch:
                self.epoch, self.batch = self.epoch + 1, 0
            yield self._next()

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with this loader to be resumed by it."""
        return {
            "version": STATE_VERSION,
            "data": self.dataset.identity,
            "split": self.split,
            "seq_len": self.seq_len,
            "seed": self.seed,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as plain JSON: it resumes at the next micro-batch."""
        return {
            **self._identity(),
            "epoch": self.epoch,
            "consumed": self.batch * self.step_instances,  # this epoch, all ranks together
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """How a saved state differs from this loader where it must not, as "seq_len is 128
        there, 64 here" (the data by its identity: our manifest's sha256, or a fingerprint of
        another format's files); None when this loader resumes it."""
        if state.get("kind") == "mixture":
            return (
                "the state is a mixture's (data.sources) there, a single folder's (data.dir) here"
            )
        for key, mine in self._identity().items():
            theirs = state.get(key)
            if theirs != mine:
                if key == "data":
                    ours = isinstance(self.dataset, TokenDataset)
                    key = "the data manifest's sha256" if ours else "the data's fingerprint"
                    theirs, mine = str(theirs)[:16], mine[:16]
                return f"{key} is {theirs!r} there, {mine!r} here"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the micro-batch after the last one served when ``state`` was taken.

        The data, split, sequence length and seed must match; the layout may change when the
        instances consumed so far fill whole micro-steps of the new one.
        """
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(
                f"the loader state is not allowed here ({problem}): it belongs to other data or "
                "another run."
            )
        consumed = int(state["consumed"])
        if consumed % self.step_instances:
            raise ValueError(
                f"loader state consumed={consumed} is not allowed: with dp_size={self.dp_size} "
                f"and micro_batch_size={self.micro_batch_size} it must be a multiple of "
                f"{self.step_instances}."
            )
        self.epoch, self.batch = int(state["epoch"]), consumed // self.step_instances
