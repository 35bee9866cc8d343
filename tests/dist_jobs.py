"""Jobs the distributed tests launch under torchrun (one process per rank, gloo)."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from moe_core.compose import compose_run
from moe_core.model.moe import (
    Experts,
    LocalDispatcher,
    Routing,
    TokenDispatcher,
    router_stats_paused,
)
from moe_core.parallel.dispatch import (
    AllToAllDispatcher,
    RowwiseDispatcher,
    RowwiseExchange,
    rank_slots,
)
from moe_core.parallel.symmetric import symmetric_heap
from moe_core.train.trainer import Trainer
from moe_kernels.routing import expert_counts


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


def fp8_cache_parity(out: str, overrides: list[str]) -> None:
    """Train twice under this launch's layout, without then with the FP8 weight caches; rank 0
    writes, for every rank: losses and local weights bit-equal, and whether every cache holds
    its final weight's bytes (``tests/test_fp8_cache.py``)."""
    from moe_kernels.fp8_cache import cache_of, quantize_weight

    runs, mesh, n_cached, caches_hold = [], None, 0, True
    for cached in (False, True):
        cache = f"precision.fp8_weight_cache={str(cached).lower()}"
        cfg = compose_run([*overrides, cache, f"out_dir={out}.{cached}"])
        trainer = Trainer(cfg, mesh=mesh)
        mesh = trainer.mesh
        losses = [trainer.train_step().loss for _ in range(cfg.train.steps)]
        weights = {k: v.clone() for k, v in trainer.chunks[0].state_dict().items()}
        runs.append((losses, weights))
        trainer.release()
        params = [p for p in trainer.chunks[0].parameters() if cache_of(p) is not None]
        n_cached = len(params) if cached else 0
        for p in params:
            ops, want = cache_of(p).current(p), quantize_weight(p)
            holds = ops is not None and all(
                torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in ((ops.rows[0], want.rows[0]), (ops.cols[0], want.cols[0]))
            )
            caches_hold = caches_hold and holds
    (ref_losses, ref_weights), (losses, weights) = runs
    mine = {
        "losses": losses,
        "losses_equal": losses == ref_losses,
        "weights_equal": all(torch.equal(weights[k], ref_weights[k]) for k in ref_weights),
        "cached": n_cached,
        "caches_hold": caches_hold,
        "groups": [(b.is_expert, b.size) for b in trainer.optimizer.buckets],
    }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
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
    n_experts: int = DISPATCH_E,
) -> tuple[torch.Tensor, ...]:
    """(y, dx, dweights, dw_gate_up, dw_down) of one dispatch, backward from ``dy_TD``."""
    x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
    routing = Routing(experts_TK, w, expert_counts(experts_TK, n_experts), torch.zeros(()))
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
        from moe_kernels._triton import interpret_on_cpu

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


def dispatch_fp8_parity(out: str, args: list[str]) -> None:
    """AllToAllDispatcher with FP8 rows (EP=2, gloo, fp32) vs LocalDispatcher with all experts
    on the token rows quantized and dequantized once (``moe_kernels.fp8``'s rowwise rules): the same
    outputs and gradients (the quantization is straight-through), and unlike the unquantized
    run; the token rows travel as bytes with one fp32 scale each, the combine's rows in fp32.
    Rank 0 writes what each rank saw."""
    dist.init_process_group("gloo")
    sends: list[tuple[str, list[int]]] = []
    real = dist.all_to_all_single

    def recording(output, input, *rest, **kw):
        sends.append((str(input.dtype).removeprefix("torch."), list(input.shape)))
        return real(output, input, *rest, **kw)

    dist.all_to_all_single = recording
    checked = _dispatch_cases(torch.float32, 1e-5, triton=False, fp8=True)
    dist.all_to_all_single = real
    # FP8 experts too (precision=fp8's parts): the receiver quantizes the rows it received into
    # their slots (Experts.routed), the calls with every row mapped (the local one's: None)
    from moe_core.model import moe

    routed, ep_calls = moe.fp8_routed_mlp, []

    def counting(*a, **kw):
        ep_calls.append(kw.get("every_row_mapped"))
        return routed(*a, **kw)

    moe.fp8_routed_mlp = counting
    with_experts = _dispatch_cases(torch.float32, 1e-5, triton=False, fp8=True, fp8_experts=True)
    moe.fp8_routed_mlp = routed
    # the run's option reaches every layer's dispatcher (moe_core.parallel.parallelize)
    from moe_core.model.moe import MoE
    from moe_core.parallel.mesh import build_mesh
    from moe_core.parallel.parallelize import parallelize

    fp8_rows = ["precision=fp8", "precision.fp8_parts=[experts,dispatch]"]
    run = compose_run(["model=tiny", *fp8_rows, "parallel.ep=2", "train.global_batch_size=64"])
    chunks = parallelize(run.model, run.parallel, run.precision, build_mesh(run.parallel), 0, 64)
    layers = [m.dispatcher for c in chunks.values() for m in c.modules() if isinstance(m, MoE)]
    wired = all(isinstance(d, AllToAllDispatcher) and d.fp8_rows for d in layers)
    everyone = [None, None]
    mine = {"cases": checked, "sends": sends, "wired": wired, "with_experts": with_experts}
    mine["receiver_routed_calls"] = ep_calls.count(True)
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def dispatch_fp8_cuda(out: str, args: list[str]) -> None:
    """One GPU over NCCL: the all-to-all dispatcher with FP8 rows (one rank: every row to
    itself, through the GPU's quantizer and a uint8 all-to-all) against LocalDispatcher on the
    rows quantized once, bf16; the largest relative error of each output and gradient."""
    from moe_kernels.fp8 import dequantize, quantize_rowwise

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
    E, K, D, F, T = 8, 2, 256, 128, 512
    torch.manual_seed(0)
    experts = Experts(E, D, F).cuda().to(torch.bfloat16)
    with torch.no_grad():
        experts.w_gate_up.normal_(0.0, 0.05)
        experts.w_down.normal_(0.0, 0.05)
    gen = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(T, E, generator=gen, device="cuda")
    w_TK, experts_TK = torch.topk(torch.softmax(logits, -1), K)
    x_TD = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
    dy_TD = torch.randn(T, D, generator=gen, device="cuda").to(torch.bfloat16)
    w_TK = w_TK.to(torch.bfloat16)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, 1, E, fp8_rows=True)
    got = dispatch_grads(dispatcher, experts, x_TD, w_TK, experts_TK, dy_TD, E)
    x_ref = dequantize(*quantize_rowwise(x_TD)).to(torch.bfloat16)
    ref = dispatch_grads(LocalDispatcher(), experts, x_ref, w_TK, experts_TK, dy_TD, E)
    plain = dispatch_grads(LocalDispatcher(), experts, x_TD, w_TK, experts_TK, dy_TD, E)[0]

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.float() - b.float()).norm() / b.float().norm())

    names = ("y", "dx", "dweights", "dw_gate_up", "dw_down")
    errors = {n: rel(a, b) for n, a, b in zip(names, got, ref, strict=True)}
    errors["y_vs_unquantized"] = rel(got[0], plain)
    Path(out).write_text(json.dumps(errors))
    dist.destroy_process_group()


def _dispatch_cases(
    dt: torch.dtype, tol: float, triton: bool, fp8: bool = False, fp8_experts: bool = False
) -> list[dict]:
    from moe_core.model.kernel_choice import Kernels
    from moe_kernels._triton import use_triton
    from moe_kernels.fp8 import dequantize, quantize_rowwise_reference

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
    full.kernels = mine.kernels = Kernels(fp8_experts=fp8_experts)
    dispatcher = AllToAllDispatcher(dist.group.WORLD, 2, El, fp8_rows=fp8)
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
        x_ref = dequantize(*quantize_rowwise_reference(x_TD)).to(dt) if fp8 else x_TD
        ref = list(dispatch_grads(LocalDispatcher(), full, x_ref, *inputs[1:]))
        unquantized = dispatch_grads(LocalDispatcher(), full, *inputs)[0]
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
        differs = T > 0 and not torch.allclose(got[0], unquantized, rtol=tol, atol=tol)
        # what the dispatcher counted of its two calls (rows to the other rank, tokens), what
        # the routing sends there, and nothing counted while router statistics are paused
        counted = dispatcher.take_counts()
        visits_TP, _ = rank_slots(experts_TK, 2, El)
        sends = 2 * int(visits_TP[:, 1 - rank].sum())
        with router_stats_paused():
            dispatch_grads(dispatcher, mine, *inputs)
        checked.append(
            {
                "case": case,
                "tokens": T,
                "expert_grad_abs_sum": moved,
                "differs": differs,
                "counted": list(counted),
                "sent": [sends, 2 * T],
                "counted_paused": list(dispatcher.take_counts()),
            }
        )
    return checked


ROWWISE_CASES = ["distinct", "repeats", "all-to-rank-0", "rank-1-without-tokens"]


def rowwise_routing(case: str, rank: int, P: int, E: int, K: int, gen) -> torch.Tensor:
    """experts_TK for one rank of ``P``: random, repeated experts, every token of every rank to
    rank 0's experts (the others receive nothing), a rank with no tokens."""
    T = 0 if case == "rank-1-without-tokens" and rank == 1 else 7 + 3 * rank
    if case in ("distinct", "rank-1-without-tokens"):
        rows = [torch.randperm(E, generator=gen)[:K] for _ in range(T)]
        return torch.stack(rows) if rows else torch.empty(0, K, dtype=torch.int64)
    if case == "repeats":
        return torch.randint(0, E, (T, K), generator=gen)
    assert case == "all-to-rank-0", case
    return torch.randint(0, E // P, (T, K), generator=gen)


def rowwise_parity(out: str, args: list[str]) -> None:
    """RowwiseDispatcher over a symmetric heap vs AllToAllDispatcher, same ranks, same routing:
    outputs and gradients (tokens, routing weights, expert weights) to 1e-12 in fp64
    (``reference``: CPU processes, shared memory, PyTorch ops), 1e-5 in fp32 (``interpret``: the
    Triton slot and rowwise kernels in Triton's interpreter) or bf16 noise (``cuda``: GPUs, NCCL,
    torch's symmetric memory, the GPU kernels), repeatable bit for bit; then a capacity overflow
    is counted exactly. Rank 0 writes what each rank saw."""
    mode = args[0]
    device = torch.device("cpu")
    if mode == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    if mode == "interpret":
        from moe_kernels._triton import interpret_on_cpu

        with interpret_on_cpu():
            seen = _rowwise_cases(rank, P, torch.float32, 1e-5, device)
    elif mode == "cuda":
        seen = _rowwise_cases(rank, P, torch.bfloat16, 3e-2, device)
    else:
        seen = _rowwise_cases(rank, P, torch.float64, 1e-12, device)
    everyone = [None] * P
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    dist.barrier()
    dist.destroy_process_group()


def _rowwise_cases(rank: int, P: int, dt: torch.dtype, tol: float, device: torch.device) -> dict:
    E, K, D, F = 4 * P, DISPATCH_K, DISPATCH_D, DISPATCH_F
    El = E // P
    torch.manual_seed(0)
    mine = Experts(El, D, F)
    with torch.no_grad():
        mine.w_gate_up.normal_(0.0, 0.3)
        mine.w_down.normal_(0.0, 0.3)
    mine = mine.to(device, dt)
    mine.expert_offset = rank * El
    heap = symmetric_heap(dist.group.WORLD, device)
    T_max = 7 + 3 * (P - 1)
    rows, assignments = P * T_max, P * T_max * min(K, El)  # dropless
    rowwise = RowwiseDispatcher(RowwiseExchange(heap, rows, assignments, D, K, dt), El)
    reference = AllToAllDispatcher(dist.group.WORLD, P, El)
    seen: dict = {"cases": []}

    def inputs(case: str, seed: int) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        experts_TK = rowwise_routing(case, rank, P, E, K, gen)
        T = experts_TK.shape[0]
        x_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
        w_TK = 0.1 + torch.rand(T, K, generator=gen, dtype=torch.float64)
        dy_TD = torch.randn(T, D, generator=gen, dtype=torch.float64)
        weights_dt = torch.promote_types(dt, torch.float32)
        return (
            x_TD.to(device, dt),
            w_TK.to(device, weights_dt),
            experts_TK.to(device),
            dy_TD.to(device, dt),
        )

    for i, case in enumerate(ROWWISE_CASES):
        args = inputs(case, 1000 * i + rank)
        T = args[0].shape[0]
        ref = dispatch_grads(reference, mine, *args, n_experts=E)
        got = dispatch_grads(rowwise, mine, *args, n_experts=E)
        names = ("y", "dx", "dweights", "dw_gate_up", "dw_down")
        for name, a, b in zip(names, got, ref, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, (case, name, a.shape, b.shape)
            torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=f"{case} {name}")
        again = dispatch_grads(rowwise, mine, *args, n_experts=E)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), case
        assert int(rowwise.exchange.dropped) == 0, case
        moved = [float(g.abs().sum()) for g in got[3:]]
        seen["cases"].append({"case": case, "tokens": T, "expert_grad_abs_sum": moved})

    # FP8 token rows (and on the CPU FP8 experts, which quantize the received rows into their
    # slots; a GPU's FP8 GEMMs need widths of 16): the all-to-all's FP8 rows, quantized by the
    # same rules (fp32 sums in another order)
    from moe_core.model.kernel_choice import Kernels

    mine8 = Experts(El, D, F).to(device, dt)
    with torch.no_grad():
        mine8.w_gate_up.copy_(mine.w_gate_up)
        mine8.w_down.copy_(mine.w_down)
    mine8.expert_offset = mine.expert_offset
    mine8.kernels = Kernels(fp8_experts=device.type == "cpu")
    exchange8 = RowwiseExchange(heap, rows, assignments, D, K, dt, fp8_rows=True)
    rowwise8 = RowwiseDispatcher(exchange8, El)
    reference8 = AllToAllDispatcher(dist.group.WORLD, P, El, fp8_rows=True)
    seen["fp8_cases"] = []
    for i, case in enumerate(ROWWISE_CASES):
        args = inputs(case, 1000 * i + rank)
        ref = dispatch_grads(reference8, mine8, *args, n_experts=E)
        got = dispatch_grads(rowwise8, mine8, *args, n_experts=E)
        for name, a, b in zip(names, got, ref, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype, (case, name, a.shape, b.shape)
            torch.testing.assert_close(a, b, rtol=max(tol, 1e-5), atol=max(tol, 1e-5))
        again = dispatch_grads(rowwise8, mine8, *args, n_experts=E)
        assert all(torch.equal(a, b) for a, b in zip(got, again, strict=True)), case
        assert int(exchange8.dropped) == 0, case
        moved = [float(g.abs().sum()) for g in got[3:]]
        seen["fp8_cases"].append({"case": case, "tokens": T, "expert_grad_abs_sum": moved})

    # Capacity: room for 2 rows per rank. Rows past it are dropped at the sender and counted.
    x_TD, w_TK, experts_TK, _ = inputs("distinct", rank)
    small = RowwiseDispatcher(RowwiseExchange(heap, 2, 2 * K, D, K, dt), El)
    small(x_TD, Routing(experts_TK, w_TK, expert_counts(experts_TK, E), torch.zeros(())), mine)
    T = x_TD.shape[0]
    visits_TP = torch.zeros(T, P, dtype=torch.int64, device=device)
    visits_P = visits_TP.scatter_(1, experts_TK // El, 1).sum(0)
    dist.all_reduce(visits_P)  # rows each rank is sent, from everyone
    seen["overflow"] = {
        "dropped": int(small.exchange.dropped),
        "rows_per_owner": visits_P.tolist(),
    }
    return seen


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
        "dispatch-fp8": dispatch_fp8_parity,
        "dispatch-fp8-cuda": dispatch_fp8_cuda,
        "dispatch-syncs": dispatch_host_syncs,
        "rowwise": rowwise_parity,
        "fp8-cache": fp8_cache_parity,
    }[sys.argv[1]]
    job(sys.argv[2], sys.argv[3:])
