"""Jobs the distributed tests launch under torchrun (one process per rank, gloo)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from kernels.permute import expert_counts
from moe_core.compose import compose_run
from moe_core.model.moe import Experts, LocalDispatcher, Routing, TokenDispatcher
from moe_core.parallel.dispatch import AllToAllDispatcher
from moe_core.train.trainer import Trainer


def optimizer_state(out: str, overrides: list[str]) -> None:
    """Train; rank 0 saves the losses, the gathered optimizer state and per-rank state sizes."""
    trainer = Trainer(compose_run(overrides))
    losses = [trainer.train_step().loss for _ in range(trainer.cfg.train.steps)]
    opt = trainer.optimizer
    expected = sum(3 * b.shard_numel for b in opt.buckets)
    sizes = {
        "state_numel": opt.state_numel(),
        "expected": expected,
        "bucket_groups": [(b.is_expert, b.size, b.numel) for b in opt.buckets],
    }
    all_sizes = [sizes]
    if dist.is_initialized():
        all_sizes = [None] * dist.get_world_size()
        dist.all_gather_object(all_sizes, sizes)
    full = opt.full_state()
    if trainer.is_main:
        record = {"full": full, "sizes": all_sizes, "step": opt.step_count, "losses": losses}
        torch.save(record, out)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def evaluate(out: str, overrides: list[str]) -> None:
    """Build (and resume) a trainer; rank 0 saves its step and held-out loss as JSON."""
    trainer = Trainer(compose_run(overrides))
    loss = trainer.evaluate()
    if trainer.is_main:
        Path(out).write_text(json.dumps({"step": trainer.step, "eval_loss": loss}))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# The dispatcher job: 2 ranks, 8 experts (4 per rank), top-3, small rows.
DISPATCH_E, DISPATCH_K, DISPATCH_D, DISPATCH_F = 8, 3, 16, 12


def dispatch_routing(case: str, rank: int, n_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """experts_TK for one rank: edge cases of who sends what where."""
    E, K = DISPATCH_E, DISPATCH_K
    half = E // 2
    if case == "distinct":
        rows = [torch.randperm(E, generator=gen)[:K] for _ in range(n_tokens)]
        return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    if case == "repeats":  # a token may pick one expert twice
        return torch.randint(0, E, (n_tokens, K), generator=gen)
    if case == "rank0-sends-all-away":  # rank 0 keeps nothing for itself; rank 1 mixed
        if rank == 0:
            return half + torch.randint(0, half, (n_tokens, K), generator=gen)
        return torch.randint(0, E, (n_tokens, K), generator=gen)
    if case == "rank1-receives-nothing":  # every token on both ranks wants rank 0's experts
        return torch.randint(0, half, (n_tokens, K), generator=gen)
    raise ValueError(case)


DISPATCH_CASES = [
    ("distinct", (13, 9)),
    ("repeats", (11, 11)),
    ("rank0-sends-all-away", (10, 7)),
    ("rank1-receives-nothing", (6, 12)),
    ("one-rank-without-tokens", (12, 0)),
]


def dispatch_grads(
    dispatch: TokenDispatcher,
    experts: Experts,
    x_TD: torch.Tensor,
    w_TK: torch.Tensor,
    experts_TK: torch.Tensor,
    dy_TD: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """(y, dx, dweights, dw_gate_up, dw_down) of one dispatch, backward from ``dy_TD``."""
    x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
    routing = Routing(experts_TK, w, expert_counts(experts_TK, DISPATCH_E), torch.zeros(()))
    y = dispatch(x, routing, experts)
    leaves = (x, w, experts.w_gate_up, experts.w_down)
    grads = torch.autograd.grad(y, leaves, dy_TD, allow_unused=True, materialize_grads=True)
    return (y.detach(), *grads)


def dispatch_parity(out: str, args: list[str]) -> None:
    """AllToAllDispatcher (EP=2) vs LocalDispatcher with all experts, on the same routing:
    outputs and gradients of the tokens, the routing weights and the expert weights (summed
    over both ranks' tokens); the backward bitwise repeatable. ``reference`` mode: the CPU
    training path (PyTorch references), fp64, to 1e-12; ``interpret``: the GPU path's Triton
    kernels in Triton's interpreter (fp32 sums), fp32, to 1e-5. Rank 0 writes the cases."""
    mode = args[0]
    dist.init_process_group("gloo")
    if mode == "interpret":
        from kernels._triton import interpret_on_cpu

        with interpret_on_cpu():
            checked = _dispatch_cases(torch.float32, 1e-5, triton=True)
    else:
        assert mode == "reference", mode
        checked = _dispatch_cases(torch.float64, 1e-12, triton=False)
    everyone = [None, None]
    dist.all_gather_object(everyone, checked)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def _dispatch_cases(dt: torch.dtype, tol: float, triton: bool) -> list[dict]:
    from kernels._triton import use_triton

    rank = dist.get_rank()
    assert dist.get_world_size() == 2
    E, K, D, F = DISPATCH_E, DISPATCH_K, DISPATCH_D, DISPATCH_F
    El = E // 2
    torch.manual_seed(0)  # the same full experts on both ranks
    full = Experts(E, D, F).to(dt)
    with torch.no_grad():
        full.w_gate_up.normal_(0.0, 0.3)
        full.w_down.normal_(0.0, 0.3)
    mine = Experts(El, D, F).to(dt)
    with torch.no_grad():
        mine.w_gate_up.copy_(full.w_gate_up[rank * El : (rank + 1) * El])
        mine.w_down.copy_(full.w_down[rank * El : (rank + 1) * El])
    mine.expert_offset = rank * El
    dispatcher = AllToAllDispatcher(dist.group.WORLD, 2, El)
    checked = []
    for i, (case, sizes) in enumerate(DISPATCH_CASES):
        gen = torch.Generator().manual_seed(100 * i + rank)
        T = sizes[rank]
        base = "distinct" if case == "one-rank-without-tokens" else case
        experts_TK = dispatch_routing(base, rank, T, gen)
        x_TD = torch.randn(T, D, generator=gen, dtype=dt)
        w_TK = 0.1 + torch.rand(T, K, generator=gen, dtype=dt)  # full fp64 mantissas
        dy_TD = torch.randn(T, D, generator=gen, dtype=dt)
        assert T == 0 or use_triton(x_TD) == triton, "the kernels under test must run"

        inputs = (x_TD, w_TK, experts_TK, dy_TD)
        ref = list(dispatch_grads(LocalDispatcher(), full, *inputs))
        for g in ref[3:]:  # expert weights see both ranks' tokens
            dist.all_reduce(g)
        ref[3] = ref[3][rank * El : (rank + 1) * El]
        ref[4] = ref[4][rank * El : (rank + 1) * El]
        got = dispatch_grads(dispatcher, mine, *inputs)
        names = ("y", "dx", "dweights", "dw_gate_up", "dw_down")
        for name, a, b in zip(names, got, ref, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, (case, name, a.shape, b.shape)
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{case} {name}")
        again = dispatch_grads(dispatcher, mine, *inputs)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), case
        moved = [float(g.abs().sum()) for g in got[3:]]
        checked.append({"case": case, "tokens": T, "expert_grad_abs_sum": moved})
    return checked


def dispatch_host_syncs(out: str, args: list[str]) -> None:
    """On 2 GPUs (NCCL, bf16): the dispatcher's forward synchronizes with the host exactly once
    (the split sizes), its backward never. Rank 0 writes the counts."""
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    E, K, D, F, T = 64, 8, 2048, 1024, 4096
    El = E // 2
    gen = torch.Generator(device="cuda").manual_seed(rank)
    experts = Experts(El, D, F).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.w_gate_up.normal_(0.0, 0.02)
        experts.w_down.normal_(0.0, 0.02)
    experts.expert_offset = rank * El
    dispatcher = AllToAllDispatcher(dist.group.WORLD, 2, El)
    logits_TE = torch.randn(T, E, device="cuda", generator=gen)
    w_TK, experts_TK = torch.topk(torch.softmax(logits_TE, -1), K, dim=-1)
    x_TD = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
        routing = Routing(experts_TK, w, expert_counts(experts_TK, E), torch.zeros(()))
        return dispatcher(x, routing, experts), x

    y, x = forward()  # warm-up: communicators, kernels and library handles created here
    y.float().square().mean().backward()
    torch.cuda.synchronize()
    counts = {}
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            y, x = forward()
        counts["forward"] = sum("synchroniz" in str(w.message) for w in seen)
        loss = y.float().square().mean()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loss.backward()
        counts["backward"] = sum("synchroniz" in str(w.message) for w in seen)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    counts["finite"] = bool(torch.isfinite(x.grad).all())
    everyone = [None, None]
    dist.all_gather_object(everyone, counts)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    job = {
        "optimizer": optimizer_state,
        "eval": evaluate,
        "dispatch": dispatch_parity,
        "dispatch-syncs": dispatch_host_syncs,
    }[sys.argv[1]]
    job(sys.argv[2], sys.argv[3:])
