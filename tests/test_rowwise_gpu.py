"""The rowwise dispatcher on one GPU (one PE of torch's symmetric memory): what the local
dispatcher computes, no host read in forward or backward, and the whole MoE layer step
captured in one CUDA graph. (Two GPUs: ``test_dispatch.py``.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import no_host_sync, one_rank_nccl_group

from moe_core.model.moe import Experts, LocalDispatcher, Routing
from moe_core.parallel.dispatch import RowwiseDispatcher, RowwiseExchange
from moe_core.parallel.symmetric import CudaSymmetricHeap
from moe_kernels.routing import expert_counts

pytestmark = pytest.mark.gpu
E, K, D, F, T = 16, 4, 256, 128, 512


@pytest.fixture(scope="module")
def dispatcher():
    """A one-rank NCCL group and a rowwise dispatcher over it (dropless buffers)."""
    with one_rank_nccl_group():
        heap = CudaSymmetricHeap(dist.group.WORLD, torch.device("cuda"))
        yield RowwiseDispatcher(RowwiseExchange(heap, T, T * K, D, K, torch.bfloat16), E)


def _inputs(seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    torch.manual_seed(seed)
    experts = Experts(E, D, F).cuda()
    with torch.no_grad():
        experts.w_gate_up.normal_(0.0, 0.05)
        experts.w_down.normal_(0.0, 0.05)
    experts = experts.to(torch.bfloat16)
    logits_TE = torch.randn(T, E, device="cuda", generator=gen)
    w_TK, experts_TK = torch.topk(torch.softmax(logits_TE, -1), K, dim=-1)
    x_TD = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    dy_TD = torch.randn(T, D, device="cuda", generator=gen).to(torch.bfloat16)
    return experts, x_TD, w_TK, experts_TK, dy_TD


def _step(dispatch, experts, x_TD, w_TK, experts_TK, dy_TD):
    x, w = x_TD.detach().requires_grad_(), w_TK.detach().requires_grad_()
    routing = Routing(experts_TK, w, expert_counts(experts_TK, E), torch.zeros((), device="cuda"))
    y = dispatch(x, routing, experts)
    leaves = (x, w, experts.w_gate_up, experts.w_down)
    return (y, *torch.autograd.grad(y, leaves, dy_TD))


def test_one_pe_rowwise_equals_the_local_dispatcher(dispatcher):
    experts, *args = _inputs(0)
    got = _step(dispatcher, experts, *args)
    ref = _step(LocalDispatcher(), experts, *args)
    for name, a, b in zip(("y", "dx", "dw", "dw_gate_up", "dw_down"), got, ref, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-3, msg=name)
    assert int(dispatcher.exchange.dropped) == 0


def test_one_pe_rowwise_step_reads_no_host_value_and_replays_as_a_cuda_graph(dispatcher):
    experts, *args = _inputs(1)
    eager = _step(dispatcher, experts, *args)  # warm-up: kernels compiled, handles made
    with no_host_sync():
        _step(dispatcher, experts, *args)
    # The graph's own copy of the experts, first used on the capturing side stream (autograd
    # keeps each leaf's gradient node on the stream it was made on).
    graph_experts, *_ = _inputs(1)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _step(dispatcher, graph_experts, *args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = _step(dispatcher, graph_experts, *args)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, eager, strict=True):
        torch.testing.assert_close(a, b)  # same kernels on the same inputs
