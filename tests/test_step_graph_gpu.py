"""The trainer's step replayed as CUDA graphs (``parallel.cuda_graph``) on one GPU: it trains as
the eager step does, with the local dispatcher and with the rowwise dispatcher over one PE of
symmetric memory (the expert-parallel step, forward, backward and optimizer, captured)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import BASE, one_rank_nccl_group

from moe_core.compose import compose_run
from moe_core.model.dtypes import DTYPES
from moe_core.model.moe import MoE
from moe_core.parallel.dispatch import RowwiseDispatcher
from moe_core.parallel.parallelize import rowwise_exchange
from moe_core.train.trainer import Trainer

pytestmark = pytest.mark.gpu
STEPS = 8
ARGS = [
    *BASE,
    "precision=pure-bf16",
    f"train.steps={STEPS}",
    "train.seq_len=64",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",  # two micro-batches: the accumulation is captured too
    "train.checkpoint_every=1000",
]


@pytest.fixture(scope="module")
def one_rank_group():
    with one_rank_nccl_group():
        yield dist.group.WORLD


def rowwise_at_one_pe(trainer: Trainer, group) -> None:
    """Every MoE layer dispatches through the rowwise dispatcher over one PE (what EP runs
    per rank), sharing one exchange, as ``parallelize`` sets it up for ep > 1."""
    cfg = trainer.cfg
    assert trainer.mesh.ep_group is None  # the heap takes the default group: this one
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    dtype = DTYPES[cfg.precision.params]
    exchange = rowwise_exchange(cfg.model, cfg.parallel, trainer.mesh, tokens, dtype)
    for moe in (m for m in trainer.chunks[0].modules() if isinstance(m, MoE)):
        moe.dispatcher = RowwiseDispatcher(exchange, cfg.model.n_experts)
    trainer.exchanges = [exchange]


def train(tmp_path, graph: bool, rowwise_group=None) -> tuple[Trainer, list[float]]:
    cfg = compose_run([*ARGS, f"parallel.cuda_graph={str(graph).lower()}", f"out_dir={tmp_path}"])
    trainer = Trainer(cfg)
    assert trainer.device.type == "cuda"
    if rowwise_group is not None:
        rowwise_at_one_pe(trainer, rowwise_group)
    history = trainer.fit(show_progress=False)
    return trainer, [m.loss for m in history]


@pytest.mark.parametrize("dispatch", ["local", "rowwise-one-pe"])
def test_step_replayed_as_cuda_graphs_trains_like_the_eager_step(dispatch, tmp_path, request):
    group = request.getfixturevalue("one_rank_group") if dispatch != "local" else None
    eager, eager_losses = train(tmp_path / "eager", False, group)
    assert eager.graphs is None
    graphed, graph_losses = train(tmp_path / "graph", True, group)
    g = graphed.graphs
    assert g is not None and g.captured and g.compute_calls == STEPS
    assert graph_losses[-1] < graph_losses[0], graph_losses
    for a, b in zip(eager_losses, graph_losses, strict=True):  # same kernels, not bitwise
        assert abs(a - b) <= 2e-2 * abs(a), (eager_losses, graph_losses)
    if dispatch != "local":
        assert int(graphed.exchanges[0].dropped) == 0
    # the weights the graphs updated are the model's: they equal the eager run's closely
    for (name, a), (_, b) in zip(
        eager.chunks[0].state_dict().items(), graphed.chunks[0].state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a.float(), b.float(), rtol=5e-2, atol=5e-3, msg=name)


def test_a_non_finite_step_replayed_as_graphs_changes_nothing(tmp_path):
    """The guards' verdict reaches the captured update as a device flag: a step whose loss is
    NaN (one weight poisoned after capture) is reported skipped and leaves every weight, moment
    and the step count as they were; with the weight restored, training goes on."""
    cfg = compose_run([*ARGS, "parallel.cuda_graph=true", f"out_dir={tmp_path}"])
    trainer = Trainer(cfg)
    for _ in range(4):  # two eager warm-up steps, then both graphs captured and replayed
        assert not trainer.train_step().skipped
    assert trainer.graphs is not None and trainer.graphs.captured
    model = trainer.chunks[0]
    poisoned = model.get_parameter("lm_head.weight")  # every token's logits read row 0
    clean = poisoned.detach().clone()
    with torch.no_grad():
        poisoned[0].fill_(float("nan"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [v.clone() for bucket in trainer.optimizer.moments for v in bucket.values()]
    steps = trainer.optimizer.step_count
    m = trainer.train_step()
    assert m.skipped and not math.isfinite(m.loss)
    assert trainer.optimizer.step_count == steps
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, weights[k], rtol=0, atol=0, equal_nan=True, msg=k)
    after = [v for bucket in trainer.optimizer.moments for v in bucket.values()]
    assert moments and len(after) == len(moments)
    for a, b in zip(moments, after, strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    with torch.no_grad():
        poisoned.copy_(clean)
    m = trainer.train_step()
    assert not m.skipped and math.isfinite(m.loss)
    assert trainer.optimizer.step_count == steps + 1
