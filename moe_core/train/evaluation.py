"""Evaluation during training: the held-out loss (the validation split, or synthetic walks
numbered apart from the training ones) and the in-training subsets of the downstream tasks,
each with the model as it is and router statistics paused, split over the ranks."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from moe_core.config import RunConfig
from moe_core.data.loader import TokenLoader
from moe_core.model.documents import Documents
from moe_core.model.moe import router_stats_paused
from moe_core.model.transformer import Losses
from moe_core.parallel.mesh import Mesh
from moe_core.train.batches import Batches
from moe_core.train.router_stats import RouterStats

EVAL_BASE = 1 << 40  # held-out synthetic sequences are numbered from here

# ``Trainer._forward_backward``: (micro-batches, forward_only, documents) -> the summed ``Losses``.
ForwardBackward = Callable[..., Losses]


def held_out_batches(
    cfg: RunConfig, mesh: Mesh, batches: Batches
) -> tuple[list[torch.Tensor], list[Documents] | None]:
    """This data rank's ``eval_batches / dp`` held-out micro-batches, on the device (the same
    sequences whatever the layout), and their packed documents (``train.document_mask``: the
    held-out loss attends as training does)."""
    tc, pc = cfg.train, cfg.parallel
    per_rank = tc.eval_batches // pc.data_parallel
    if batches.loader is None:
        start = EVAL_BASE + mesh.data_rank * per_rank * tc.micro_batch_size
        return [b.to(mesh.device) for b in batches.sequences(start, per_rank)], None
    held_out = TokenLoader(
        batches.held_out(),  # a mixture's first source's, in any format; else the one folder's
        "validation",
        tc.seq_len,
        tc.micro_batch_size,
        dp_rank=mesh.data_rank,
        dp_size=pc.data_parallel,
    )
    host = [b for b, _ in zip(held_out, range(per_rank), strict=False)]
    if len(host) < per_rank:
        raise ValueError(
            f"train.eval_batches={tc.eval_batches} is not allowed: the validation split "
            f"holds {len(host) * pc.data_parallel} micro-batches."
        )
    docs = batches.documents_of(host)
    return [b.to(mesh.device) for b in host], (
        None if docs is None else [d.to(mesh.device) for d in docs]
    )


@torch.no_grad()
def held_out_loss(
    cfg: RunConfig,
    mesh: Mesh,
    held_out: tuple[list[torch.Tensor], list[Documents] | None],
    forward_backward: ForwardBackward,
    router_stats: RouterStats,
    step: int,
) -> float:
    """Mean held-out loss over ``train.eval_batches`` micro-batches (all ranks)."""
    with router_stats_paused():
        ce_sum = forward_backward(held_out[0], forward_only=True, documents=held_out[1]).ce
    read = torch.stack([ce_sum, router_stats.dropped()])
    if mesh.distributed:
        dist.all_reduce(read)
    ce, dropped = read.tolist()
    router_stats.check_dropped(dropped, f"evaluation after step {step}")
    # each context-parallel rank's loss is a mean over its slice of the sequences
    return ce / (cfg.train.eval_batches * cfg.parallel.cp)


class Downstream:
    """The in-training subset of every task (``eval.every_limit`` examples, by ``eval.seed``),
    encoded once with the run's tokenizer."""

    def __init__(self, cfg: RunConfig, eos_id: int | None) -> None:
        from moe_core.data.tokenizer import load_tokenizer
        from moe_core.eval.downstream import encode_tasks
        from moe_core.eval.tasks import load_tasks, subset

        ev = cfg.eval
        assert cfg.data.tokenizer_dir is not None  # config: eval.every needs one
        self.cfg = cfg
        self.tasks = [subset(t, ev.every_limit, ev.seed) for t in load_tasks(ev)]
        self.requests = encode_tasks(
            self.tasks, load_tokenizer(cfg.data.tokenizer_dir), cfg.model.vocab_size, eos_id
        )

    @torch.no_grad()
    def scores(
        self,
        forward: Callable[[torch.Tensor], torch.Tensor],
        mesh: Mesh,
        router_stats: RouterStats,
        step: int,
    ) -> dict[str, dict[str, float]]:
        """Accuracies with ``forward`` (tokens -> logits): batches of the training
        micro-batch's shape (``[micro_batch_size, seq_len]``, so static buffers and compiled
        graphs are reused), split over every rank (``parallel.pp`` is 1 here)."""
        from moe_core.eval.downstream import request_logprobs, scores_from

        tc = self.cfg.train
        with router_stats_paused():
            logp = request_logprobs(
                self.requests,
                forward,
                tc.seq_len,
                tc.micro_batch_size,
                mesh.device,
                fixed_shape=True,
            )
        read = router_stats.dropped()
        if mesh.distributed:
            dist.all_reduce(read)
        router_stats.check_dropped(float(read), f"downstream evaluation after step {step}")
        scores = scores_from(self.tasks, self.requests, logp)
        return {s.key: s.metrics() for s in scores}
