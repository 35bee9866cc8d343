"""Honest training metrics: throughput by the design's FLOP convention, MFU only against a
known peak, and router health that shows the real load next to the balancing score.

The load-balancing score ``E * sum_e f_e P_e`` can improve while the real load gets worse
("token gerrymandering": probability mass moves onto lightly used experts while the argmax
keeps sending tokens to a busy one). So every layer reports both the score and the load
imbalance computed from the routing decisions themselves.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import torch
from rich.console import Console

from moe_core.errors import RunFileError
from moe_core.hardware import PEAK_BF16_TFLOPS

# Beside metrics.jsonl (one line per step): one line per published checkpoint, its ``step`` and
# what it cost (``checkpoint.SaveCost.record``).
CHECKPOINT_LOG = "checkpoints.jsonl"


def peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak, or None where unknown (CPU, other GPUs): never guessed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if all(part in name for part in key.split()):
            return PEAK_BF16_TFLOPS[key]
    return None


def throughput(
    tokens: int, seconds: float, world_size: int, flops_per_token: int, peak: float | None
) -> dict[str, float]:
    tps = tokens / seconds / world_size
    tflops = tps * flops_per_token / 1e12
    out = {"tokens_per_s_per_gpu": tps, "model_tflops_per_gpu": tflops}
    if peak is not None:
        out["mfu"] = tflops / peak
    return out


def router_health(
    counts_E: torch.Tensor, lb_score: float, ep: int, bias_E: torch.Tensor | None
) -> dict[str, Any]:
    """One layer's routing over a step: the balancing score and the load it really produced."""
    counts = counts_E.double()
    mean = counts.mean().clamp_min(1e-12)
    rank_load = counts.view(ep, -1).sum(1)
    out = {
        "lb_score": float(lb_score),
        "load_max_share": float(counts.max() / counts.sum().clamp_min(1e-12)),
        "load_imbalance": float(counts.max() / mean),  # max / mean tokens per expert
        "ep_rank_imbalance": float(rank_load.max() / rank_load.mean().clamp_min(1e-12)),
        "experts_unused": float((counts == 0).sum()),
        "load_share": [round(float(x), 5) for x in counts / counts.sum().clamp_min(1e-12)],
    }
    if bias_E is not None:
        out["bias_abs_mean"] = float(bias_E.abs().mean())
        out["bias_abs_max"] = float(bias_E.abs().max())
    return out


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """One JSON object per step (or per checkpoint: ``CHECKPOINT_LOG``). On resume, lines of
    steps at or after ``resume_step`` (written before a crash, to be redone) are dropped so the
    file stays one line per step; so is a last line that a crash (or a full disk) cut short: it
    belongs to a step being redone."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        kept: list[str] = []
        if resume_step > 0 and path.is_file():
            lines = path.read_text(errors="replace").splitlines()
            for i, line in enumerate(lines):
                try:
                    record = json.loads(line) if line.strip() else None
                except ValueError:
                    record = None
                if isinstance(record, dict):
                    if record.get("step", -1) < resume_step:
                        kept.append(line)
                elif line.strip() and i < len(lines) - 1:
                    raise RunFileError(
                        f"{path} line {i + 1} is not a JSON object ({line[:40]!r}), and only a "
                        "last line cut short by a crash is dropped on resume: repair or remove "
                        "that line (or move the file aside to start a new log) and resume."
                    )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(line + "\n" for line in kept))
        self.file = path.open("a")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.file.write(json.dumps({"step": step, **metrics}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def first_logged(path: Path) -> dict[str, Any] | None:
    """The first step a ``metrics.jsonl`` holds (the run's first, kept across resumes), or
    None without one."""
    try:
        with path.open() as f:
            record = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "loss" in record else None


class ConsoleSink:
    """A line every ``every`` steps (and for every skipped or spiking step)."""

    def __init__(self, console: Console, every: int) -> None:
        self.console, self.every = console, every

    def log(self, step: int, m: dict[str, Any]) -> None:
        flagged = m.get("skipped") or m.get("spike")
        if step % self.every and not flagged and "eval_loss" not in m and "downstream" not in m:
            return
        parts = [f"step {step:>6}", f"loss {m['loss']:.4f}"]
        if "mtp_loss" in m:
            parts.append(f"mtp {m['mtp_loss']:.4f}")
        if "eval_loss" in m:
            parts.append(f"eval {m['eval_loss']:.4f}")
        parts += [f"grad {m['grad_norm']:.3f}", f"lr {m['lr']:.2e}"]
        parts.append(f"{m['tokens_per_s_per_gpu']:,.0f} tok/s/gpu")
        parts.append(f"{m['model_tflops_per_gpu']:.1f} TFLOP/s/gpu")
        if "mfu" in m:
            parts.append(f"MFU {m['mfu']:.1%}")
        for task, acc in (m.get("downstream") or {}).items():
            parts.append(f"{task} {acc['acc']:.3f}")
        if "router" in m:
            worst = max(layer["load_imbalance"] for layer in m["router"].values())
            parts.append(f"max load/mean {worst:.2f}")
        if m.get("skipped"):
            parts.append("[red]SKIPPED (non-finite)[/]")
        if m.get("spike"):
            parts.append("[yellow]loss spike[/]")
        self.console.print("  ".join(parts), soft_wrap=True)

    def close(self) -> None:
        pass
