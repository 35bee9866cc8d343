"""The training loop over any ``pp x dp x ep`` layout (one process is the 1 x 1 x 1 layout).

One optimizer step: every data-parallel rank runs ``global_batch / (micro_batch x dp x ep)``
micro-batches (through the pipeline when ``pp > 1``), each loss scaled so the step's gradient is
that of the mean loss over the whole global batch; gradients are reduce-scattered in buckets
during backward; the ZeRO-1 AdamW clips by the global norm and updates its shards. Router
statistics summed over the step (and over data-parallel ranks) drive the expert bias.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from moe_core.config import RunConfig
from moe_core.convert.native import save_model_dir
from moe_core.data.synthetic import SyntheticTokens
from moe_core.model import Transformer, lm_loss
from moe_core.model.moe import Router
from moe_core.parallel.ddp import GradBuckets
from moe_core.parallel.mesh import Mesh, init_distributed
from moe_core.parallel.optimizer import ShardedAdamW
from moe_core.parallel.parallelize import DTYPES, parallelize
from moe_core.parallel.pipeline import PipelineRunner, p2p_groups
from moe_core.train.schedule import lr_multiplier

EXPERT_KEYS = ("moe.experts.w_gate_up", "moe.experts.w_down")


@dataclass
class StepMetrics:
    step: int
    loss: float  # cross-entropy, mean over the global batch
    aux_loss: float  # weighted router losses summed over layers (part of the objective)
    lb_loss: float  # load-balancing score, mean over layers and micro-batches (1.0 = uniform)
    z_loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float  # whole job


def routers(modules: list[torch.nn.Module]) -> list[Router]:
    return [r for m in modules for r in m.modules() if isinstance(r, Router)]


class Trainer:
    def __init__(self, cfg: RunConfig, mesh: Mesh | None = None) -> None:
        self.cfg = cfg
        tc, pc = cfg.train, cfg.parallel
        self.mesh = mesh or init_distributed(pc)
        self.device = self.mesh.device
        torch.manual_seed(tc.seed)
        self.chunks: dict[int, Transformer] = parallelize(cfg.model, pc, self.mesh, tc.seed)
        modules = list(self.chunks.values())
        self.routers = routers(modules)
        self.buckets = GradBuckets(modules, self.mesh, pc.bucket_mb, divisor=pc.data_parallel)
        self.optimizer = ShardedAdamW(
            self.buckets, self.mesh, tc.lr, (tc.beta1, tc.beta2), tc.eps, tc.weight_decay
        )
        self.autocast = torch.autocast(self.device.type, torch.bfloat16, enabled=tc.dtype == "bf16")
        self.pipeline = None
        if pc.pp > 1:
            shape = (tc.micro_batch_size, tc.seq_len, cfg.model.d_model)
            self.pipeline = PipelineRunner(
                self.chunks,
                self.mesh,
                p2p_groups(pc, self.mesh),
                shape,
                DTYPES[pc.param_dtype],
                self.autocast,
            )
        self.data = SyntheticTokens(cfg.model.vocab_size, cfg.data.branching, tc.seed)
        self.step = 0

    @property
    def is_main(self) -> bool:
        return self.mesh.rank == 0

    def micro_batches(self) -> list[torch.Tensor]:
        """This rank's micro-batches of the current step: sequences are numbered globally, and
        data rank ``d`` reads the ``d``-th contiguous slice of the step's global batch."""
        tc = self.cfg.train
        per_rank = tc.global_batch_size // self.cfg.parallel.data_parallel
        base = self.step * tc.global_batch_size + self.mesh.data_rank * per_rank
        mb = tc.micro_batch_size
        return [
            self.data.sequences(base + j * mb, mb, tc.seq_len).to(self.device)
            for j in range(self.cfg.micro_batches)
        ]

    def _forward_backward(self, batches: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pipeline is not None:
            return self.pipeline.run(batches)
        model = self.chunks[0]
        ce_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        for tokens in batches:
            with self.autocast:
                logits, aux = model(tokens[:, :-1])
                ce = lm_loss(logits, tokens[:, 1:])
            ((ce + aux) / len(batches)).backward()
            ce_sum += ce.detach()
            aux_sum += aux.detach()
        return ce_sum, aux_sum

    def train_step(self) -> StepMetrics:
        tc, pc = self.cfg.train, self.cfg.parallel
        start = time.perf_counter()
        lr = tc.lr * lr_multiplier(self.step, tc)
        self.optimizer.set_lr(lr)
        batches = self.micro_batches()
        self.buckets.start_step(len(batches))
        ce_sum, aux_sum = self._forward_backward(batches)
        self.buckets.finish()
        grad_norm = self.optimizer.step(tc.grad_clip if tc.grad_clip > 0 else float("inf"))

        if self.cfg.model.expert_bias and self.routers:
            counts = torch.stack([r.stat_counts_E for r in self.routers])
            if self.mesh.dense_dp_group is not None:
                dist.all_reduce(counts, group=self.mesh.dense_dp_group)
            for r, c in zip(self.routers, counts, strict=True):
                r.update_bias(c)
        lb = sum((r.stat_lb for r in self.routers), torch.zeros((), device=self.device))
        z = sum((r.stat_z for r in self.routers), torch.zeros((), device=self.device))
        n_routers = torch.tensor(float(len(self.routers)), device=self.device)
        for r in self.routers:
            r.reset_stats()
        sums = torch.stack([ce_sum, aux_sum, lb, z, n_routers])
        if self.mesh.distributed:
            dist.all_reduce(sums)
        ce_total, aux_total, lb_total, z_total, routers_total = sums.tolist()
        n_micro_total = len(batches) * pc.data_parallel
        elapsed = time.perf_counter() - start
        self.step += 1
        return StepMetrics(
            step=self.step - 1,
            loss=ce_total / n_micro_total,
            aux_loss=aux_total / n_micro_total,
            lb_loss=lb_total / routers_total / len(batches),
            z_loss=z_total / routers_total / len(batches),
            grad_norm=float(grad_norm),
            lr=lr,
            tokens_per_s=tc.global_batch_size * tc.seq_len / elapsed,
        )

    def full_model_state(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state dict on rank 0 (None elsewhere); collective."""
        local: dict[str, torch.Tensor] = {}
        for chunk in self.chunks.values():
            for name, t in chunk.state_dict().items():
                if self.mesh.ep_group is not None and name.endswith(EXPERT_KEYS):
                    parts = [torch.empty_like(t) for _ in range(self.cfg.parallel.ep)]
                    dist.all_gather(parts, t.contiguous(), group=self.mesh.ep_group)
                    t = torch.cat(parts)
                local[name] = t.detach().cpu()
        if not self.mesh.distributed:
            return local
        representative = self.mesh.dp_rank == 0 and self.mesh.ep_rank == 0
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

    def fit(self, show_progress: bool = True) -> list[StepMetrics]:
        """Run ``train.steps`` steps; rank 0 logs ``out_dir/metrics.jsonl`` and saves
        ``out_dir/model``."""
        tc = self.cfg.train
        out = Path(self.cfg.out_dir)
        show = show_progress and self.is_main
        history: list[StepMetrics] = []
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        )
        if self.is_main:
            out.mkdir(parents=True, exist_ok=True)
        log = (out / "metrics.jsonl").open("w") if self.is_main else None
        with Progress(*columns, disable=not show) as bar:
            task = bar.add_task("train", total=tc.steps, status="")
            while self.step < tc.steps:
                m = self.train_step()
                history.append(m)
                if log is not None:
                    log.write(json.dumps(asdict(m)) + "\n")
                    log.flush()
                status = f"loss {m.loss:.3f}  aux {m.aux_loss:.4f}  {m.tokens_per_s:,.0f} tok/s"
                bar.update(task, advance=1, status=status)
                if show and (m.step % tc.log_every == 0 or m.step == tc.steps - 1):
                    bar.console.print(
                        f"step {m.step:>5}  loss {m.loss:.4f}  lb {m.lb_loss:.3f}  "
                        f"z {m.z_loss:.3f}  grad {m.grad_norm:.3f}  lr {m.lr:.2e}  "
                        f"{m.tokens_per_s:,.0f} tok/s"
                    )
        if log is not None:
            log.close()
        state = self.full_model_state()
        if state is not None:
            save_model_dir(state, self.cfg.model, out / "model")
        return history
