"""The expert-parallel dispatchers compute what the local dispatcher computes: all-to-all
against the local path, rowwise (symmetric memory) against all-to-all."""

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
    # The rows each rank counts (for the trainer's ep_rows_per_token) are the rows its routing
    # sends to the other rank, and its tokens; nothing while router statistics are paused.
    for r in ranks:
        for c in r:
            assert c["counted"] == c["sent"] and c["counted_paused"] == [0, 0], c
    assert by_case[0]["rank0-sends-all-away"]["counted"][0] == 2 * 10  # every token leaves
    # rank 1 receiving nothing: rank 0's tokens stay home, all of rank 1's leave
    assert [r["rank1-receives-nothing"]["counted"][0] for r in by_case] == [0, 2 * 12]


@pytest.mark.slow
def test_fp8_rows_travel_as_bytes_and_the_experts_see_them_quantized(tmp_path):
    """precision.fp8_parts 'dispatch' (2 ranks, gloo): every case's outputs and gradients equal
    the local dispatcher's on token rows quantized once by moe_kernels.fp8's rules (the gradient
    passes the quantization straight through) and differ from the unquantized run's; the token
    rows go out as one byte per value plus one fp32 scale per row, the combine in fp32. With
    FP8 experts as well (``precision=fp8``'s parts) the same, the receiver's experts quantizing
    the rows it received into their slots (``Experts.routed``), and the outputs those of the
    unquantized trip: the experts quantize the rows by the same rules."""
    out = tmp_path / "dispatch-fp8.json"
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "dispatch-fp8", str(out)])
    assert result.returncode == 0, explain(result)
    for rank in json.loads(out.read_text()):
        assert rank["wired"]  # moe train's layers with the option send FP8 rows
        cases, sends = rank["cases"], rank["sends"]
        assert len(cases) == 5 and all(c["differs"] for c in cases if c["tokens"] > 0)
        # token rows: 16 (DISPATCH_D) bytes each, once per forward (cases run three times: the
        # third with router statistics paused)
        rows = [i for i, (dtype, _) in enumerate(sends) if dtype == "uint8"]
        assert len(rows) == 3 * len(cases) and all(sends[i][1][1:] == [16] for i in rows)
        for i in rows:  # each followed by its fp32 scales, one per row
            assert sends[i + 1] == ["float32", sends[i][1][:1]], sends[i : i + 2]
        # the combine's rows and the gradients: fp32, never bytes
        assert any(dtype == "float32" and shape[1:] == [16] for dtype, shape in sends)
        # FP8 experts quantize the rows by the same rules: the trip in FP8 changes no output
        experts = rank["with_experts"]
        assert len(experts) == 5 and not any(c["differs"] for c in experts)
        assert rank["receiver_routed_calls"] == 3 * len(experts)


@pytest.mark.gpu
def test_fp8_rows_over_nccl_on_one_gpu(tmp_path):
    """The GPU path of FP8 rows (the Triton quantizer, a uint8 all-to-all over NCCL, one rank):
    the local dispatcher's outputs and gradients on rows quantized once, to bf16's summation
    noise, and not the unquantized output."""
    out = tmp_path / "fp8-cuda.json"
    result = torchrun(1, [str(TESTS / "dist_jobs.py"), "dispatch-fp8-cuda", str(out)])
    assert result.returncode == 0, explain(result)
    errors = json.loads(out.read_text())
    unquantized = errors.pop("y_vs_unquantized")
    assert all(e < 1e-2 for e in errors.values()), errors
    assert unquantized > 1e-2, unquantized


@pytest.mark.gpu
@needs_gpus(2)
def test_all_to_all_dispatcher_reads_the_host_once_per_forward_and_never_in_backward(tmp_path):
    out = tmp_path / "syncs.json"
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "dispatch-syncs", str(out)])
    assert result.returncode == 0, explain(result)
    for counts in json.loads(out.read_text()):
        assert counts == {"forward": 1, "backward": 0, "finite": True}, counts


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, mode",
    [
        (2, "reference"),
        # the moves' kernels have their own interpreter tests (tests/test_kernels_rowwise.py)
        pytest.param(2, "interpret", marks=pytest.mark.extended),
        pytest.param(8, "reference", marks=pytest.mark.extended),
    ],
    ids=["ep2", "ep2-interpret", "ep8"],  # the code is the same for every size: 2 and 8 bracket 4
)
def test_rowwise_dispatcher_equals_all_to_all_and_counts_every_dropped_row(
    nproc, mode, tmp_path, monkeypatch
):
    """EP = 2 and 8 processes (gloo) with a shared-memory symmetric heap: the rowwise
    dispatcher (routing metadata exchanged through the heap, rows written into the owners'
    buffers, results read back) gives the all-to-all dispatcher's outputs and gradients of
    tokens, routing weights and expert weights, incl. a rank receiving nothing and a rank with
    no tokens, bit-repeatably, also with FP8 token rows (the scales in the routing rows) and
    FP8 experts; a buffer with room for 2 rows counts exactly the rows past it."""
    if mode == "interpret":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "rowwise.json"
    result = torchrun(nproc, [str(TESTS / "dist_jobs.py"), "rowwise", str(out), mode])
    assert result.returncode == 0, explain(result)
    ranks = json.loads(out.read_text())
    assert len(ranks) == nproc
    by_case = [{c["case"]: c for c in r["cases"]} for r in ranks]
    assert set(by_case[0]) == {"distinct", "repeats", "all-to-rank-0", "rank-1-without-tokens"}
    assert by_case[1]["rank-1-without-tokens"]["tokens"] == 0
    # every token wants rank 0's experts: no other rank's experts move
    assert all(s > 0 for s in by_case[0]["all-to-rank-0"]["expert_grad_abs_sum"])
    for r in range(1, nproc):
        assert by_case[r]["all-to-rank-0"]["expert_grad_abs_sum"] == [0.0, 0.0]
    fp8 = [{c["case"]: c for c in r["fp8_cases"]} for r in ranks]
    assert set(fp8[0]) == set(by_case[0])
    assert all(s > 0 for s in fp8[0]["all-to-rank-0"]["expert_grad_abs_sum"])
    received = ranks[0]["overflow"]["rows_per_owner"]
    dropped = sum(r["overflow"]["dropped"] for r in ranks)
    assert dropped == sum(max(0, n - 2) for n in received) > 0


@pytest.mark.gpu
@needs_gpus(2)
def test_rowwise_dispatcher_over_nvlink_equals_all_to_all(tmp_path):
    """2 GPUs (NCCL, torch's symmetric memory, bf16): the rowwise dispatcher's outputs and
    gradients equal the all-to-all dispatcher's within bf16 noise, also with FP8 token rows;
    overflow is counted."""
    out = tmp_path / "rowwise.json"
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "rowwise", str(out), "cuda"])
    assert result.returncode == 0, explain(result)
    ranks = json.loads(out.read_text())
    assert all(len(r["fp8_cases"]) == len(r["cases"]) == 4 for r in ranks)  # FP8 rows too
    received = ranks[0]["overflow"]["rows_per_owner"]
    assert sum(r["overflow"]["dropped"] for r in ranks) == sum(max(0, n - 2) for n in received)
