"""The bare step's optimizer (``benchmarks/baselines/adamw.py``, a ``torch.optim`` AdamW on the
fused update) equals ``torch.optim.AdamW``, with and without fp32 master weights."""

from __future__ import annotations

import torch
from kernel_cases import assert_cast_once

from benchmarks.baselines.adamw import AdamW


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
