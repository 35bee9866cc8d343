"""The GPU benchmarks on a machine without one: every script imports (no stale path into the
library or the baselines), and the benchmarked OLMoE shape comes from the config classes."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from moe_core.compose import compose_run

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py") if p.stem != "__init__")


@pytest.fixture
def scripts(monkeypatch):
    """The scripts importable as they import each other (``from timing import ...``); the
    modules are dropped afterwards so their generic names leak into no other test."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    before = set(sys.modules)
    yield lambda name: importlib.import_module(name)
    for name in set(sys.modules) - before:
        if name in SCRIPTS:
            del sys.modules[name]


def test_every_benchmark_imports_and_takes_the_olmoe_shape_from_the_config(scripts):
    for name in SCRIPTS:
        scripts(name)
    train_step = scripts("train_step")
    args = train_step.parser().parse_args([])
    olmoe = compose_run(["model=olmoe-1b-7b"]).model
    assert train_step.model_config(args) == olmoe
    assert (args.layers, args.seq) == (olmoe.n_layers, olmoe.max_seq_len)
    assert olmoe == scripts("moe_layer_ep").CFG
    assert list(scripts("grouped_gemm").libraries("triton")) == ["triton"]  # imported lazily
    ep = scripts("ep_dispatch")
    assert (olmoe.d_model, olmoe.n_experts, olmoe.top_k) == (ep.D, ep.E, ep.K)
