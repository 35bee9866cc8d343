"""When a training run checkpoints, what it refuses to checkpoint, and where it starts.

``CheckpointPolicy`` decides; ``train/checkpoint.py``'s ``Checkpointer`` writes, verifies,
loads and prunes (retention: ``train.keep_last`` / ``train.keep_every``). The policy: resume
from the newest valid checkpoint (``train.resume``), else start fresh with what an earlier run
left moved aside; save every ``train.checkpoint_every`` steps and at the end
(``train.checkpoint_at_end``) unless that state is already saved; never write a state holding
NaN or infinity (the run stops naming the checkpoint to resume from); and stop a run whose
steps keep coming out non-finite with its (unchanged) state saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe_core.config import RunConfig
from moe_core.model.transformer import parameter_shapes
from moe_core.parallel.mesh import Mesh
from moe_core.parallel.optimizer import ShardedAdamW
from moe_core.rundir import set_aside
from moe_core.train.checkpoint import Checkpointer, SaveCost
from moe_core.train.guards import TrainingHaltedError
from moe_core.train.metrics import CHECKPOINT_LOG


class CheckpointPolicy:
    """The checkpoints of a run in ``out / "checkpoints"``: the optimizer's state, the router
    buffers and ``trainer_state()`` (step, guards, config, loader position). ``on_cost``
    receives each published checkpoint's cost (rank 0)."""

    def __init__(
        self,
        cfg: RunConfig,
        mesh: Mesh,
        out: Path,
        optimizer: ShardedAdamW,
        buffers: dict[str, torch.Tensor],
        trainer_state: Callable[[], dict[str, Any]],
        warn: Callable[[str], None],
        on_cost: Callable[[SaveCost], None] | None = None,
    ) -> None:
        tc = cfg.train
        self.cfg, self.mesh, self.out = cfg, mesh, out
        self.optimizer, self.buffers = optimizer, buffers
        self.trainer_state, self.warn = trainer_state, warn
        self.checkpointer = Checkpointer(
            out / "checkpoints",
            mesh,
            tc.keep_last,
            tc.keep_every,
            tc.async_checkpoint,
            report=warn,
            on_cost=on_cost,
        )
        self.resumed_from: Path | None = None
        self.saved_at = -1  # the step whose state is saved during this ``fit`` (-1: none)

    # ---- where the run starts -------------------------------------------------------------

    def resume(self) -> dict[str, Any] | None:
        """Load the newest valid checkpoint into the optimizer and buffers and return its
        trainer state; None when there is none (collective)."""
        path = self.checkpointer.newest_valid(report=self.warn)
        if path is None:
            return None
        shapes = parameter_shapes(self.cfg.model)
        state = self.checkpointer.load(path, self.optimizer, self.buffers, shapes)
        self.checkpointer.adopt(path)
        self.resumed_from = path
        return state

    def start_from_hf(self, chunks: list[torch.nn.Module]) -> str:
        """A fresh run with ``init.from_hf``: this rank's chunks take the folder's weights (its
        parameters of them: a pipeline stage's layers, an expert-parallel rank's experts), and
        the optimizer's masters follow; returns the line that says so. The folder must still
        hold the architecture the run was configured with."""
        from moe_core.convert.load import fill_from_source, hf_source_for

        folder = self.cfg.init.from_hf
        assert folder is not None
        source = hf_source_for(self.cfg.model, folder)
        for chunk in chunks:
            fill_from_source(chunk, source)
        self.optimizer.reset_masters()
        return f"started from the weights of {folder} ({source.family.title})"

    def start_fresh(self) -> None:
        """A run that resumes nothing is a new run: what an earlier run left in ``out_dir``
        (checkpoints and their costs, metrics, model) is moved to ``*.superseded-N``, never
        pruned or overwritten by this one."""
        if self.mesh.rank == 0:
            ckpts = self.checkpointer.root
            earlier = [
                p
                for p in (
                    ckpts,
                    self.out / CHECKPOINT_LOG,
                    self.out / "metrics.jsonl",
                    self.out / "model",
                )
                if p.exists() and not (p == ckpts and not any(p.iterdir()))
            ]
            n = set_aside(earlier)
            ckpts.mkdir(parents=True, exist_ok=True)
            if n is not None:
                names = ", ".join(p.name for p in earlier)
                why = "train.resume=false" if not self.cfg.train.resume else "nothing to resume"
                self.warn(
                    f"starting a new run in {self.out} ({why}): the earlier run's {names} "
                    f"moved to *.superseded-{n} there"
                )
        if self.mesh.distributed:
            dist.barrier()

    # ---- when it saves --------------------------------------------------------------------

    def begin(self, step: int) -> None:
        """A ``fit`` starts at ``step``: its state is saved when the run resumed there."""
        self.saved_at = step if self.resumed_from is not None else -1

    def after_step(self, step: int) -> bool:
        """Save when ``train.checkpoint_every`` says so; whether it saved (then lets async
        writes finish their work in the background)."""
        every = self.cfg.train.checkpoint_every
        saved = bool(every) and step % every == 0
        if saved:
            self.save(step)
        self.checkpointer.poll()
        return saved

    def at_end(self, step: int) -> None:
        """The run's last state, unless already saved (``train.checkpoint_at_end``); waits
        for every write and frees the background saves' host copy."""
        if self.cfg.train.checkpoint_at_end and self.saved_at != step:
            self.save(step)
        self.checkpointer.close()

    def save(self, step: int) -> None:
        """Checkpoint the current state. A state holding NaN or infinity is never written
        (resume would pick it): the run stops instead, naming the checkpoint to resume from.
        Its cost is timed from here: the finite check's device sync is part of the stall."""
        started = time.perf_counter()
        if not self.state_is_finite():
            raise self.not_finite(step)
        state = self.checkpointer.state_dict(self.optimizer, self.buffers, self.trainer_state())
        pc = self.cfg.parallel
        layout = {"pp": pc.pp, "dp": pc.dp, "ep": pc.ep}
        self.checkpointer.save(step, state, layout, started=started)
        self.saved_at = step

    # ---- what it refuses ------------------------------------------------------------------

    def state_is_finite(self) -> bool:
        """Whether every master weight, Adam moment and router buffer is finite on every rank
        (collective)."""
        opt = self.optimizer
        tensors = [*opt.masters, *(t for m in opt.moments for t in m.values())]
        tensors += list(self.buffers.values())
        ok = torch.ones((), device=self.mesh.device)
        for t in tensors:
            ok = ok * torch.isfinite(t).all()
        if self.mesh.distributed:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def newest(self) -> str:
        """Which checkpoint a resume would start from, in words (collective)."""
        self.checkpointer.wait()
        path = self.checkpointer.newest_valid(report=lambda _: None)
        if path is None:
            return f"there is no valid checkpoint in {self.checkpointer.root}"
        return f"the newest valid checkpoint is {path}"

    def not_finite(self, step: int) -> TrainingHaltedError:
        return TrainingHaltedError(
            f"at step {step} the weights, Adam moments or router buffers hold NaN or "
            f"infinity, so that state was not checkpointed; {self.newest()}: resume "
            "from it after fixing the cause (such as a lower train.lr or a larger train.eps)."
        )

    def halt(self, step: int, last: int, skips: int) -> None:
        """Stop after ``skips`` non-finite steps in a row (the last one ``last``; the run is at
        ``step``). Skipped steps change nothing, so the state now is the one all of them started
        from: checkpointed when it is finite, and named as such (never as a known-good state)."""
        first = last - skips + 1
        what = (
            f"{skips} steps in a row had a non-finite loss or gradient norm "
            f"(steps {first} to {last})"
        )
        if not self.state_is_finite():
            cause = self.not_finite(step)
            raise TrainingHaltedError(f"{what}; {cause}") from None
        self.save(step)
        self.checkpointer.wait()
        start = f"step {first - 1}'s update" if first > 0 else "initialization"
        raise TrainingHaltedError(
            f"{what}; skipped steps change nothing, so the state checkpointed at step {step} "
            f"in {self.checkpointer.root} is the one they all started from (after {start}): "
            "lower train.lr or check the data before resuming from it."
        )
