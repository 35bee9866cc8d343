"""Context parallelism (``parallel.cp``): a sequence split over ranks trains what one process
trains (CPU, gloo, under torchrun; tolerances: tests/test_parallel.py's docstring), with equal
causal attention work on every rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BASE, assert_trains_like, explain, torchrun, write_token_dir

from moe_core.compose import compose_run
from moe_core.config import ConfigError, OptionNotImplementedError
from moe_core.model.attention import causal_attention, context_attention
from moe_core.model.context import ContextShard, local_positions, pairs_per_rank
from moe_core.model.documents import documents_of
from moe_core.model.kernel_choice import Kernels
from moe_core.plan import plan
from moe_core.plan.memory import context_activation_bytes
from moe_core.train.trainer import Trainer

EOS = 0  # write_token_dir's stand-in tokenizer records EOS id 0
# grouped-query heads (4 query heads over 2 key-value heads) with QK-norm per head
GQA = ["model.n_kv_heads=2", "model.qk_norm=head"]


def _causal_pairs(seq_len: int, cp: int, rank: int) -> int:
    """Query-key pairs rank ``rank`` attends, counted on the mask its attention applies (one
    document: plain causal attention over the whole sequence)."""
    docs = documents_of(torch.ones(1, seq_len, dtype=torch.long), EOS)
    return int(ContextShard(cp, rank, seq_len).documents(docs).mask().sum())


@pytest.mark.parametrize("cp", [2, 4])
def test_head_and_tail_chunks_give_every_rank_equal_attention_work(cp):
    S = 64
    pairs = [_causal_pairs(S, cp, r) for r in range(cp)]
    assert pairs == pairs_per_rank(S, cp)
    assert len(set(pairs)) == 1 and sum(pairs) == S * (S + 1) // 2
    # each rank holds S / cp distinct positions, together the whole sequence
    held = torch.cat([local_positions(S, cp, r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(S))
    # contiguous slices would not balance: the last rank's queries see far more keys
    contiguous = [sum(p + 1 for p in range(r * S // cp, (r + 1) * S // cp)) for r in range(cp)]
    assert contiguous[-1] > 2 * contiguous[0]


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize(
    "kv_heads, qk_width, v_width", [(2, 8, 8), (4, 12, 6)], ids=["gqa", "latent-widths"]
)
def test_each_ranks_queries_against_the_gathered_keys_are_its_rows_of_causal_attention(
    cp, kv_heads, qk_width, v_width
):
    """The attention core under context parallelism, given the whole sequence's keys and
    values (what the gather hands it), returns exactly the one-process outputs of this rank's
    queries: grouped-query heads, and latent attention's unequal query/key and value widths."""
    B, H, S = 2, 4, 32
    gen = torch.Generator().manual_seed(cp)
    q = torch.randn(B, H, S, qk_width, generator=gen)
    k = torch.randn(B, kv_heads, S, qk_width, generator=gen)
    v = torch.randn(B, kv_heads, S, v_width, generator=gen)
    whole_BSE = causal_attention(q, k, v, Kernels(), scale=0.3)
    for rank in range(cp):
        shard = ContextShard(cp, rank, S)
        rows = local_positions(S, cp, rank)
        mine = context_attention(q[:, :, rows], k, v, Kernels(), shard, scale=0.3)
        torch.testing.assert_close(mine, whole_BSE[:, rows], rtol=1e-5, atol=1e-6)


def test_a_ranks_document_mask_is_the_whole_masks_rows_of_its_queries():
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(1, 50, (2, 32), generator=gen)
    inputs[inputs < 8] = EOS  # documents of uneven lengths, crossing the chunks' edges
    docs = documents_of(inputs, EOS)
    whole_BSS = docs.mask()[:, 0]
    for rank in range(2):
        shard = ContextShard(2, rank, 32)
        mine = shard.documents(docs)
        rows = local_positions(32, 2, rank)
        assert torch.equal(mine.mask()[:, 0], whole_BSS[:, rows])
        assert torch.equal(mine.positions_BS, docs.positions_BS[:, rows])  # RoPE positions


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.cp=2", "train.seq_len=30"],
            "train.seq_len=30 is not allowed: a multiple of 2 x parallel.cp (4)",
        ),
        (
            ["parallel.cp=2", "parallel.pp=2"],
            "parallel.cp=2 with parallel.pp=2 is not built yet",
        ),
        (
            ["model=small-mla", "model.mtp_depth=1", "parallel.cp=2"],
            "model.mtp_depth=1 with parallel.cp=2 is not built yet",
        ),
        (["parallel.cp=0"], "parallel.cp=0 is not allowed"),
    ],
)
def test_context_parallel_refusals_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        compose_run([*BASE, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_downstream_evaluation_with_context_parallelism_is_refused():
    with pytest.raises(OptionNotImplementedError, match=r"eval.every=5 with parallel.cp=2"):
        tokens = ["data.kind=tokens", "data.dir=.", "eval.every=5", "eval.tasks=[toy:rc_0shot]"]
        compose_run([*BASE, "parallel.cp=2", *tokens])


def test_the_layout_counts_context_parallel_ranks():
    par = compose_run([*BASE, "parallel.cp=2", "parallel.ep=2", "parallel.dp=2"]).parallel
    assert (par.world_size, par.data_parallel, par.loss_ranks) == (8, 4, 8)


def _train(nproc: int, overrides: list[str], out: Path) -> None:
    result = torchrun(nproc, ["-m", "moe_core.cli", "train", *overrides, f"out_dir={out}"])
    assert result.returncode == 0, explain(result)


@pytest.mark.slow
def test_cp2_and_cp2_ep2_train_the_single_process_model_and_resume_at_cp1(tmp_path):
    """Grouped-query attention with per-head QK-norm: CP=2 and CP=2 x EP=2 reproduce one
    process over 5 steps; a checkpoint written at CP=2 (step 3) resumes in one process and
    finishes the same run."""
    run = [*BASE, *GQA]
    reference = tmp_path / "one"
    Trainer(compose_run([*run, f"out_dir={reference}"])).fit(show_progress=False)
    cp2 = tmp_path / "cp2"
    _train(2, [*run, "parallel.cp=2", "train.checkpoint_every=3"], cp2)
    assert_trains_like(reference, cp2, steps=5, keys=("loss", "grad_norm"))
    _train(4, [*run, "parallel.cp=2", "parallel.ep=2"], tmp_path / "cp2-ep2")
    assert_trains_like(reference, tmp_path / "cp2-ep2", steps=5, keys=("loss", "grad_norm"))

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    step3 = Path("checkpoints") / "step_00000003"
    shutil.copytree(cp2 / step3, resumed / step3)
    lines = (cp2 / "metrics.jsonl").read_text().splitlines()[:3]
    (resumed / "metrics.jsonl").write_text("".join(x + "\n" for x in lines))
    trainer = Trainer(compose_run([*run, f"out_dir={resumed}"]))
    assert trainer.step == 3 and trainer.resumed_from is not None
    trainer.fit(show_progress=False)
    assert_trains_like(reference, resumed, steps=5, keys=("loss", "grad_norm"))


def _documents(n_tokens: int, vocab: int, seed: int) -> np.ndarray:
    """Tokens with an EOS after documents of 3 to 20 tokens: sequences and their chunks split
    them unevenly."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, n_tokens)
    ends = np.cumsum(rng.integers(3, 21, n_tokens))
    tokens[ends[ends < n_tokens]] = EOS
    return tokens


@pytest.mark.slow
def test_latent_attention_at_cp4_within_documents_trains_the_single_process_model(tmp_path):
    """Multi-head latent attention (its compressed key-value gathered, unequal head widths)
    attending within packed documents that the chunks cut unevenly, at CP=4: losses, gradient
    norms, weights and the held-out loss reproduce one process."""
    vocab = 4096
    splits = {"train": _documents(12_000, vocab, 0), "validation": _documents(2_000, vocab, 1)}
    data = write_token_dir(tmp_path / "data", splits, 4096, vocab_size=vocab)
    base = [o for o in BASE if o != "model=tiny"]
    run = [
        *base,
        *["model=small-mla", "model.n_layers=3", "data.kind=tokens", f"data.dir={data}"],
        *["train.document_mask=true", "train.eval_every=5", "train.eval_batches=2"],
    ]
    reference = tmp_path / "one"
    Trainer(compose_run([*run, f"out_dir={reference}"])).fit(show_progress=False)
    _train(4, [*run, "parallel.cp=4"], tmp_path / "cp4")
    assert_trains_like(reference, tmp_path / "cp4", steps=5, keys=("loss", "grad_norm"))
    evals = [
        json.loads((tmp_path / x / "metrics.jsonl").read_text().splitlines()[-1])["eval_loss"]
        for x in ("one", "cp4")
    ]
    assert abs(evals[0] - evals[1]) < 1e-5


def _stage(overrides: list[str]):
    return plan(compose_run([*BASE, *overrides]))


def test_the_plan_counts_a_cp_th_of_each_sequence_plus_the_gathered_keys_and_values():
    """``moe plan`` at CP=2 and sequence S: a rank's activations are those of one process at
    S / 2 plus, per layer, the other rank's keys and values (grouped-query: 2 kv heads of 32);
    the traffic adds their all-gather and reduce-scatter per layer."""
    cp2 = compose_run([*BASE, *GQA, "parallel.cp=2", "train.seq_len=64"])
    with_cp = _stage([*GQA, "parallel.cp=2", "train.seq_len=64"])
    half = _stage([*GQA, "train.seq_len=32"])
    assert with_cp.tokens_per_micro_batch == half.tokens_per_micro_batch == 2 * 32
    T, kv, layers, bc = 2 * 32, 2 * 32, 4, 4  # tokens per rank, kv width, fp32
    gathered = context_activation_bytes(cp2)
    assert gathered == (2 - 1) * T * 2 * kv * bc
    assert with_cp.memory.activations == half.memory.activations + layers * gathered
    assert with_cp.comm.context_per_layer == 2 * T * 2 * kv * bc  # gather + reduce-scatter
    assert with_cp.comm.context == with_cp.comm.context_per_layer * layers * 4  # micro-batches
    assert half.comm.context == 0
    # the sequence-proportional all-to-all halves with the rank's tokens
    ep = ["parallel.ep=2", "train.global_batch_size=16"]
    assert (
        _stage([*GQA, *ep, "parallel.cp=2", "train.seq_len=64"]).comm.all_to_all_per_layer
        == _stage([*GQA, *ep, "train.seq_len=32"]).comm.all_to_all_per_layer
    )


def test_the_plan_gathers_latent_attentions_compressed_key_value():
    """Latent attention sends its compressed key-value and rotary key (32 + 16 wide in
    small-mla), gathered again by selective recompute, and keeps nothing gathered then."""
    mla = [o for o in BASE if o != "model=tiny"] + ["model=small-mla", "parallel.cp=2"]
    run = compose_run([*mla, "parallel.recompute=selective"])
    T = 2 * 32 // 2
    assert plan(run).comm.context_per_layer == 3 * T * (32 + 16) * 4
    assert context_activation_bytes(run) == 0
    assert context_activation_bytes(compose_run(mla)) > 0
