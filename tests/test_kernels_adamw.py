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


def test_adamw_step_rejects_mismatched_shapes():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="shapes differ"):
        adamw_step_(p, torch.zeros(5), p, p, torch.tensor(1.0), torch.tensor(1.0), **HYPER)
