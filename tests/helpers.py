"""Small model configs and launch helpers shared by tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from moe_core.config import ModelConfig

TESTS = Path(__file__).parent
BASE = [
    "model=tiny",
    "model.n_layers=4",
    "train.steps=5",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.warmup_steps=1",
    "train.eps=1e-6",
]


def small_config(**overrides) -> ModelConfig:
    base = dict(
        name="test",
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        n_experts=8,
        top_k=2,
        expert_hidden=32,
        max_seq_len=64,
    )
    base.update(overrides)
    return ModelConfig(**base)


def torchrun(nproc: int, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    return subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=timeout)


def explain(result: subprocess.CompletedProcess) -> str:
    """The lines of a failed run worth reading: errors from every rank, then the output's end."""
    keys = ("Error", "error", "what()", "Traceback", "Exception", "Signal")
    lines = [x for x in result.stderr.splitlines() if any(k in x for k in keys)]
    return "\n".join(lines[:40]) + "\n--- stdout ---\n" + result.stdout[-2000:]


def losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
