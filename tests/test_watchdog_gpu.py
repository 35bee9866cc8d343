"""Several ranks on one GPU over gloo (``parallel.backend=gloo``): the GPU kernels meet a real
multi-rank token dispatch, and the hang watchdog names a stalled rank, before machines with
several GPUs are lent (NCCL and symmetric memory refuse two ranks on one GPU; gloo's collectives
take CUDA tensors)."""

from __future__ import annotations

import pytest
from helpers import BASE, assert_trains_like, explain, torchrun

from moe_core.compose import compose_run
from moe_core.train.trainer import Trainer
from moe_core.train.watchdog import HANG_EXIT, LATEST, hangs_dir

pytestmark = pytest.mark.gpu

GPU = [*BASE, "parallel.compile=false"]  # fp32 (tiny's), eager: the parity contract's tolerance


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    out = tmp_path_factory.mktemp("one-gpu")
    Trainer(compose_run([*GPU, f"out_dir={out}"])).fit(show_progress=False)
    return out


def test_ep2_all_to_all_on_one_gpu_trains_the_one_rank_model(one_gpu, tmp_path):
    args = ["-m", "moe_core.cli", "train", *GPU, "parallel.ep=2", "parallel.backend=gloo"]
    result = torchrun(2, [*args, f"out_dir={tmp_path}"], timeout=600)
    assert result.returncode == 0, explain(result)
    assert_trains_like(one_gpu, tmp_path, steps=5)


def test_a_stalled_rank_on_one_gpu_is_named_and_the_relaunch_finishes(
    one_gpu, tmp_path, monkeypatch
):
    marker = tmp_path / "stalled-once"
    monkeypatch.setenv("MOE_TEST_STALL", f"1:3:120:{marker}")
    out = tmp_path / "run"
    watch = ["train.hang_factor=10", "train.hang_min_s=8", "train.checkpoint_every=2"]
    args = ["-m", "moe_core.cli", "train", *GPU, "parallel.ep=2", "parallel.backend=gloo"]
    args += [*watch, f"out_dir={out}"]
    hung = torchrun(2, args, timeout=600)
    assert hung.returncode != 0 and f"exitcode  : {HANG_EXIT}" in hung.stderr, explain(hung)
    assert "rank 1 fell behind" in (hangs_dir(out) / LATEST).read_text()
    result = torchrun(2, args, timeout=600)
    assert result.returncode == 0, explain(result)
    assert_trains_like(one_gpu, out, steps=5)
