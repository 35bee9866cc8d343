"""The init stage: a step-0 checkpoint equal to a fresh model, written without holding it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import BASE

from moe_core.compose import compose_run
from moe_core.model import build_model
from moe_core.train.checkpoint import verify
from moe_core.train.init import write_initial_checkpoint
from moe_core.train.trainer import Trainer


@pytest.mark.slow
def test_initial_checkpoint_is_the_fresh_model_and_trains_identically(tmp_path):
    run = compose_run([*BASE, "train.steps=3", f"out_dir={tmp_path / 'a'}"])
    path = write_initial_checkpoint(run, tmp_path / "a" / "checkpoints")
    assert verify(path) is None
    resumed = Trainer(run)
    assert resumed.resumed_from == path and resumed.step == 0
    fresh = build_model(run.model, seed=run.train.seed).state_dict()
    assert all(torch.equal(fresh[k], v) for k, v in resumed.chunks[0].state_dict().items())
    from_init = [m.loss for m in resumed.fit(show_progress=False)]
    scratch = Trainer(compose_run([*BASE, "train.steps=3", f"out_dir={tmp_path / 'b'}"]))
    assert from_init == [m.loss for m in scratch.fit(show_progress=False)]


@pytest.mark.slow
def test_initial_checkpoint_never_holds_the_model_in_memory(tmp_path):
    """A 1.6 GB (fp32) model is written by a process whose peak memory stays far below it."""
    code = f"""
import resource
from moe_core.compose import compose_run
from moe_core.model.flops import count
from moe_core.train.init import write_initial_checkpoint
run = compose_run(["model.d_model=512", "model.n_layers=4", "model.n_experts=64",
                   "model.expert_hidden=1024", "out_dir={tmp_path}"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
write_initial_checkpoint(run, "{tmp_path}/checkpoints")
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(count(run.model).total_params * 4, before * 1024, peak * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    model_bytes, before, peak = map(int, out.stdout.split())
    assert model_bytes > 1.5e9
    assert peak - before < 0.15 * model_bytes, f"grew {(peak - before) / 2**20:.0f} MiB"


def test_on_meta_builds_without_filling_and_restores_the_initializers():
    from moe_core.model.meta import FILLS, on_meta

    before = {name: getattr(torch.nn.init, name) for name in FILLS}
    with on_meta():
        layer = torch.nn.Linear(3, 4)
        assert torch.nn.init.normal_(layer.weight) is layer.weight  # a no-op inside
    assert layer.weight.is_meta and layer.bias.is_meta
    assert {name: getattr(torch.nn.init, name) for name in FILLS} == before
    with pytest.raises(RuntimeError, match="inside"), on_meta():
        raise RuntimeError("inside")
    assert {name: getattr(torch.nn.init, name) for name in FILLS} == before
    real = torch.empty(3)
    torch.nn.init.ones_(real)
    assert torch.equal(real, torch.ones(3))
