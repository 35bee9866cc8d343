"""The fused AdamW update: Triton equals the PyTorch reference, and the reference (and the
optimizer built on it) equals ``torch.optim.AdamW``."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_matches, assert_triton_path, randn

from kernels import adamw_triton
from kernels.adamw import adamw_reference_, adamw_step_
from moe_core.train.adamw import AdamW

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    p, g = randn(n, dtype=dtype, seed=seed), randn(n, dtype=dtype, seed=seed + 1)
    m = randn(n, dtype=dtype, seed=seed + 2) * 0.1
    v = randn(n, dtype=dtype, seed=seed + 3).square() * 0.01
    return [p, g, m, v]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "clip-scaled"])
def test_adamw_kernel_equals_reference(dtype, scaled):
    n = 3 * 64 + 5  # several programs of a small block, the last one partial
    lr = torch.tensor(1e-2, device=DEVICE)
    step = torch.tensor(3.0, device=DEVICE)
    scale = torch.tensor(0.5, device=DEVICE) if scaled else None
    fused, ref = _state(n, dtype, 1), _state(n, dtype, 1)
    assert_triton_path(fused[0])
    adamw_triton.adamw_step_(*fused, lr, step, scale, *HYPER.values(), block=64)
    adamw_reference_(*ref, lr, step, scale, *HYPER.values())
    for name, a, b in zip(["param", "grad", "exp_avg", "exp_avg_sq"], fused, ref, strict=True):
        if dtype == torch.float32:
            assert_matches(a, b)
        else:  # one bf16 rounding of results computed in fp32 in another order
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5, msg=name)
    assert not torch.equal(fused[0], _state(n, dtype, 1)[0]), "the parameter must change"


def assert_cast_once(low: torch.Tensor, master: torch.Tensor) -> None:
    """``low`` is ``master`` rounded to its dtype: exactly (round to nearest even) on the GPU;
    Triton's interpreter truncates instead, so on the CPU within one bf16 step."""
    if low.is_cuda:
        assert torch.equal(low, master.to(low.dtype)), "not the master rounded once"
    else:
        torch.testing.assert_close(low.float(), master, rtol=2**-7, atol=0.0)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16], ids=["g-fp32", "g-bf16"])
def test_adamw_kernel_writes_the_bf16_weights_from_fp32_masters(grad_dtype):
    """``out``: the fp32 master's update also lands, cast once, in the bf16 model weights (every
    element written: ``out`` starts as NaN)."""
    n = 3 * 64 + 5
    lr, step = torch.tensor(1e-2, device=DEVICE), torch.tensor(2.0, device=DEVICE)
    fused = _state(n, torch.float32, 5)
    fused[1] = fused[1].to(grad_dtype)
    ref = [t.clone() for t in fused]
    out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    assert_triton_path(fused[0])
    adamw_triton.adamw_step_(*fused, lr, step, None, *HYPER.values(), out=out, block=64)
    adamw_reference_(*ref, lr, step, None, *HYPER.values())
    assert_matches(fused[0], ref[0])
    assert_cast_once(out, fused[0])


def test_optimizer_equals_torch_adamw_over_steps():
    """Five steps, two groups (one without decay): same parameters as torch's AdamW (fp32)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (33,), (4, 4, 3)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    ours = [torch.nn.Parameter(t.clone()) for t in init]
    theirs = [torch.nn.Parameter(t.clone()) for t in init]

    def groups(ps):
        return [{"params": ps[:2], "weight_decay": 0.1}, {"params": ps[2:], "weight_decay": 0.0}]

    opt = AdamW(groups(ours), lr=3e-2, betas=(0.9, 0.95), eps=1e-8)
    ref = torch.optim.AdamW(groups(theirs), lr=3e-2, betas=(0.9, 0.95), eps=1e-8)
    for step, gs in enumerate(grads):
        for a, b, g in zip(ours, theirs, gs, strict=True):
            a.grad, b.grad = g.clone(), g.clone()
        if step == 3:
            opt.set_lr(1e-2)
            for group in ref.param_groups:
                group["lr"] = 1e-2
        opt.step()
        ref.step()
    for a, b, start in zip(ours, theirs, init, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert not torch.equal(a, start)
    state = opt.state[ours[0]]
    torch.testing.assert_close(state["exp_avg"], ref.state[theirs[0]]["exp_avg"])


def test_master_weights_track_torch_adamw_on_fp32_copies():
    """``master_weights=True`` on bf16 parameters: fp32 masters and moments equal torch's AdamW
    run on fp32 copies, and the bf16 parameters are those masters rounded."""
    gen = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=gen) for s in [(6, 5), (17,)]]
    ours = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    ref_params = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = AdamW(ours, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, master_weights=True)
    ref = torch.optim.AdamW(ref_params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(4):
        grads = [torch.randn(p.shape, generator=gen).to(torch.bfloat16) for p in ours]
        for p, r, g in zip(ours, ref_params, grads, strict=True):
            p.grad, r.grad = g, g.float()
        opt.step()
        ref.step()
    for p, r in zip(ours, ref_params, strict=True):
        state = opt.state[p]
        assert state["master"].dtype == state["exp_avg"].dtype == torch.float32
        torch.testing.assert_close(state["master"], r.detach(), rtol=1e-5, atol=1e-6)
        assert_cast_once(p.detach(), state["master"])


def test_adamw_step_rejects_mismatched_shapes():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="shapes differ"):
        adamw_step_(p, torch.zeros(5), p, p, torch.tensor(1.0), torch.tensor(1.0), **HYPER)
