"""The pipeline's ``evaluate`` stage: held-out perplexity computed twice, by our model from the
training checkpoint and by ``transformers`` from the exported directory, which must agree; and
greedy continuations of a fixed prompt list by both."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from moe_core.convert.checkpoint import CheckpointSource, checkpoint_config
from moe_core.data.dataset import Instances
from moe_core.data.loader import TokenLoader
from moe_core.model import Transformer, build_model, lm_loss
from moe_core.model.documents import documents_of

PROMPTS = (
    "In the beginning",
    "And God said",
    "The LORD is my shepherd",
    "Blessed are the",
)


@dataclass
class EvalResult:
    tokens: int  # held-out tokens scored
    loss: float  # our model, mean next-token cross-entropy (nats)
    hf_loss: float  # the exported model through transformers
    perplexity: float
    hf_perplexity: float
    relative_difference: float  # |loss - hf_loss| / loss
    samples: list[dict[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def score(
    ours: Transformer, theirs: torch.nn.Module, tokens_BT: torch.Tensor, eos_id: int | None
) -> tuple[float, float]:
    """Mean next-token cross-entropy of a micro-batch by our model and by ``transformers``';
    with ``eos_id`` (a run trained with ``train.document_mask``) attention stays within each
    document and positions restart, for transformers through position ids and a 4-D mask."""
    inputs_BS = tokens_BT[:, :-1]
    if eos_id is None:
        logits, hf_logits = ours(inputs_BS)[0], theirs(inputs_BS).logits
    else:
        docs = documents_of(inputs_BS, eos_id)
        logits = ours.head(ours.norm(ours.hidden(inputs_BS, docs=docs)[0]))
        hf_logits = theirs(inputs_BS, position_ids=docs.positions_BS, attention_mask=docs.mask())
        hf_logits = hf_logits.logits
    targets_BS = tokens_BT[:, 1:]
    return float(lm_loss(logits, targets_BS)), float(lm_loss(hf_logits, targets_BS))


@torch.no_grad()
def _greedy(model: Transformer, ids: list[int], new_tokens: int, max_len: int) -> list[int]:
    out = list(ids)
    for _ in range(new_tokens):
        logits, _ = model(torch.tensor([out[-max_len:]]))
        out.append(int(logits[0, -1].argmax()))
    return out[len(ids) :]


@torch.no_grad()
def evaluate(
    checkpoint: str | os.PathLike,
    hf_dir: str | os.PathLike,
    data_dir: str | os.PathLike | Instances,
    batches: int = 8,
    new_tokens: int = 16,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> EvalResult:
    """Score ``batches`` validation micro-batches with both models (fp32, CPU) and sample;
    ``data_dir`` is a folder of ours or the validation split of any format.

    ``on_progress(phase, done, total)`` follows it: phase ``"scoring"`` counts micro-batches,
    ``"sampling"`` prompts."""
    report = on_progress or (lambda phase, done, total: None)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = checkpoint_config(checkpoint)
    ours = build_model(run.model, "cpu", seed=run.train.seed).eval()
    ours.load_state_dict(CheckpointSource(checkpoint, run.model, torch.float32).state_dict())
    theirs = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    held_out = TokenLoader(data_dir, "validation", run.train.seq_len, run.train.micro_batch_size)
    # a run trained with train.document_mask is scored as it trained: attention within each
    # document, positions from 0 in each; transformers takes the same documents as position ids
    # and a 4-D mask
    eos = held_out.dataset.eos_id if run.train.document_mask else None
    loss_sum = hf_sum = 0.0
    n_batches = tokens = 0
    for tokens_BT in held_out:
        if n_batches == batches:
            break
        loss, hf_loss = score(ours, theirs, tokens_BT, eos)
        loss_sum += loss
        hf_sum += hf_loss
        n_batches += 1
        tokens += tokens_BT[:, 1:].numel()
        report("scoring", n_batches, batches)
    if n_batches == 0:
        where = data_dir if isinstance(data_dir, str | os.PathLike) else data_dir.root
        raise ValueError(f"the validation split of {where} holds no micro-batch to score.")
    loss, hf_loss = loss_sum / n_batches, hf_sum / n_batches

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    samples = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt)["input_ids"]
        out = theirs.generate(
            torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        hf_ids = out[0, len(ids) :].tolist()
        our_ids = _greedy(ours, ids, len(hf_ids), run.model.max_seq_len)
        samples.append(
            {
                "prompt": prompt,
                "continuation": tokenizer.decode(hf_ids),
                "ours_matches_hf": str(our_ids == hf_ids).lower(),
            }
        )
        report("sampling", len(samples), len(PROMPTS))
    return EvalResult(
        tokens=tokens,
        loss=loss,
        hf_loss=hf_loss,
        perplexity=math.exp(loss),
        hf_perplexity=math.exp(hf_loss),
        relative_difference=abs(loss - hf_loss) / abs(loss),
        samples=samples,
    )


def write_samples(result: EvalResult, path: Path) -> None:
    lines = [f"# held-out perplexity {result.perplexity:.3f} (HF {result.hf_perplexity:.3f})", ""]
    for s in result.samples:
        lines += [f"## {s['prompt']}", "", s["continuation"], ""]
    path.write_text("\n".join(lines))
