"""On a GPU, one MoE layer's forward and backward never wait on the device from the host."""

from __future__ import annotations

import pytest
import torch

from moe_core.config import ModelConfig
from moe_core.model.moe import MoE


@pytest.mark.gpu
def test_moe_layer_forward_backward_runs_without_host_sync():
    cfg = ModelConfig(d_model=2048, n_heads=16, n_experts=64, top_k=8, expert_hidden=1024)
    torch.manual_seed(0)
    moe = MoE(cfg).cuda()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(2, 2048, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step() -> torch.Tensor:
        y, aux = moe(x)
        (y.float().square().mean() + aux).backward()
        return y

    step()  # warm-up: library handles and workspaces are created outside the checked region
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    assert moe.experts.w_gate_up.grad is not None and moe.experts.w_gate_up.grad.abs().sum() > 0
    assert int(moe.router.stat_counts_E.sum()) == 2 * (2 * 2048 * 8)
