"""Context parallelism (``parallel.cp``): a sequence split over ranks trains what one process
trains (CPU, gloo, under torchrun; tolerances: tests/test_parallel.py's docstring), with equal
causal attention work on every rank."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import BASE, assert_trains_like, explain, torchrun, write_token_dir

from moe_core.compose import compose_run
from moe_core.config import ConfigError, OptionNotImplementedError
from moe_core.model import attention
from moe_core.model.attention import causal_attention, context_attention
from moe_core.model.context import (
    ContextShard,
    context_varlen,
    local_positions,
    pairs_per_rank,
    with_layout,
)
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


def _documents_crossing_chunks(B: int, S: int, seed: int) -> torch.Tensor:
    """Inputs whose documents cross the chunks' edges unevenly; the first row is one document
    (a rank's head and tail chunk both reach its keys)."""
    gen = torch.Generator().manual_seed(seed)
    inputs = torch.randint(1, 50, (B, S), generator=gen)
    inputs[inputs < 8] = EOS
    inputs[0] = 1
    return inputs


def _layout_mask(layout, B: int, S: int, K: int) -> torch.Tensor:
    """[B, 1, S, K] boolean: which key each query sees under ``layout``, read as a varlen
    kernel with causal attention aligned at the bottom right reads it (per segment, query i
    of Lq sees its keys 0 .. i + Lk - Lq)."""
    seen = torch.zeros(B * S, B * K, dtype=torch.bool)
    cu_q, cu_k = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        keys = layout.key_index[k0:k1]
        for i in range(q1 - q0):
            seen[q0 + i, keys[: i + 1 + (k1 - k0) - (q1 - q0)]] = True
    rows = seen.view(B, S, B, K).transpose(1, 2)  # [query row, key row, S, K]
    assert not rows[~torch.eye(B, dtype=torch.bool)].any()  # no query reaches another row
    return torch.stack([rows[b, b] for b in range(B)])[:, None]


@pytest.mark.parametrize("cp", [2, 4])
def test_the_varlen_layout_of_a_ranks_segments_is_its_document_mask(cp):
    """``context_varlen`` (host arithmetic): segments within one document and one chunk,
    int32 boundaries ending at the totals, longest lengths as host ints; read as bottom-right
    causal attention, exactly the mask of the rank's queries within their documents."""
    B, S = 3, 48
    docs = documents_of(_documents_crossing_chunks(B, S, cp), EOS)
    for rank in range(cp):
        layout = context_varlen(docs.positions_BS, cp, rank)
        len_q, len_k = (torch.diff(c.long()) for c in (layout.cu_seqlens_q, layout.cu_seqlens_k))
        assert layout.cu_seqlens_q.dtype == layout.cu_seqlens_k.dtype == torch.int32
        assert int(layout.cu_seqlens_q[-1]) == B * S // cp
        assert int(layout.cu_seqlens_k[-1]) == len(layout.key_index)
        assert (len_q >= 1).all() and (len_k >= len_q).all()
        assert (layout.max_len_q, layout.max_len_k) == (int(len_q.max()), int(len_k.max()))
        expected = ContextShard(cp, rank, S).documents(docs).mask()
        assert torch.equal(_layout_mask(layout, B, S // cp, S), expected)
    # the one-document row: a rank's tail chunk reaches keys its head chunk reaches too
    assert len(context_varlen(docs.positions_BS[:1], cp, 0).key_index) > S


def _sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kw):
    """A reference for ``flash_attn_varlen_func``: SDPA per (query segment, key segment) pair
    under causal attention aligned at the bottom right (FlashAttention's convention where a
    segment has fewer queries than keys), heads [T, H, d]."""
    assert kw["causal"] and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == int(torch.diff(cu_seqlens_q).max())
    assert max_seqlen_k == int(torch.diff(cu_seqlens_k).max())
    outs = []
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:], strict=False):
        Lq, Lk = q1 - q0, k1 - k0
        mask = torch.arange(Lk)[None, :] <= torch.arange(Lq)[:, None] + (Lk - Lq)
        qs, ks, vs = (x.transpose(0, 1) for x in (q[q0:q1], k[k0:k1], v[k0:k1]))
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=kw["softmax_scale"], enable_gqa=True
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("cp", [2, 4])
def test_the_varlen_call_under_cp_gives_the_masked_paths_outputs_and_gradients(cp, monkeypatch):
    """The FlashAttention 4 path of ``context_attention`` with documents (its key picking,
    layouts, one varlen call), the kernel replaced by the SDPA reference per segment: outputs
    and the gradients of queries and the gathered keys and values equal the masked SDPA path's
    (grouped-query heads; the real kernel: tests/test_context_parallel_gpu.py)."""
    monkeypatch.setattr(
        attention,
        "_varlen",
        lambda q, k, v, cu, lens, scale: _sdpa_varlen(
            q, k, v, *cu, *lens, causal=True, softmax_scale=scale
        ),
    )
    B, H, Hkv, S, d = 2, 4, 2, 32, 8
    docs = documents_of(_documents_crossing_chunks(B, S, 10 + cp), EOS)
    gen = torch.Generator().manual_seed(cp)
    for rank in range(cp):
        shard = ContextShard(cp, rank, S)
        q = torch.randn(B, H, S // cp, d, generator=gen, requires_grad=True)
        k, v = (torch.randn(B, Hkv, S, d, generator=gen, requires_grad=True) for _ in "kv")
        dy = torch.randn(B, S // cp, H * d, generator=gen)
        results = []
        for run in ("masked", "varlen"):
            if run == "masked":
                y = context_attention(q, k, v, Kernels(), shard, 0.3, docs)
            else:
                layout = shard.documents(with_layout(docs, cp, rank)).context
                y = attention._flash4_context_varlen(q, k, v, layout, 0.3)
            results.append((y, *torch.autograd.grad(y, [q, k, v], dy)))
        for got, ref in zip(*results, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


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


@pytest.mark.slow
@pytest.mark.extended  # its parts run every time: CP=2 x EP=2 above, documents at CP=4 above
def test_grouped_query_attention_within_documents_at_cp2_and_cp2_ep2(tmp_path):
    """Grouped-query attention within packed documents that the chunks cut unevenly, at CP=2
    and CP=2 x EP=2: losses, gradient norms, weights and every tensor's update reproduce one
    process over 5 steps."""
    splits = {"train": _documents(12_000, 4096, 2), "validation": _documents(2_000, 4096, 3)}
    data = write_token_dir(tmp_path / "data", splits, 4096, vocab_size=4096)
    run = [*BASE, *GQA, "data.kind=tokens", f"data.dir={data}", "train.document_mask=true"]
    reference = tmp_path / "one"
    Trainer(compose_run([*run, f"out_dir={reference}"])).fit(show_progress=False)
    for name, nproc, layout in (("cp2", 2, []), ("cp2-ep2", 4, ["parallel.ep=2"])):
        _train(nproc, [*run, "parallel.cp=2", *layout], tmp_path / name)
        assert_trains_like(reference, tmp_path / name, steps=5, keys=("loss", "grad_norm"))


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
    # under a document mask the varlen core keeps the keys its segments pick instead: at most
    # one chunk (64 / 4) a row more than gathered, micro-batch 2
    docs = compose_run([*BASE, *GQA, "parallel.cp=2", "train.seq_len=64", "data.kind=tokens"])
    docs = dataclasses.replace(docs, train=dataclasses.replace(docs.train, document_mask=True))
    assert context_activation_bytes(docs) == gathered + 2 * 16 * 2 * kv * bc
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
