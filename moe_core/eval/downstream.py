"""Multiple-choice scoring with our own forward: continuation log-likelihoods, batched with
padding on the device, split over data-parallel ranks, turned into accuracies.

Each choice is scored as ``sum log p(continuation | context)`` over the continuation's tokens,
encoded as lm-evaluation-harness does (trailing spaces of the context move to the
continuation; the continuation's tokens are those of ``context + continuation`` past the
context's own; the sequence is cut from the left to ``max_len + 1`` tokens). Accuracies, per
task: ``acc_raw`` (the highest sum), ``acc_per_char`` (the sum divided by the continuation's
length in characters, leading space included, as OLMES does; lm-eval's ``acc_norm`` divides by
the choice text without its leading space) and ``acc_per_token``. A tie among the top choices
counts ``1/k`` (the expected accuracy of breaking it at random), so a model that prefers no
choice scores chance.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from moe_core.config import ConfigError, EvalConfig
from moe_core.eval.tasks import Task, load_tasks, subset

Forward = Callable[[torch.Tensor], torch.Tensor]  # tokens [B, T] -> logits [B, T, V]


def encode_pair(tokenizer: Tokenizer, context: str, continuation: str) -> tuple[list, list]:
    """Context and continuation token ids, split as lm-evaluation-harness splits them."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, add_special_tokens=False).ids
    ctx = tokenizer.encode(context, add_special_tokens=False).ids
    return ctx, whole[len(ctx) :]


def _unknown_id(tokenizer: Tokenizer) -> int | None:
    unk = getattr(tokenizer.model, "unk_token", None)
    return tokenizer.token_to_id(unk) if unk else None


@dataclass
class Request:
    task: int  # index into the task list
    example: int  # index into the task's examples
    choice: int
    context: list[int]
    continuation: list[int]
    chars: int  # continuation length in characters (as given, leading space included)


def encode_tasks(
    tasks: list[Task], tokenizer: Tokenizer, vocab_size: int, eos_id: int | None = None
) -> list[Request]:
    """Every (example, choice) of every task as token ids; a text the tokenizer cannot encode
    (an unknown token, an id past the model's vocabulary, an empty continuation) is refused
    in one sentence naming the task and the example."""
    unk = _unknown_id(tokenizer)
    out = []
    for t, task in enumerate(tasks):
        for e, ex in enumerate(task.examples):
            for c, (context, cont) in enumerate(zip(ex.contexts, ex.continuations, strict=True)):
                ctx, cont_ids = encode_pair(tokenizer, context, cont)
                bad = [i for i in ctx + cont_ids if i == unk or not 0 <= i < vocab_size]
                if bad or not cont_ids:
                    what = (
                        f"token id {bad[0]} (unknown, or past the model's {vocab_size})"
                        if bad
                        else "no continuation tokens"
                    )
                    raise ConfigError(
                        f"eval.tasks entry {task.name!r} is not allowed with this tokenizer: "
                        f"example {ex.doc_id} choice {c} encodes to {what}, so the tokenizer "
                        "cannot score its text."
                    )
                if not ctx:  # as lm-eval: an empty context starts from end-of-text
                    if eos_id is None:
                        raise ConfigError(
                            f"eval.tasks entry {task.name!r} is not allowed: example "
                            f"{ex.doc_id} has an empty context and the tokenizer no EOS id."
                        )
                    ctx = [eos_id]
                out.append(Request(t, e, c, ctx, cont_ids, len(cont)))
    return out


def _batches(order: list[int], size: int) -> list[list[int]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


@torch.no_grad()
def request_logprobs(
    requests: list[Request],
    forward: Forward,
    max_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    fixed_shape: bool = False,
    group: dist.ProcessGroup | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[float]:
    """``sum log p(continuation | context)`` of each request. Requests whose model input is
    the same (answer letters: one context, a one-token continuation per choice) share one row.
    Rows go longest first in batches of ``batch_size``, right-padded to the batch's longest
    (to ``[batch_size, max_len]`` with ``fixed_shape``, for static buffers and compiled
    graphs); batch ``j`` runs on data rank ``j % world`` of ``group`` (all ranks run as many
    forwards, the last ones on padding where they have no batch left, since expert-parallel
    dispatch is collective) and the sums are gathered on every rank. ``on_progress(done,
    total)`` follows this rank's batches."""
    world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank(group) if world > 1 else 0
    seqs = [(r.context + r.continuation)[-(max_len + 1) :] for r in requests]
    n_cont = [min(len(r.continuation), len(s) - 1) for r, s in zip(requests, seqs, strict=True)]
    sharing: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(seqs):
        sharing.setdefault(tuple(seq[:-1]), []).append(i)
    inputs = sorted(sharing, key=lambda x: (-len(x), sharing[x][0]))
    batches = _batches(list(range(len(inputs))), batch_size)
    rounds = -(-len(batches) // world)
    mine: dict[int, float] = {}
    for done, j in enumerate(range(rounds * world)[rank::world]):
        batch = [inputs[k] for k in batches[j]] if j < len(batches) else []
        width = max_len if fixed_shape or not batch else max(len(x) for x in batch)
        rows = batch_size if fixed_shape or not batch else len(batch)
        tokens_BT = torch.zeros(rows, width, dtype=torch.long)
        for b, x in enumerate(batch):
            tokens_BT[b, : len(x)] = torch.tensor(x)
        logits_BTV = forward(tokens_BT.to(device))
        for b, x in enumerate(batch):
            for i in sharing[x]:
                end = len(x)  # the logits that predict the sequence's tokens 1..end
                start = end - n_cont[i]
                logp_CV = logits_BTV[b, start:end].float().log_softmax(-1)
                target_C = torch.tensor(seqs[i][start + 1 : end + 1], device=logp_CV.device)
                mine[i] = float(logp_CV.gather(1, target_C[:, None]).sum())
        if on_progress is not None:
            on_progress(done + 1, rounds)
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, mine, group=group)
        for part in parts:
            mine.update(part)
    return [mine[i] for i in range(len(requests))]


@dataclass
class TaskScore:
    task: str
    format: str
    examples: int
    acc_raw: float
    acc_per_char: float
    acc_per_token: float
    # per example: the gold index and each choice's (sum log p, characters, tokens)
    details: list[dict] = field(default_factory=list, repr=False)

    @property
    def key(self) -> str:
        """The name in metrics: ``arc_easy:rc_5shot`` -> ``arc_easy_rc_5shot``."""
        return self.task.replace(":", "_")

    @property
    def acc(self) -> float:
        """The headline accuracy: length-normalized (per character) for ranked
        classification, raw for answer letters (one short token each)."""
        return self.acc_per_char if self.format == "rc" else self.acc_raw

    def metrics(self) -> dict[str, float]:
        out = {k: v for k, v in asdict(self).items() if k.startswith("acc_")}
        return {"acc": self.acc, **out}


def _accuracy(gold: int, scores: list[float]) -> float:
    best = max(scores)
    top = [i for i, s in enumerate(scores) if s == best]
    return 1.0 / len(top) if gold in top else 0.0


def accuracies(task: Task, details: list[dict]) -> TaskScore:
    """A task's accuracies from its examples' per-choice log-likelihoods."""
    sums = {"raw": 0.0, "char": 0.0, "token": 0.0}
    for d in details:
        logp, chars, tokens = (list(x) for x in zip(*d["choices"], strict=True))
        sums["raw"] += _accuracy(d["gold"], logp)
        sums["char"] += _accuracy(d["gold"], [s / n for s, n in zip(logp, chars, strict=True)])
        sums["token"] += _accuracy(d["gold"], [s / n for s, n in zip(logp, tokens, strict=True)])
    n = len(details)
    return TaskScore(
        task.name,
        task.format,
        n,
        sums["raw"] / n if n else math.nan,
        sums["char"] / n if n else math.nan,
        sums["token"] / n if n else math.nan,
        details,
    )


def score_tasks(
    tasks: list[Task],
    tokenizer: Tokenizer,
    forward: Forward,
    *,
    vocab_size: int,
    max_len: int,
    batch_size: int,
    device: torch.device | str = "cpu",
    eos_id: int | None = None,
    fixed_shape: bool = False,
    group: dist.ProcessGroup | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[TaskScore]:
    """Score every task with ``forward`` (collective over ``group`` when one is running;
    ``on_progress(done, total)`` follows the batches)."""
    requests = encode_tasks(tasks, tokenizer, vocab_size, eos_id)
    logp = request_logprobs(
        requests, forward, max_len, batch_size, device, fixed_shape, group, on_progress
    )
    return scores_from(tasks, requests, logp)


def scores_from(tasks: list[Task], requests: list[Request], logp: list[float]) -> list[TaskScore]:
    """Each task's accuracies from the log-likelihoods of its requests."""
    details: list[list[dict]] = [
        [{"doc_id": ex.doc_id, "gold": ex.label, "choices": []} for ex in t.examples] for t in tasks
    ]
    for r, lp in zip(requests, logp, strict=True):
        details[r.task][r.example]["choices"].append((lp, r.chars, len(r.continuation)))
    return [accuracies(t, d) for t, d in zip(tasks, details, strict=True)]


def model_forward(model: torch.nn.Module) -> Forward:
    """Our ``Transformer`` as a ``Forward`` (its auxiliary loss dropped)."""
    return lambda tokens_BT: model(tokens_BT)[0]


@torch.no_grad()
def evaluate_checkpoint(
    checkpoint: str | os.PathLike,
    data_dir: str | os.PathLike,
    cfg: EvalConfig,
    eos_id: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[TaskScore]:
    """Every configured task (``cfg.limit`` examples of each, 0: all) scored by the model of a
    training checkpoint, fp32, on the GPU where there is one; batches of the run's
    micro-batch size, sequences cut to the model's ``max_seq_len``. ``data_dir`` holds the
    tokenizer; the end-of-text id is its data manifest's, or ``eos_id`` where it has none (a
    mixture's tokenizer files); ``on_progress(done, total)`` follows the batches."""
    from moe_core.convert.checkpoint import CheckpointSource, checkpoint_config
    from moe_core.data.manifest import read_manifest
    from moe_core.data.tokenizer import load_tokenizer
    from moe_core.model import build_model

    run = checkpoint_config(checkpoint)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(run.model, "cpu", seed=run.train.seed).eval()
    model.load_state_dict(CheckpointSource(checkpoint, run.model, torch.float32).state_dict())
    model.to(device)
    tasks = [subset(t, cfg.limit, cfg.seed) for t in load_tasks(cfg)]
    eos = eos_id
    if eos is None:
        eos = read_manifest(data_dir).content.get("tokenizer", {}).get("eos_id")
    return score_tasks(
        tasks,
        load_tokenizer(data_dir),
        model_forward(model),
        vocab_size=run.model.vocab_size,
        max_len=run.model.max_seq_len,
        batch_size=run.train.micro_batch_size,
        device=device,
        eos_id=eos,
        on_progress=on_progress,
    )


def write_scores(scores: list[TaskScore], out: Path) -> list[Path]:
    """``downstream.json`` (accuracies per task) and ``downstream_examples.jsonl`` (each
    example's gold index and per-choice log-likelihood, characters and tokens) in ``out``."""
    table = {s.task: {"format": s.format, "examples": s.examples, **s.metrics()} for s in scores}
    summary = out / "downstream.json"
    summary.write_text(json.dumps(table, indent=1))
    examples = out / "downstream_examples.jsonl"
    with examples.open("w") as f:
        for s in scores:
            for d in s.details:
                f.write(json.dumps({"task": s.task, **d}) + "\n")
    return [summary, examples]
