"""The single-process training loop (the distributed runtime wraps the same steps).

One optimizer step = ``global_batch_size / micro_batch_size`` micro-batches, each loss scaled so
the step's gradient is that of the mean loss over the whole batch. Router statistics summed
over the step drive the auxiliary-loss-free expert bias, when enabled.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from moe_core.config import RunConfig, check_tokenizer_fits
from moe_core.convert.native import save_model_dir
from moe_core.data.loader import TokenLoader
from moe_core.data.synthetic import SyntheticTokens
from moe_core.model import Transformer, build_model, lm_loss
from moe_core.model.moe import Router
from moe_core.train.schedule import lr_multiplier


@dataclass
class StepMetrics:
    step: int
    loss: float  # cross-entropy, mean over the step's tokens
    aux_loss: float  # weighted router losses (part of the optimized objective)
    lb_loss: float  # load-balancing score, mean over layers (1.0 = uniform)
    z_loss: float
    grad_norm: float
    lr: float
    tokens_per_s: float


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms, biases and other vectors are not decayed."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def routers(model: torch.nn.Module) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class Trainer:
    def __init__(self, cfg: RunConfig, device: torch.device | None = None) -> None:
        self.cfg = cfg
        self.device = device or default_device()
        tc = cfg.train
        torch.manual_seed(tc.seed)
        self.model: Transformer = build_model(cfg.model, self.device, seed=tc.seed)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, tc.weight_decay),
            lr=tc.lr,
            betas=(tc.beta1, tc.beta2),
            eps=tc.eps,
            fused=self.device.type == "cuda",
        )
        self.data = SyntheticTokens(cfg.model.vocab_size, cfg.data.branching, tc.seed)
        self.loader: TokenLoader | None = None
        if cfg.data.kind == "tokens":
            assert cfg.data.dir is not None
            self.loader = TokenLoader(
                cfg.data.dir, "train", tc.seq_len, tc.micro_batch_size, seed=tc.seed
            )
            vocab = self.loader.dataset.manifest.tokenizer["vocab_size"]
            check_tokenizer_fits(cfg.data, vocab, cfg.model.vocab_size)
            self._batches = iter(self.loader)
        self.micro_batches = tc.global_batch_size // tc.micro_batch_size
        self.step = 0

    def _micro_batch(self, index: int) -> torch.Tensor:
        """Micro-batch ``index`` of the run: token shards when configured, else synthetic."""
        tc = self.cfg.train
        if self.loader is None:
            return self.data.batch(index, tc.micro_batch_size, tc.seq_len)
        return next(self._batches)

    def train_step(self) -> StepMetrics:
        tc = self.cfg.train
        start = time.perf_counter()
        lr = tc.lr * lr_multiplier(self.step, tc)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        aux_sum = torch.zeros((), device=self.device)
        autocast = torch.autocast(self.device.type, torch.bfloat16, enabled=tc.dtype == "bf16")
        for micro in range(self.micro_batches):
            index = self.step * self.micro_batches + micro
            tokens = self._micro_batch(index).to(self.device)
            with autocast:
                logits, aux = self.model(tokens[:, :-1])
                loss = lm_loss(logits, tokens[:, 1:])
            ((loss + aux) / self.micro_batches).backward()
            loss_sum += loss.detach()
            aux_sum += aux.detach()
        max_norm = tc.grad_clip if tc.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        rs = routers(self.model)
        calls = max(self.micro_batches, 1)
        lb = torch.stack([r.stat_lb for r in rs]).mean() / calls
        z = torch.stack([r.stat_z for r in rs]).mean() / calls
        if self.cfg.model.expert_bias:
            for r in rs:
                r.update_bias(r.stat_counts_E)
        for r in rs:
            r.reset_stats()
        values = torch.stack([loss_sum / calls, aux_sum / calls, lb, z, grad_norm]).tolist()
        elapsed = time.perf_counter() - start
        tokens = tc.global_batch_size * tc.seq_len
        metrics = StepMetrics(
            self.step, *values[:4], grad_norm=values[4], lr=lr, tokens_per_s=tokens / elapsed
        )
        self.step += 1
        return metrics

    def fit(self, show_progress: bool = True) -> list[StepMetrics]:
        """Run ``train.steps`` steps, log to ``out_dir/metrics.jsonl``, save ``out_dir/model``."""
        tc = self.cfg.train
        out = Path(self.cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        history: list[StepMetrics] = []
        columns = (
            TextColumn("[bold]train"),
            BarColumn(),
            TextColumn("step {task.completed}/{task.total}"),
            TextColumn("{task.fields[status]}"),
            TimeRemainingColumn(),
        )
        with (
            (out / "metrics.jsonl").open("w") as log,
            Progress(*columns, disable=not show_progress) as bar,
        ):
            task = bar.add_task("train", total=tc.steps, status="")
            while self.step < tc.steps:
                m = self.train_step()
                history.append(m)
                log.write(json.dumps(asdict(m)) + "\n")
                status = f"loss {m.loss:.3f}  aux {m.aux_loss:.4f}  {m.tokens_per_s:,.0f} tok/s"
                bar.update(task, advance=1, status=status)
                if show_progress and (m.step % tc.log_every == 0 or m.step == tc.steps - 1):
                    bar.console.print(
                        f"step {m.step:>5}  loss {m.loss:.4f}  lb {m.lb_loss:.3f}  "
                        f"z {m.z_loss:.3f}  grad {m.grad_norm:.3f}  lr {m.lr:.2e}  "
                        f"{m.tokens_per_s:,.0f} tok/s"
                    )
        save_model_dir(self.model.state_dict(), self.cfg.model, out / "model")
        return history
