"""Every parallel layout trains the same model as one process (CPU, gloo, under torchrun).

Tolerance. Layouts change fp32 summation order (all-reduce vs. local accumulation, GEMM
shapes under expert parallelism, norm partial sums), so gradients agree to ~1e-7 relative.
Adam divides by sqrt(v) + eps, which turns rounding noise in gradients of order eps into
update differences of order lr; with the default eps=1e-8 a handful of embedding entries whose
gradient is ~1e-8 differ by up to lr. The parity runs therefore use eps=1e-6 (a setting used
in practice), where the observed difference after 5 steps is ~1e-5 per weight against ~1e-2
of movement. We assert losses within 1e-5 per step, every weight within 1e-4, and every
tensor's update within 5e-4 relative: a real bug (a lost micro-batch, a wrong scale, a wrong
shard) moves these by orders of magnitude more.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import BASE, TESTS, assert_trains_like, explain, needs_gpus, torchrun

from moe_core.compose import compose_run
from moe_core.config import ConfigError
from moe_core.model import build_model
from moe_core.parallel.mesh import check_world_size
from moe_core.parallel.placement import RoutingRule, reach
from moe_core.train.trainer import Trainer

LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    "dp2": (2, ["parallel.dp=2"]),
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-interleaved": (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    ),
    "ep2-rowwise": (2, ["parallel.ep=2", "parallel.dispatcher=nvshmem_rowwise"]),
    "dp2-ep2": (4, ["parallel.dp=2", "parallel.ep=2"]),
    "pp2-ep2": (4, ["parallel.pp=2", "parallel.ep=2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    Trainer(compose_run([*BASE, f"out_dir={out}"])).fit(show_progress=False)
    return out


# pp2-ep2 (4 ranks) runs with rank 1 slowed by a sleep on its way to each step's first
# collective: it still trains the same model, and rank 0 names it as a straggler
# (moe_core.train.stragglers), once
SLOWED = {"pp2-ep2": ["train.log_every=1", "train.straggler_share=0.1"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_single_process(layout, reference, tmp_path, request, monkeypatch):
    nproc, overrides = LAYOUTS[layout]
    out = tmp_path / layout
    if layout == "dp2-ep2":  # the session's run of this layout (also the two-node reference)
        out = request.getfixturevalue("dp2_ep2_run")
    else:
        if layout in SLOWED:
            monkeypatch.setenv("MOE_TEST_SLOW", "1:0.5")
            overrides = [*overrides, *SLOWED[layout]]
        command = ["-m", "moe_core.cli", "train", *BASE, *overrides, f"out_dir={out}"]
        result = torchrun(nproc, command)
        assert result.returncode == 0, explain(result)
        if layout in SLOWED:
            assert_names_the_slowed_rank(out, result.stdout)
    assert_trains_like(reference, out, steps=5)


def assert_names_the_slowed_rank(out: Path, stdout: str) -> None:
    """Rank 1, the slowed one, is named in one warning line and in metrics.jsonl (reports from
    step 1 on, each over the step before it; named at the third report in a row); rank 0 never
    is."""
    said = [x for x in stdout.splitlines() if "straggler" in x]
    assert len(said) == 1 and said[0].startswith("warning: rank 1 is a straggler: its own work "), (
        stdout[-3000:]
    )
    assert "data-bound" not in said[0] and "rank 0" not in said[0]
    reports = [json.loads(x).get("ranks") for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert reports[0] is None and all(r["slowest"] == 1 for r in reports[1:]), reports
    assert [r["stragglers"] for r in reports[1:]] == [0, 0, 1, 1], reports
    assert reports[-1]["straggler_ranks"] == [1] and reports[-1]["work_s_max"] > 0.5


# tiny's 8 experts in 4 groups of 2, a token's top-3 among its best 2 groups: at EP=4 each rank
# holds one group, so a token's rows reach 2 ranks (top-3 alone would reach 3)
GROUPED = ["model.top_k=3", "model.n_expert_groups=4", "model.top_k_groups=2"]


@pytest.mark.slow
@pytest.mark.extended  # tests/test_placement.py holds the bounds; this is their 4-rank run
def test_group_limited_routing_at_ep4_matches_single_process(tmp_path):
    """Group-limited routing over 4 expert-parallel ranks (gloo) trains what one process
    trains, and the rows per token it logs (the all-to-all's split sizes) stay within the
    placement's bound: each token reaches exactly its 2 groups' ranks, so it sends 1 or 2
    rows to other ranks, 2 - 1/4 expected where routing is uniform."""
    reference = tmp_path / "one"
    Trainer(compose_run([*BASE, *GROUPED, f"out_dir={reference}"])).fit(show_progress=False)
    out = tmp_path / "ep4"
    command = ["-m", "moe_core.cli", "train", *BASE, *GROUPED, "parallel.ep=4", f"out_dir={out}"]
    result = torchrun(4, command)
    assert result.returncode == 0, explain(result)
    assert_trains_like(reference, out, steps=5)
    bound = reach(RoutingRule(8, 3, 4, 2), 4, 4)
    assert (bound.max_ranks, reach(RoutingRule(8, 3), 4, 4).max_ranks) == (2, 3)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [x["ep_rows_per_token"] for x in lines]
    assert len(rows) == 5 and all(1.0 <= r <= bound.max_ranks for r in rows), rows
    assert all(1.0 < r < 2.0 for r in rows), rows  # some tokens keep their own rank's group
    assert "ep_rows_per_token" not in json.loads(
        (reference / "metrics.jsonl").read_text().splitlines()[0]
    )


@pytest.mark.slow
def test_sharded_optimizer_state_is_one_nth_and_gathers_to_the_unsharded_state(tmp_path):
    overrides = [*BASE, "train.steps=2", "parallel.dp=2", "parallel.ep=2", f"out_dir={tmp_path}"]
    out = tmp_path / "state.pt"
    result = torchrun(4, [str(TESTS / "dist_jobs.py"), "optimizer", str(out), *overrides])
    assert result.returncode == 0, explain(result)
    saved = torch.load(out, weights_only=False)

    single = Trainer(compose_run([*BASE, "train.steps=2", f"out_dir={tmp_path / 'single'}"]))
    for _ in range(2):
        single.train_step()
    full_single = single.optimizer.full_state()
    unsharded_numel = single.optimizer.state_numel()
    for rank_sizes in saved["sizes"]:
        assert rank_sizes["state_numel"] == rank_sizes["expected"]
        for is_expert, size, _ in rank_sizes["bucket_groups"]:
            assert size == (2 if is_expert else 4)  # experts over dp, dense over dp x ep
    # Dense state is split 4 ways; each rank's experts (half of them) 2 ways.
    n_expert = sum(v["param"].numel() for k, v in full_single.items() if ".experts." in k)
    n_dense = sum(v["param"].numel() for k, v in full_single.items() if ".experts." not in k)
    assert unsharded_numel == 3 * (n_dense + n_expert)
    per_rank = saved["sizes"][0]["state_numel"]
    assert abs(per_rank - 3 * (n_dense / 4 + n_expert / 2 / 2)) <= 3 * 8 * len(
        saved["sizes"][0]["bucket_groups"]
    )

    assert saved["step"] == single.optimizer.step_count == 2
    assert set(saved["full"]) == set(full_single)
    for name, ref in full_single.items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            got = saved["full"][name][key]
            assert got.shape == ref[key].shape, (name, key)
            torch.testing.assert_close(got, ref[key], rtol=1e-3, atol=1e-5, msg=f"{name} {key}")


@pytest.mark.gpu
@needs_gpus(2)
def test_nccl_bf16_ep2_and_dp2_match_one_gpu(tmp_path):
    """On 2 GPUs with NCCL, bf16 weights and autocast: EP=2 and DP=2 train what 1 GPU trains.

    bf16 tolerance: activations and GEMM outputs round to bf16 (~0.4 %), and the layouts round
    in different places; Adam's normalized steps then spread that noise into the updates of
    small tensors (a norm's 128 weights). Losses are compared to 0.5 % per step; the 5-step
    update of the fp32 master weights (bf16 model weights are too coarse to compare updates: a
    norm weight near 1 moves in steps of 1/128) to 5 % of its norm over the whole model and
    15 % for any single tensor (5.8 % was seen for the final norm).
    """
    bf16 = [*BASE, "precision=bf16", f"out_dir={tmp_path}"]
    runs = {}
    for name, nproc, extra in (
        ("one-gpu", 1, []),
        ("ep2", 2, ["parallel.ep=2"]),
        ("dp2", 2, ["parallel.dp=2"]),
    ):
        out = tmp_path / f"{name}.pt"
        result = torchrun(
            nproc, [str(TESTS / "dist_jobs.py"), "optimizer", str(out), *bf16, *extra]
        )
        assert result.returncode == 0, explain(result)
        runs[name] = torch.load(out, weights_only=False, map_location="cpu")
    ref = runs["one-gpu"]
    init = {
        k: v.bfloat16().float()
        for k, v in build_model(compose_run(BASE).model, seed=0).state_dict().items()
    }
    for layout in ("ep2", "dp2"):
        got = runs[layout]
        for step, (a, b) in enumerate(zip(ref["losses"], got["losses"], strict=True)):
            assert abs(a - b) < 5e-3 * abs(a), f"{layout} step {step}: loss {b} vs {a}"
        diff_sq = moved_sq = 0.0
        for name, r in ref["full"].items():
            moved = (r["param"] - init[name]).norm()
            diff = (got["full"][name]["param"] - r["param"]).norm()
            diff_sq, moved_sq = diff_sq + diff.item() ** 2, moved_sq + moved.item() ** 2
            assert diff / moved < 0.15, f"{layout} {name}: update differs by {diff / moved:.2e}"
        total = (diff_sq / moved_sq) ** 0.5
        assert total < 0.05, f"{layout}: the whole model's update differs by {total:.2e}"


@pytest.mark.slow
def test_single_process_sharded_adamw_equals_torch_adamw(tmp_path):
    run = compose_run([*BASE, "train.steps=3", "train.grad_clip=0.05", f"out_dir={tmp_path}"])
    trainer = Trainer(run)
    model = build_model(run.model, seed=run.train.seed)
    tc = run.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": tc.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        betas=(tc.beta1, tc.beta2),
        eps=tc.eps,
    )
    from moe_core.model import lm_loss
    from moe_core.train.schedule import lr_multiplier

    for step in range(3):
        batches = trainer.micro_batches()
        metrics = trainer.train_step()
        for g in opt.param_groups:
            g["lr"] = tc.lr * lr_multiplier(step, tc)
        for tokens in batches:
            logits, aux = model(tokens[:, :-1])
            ((lm_loss(logits, tokens[:, 1:]) + aux) / len(batches)).backward()
        exact = torch.cat([p.grad.double().flatten() for p in model.parameters()]).norm().item()
        assert abs(metrics.grad_norm - exact) < 1e-6 * exact, (metrics.grad_norm, exact)
        assert exact > tc.grad_clip, "the test should exercise clipping"
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad()
    ours = trainer.chunks[0].state_dict()
    for name, p in model.state_dict().items():
        torch.testing.assert_close(ours[name], p, rtol=1e-5, atol=2e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["parallel.ep=3"], "parallel.ep=3 is not allowed: a divisor of model.n_experts (8)"),
        (["parallel.pp=3"], "parallel.pp=3 is not allowed: pp x virtual_stages (3) must divide"),
        (
            ["parallel.dp=3"],
            "train.global_batch_size=16 is not allowed: a multiple of micro_batch_size x dp x ep",
        ),
        (
            ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=1"],
            "parallel.virtual_stages=1 is not allowed: at least 2",
        ),
        (["parallel.pp=0"], "parallel.pp=0 is not allowed: it must be positive"),
        (
            ["parallel.ep=2", "train.micro_batch_size=4", "parallel.ep_capacity_factor=1.5"],
            "parallel.ep_capacity_factor=1.5 is not allowed: null unless parallel.dispatcher=",
        ),
        (
            [
                "parallel.dispatcher=nvshmem_rowwise",
                "parallel.ep=2",
                "train.micro_batch_size=4",
                "parallel.ep_capacity_factor=0.5",
            ],
            "parallel.ep_capacity_factor=0.5 is not allowed: at least 1.0",
        ),
        (
            ["parallel.ep=2", "train.micro_batch_size=4", "parallel.cuda_graph=true"],
            "parallel.cuda_graph=True is not allowed: false or null with parallel.dispatcher="
            "all_to_all, which reads split sizes on the host",
        ),
        (
            ["precision=fp8", "precision.fp8_parts=[experts,payload]"],
            "precision.fp8_parts=['experts', 'payload'] is not allowed: a list of 'experts', "
            "'attention', 'dense', 'lm_head', 'dispatch', each at most once",
        ),
        (
            ["precision=fp8", "precision.fp8_parts=[experts,dispatch]"],
            "precision.fp8_parts=['experts', 'dispatch'] is not allowed: a list without "
            "'dispatch' when parallel.ep=1 (no token rows travel)",
        ),
        (
            ["precision=fp8", "precision.fp8_parts=[attention,attention]"],
            "precision.fp8_parts=['attention', 'attention'] is not allowed: a list naming each "
            "part at most once",
        ),
        (
            ["precision=mxfp8", "precision.fp8_parts=[experts,attention]"],
            "precision.fp8_parts=['experts', 'attention'] is not allowed: ['experts'] with "
            "precision.fp8_scaling='mx' (MX scaling is built for the experts only)",
        ),
        (
            ["precision.fp8_parts=[experts]"],
            "precision.fp8_parts=['experts'] is not allowed: [] unless precision.params=bf16",
        ),
        (
            ["parallel.pp=2", "parallel.cuda_graph=true"],
            "parallel.cuda_graph=True is not allowed: false or null with parallel.pp > 1",
        ),
    ],
)
def test_invalid_layouts_fail_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose_run(overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.slow
def test_wrong_process_count_fails_before_any_process_group():
    layout = [*BASE, "parallel.ep=2", "parallel.dp=2"]
    with pytest.raises(ConfigError, match=r"needs 4 processes, but 2 were launched"):
        check_world_size(compose_run(layout).parallel, 2)
    result = torchrun(2, ["-m", "moe_core.cli", "train", *layout], timeout=120)
    assert result.returncode != 0
    assert "needs 4 processes, but 2 were launched" in result.stdout
    assert "ProcessGroup" not in result.stderr + result.stdout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sum_of_squares_takes_large_and_small_tensors_alike(dtype):
    """The gradient norm's sum: tensors at or over ``LARGE`` elements reduce on their own,
    smaller ones in one multi-tensor pass; both halves (and neither) count every element."""
    from moe_core.parallel.optimizer import LARGE, global_norm, sum_of_squares

    gen = torch.Generator().manual_seed(0)
    large = [torch.randn(LARGE, generator=gen), torch.randn(2, LARGE // 2 + 3, generator=gen)]
    small = [torch.randn(5, 7, generator=gen).bfloat16(), torch.randn(LARGE - 1, generator=gen)]
    # The CPU sums fp32 in order: ~2e-5 lost over a million squares (why the trainer sums in
    # fp64 on the CPU); a dropped tensor would be off by more than 1e-2 here.
    rtol = 1e-4 if dtype == torch.float32 else 1e-12
    for tensors in (large + small, large, small):
        exact = sum(t.double().square().sum() for t in tensors)
        got = sum_of_squares(tensors, dtype)
        assert got.dtype == dtype and got.dim() == 0
        torch.testing.assert_close(got.double(), exact, rtol=rtol, atol=0)
    assert sum_of_squares([], dtype).item() == 0.0
    norm = global_norm(large + small)
    assert norm.dtype == torch.float32
    exact = sum(t.double().square().sum() for t in large + small)
    torch.testing.assert_close(norm.double() ** 2, exact, rtol=1e-4, atol=0)
