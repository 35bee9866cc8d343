"""A weighted mixture of token sources (``data.sources``): drawn deterministically from the
seed, a disjoint slice per data rank, resumable exactly under any data-parallel size.

Instance slots are numbered over the whole run as ``TokenLoader`` numbers its positions: global
micro-step ``m`` holds slots ``[m * dp_size * micro_batch_size, (m + 1) * dp_size *
micro_batch_size)`` and rank ``r`` the ``r``-th block of ``micro_batch_size`` of them, so a
step's instances are the same for every ``dp_size``. Slot ``g`` draws from the source that lags
its share most (``share * (g + 1) - drawn``, ties to the first listed): a fixed schedule rather
than coin flips, so every source's count stays within about one instance of ``share * slots``
and realized shares track the weights from the first step on. The ``k``-th draw of source ``s``
is its instance ``Permutation(n_s, seed_s, k // n_s)(k % n_s)``: each source walks its own
seeded permutation, epoch after epoch, every instance once per epoch (a source smaller than its
share of the run repeats: its epochs pass 1). The state is the slots drawn and each source's
draws, from which the sequence continues exactly.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from moe_core.config import SourceConfig
from moe_core.data.dataset import Instances, TokenDataset
from moe_core.data.errors import DataError
from moe_core.data.shuffle import Permutation

STATE_VERSION = 1


def source_seed(seed: int, name: str) -> int:
    """Source ``name``'s permutation seed: its own order, unchanged when other sources are
    added or reordered."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def assign(
    shares: Sequence[float], drawn: list[int], first: int, n: int
) -> tuple[np.ndarray, np.ndarray]:
    """The sources of slots ``first .. first + n - 1`` and each slot's draw number within its
    source, given each source's draws before ``first`` (``drawn``, advanced in place)."""
    source_N = np.empty(n, dtype=np.int64)
    draw_N = np.empty(n, dtype=np.int64)
    for j in range(n):
        t = first + j + 1
        best, lag = 0, shares[0] * t - drawn[0]
        for s in range(1, len(shares)):
            d = shares[s] * t - drawn[s]
            if d > lag:
                best, lag = s, d
        source_N[j], draw_N[j] = best, drawn[best]
        drawn[best] += 1
    return source_N, draw_N


class MixtureLoader:
    """Micro-batches ``int64 [micro_batch_size, seq_len + 1]`` of one rank drawn from several
    sources by their shares; the train split of each (``datasets``, one a source, in any format
    of ``formats.FORMATS``; omitted, the sources are folders of ours, opened here)."""

    def __init__(
        self,
        sources: Sequence[SourceConfig],
        shares: Sequence[float],
        seq_len: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        *,
        datasets: Sequence[Instances] | None = None,
    ) -> None:
        if len(shares) != len(sources) or not sources:
            raise ValueError(f"{len(shares)} shares for {len(sources)} sources: one each.")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size={micro_batch_size} is not allowed: it must be > 0.")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"dp_rank={dp_rank} is not allowed with dp_size={dp_size}: it must be in "
                f"[0, dp_size) and dp_size > 0."
            )
        self.sources, self.shares = list(sources), [float(x) for x in shares]
        self.names = [s.name for s in sources]
        if datasets is None:
            if any(s.format != "moe" for s in sources):
                raise ValueError("sources in another format than 'moe' come with their datasets.")
            datasets = [TokenDataset(s.dir, "train", seq_len) for s in sources]
        if len(datasets) != len(sources):
            raise ValueError(f"{len(datasets)} datasets for {len(sources)} sources: one each.")
        for d in datasets:
            if d.split != "train" or d.seq_len != seq_len:
                raise ValueError(
                    f"the dataset of {d.root} is the {d.split} split at seq_len={d.seq_len}, "
                    f"which is not allowed for a mixture's train split at seq_len={seq_len}."
                )
        self.datasets: list[Instances] = list(datasets)
        self.sizes = [len(d) for d in self.datasets]
        for source, n in zip(sources, self.sizes, strict=True):
            if n == 0:
                raise DataError(
                    f"data source {source.name!r} ({source.dir}) holds no instance of "
                    f"{seq_len + 1} tokens in its train split: tokenize more text, lower the "
                    "sequence length or leave the source out."
                )
        self.seeds = [source_seed(seed, s.name) for s in sources]
        self.seq_len, self.seed = seq_len, seed
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.step_instances = micro_batch_size * dp_size
        self.consumed = 0  # slots drawn, all ranks together
        self.drawn = [0] * len(sources)  # each source's draws among them
        self._perms: dict[tuple[int, int], Permutation] = {}

    def _permutation(self, s: int, epoch: int) -> Permutation:
        key = (s, epoch)
        if key not in self._perms:
            if len(self._perms) > 4 * len(self.sizes):  # only the current epochs are read
                self._perms.clear()
            self._perms[key] = Permutation(self.sizes[s], self.seeds[s], epoch)
        return self._perms[key]

    def slots(self, first: int, n: int, drawn: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Slots ``first ..`` as (source, instance of that source) arrays; ``drawn`` advances."""
        source_N, draw_N = assign(self.shares, drawn, first, n)
        instance_N = np.empty(n, dtype=np.int64)
        for s in np.unique(source_N).tolist():
            rows = source_N == s
            epoch_R, position_R = np.divmod(draw_N[rows], self.sizes[s])
            out_R = np.empty(len(position_R), dtype=np.int64)
            for e in np.unique(epoch_R).tolist():
                here = epoch_R == e
                out_R[here] = self._permutation(s, e)(position_R[here])
            instance_N[rows] = out_R
        return source_N, instance_N

    def _next(self) -> torch.Tensor:
        source_N, instance_N = self.slots(self.consumed, self.step_instances, self.drawn)
        self.consumed += self.step_instances
        lo = self.dp_rank * self.micro_batch_size
        mine = slice(lo, lo + self.micro_batch_size)
        source_B, instance_B = source_N[mine], instance_N[mine]
        out_BT = np.empty((self.micro_batch_size, self.seq_len + 1), dtype=np.int64)
        for s in np.unique(source_B).tolist():
            rows = source_B == s
            out_BT[rows] = self.datasets[s].batch(instance_B[rows])
        return torch.from_numpy(out_BT)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while True:
            yield self._next()

    def seen(self, state: dict[str, Any]) -> tuple[dict[str, int], dict[str, float]]:
        """Per source, the tokens trained on (``seq_len`` per instance, as throughput counts
        them) and the epochs read, all ranks together, where ``state`` stands."""
        drawn = state["drawn"]
        tokens = {name: int(drawn[name]) * self.seq_len for name in self.names}
        epochs = {
            name: int(drawn[name]) / n for name, n in zip(self.names, self.sizes, strict=True)
        }
        return tokens, epochs

    def _identity(self) -> dict[str, Any]:
        """What a saved state must share with this loader to be resumed by it."""
        return {
            "version": STATE_VERSION,
            "kind": "mixture",
            "split": "train",
            "seq_len": self.seq_len,
            "seed": self.seed,
            "sources": [
                {"name": s.name, "format": s.format, "data": d.identity, "share": share}
                for s, d, share in zip(self.sources, self.datasets, self.shares, strict=True)
            ],
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this loader stands, as plain JSON: it resumes at the next micro-batch."""
        return {
            **self._identity(),
            "consumed": self.consumed,
            "drawn": dict(zip(self.names, self.drawn, strict=True)),
            "micro_batch_size": self.micro_batch_size,
            "dp_size": self.dp_size,
        }

    def state_problem(self, state: dict[str, Any]) -> str | None:
        """How a saved state differs from this loader where it must not, as "the sources are
        ['web', 'code'] there, ['web', 'books'] here"; None when this loader resumes it."""
        if state.get("kind") != "mixture":
            return "the state is a single folder's (data.dir) there, a mixture (data.sources) here"
        for key, mine in self._identity().items():
            theirs = state.get(key)
            if key == "sources" and isinstance(theirs, list) and theirs != mine:
                return _sources_problem(theirs, mine)
            if theirs != mine:
                return f"{key} is {theirs!r} there, {mine!r} here"
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the micro-batch after the last one served when ``state`` was taken; the
        layout may change when the slots drawn so far fill whole micro-steps of the new one."""
        problem = self.state_problem(state)
        if problem is not None:
            raise ValueError(
                f"the loader state is not allowed here ({problem}): it belongs to other data or "
                "another run."
            )
        consumed = int(state["consumed"])
        drawn = [int(state["drawn"][name]) for name in self.names]
        if consumed % self.step_instances or sum(drawn) != consumed:
            raise ValueError(
                f"loader state consumed={consumed} (draws {drawn}) is not allowed: with "
                f"dp_size={self.dp_size} and micro_batch_size={self.micro_batch_size} it must be "
                f"a multiple of {self.step_instances}, and the sum of the sources' draws."
            )
        self.consumed, self.drawn = consumed, drawn


def _sources_problem(theirs: list[Any], mine: list[dict[str, Any]]) -> str:
    """The first way the saved sources differ from these, in words."""
    names = [t.get("name") if isinstance(t, dict) else t for t in theirs]
    if names != [m["name"] for m in mine]:
        return f"the sources are {names!r} there, {[m['name'] for m in mine]!r} here"
    for t, m in zip(theirs, mine, strict=True):
        for key in ("format", "data", "share"):
            if t.get(key) != m[key]:
                a, b = t.get(key), m[key]
                if key == "data":
                    key, a, b = "data (its checksum)", str(a)[:16], str(b)[:16]
                return f"source {m['name']!r} has {key} {a!r} there, {b!r} here"
    return "the sources differ"
