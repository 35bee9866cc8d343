"""The training loop over any ``pp x dp x cp x ep`` layout (one process is the 1 x 1 x 1 x 1
layout).

One optimizer step: every data-parallel rank runs ``global_batch / (micro_batch x dp x ep)``
micro-batches (through the pipeline when ``pp > 1``), each loss scaled so the step's gradient is
that of the mean loss over the whole global batch; gradients are reduce-scattered in buckets
during backward. Before the optimizer applies the step, all ranks agree on the loss and the
global gradient norm: a non-finite one skips the step (nothing changes), too many in a row stop
the run with a checkpoint. That verdict is computed on the device, so the update is queued
before the host reads the step and changes nothing where the step is skipped. Router
statistics summed over the step drive the expert bias and the router-health metrics.
Checkpoints are sharded and atomic; a restarted run resumes from the newest valid one and
reproduces the uninterrupted run bit for bit (deterministic kernels).

Keeping the GPU busy: the next step's micro-batches are produced on a background thread while
the GPU runs this one (``data.prefetch``); the step reads the host once (loss, norm, router
statistics and memory in one transfer), started before the optimizer is queued, so the host
waits only for the transfer and logs the metrics while the GPU runs the optimizer. A step's
time is wall time from the previous step's host read to its own (data, optimizer and logging
included), so TFLOP/s over steps is the run's real rate. Each rank also times its own work (the
step less its waits for other ranks) and its data wait; every rank's previous step rides in the
step's one all-reduce, and every ``train.log_every`` steps rank 0 logs their spread and names a
persistent straggler (``stragglers``): no collective or host read is added for it.

This module is the loop; its parts live beside it: ``stack`` (the model and optimizer it
builds), ``batches`` (its data), ``evaluation`` (held-out loss, downstream tasks),
``step_metrics`` (the step's
values, reduced in one collective and read in one transfer, and the logged ``StepMetrics``),
``router_stats`` (router statistics, expert-bias update, health, dropped rows),
``stragglers`` (the ranks' time spread) and ``checkpoint_policy`` (resume or start fresh,
when to save, what is never saved, halting).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from moe_core.config import RunConfig, grouped_rows_aligned
from moe_core.config_dict import to_dict
from moe_core.convert.native import save_model_dir
from moe_core.data.manifest import read_manifest
from moe_core.data.prefetch import pinned
from moe_core.errors import CheckpointError, RunDirLockedError, RunFileError
from moe_core.model.documents import Documents
from moe_core.model.dtypes import DTYPES
from moe_core.model.flops import count
from moe_core.model.moe import Experts, Router
from moe_core.model.transformer import Losses, zero_losses
from moe_core.parallel.mesh import Mesh, gather_experts, init_distributed
from moe_core.parallel.trace import TRACE
from moe_core.rundir import RunLock
from moe_core.train.batches import Batches, check_data_fits
from moe_core.train.checkpoint import Checkpointer, SaveCost, router_buffers
from moe_core.train.checkpoint_policy import CheckpointPolicy
from moe_core.train.evaluation import Downstream, held_out_batches, held_out_loss
from moe_core.train.guards import Guards
from moe_core.train.metrics import (
    CHECKPOINT_LOG,
    ConsoleSink,
    JsonlSink,
    MetricsSink,
    peak_tflops,
    throughput,
)
from moe_core.train.router_stats import RouterStats, routers_by_layer
from moe_core.train.schedule import lr_multiplier, mtp_weight
from moe_core.train.stack import build_stack
from moe_core.train.step_graph import StepGraphs
from moe_core.train.step_metrics import StepMetrics, StepValues, alloc_retry_warning
from moe_core.train.stragglers import Stragglers
from moe_core.train.watchdog import Watchdog, keep_flight_record
from moe_kernels.grouped_gemm import runs_on_device

COUNTS_WAIT_S = 5.0  # the hang report waits this long for a device to give its router counts

__all__ = ["StepMetrics", "Trainer", "expert_host_reads", "routers_by_layer", "threading_main"]


def allocator_retries(device: torch.device) -> int | None:
    """How often the CUDA caching allocator has found no free memory on ``device``, emptied its
    cache and retried, so far (a host count, no device sync); None off CUDA."""
    if device.type != "cuda":
        return None
    return torch.cuda.memory_stats(device).get("num_alloc_retries", 0)


def expert_host_reads(cfg: RunConfig, device: torch.device) -> str:
    """Why the experts' grouped GEMMs read the host on ``device`` (their per-group reference
    loop: fp32 weights, a GPU older than sm90, or rows whose width gives no 16-byte stride), or
    "" where they don't (FP8 experts run their own GEMMs, on sm90 and newer only; their weight
    gradients are bf16 grouped products, and FP8 needs bf16 weights)."""
    if device.type != "cuda":
        return ""
    m = cfg.model
    if not grouped_rows_aligned(m):
        return (
            f"model.d_model={m.d_model} and model.expert_hidden={m.expert_hidden}, not both "
            "multiples of 8 (the grouped kernels' 16-byte row strides)"
        )
    params = cfg.precision.params
    if runs_on_device(device, DTYPES[params]):
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    return f"precision.params={params} on compute capability {major}.{minor}"


@dataclass(frozen=True)
class QueuedStep:
    """A step whose device work is queued: what the host needs to finish it."""

    lr: float
    n_batches: int  # this rank's micro-batches
    bias: torch.Tensor | None  # the expert-bias rows the update used
    read: Callable[[], StepValues]  # waits for the step's one host transfer


class Trainer:
    """Trains ``cfg`` in ``cfg.out_dir``, which it locks (rank 0) from construction to the end
    of ``fit`` (or ``release``): a run of another process there is refused before anything is
    built."""

    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None, console: Console | None = None):
        self.cfg = cfg
        keep_flight_record(cfg.train.flight_recorder)  # before any process group is made
        self.mesh = mesh or init_distributed(cfg.parallel)
        self.device = self.mesh.device
        self.graphs: StepGraphs | None = None
        if cfg.parallel.cuda_graph_on(
            self.device.type, cfg.train.document_mask, expert_host_reads(cfg, self.device)
        ):
            self.graphs = StepGraphs(self.device)
        self.console = console or Console()
        self.out = Path(cfg.out_dir)
        self.watchdog = Watchdog(
            cfg.train, cfg.out_dir, self.mesh.rank, cfg.parallel.world_size, self._router_counts
        )
        self._lock: RunLock | None = None
        self._lock_out_dir()
        try:
            self._build()
        except BaseException:
            self.release()
            raise

    def _lock_out_dir(self) -> None:
        """Take ``out_dir``'s lock on rank 0; every rank raises the same refusal (collective),
        also when ``out_dir`` cannot be made (a file, a symlink loop, no permission)."""
        problem: list[BaseException | None] = [None]
        if self.is_main and self._lock is None:
            try:
                self._lock = RunLock(self.out, "training")
            except (RunDirLockedError, RunFileError, OSError) as err:
                problem[0] = err
            else:
                if self._lock.previous is not None:
                    self._warn(f"took over the lock of {self._lock.previous}: it no longer runs")
                if self._lock.unsupported is not None:
                    self._warn(f"{self._lock.unsupported}: a second run here would not be stopped")
        if self.mesh.distributed:
            dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise problem[0]

    def release(self) -> None:
        """Let another run use ``out_dir`` (``fit`` takes the lock again if it runs later)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def _build(self) -> None:
        """Model, optimizer, data and checkpoints: everything that comes after the lock."""
        cfg = self.cfg
        if cfg.data.kind == "tokens":
            check_data_fits(cfg)
        torch.manual_seed(cfg.train.seed)
        self._build_model()
        self.batches = Batches(cfg, self.mesh, self.console, self._warn)
        self.downstream_set: Downstream | None = None
        if cfg.eval.every:
            # data.dir, or a mixture's first source of ours (the config refuses none)
            assert cfg.data.tokenizer_dir is not None
            eos_id = read_manifest(cfg.data.tokenizer_dir).tokenizer.get("eos_id")
            self.downstream_set = Downstream(cfg, eos_id)
        self._clock: float | None = None  # when the last step's host read returned
        self._blocked_at = 0.0  # TRACE.blocked_s at that moment
        self._data_s = 0.0  # this step's wait for its micro-batches
        self._times = [0.0, 0.0, 0.0]  # the last step's wall, own work and data seconds
        self.stragglers: Stragglers | None = None  # rank 0's, with more than one rank
        if self.is_main and self.mesh.distributed:
            tc = cfg.train
            world = dist.get_world_size()
            self.stragglers = Stragglers(world, tc.straggler_share, tc.straggler_windows)
        self.flops_per_token = count(cfg.model, cfg.train.seq_len).flops_per_token
        self.peak = peak_tflops(self.device)
        self._build_policy()

    def _build_model(self) -> None:
        """This rank's model chunks and what trains them (``stack.build_stack``), and the
        router statistics and buffers read from them."""
        stack = build_stack(self.cfg, self.mesh)
        self.chunks = stack.chunks
        self.loss_fn, self.buckets, self.optimizer = stack.loss_fn, stack.buckets, stack.optimizer
        self.autocast, self.pipeline = stack.autocast, stack.pipeline
        self.mtp_weight = stack.mtp_weight
        modules = list(self.chunks.values())
        self.router_stats = RouterStats(self.cfg, self.mesh, modules)
        self.buffers = router_buffers(modules)
        # Whether this step's update applies (the guards' rule on the device; a graph reads it).
        self._apply = torch.ones((), dtype=torch.bool, device=self.device)

    def _build_policy(self) -> None:
        """Guards and checkpoints; resume from the newest valid checkpoint or start fresh."""
        tc = self.cfg.train
        self.guards = Guards(tc.max_consecutive_skips, tc.spike_sigma, tc.spike_window)
        self.checkpoints = CheckpointPolicy(
            self.cfg,
            self.mesh,
            self.out,
            self.optimizer,
            self.buffers,
            self._trainer_state,
            self._warn,
            self._checkpoint_cost,
        )
        self.checkpoint_costs: list[SaveCost] = []  # this object's published checkpoints (rank 0)
        self._retries_seen = 0  # the CUDA allocator's retries counted so far
        self._alloc_retries()  # from here: retries before this trainer are not its steps'
        self._retries_warned = False
        self._checkpoint_log: JsonlSink | None = None  # ``checkpoints.jsonl`` while ``fit`` runs
        self.step = 0
        self.stop_requested = False
        if tc.resume:
            self._resume()
        if self.resumed_from is None:
            self.checkpoints.start_fresh()
            if self.cfg.init.from_hf is not None:
                said = self.checkpoints.start_from_hf(list(self.chunks.values()))
                if self.is_main:
                    self.console.print(said)

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0

    @property
    def routers(self) -> dict[str, Router]:
        """This rank's routers by global layer index."""
        return self.router_stats.routers

    def _router_counts(self) -> dict[str, list[float]] | None:
        """Each router's expert counts of the step so far (the hang report), read on a stream
        of its own and given up after ``COUNTS_WAIT_S`` when a hung device does not answer."""
        stats = {name: r.stat_counts_E for name, r in self.routers.items()}
        if self.device.type != "cuda":
            return {name: t.tolist() for name, t in stats.items()}
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            host = {n: t.to("cpu", non_blocking=True) for n, t in stats.items()}
            done = torch.cuda.Event()
            done.record(stream)
        deadline = time.monotonic() + COUNTS_WAIT_S
        while not done.query():
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        return {name: t.tolist() for name, t in host.items()}

    @property
    def exchanges(self) -> list:
        """This rank's rowwise dispatchers' exchanges (whose dropped rows each step checks)."""
        return self.router_stats.exchanges

    @exchanges.setter
    def exchanges(self, value: list) -> None:
        self.router_stats.exchanges = value

    @property
    def checkpointer(self) -> Checkpointer:
        return self.checkpoints.checkpointer

    @property
    def resumed_from(self) -> Path | None:
        """The checkpoint this run resumed from (None: it started fresh)."""
        return self.checkpoints.resumed_from

    # ---- data (``batches.py``) ------------------------------------------------------------

    @property
    def loader(self):
        """The token loader (None for synthetic data)."""
        return self.batches.loader

    @property
    def _loader_state(self) -> dict[str, Any] | None:
        return self.batches.loader_state

    def micro_batches(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the current step, on the device (made one step ahead on
        a background thread)."""
        return self.batches.take(self.step)

    def _stop_prefetching(self) -> None:
        self.batches.stop()

    # ---- one step -------------------------------------------------------------------------

    def _forward_backward(
        self,
        batches: list[torch.Tensor],
        forward_only: bool = False,
        documents: list[Documents] | None = None,
    ) -> Losses:
        """Every micro-batch's forward (and unless ``forward_only``, backward of its objective,
        ``Losses.objective``, MTP included); the sums of their losses (no MTP losses when
        ``forward_only``); ``documents``: each micro-batch's packed documents
        (``train.document_mask``). The pipeline runs the same calls chunk by chunk."""
        if self.pipeline is not None:
            return self.pipeline.run(batches, forward_only, documents)
        model = self.chunks[0]
        sums = zero_losses(self.device)
        for i, tokens in enumerate(batches):
            TRACE.micro_batch = i
            docs = None if documents is None else documents[i]
            with self.autocast:
                h, aux, e = model.hidden(tokens[:, :-1], docs=docs)
                losses = model.losses(
                    h, aux, e, tokens, self.loss_fn, mtp=not forward_only, docs=docs
                )
            if not forward_only:
                (losses.objective(self.mtp_weight) / len(batches)).backward()
            sums = sums + losses.detach()
        return sums

    def _compute(
        self, batches: list[torch.Tensor], documents: list[Documents] | None = None
    ) -> tuple[torch.Tensor, ...]:
        """The step's device work before its host read: forward and backward of every
        micro-batch, gradients reduced, their global norm (``StepGraphs.compute`` captures it):
        summed cross-entropy, aux and MTP losses, and the norm."""
        self.buckets.start_step()
        sums = self._forward_backward(batches, documents=documents)
        self.buckets.finish()
        return sums.ce, sums.aux, sums.mtp_D, self.optimizer.grad_norm()

    def train_step(self) -> StepMetrics:
        """One optimizer step: its device work queued, then its one host read made into the
        step's metrics while the GPU runs the update."""
        return self._step_metrics(self._queue_step())

    def _queue_step(self) -> QueuedStep:
        """Queue the step: forward and backward of every micro-batch, reduced gradients and
        their norm, the next step's batches started, then the values the host reads and the
        update (``_queue_read``, ``_queue_update``)."""
        tc = self.cfg.train
        if self._clock is None:
            self._clock, self._blocked_at = time.perf_counter(), TRACE.blocked_s
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        lr = tc.lr * lr_multiplier(self.step, tc)
        self.optimizer.set_lr(lr)
        self.mtp_weight.fill_(mtp_weight(self.step, self.cfg.model, tc))
        began = time.perf_counter()
        batches = self.micro_batches()
        self._data_s = time.perf_counter() - began
        if self.graphs is None:
            ce_sum, aux_sum, mtp_sum, grad_norm = self._compute(batches, self.batches.documents)
        else:  # never with documents (ParallelConfig.cuda_graph_on)
            ce_sum, aux_sum, mtp_sum, grad_norm = self.graphs.compute(self._compute, batches)
        if self.step + 1 < tc.steps:
            self.batches.prepare(self.step + 1)
        reduced, bias, read = self._queue_read(Losses(ce_sum, aux_sum, mtp_sum), grad_norm)
        self._queue_update(reduced, grad_norm)
        return QueuedStep(lr, len(batches), bias, read)

    def _queue_read(
        self, sums: Losses, grad_norm: torch.Tensor
    ) -> tuple[StepValues, torch.Tensor | None, Callable[[], StepValues]]:
        """The step's values reduced over all ranks in one collective, the expert-bias rows
        from them, and the step's one host read started."""
        routers = self.router_stats
        # Host values join the device's through pinned memory: an asynchronous copy, no sync.
        rows, tokens = routers.ep_rows()
        values = [len(routers.routers), self.stop_requested, self._peak_mem_gib(), rows, tokens]
        values += self._times  # this rank's previous step, for the straggler report
        values.append(self._alloc_retries())
        known = torch.tensor(values, dtype=torch.float64)  # exact integers past 2**24
        known = pinned(known, self.device).to(self.device, non_blocking=True)
        local = StepValues(
            ce=sums.ce,
            aux=sums.aux,
            mtp=self._mtp_sums(sums.mtp_D),
            routers=known[0],
            dropped=routers.dropped(),
            stop=known[1],
            peak_mem_gib=known[2],
            grad_norm=grad_norm,
            ep_rows=known[3],
            ep_tokens=known[4],
            rank_times=known[5:8],
            alloc_retries=known[8],
            **routers.sums(),
        )
        world = dist.get_world_size() if self.mesh.distributed else 1
        reduced = local.all_reduce(self.mesh.rank, world)
        bias = routers.bias_rows(reduced.router_table)
        read = replace(reduced, expert_bias=bias).start_read()  # the step's one host read
        return reduced, bias, read

    def _queue_update(self, reduced: StepValues, grad_norm: torch.Tensor) -> None:
        """The guards' skip rule and the dropped-row stop, decided on the device from the values
        the host is about to read: the update is queued now and changes nothing when the step
        is not applied, so the GPU goes on to it without waiting for the host."""
        tc = self.cfg.train
        ok = torch.isfinite(reduced.ce) & torch.isfinite(reduced.grad_norm) & (reduced.dropped == 0)
        self._apply.copy_(ok)
        clip = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        if self.graphs is None:
            self.optimizer.update(grad_norm, clip, self._apply)
        else:
            update = functools.partial(self.optimizer.update, grad_norm, clip, self._apply)
            self.graphs.update(update, prepare=self.optimizer.allocate_state)

    def _step_metrics(self, q: QueuedStep) -> StepMetrics:
        """Wait for the step's host read; the guards' verdict, router health, the stop request
        and throughput from it; the step counted."""
        tc, pc = self.cfg.train, self.cfg.parallel
        routers = self.router_stats
        host = q.read()
        now = time.perf_counter()
        elapsed, self._clock = now - self._clock, now
        blocked, self._blocked_at = TRACE.blocked_s - self._blocked_at, TRACE.blocked_s
        self._times = [elapsed, elapsed - blocked, self._data_s]
        routers.check_dropped(host.dropped.item(), f"step {self.step}")
        n_micro = q.n_batches * pc.loss_ranks  # every rank's loss is a mean of its tokens
        loss, norm = host.ce.item() / n_micro, host.grad_norm.item()
        verdict = self.guards.check(loss, norm)  # skips exactly where ``ok`` was false
        health = routers.finish_step(
            q.bias, host.router_table, host.expert_bias, applied=not verdict.skip
        )
        self.stop_requested = self.stop_requested or host.stop.item() > 0
        speed = throughput(
            tc.global_batch_size * tc.seq_len,
            elapsed,
            pc.world_size,
            self.flops_per_token,
            self.peak,
        )
        self.step += 1
        per_router_call = max(host.routers.item(), 1) * q.n_batches
        ep_tokens = host.ep_tokens.item()
        mtp_losses = [v / n_micro for v in host.mtp.tolist()]
        seen = self.batches.seen()  # a mixture's sources: known on every rank, no collective
        counted = allocator_retries(self.device) is not None
        retries = round(host.alloc_retries.item()) if counted else None
        if retries and not self._retries_warned:
            self._retries_warned = True
            self._warn(alloc_retry_warning(self.step - 1, retries))
        return StepMetrics(
            step=self.step - 1,
            loss=loss,
            mtp_loss=sum(mtp_losses) / len(mtp_losses) if mtp_losses else None,
            mtp_losses=mtp_losses or None,
            aux_loss=host.aux.item() / n_micro,
            lb_loss=host.lb.item() / per_router_call,
            z_loss=host.z.item() / per_router_call,
            grad_norm=norm,
            lr=q.lr,
            tokens_per_s_per_gpu=speed["tokens_per_s_per_gpu"],
            model_tflops_per_gpu=speed["model_tflops_per_gpu"],
            mfu=speed.get("mfu"),
            step_time_s=elapsed,
            skipped=verdict.skip,
            spike=verdict.spike,
            peak_mem_gib=host.peak_mem_gib.item() if self.device.type == "cuda" else None,
            alloc_retries=retries,
            router=health,
            ep_rows_per_token=host.ep_rows.item() / ep_tokens if ep_tokens else None,
            data_tokens=None if seen is None else seen[0],
            data_epochs=None if seen is None else seen[1],
            ranks=self._rank_report(host.rank_times),
        )

    def _rank_report(self, rank_times: torch.Tensor) -> dict[str, Any] | None:
        """Rank 0 adds every rank's previous step to the straggler window; every
        ``train.log_every`` steps the window's report, and the one warning line when the set of
        stragglers changed (``stragglers``)."""
        if self.stragglers is None:
            return None
        self.stragglers.add(rank_times.tolist())
        if (self.step - 1) % self.cfg.train.log_every:
            return None
        record, said = self.stragglers.close()
        if said is not None:
            self.console.print(f"[yellow]warning:[/] {said}", highlight=False, soft_wrap=True)
        return record

    def _mtp_sums(self, mtp_D: torch.Tensor) -> torch.Tensor:
        """Each MTP depth's summed loss, zeros on stages without the MTP modules (so every
        rank reduces the same fields)."""
        depth = self.cfg.model.mtp_depth
        return mtp_D if mtp_D.numel() == depth else torch.zeros(depth, device=self.device)

    def _alloc_retries(self) -> int:
        """This rank's CUDA allocator retries since the last call (0 off CUDA)."""
        total = allocator_retries(self.device)
        if total is None:
            return 0
        new, self._retries_seen = total - self._retries_seen, total
        return new

    def _peak_mem_gib(self) -> float:
        """This rank's peak device memory over the step (GiB; 0 off CUDA). Graph replays
        allocate from the graphs' own pool, unseen by the peak counter: with graphs, what the
        allocator holds counts too."""
        if self.device.type != "cuda":
            return 0.0
        peak = torch.cuda.max_memory_allocated(self.device)
        if self.graphs is not None:
            peak = max(peak, torch.cuda.max_memory_reserved(self.device))
        return peak / 2**30

    # ---- evaluation (``evaluation.py``) ---------------------------------------------------

    def evaluate(self) -> float:
        """Mean held-out loss over ``eval_batches`` micro-batches, split over the data ranks
        (the same sequences whatever the layout)."""
        held_out = held_out_batches(self.cfg, self.mesh, self.batches)
        return held_out_loss(
            self.cfg, self.mesh, held_out, self._forward_backward, self.router_stats, self.step
        )

    def downstream(self) -> dict[str, dict[str, float]]:
        """Accuracies of the in-training task subsets with the model as it is."""
        assert self.downstream_set is not None
        model = self.chunks[0]

        def forward(tokens_BT: torch.Tensor) -> torch.Tensor:
            with self.autocast:
                return model(tokens_BT)[0]

        return self.downstream_set.scores(forward, self.mesh, self.router_stats, self.step)

    # ---- checkpoints (the policy: ``checkpoint_policy.py``) --------------------------------

    def _trainer_state(self) -> dict[str, Any]:
        """What a checkpoint holds of the trainer beside the optimizer and router buffers."""
        return {
            "step": self.step,
            "guards": self.guards.state_dict(),
            "config": to_dict(self.cfg),
            "loader": self._loader_state,
        }

    def _resume(self) -> None:
        """Continue from the newest valid checkpoint, if any: step, guards, loader position."""
        state = self.checkpoints.resume()
        if state is None:
            return
        self.step = int(state["step"])
        self.guards.load_state_dict(state.get("guards", {}))
        problem = self.batches.resume_at(state.get("loader"))
        if problem is not None:
            raise CheckpointError(
                f"{self.resumed_from} was trained on other data or another sequence length "
                f"({problem}), so it is not allowed to resume here: resume with the settings "
                "it was trained with (data.dir or data.sources, train.seq_len, train.seed) or "
                "train into another out_dir."
            )
        if self.is_main:
            self.console.print(f"resumed from {self.resumed_from} (step {self.step})")

    def _checkpoint_cost(self, cost: SaveCost) -> None:
        """A checkpoint is published: its line, and its record in ``checkpoints.jsonl``."""
        self.checkpoint_costs.append(cost)
        self.console.print(cost.line())
        if self._checkpoint_log is not None:
            self._checkpoint_log.log(cost.step, cost.record())

    def _warn(self, message: str) -> None:
        if self.is_main:
            self.console.print(f"[yellow]warning:[/] {message}", highlight=False)

    # ---- the loop -------------------------------------------------------------------------

    def fit(
        self, show_progress: bool = True, sinks: list[MetricsSink] | None = None
    ) -> list[StepMetrics]:
        """Train to ``train.steps`` (from wherever resume left off); checkpoint as configured;
        stop gracefully on SIGTERM / SIGINT with a checkpoint. ``out_dir`` stays locked until
        this returns or raises."""
        self._lock_out_dir()
        try:
            return self._fit(show_progress, sinks)
        finally:
            self.release()

    def _fit(self, show_progress: bool, sinks: list[MetricsSink] | None) -> list[StepMetrics]:
        tc = self.cfg.train
        show = show_progress and self.is_main
        sinks = self._sinks(sinks, show)
        if self.is_main:  # records of checkpoints after the step this run continues from go
            kept = self.step + 1 if self.step > 0 else 0
            self._checkpoint_log = JsonlSink(self.out / CHECKPOINT_LOG, kept)
        history: list[StepMetrics] = []
        self.checkpoints.begin(self.step)
        with self._stop_on_signals():
            try:
                with self._progress(show) as progress:
                    while self.step < tc.steps:
                        with self.watchdog.watch(self.step):
                            m = self.train_step()
                        self._evaluate_on_cadence(m)
                        history.append(m)
                        for sink in sinks:
                            sink.log(m.step, m.as_dict())
                        if len(history) == 1:
                            # What lives now (the model, compiled graphs) stays: keep it out of
                            # the collector's full passes, which otherwise stall the host mid-run.
                            gc.collect()
                            gc.freeze()
                            self._clock = None
                        progress(m)
                        if self.guards.exhausted:
                            self.checkpoints.halt(self.step, m.step, self.guards.consecutive_skips)
                        if self.stop_requested:
                            break
                        if self.checkpoints.after_step(self.step):
                            self._clock = None
                self.checkpoints.at_end(self.step)
                if self.stop_requested and self.is_main:
                    self.console.print(f"stopped at step {self.step} on request; checkpoint saved")
            finally:
                self.watchdog.close()
                self.checkpoints.checkpointer.salvage()  # nothing pending unless it raised
                self.checkpoints.checkpointer.free_host_copy()  # freed by at_end, unless it raised
                gc.unfreeze()
                self._stop_prefetching()
                self._clock = None
                for sink in sinks:
                    sink.close()
                if self._checkpoint_log is not None:
                    self._checkpoint_log.close()
                    self._checkpoint_log = None
        if tc.save_model and not self.stop_requested:
            state = self.full_model_state()
            if state is not None:
                save_model_dir(state, self.cfg.model, self.out / "model", overwrite=True)
        return history

    def _sinks(self, sinks: list[MetricsSink] | None, show: bool) -> list[MetricsSink]:
        """Where steps are logged: the caller's sinks, and on rank 0 ``metrics.jsonl`` (appended
        from this step on) and the console (every ``train.log_every`` steps when shown)."""
        if not self.is_main:
            return list(sinks or [])
        self.out.mkdir(parents=True, exist_ok=True)
        out = [*list(sinks or []), JsonlSink(self.out / "metrics.jsonl", self.step)]
        if show:
            out.append(ConsoleSink(self.console, self.cfg.train.log_every))
        return out

    @contextlib.contextmanager
    def _stop_on_signals(self) -> Iterator[None]:
        """SIGTERM and SIGINT ask the loop to stop after the current step (with a checkpoint);
        the previous handlers come back afterwards. Only the main thread can install them."""
        previous = {}
        if threading_main():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self._on_signal)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.stop_requested = True

    @contextlib.contextmanager
    def _progress(self, show: bool) -> Iterator[Callable[[StepMetrics], None]]:
        """A progress bar (drawn when ``show``); yields what advances it by a step."""
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        )
        with Progress(*columns, console=self.console, disable=not show) as bar:
            total = self.cfg.train.steps
            task = bar.add_task("train", total=total, completed=self.step, status="")

            def advance(m: StepMetrics) -> None:
                bar.update(task, completed=self.step, status=f"loss {m.loss:.3f}")

            yield advance

    def _evaluate_on_cadence(self, m: StepMetrics) -> None:
        """Held-out loss every ``train.eval_every`` steps and downstream accuracies every
        ``eval.every`` steps (and at the last step), into ``m``; the next step is timed from
        its own start."""
        last = self.cfg.train.steps
        every = self.cfg.train.eval_every
        if every and (self.step % every == 0 or self.step == last):
            m.eval_loss = self.evaluate()
            self._clock = None
        every = self.cfg.eval.every
        if every and (self.step % every == 0 or self.step == last):
            m.downstream = self.downstream()
            self._clock = None

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (None elsewhere); collective."""
        local: dict[str, torch.Tensor] = {}
        for chunk in self.chunks.values():
            experts = {
                f"{prefix}.{name}"
                for prefix, m in chunk.named_modules()
                if isinstance(m, Experts)
                for name, _ in m.named_parameters()
            }
            for name, t in chunk.state_dict().items():
                if name in experts:
                    t = gather_experts(t, self.mesh)
                local[name] = t.detach().cpu()
        if not self.mesh.distributed:
            return local
        representative = self.mesh.dp_rank == self.mesh.cp_rank == self.mesh.ep_rank == 0
        gathered: list = [None] * dist.get_world_size() if self.is_main else []
        dist.gather_object(
            local if representative else None, gathered if self.is_main else None, dst=0
        )
        if not self.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            if part:
                merged.update(part)
        return merged


def threading_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
