"""On a GPU, the MoE layer and a whole training step never wait on the device from the host."""

from __future__ import annotations

import pytest
import torch
from helpers import no_host_sync, small_gpu_model

from moe_core.config import ModelConfig
from moe_core.model import lm_loss
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
    with no_host_sync():
        y = step()
    torch.cuda.synchronize()
    assert torch.isfinite(y).all()
    assert moe.experts.w_gate_up.grad is not None and moe.experts.w_gate_up.grad.abs().sum() > 0
    assert int(moe.router.stat_counts_E.sum()) == 2 * (2 * 2048 * 8)


def _small_training_setup() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    model = small_gpu_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    tokens = torch.randint(0, 1024, (2, 257), device="cuda", generator=_gen())
    return model, opt, tokens


def _gen() -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(5)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor):
    opt.zero_grad(set_to_none=True)
    logits, aux = model(tokens[:, :-1])
    loss = lm_loss(logits, tokens[:, 1:]) + aux
    loss.backward()
    opt.step()
    return loss.detach()


@pytest.mark.gpu
def test_training_step_without_host_sync_and_as_one_cuda_graph():
    """Forward, backward and the AdamW step of the MoE model: no host read, and the whole step
    captured in one CUDA graph trains like the eager step."""
    model, opt, tokens = _small_training_setup()
    _train_step(model, opt, tokens)  # warm-up: kernels compiled, optimizer state created
    with no_host_sync():
        _train_step(model, opt, tokens)

    eager_model, eager_opt, _ = _small_training_setup()
    eager = [_train_step(eager_model, eager_opt, tokens).item() for _ in range(8)]

    graph_model, graph_opt, _ = _small_training_setup()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph, as capture requires
        first = [_train_step(graph_model, graph_opt, tokens).item() for _ in range(3)]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = _train_step(graph_model, graph_opt, tokens)
    replayed = []
    for _ in range(5):
        graph.replay()
        replayed.append(static_loss.item())
    losses = first + replayed
    assert losses[-1] < losses[0], losses
    for a, b in zip(eager, losses, strict=True):  # same kernels; grouped GEMMs not bitwise
        assert abs(a - b) <= 2e-2 * abs(a), (eager, losses)
