"""The all-to-all expert-parallel dispatcher computes what the local dispatcher computes."""

from __future__ import annotations

import json

import pytest
from helpers import TESTS, explain, needs_gpus, torchrun


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reference", "interpret"])
def test_all_to_all_dispatcher_equals_local_dispatcher(mode, tmp_path, monkeypatch):
    """2 ranks (gloo): outputs and the gradients of tokens, routing weights and expert weights
    equal LocalDispatcher with all experts; every edge case of the exchange (a rank sending
    nothing to itself, a rank receiving nothing, a rank without tokens, repeated experts) is
    covered, and the backward is bitwise repeatable. ``reference``: the CPU path in fp64;
    ``interpret``: the Triton kernels the GPU runs (exact-size buffers with no zero-fill pass
    among them), in Triton's interpreter."""
    if mode == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # read by triton when the child imports it
    out = tmp_path / "dispatch.json"
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "dispatch", str(out), mode])
    assert result.returncode == 0, explain(result)
    ranks = json.loads(out.read_text())
    cases = {c["case"] for c in ranks[0]}
    assert cases == {
        "distinct",
        "repeats",
        "rank0-sends-all-away",
        "rank1-receives-nothing",
        "one-rank-without-tokens",
    }
    by_case = [{c["case"]: c for c in r} for r in ranks]
    # The cases are what they say: rank 1's experts get no gradient when it receives nothing;
    # every other case moves both ranks' experts.
    assert by_case[1]["rank1-receives-nothing"]["expert_grad_abs_sum"] == [0.0, 0.0]
    assert by_case[1]["one-rank-without-tokens"]["tokens"] == 0
    assert all(s > 0 for s in by_case[0]["rank0-sends-all-away"]["expert_grad_abs_sum"])
    assert all(s > 0 for s in by_case[1]["distinct"]["expert_grad_abs_sum"])


@pytest.mark.gpu
@needs_gpus(2)
def test_all_to_all_dispatcher_reads_the_host_once_per_forward_and_never_in_backward(tmp_path):
    out = tmp_path / "syncs.json"
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "dispatch-syncs", str(out)])
    assert result.returncode == 0, explain(result)
    for counts in json.loads(out.read_text()):
        assert counts == {"forward": 1, "backward": 0, "finite": True}, counts
