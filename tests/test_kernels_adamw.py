"""The fused AdamW update: Triton equals the PyTorch reference, and writes bf16 weights from
fp32 masters (the trainer's optimizer against ``torch.optim.AdamW``: tests/test_parallel.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DEVICE, assert_cast_once, assert_matches, assert_triton_path, randn

from moe_kernels import adamw_triton
from moe_kernels.adamw import adamw_reference_, adamw_step_

HYPER = dict(beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)


def _state(n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    p, g = randn(n, dtype=dtype, seed=seed), randn(n, dtype=dtype, seed=seed + 1)
    m = randn(n, dtype=dtype, seed=seed + 2) * 0.1
    v = randn(n, dtype=dtype, seed=seed + 3).square() * 0.01
    return [p, g, m, v]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "clip-scaled"])
@pytest.mark.parametrize("iters", [1, 3], ids=["1-chunk", "3-chunks"])
def test_adamw_kernel_equals_reference(dtype, scaled, iters):
    """Several programs of a small block (of ``iters`` chunks each), the last one partial."""
    n = 3 * 64 + 5
    lr = torch.tensor(1e-2, device=DEVICE)
    step = torch.tensor(3.0, device=DEVICE)
    scale = torch.tensor(0.5, device=DEVICE) if scaled else None
    fused, ref = _state(n, dtype, 1), _state(n, dtype, 1)
    assert_triton_path(fused[0])
    adamw_triton.adamw_step_(*fused, lr, step, scale, *HYPER.values(), block=64, iters=iters)
    adamw_reference_(*ref, lr, step, scale, *HYPER.values())
    for name, a, b in zip(["param", "grad", "exp_avg", "exp_avg_sq"], fused, ref, strict=True):
        if dtype == torch.float32:
            assert_matches(a, b)
        else:  # one bf16 rounding of results computed in fp32 in another order
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-5, msg=name)
    assert not torch.equal(fused[0], _state(n, dtype, 1)[0]), "the parameter must change"


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


def test_adamw_step_rejects_mismatched_shapes():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="shapes differ"):
        adamw_step_(p, torch.zeros(5), p, p, torch.tensor(1.0), torch.tensor(1.0), **HYPER)


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "skipped"])
@pytest.mark.parametrize("flag_dtype", [torch.bool, torch.float32], ids=["bool", "float"])
def test_adamw_apply_flag_decides_on_the_device_whether_anything_changes(applied, flag_dtype):
    """``apply`` (a skipped step decided on the device): true is the plain update, false leaves
    parameter, moments and ``out`` exactly as they were, in the kernel and the reference."""
    n = 3 * 64 + 5
    lr, step = torch.tensor(1e-2, device=DEVICE), torch.tensor(2.0, device=DEVICE)
    flag = torch.tensor(applied, dtype=flag_dtype, device=DEVICE)
    start = _state(n, torch.float32, 9)
    plain = [t.clone() for t in start]
    adamw_reference_(*plain, lr, step, None, *HYPER.values())
    fused, ref = [t.clone() for t in start], [t.clone() for t in start]
    out_fused = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out_ref = out_fused.clone()
    assert_triton_path(fused[0])
    adamw_triton.adamw_step_(
        *fused, lr, step, None, *HYPER.values(), out=out_fused, apply=flag, block=64
    )
    adamw_reference_(*ref, lr, step, None, *HYPER.values(), out=out_ref, apply=flag)
    expected = plain if applied else start
    for name, a, b, want in zip(["p", "g", "m", "v"], fused, ref, expected, strict=True):
        if applied:
            assert_matches(a, want)
        else:
            assert torch.equal(a, want), name
        assert torch.equal(b, want), name
    if applied:
        assert_cast_once(out_fused, fused[0])
        assert_cast_once(out_ref, ref[0])
    else:
        assert out_fused.isnan().all() and out_ref.isnan().all()


def test_adamw_apply_flag_must_be_one_value():
    p = torch.zeros(4)
    with pytest.raises(ValueError, match="apply must be one value"):
        adamw_step_(p, p, p, p, torch.tensor(1.0), torch.tensor(1.0), apply=torch.ones(2), **HYPER)
