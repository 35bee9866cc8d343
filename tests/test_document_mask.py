"""Intra-document attention (``train.document_mask``): a packed document trains exactly as it
would alone in its own sequence, on every layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import BASE, assert_trains_like, explain, torchrun, write_token_dir

from moe_core.compose import compose_run
from moe_core.config import ConfigError, ModelConfig, OptionNotImplementedError
from moe_core.model import build_model
from moe_core.model.documents import Documents, documents_of
from moe_core.train.trainer import Trainer

EOS = 0  # write_token_dir's stand-in tokenizer records EOS id 0


def test_documents_start_at_each_row_and_after_every_eos():
    inputs = torch.tensor([[5, EOS, 7, 8, EOS, 9], [EOS, EOS, 3, 4, 5, 6]])
    docs = documents_of(inputs, EOS)
    assert docs.positions_BS.tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    # flattened starts: row 0 at 0, 2, 5; row 1 at 6, 7, 8; then the end
    assert docs.cu_seqlens_N.tolist() == [0, 2, 5, 6, 7, 8, 12]
    assert docs.cu_seqlens_N.dtype == torch.int32
    assert docs.max_len == 4
    mask = docs.mask()[1, 0]
    assert mask[5].tolist() == [False, False, True, True, True, True]  # its document's keys
    assert not mask[2, 3]  # never a later key


def _variants() -> dict[str, ModelConfig]:
    tiny = compose_run(["model=tiny", "model.n_layers=2"]).model
    gqa = compose_run(
        ["model=tiny", "model.n_layers=2", "model.n_kv_heads=2", "model.qk_norm=head"]
    ).model
    mla = compose_run(["model=small-mla", "model.n_layers=2"]).model
    return {"olmoe-style": tiny, "gqa-head-norm": gqa, "latent": mla}


def _packed(lengths: list[list[int]], vocab: int, seed: int) -> tuple[torch.Tensor, list]:
    """Rows of documents (each ending in EOS but a row's last, which the row cuts) and each
    document's (row, start, end)."""
    gen = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for r, row in enumerate(lengths):
        parts, start = [], 0
        for length in row:
            doc = torch.randint(1, vocab, (length,), generator=gen)
            doc[-1] = EOS
            parts.append(doc)
            spans.append((r, start, start + length))
            start += length
        rows.append(torch.cat(parts))
    return torch.stack(rows), spans


@pytest.mark.parametrize("variant", ["olmoe-style", "gqa-head-norm", "latent"])
def test_a_packed_document_gets_the_logits_it_gets_alone(variant):
    cfg = _variants()[variant]
    model = build_model(cfg, seed=3).eval()
    inputs, spans = _packed([[5, 9, 2, 8], [11, 13]], cfg.vocab_size, seed=1)
    docs = documents_of(inputs, EOS)
    with torch.no_grad():
        packed = model.head(model.norm(model.hidden(inputs, docs=docs)[0]))
        unmasked = model(inputs)[0]
        for r, start, end in spans:
            alone = model(inputs[r : r + 1, start:end])[0][0]
            torch.testing.assert_close(packed[r, start:end], alone, rtol=1e-5, atol=1e-5)
        # a later document does see its predecessors without the mask (the test can fail)
        r, start, end = spans[1]
        assert (unmasked[r, start:end] - packed[r, start:end]).abs().max() > 1e-3


@pytest.mark.parametrize("variant", ["gqa-head-norm", "latent"])
def test_flex_attention_computes_what_the_masked_reference_computes(variant):
    """``parallel.attention=flex``: FlexAttention under the documents' block mask (and the
    causal one without documents) gives the SDPA reference's logits (the CPU runs torch's
    unfused FlexAttention, forward only: its gradients are tests/test_document_mask_gpu.py's)."""
    import copy

    from moe_core.model.kernel_choice import Kernels
    from moe_core.model.transformer import apply_kernels

    cfg = _variants()[variant]
    reference = build_model(cfg, seed=5)
    flex = copy.deepcopy(reference)
    apply_kernels(flex, Kernels(attention="flex"))
    inputs, _ = _packed([[5, 9, 2, 8], [11, 13]], cfg.vocab_size, seed=4)
    with torch.no_grad():
        for docs in (documents_of(inputs, EOS), None):
            want, got = (m.head(m.norm(m.hidden(inputs, docs=docs)[0])) for m in (reference, flex))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # the documents' block mask is made once and shared by every layer of the micro-batch
        docs = documents_of(inputs, EOS)
        flex.hidden(inputs, docs=docs)
        assert docs.block_mask is not None and docs.block_mask.shape[0] == inputs.shape[0]


def test_flex_attention_with_context_parallelism_or_on_a_cpu_is_refused(tmp_path):
    with pytest.raises(OptionNotImplementedError) as err:
        compose_run([*BASE, "parallel.attention=flex", "parallel.cp=2", "train.seq_len=32"])
    assert str(err.value) == (
        "parallel.attention='flex' with parallel.cp=2 is not built yet: context parallelism runs "
        "FlashAttention 4 or SDPA; set parallel.attention=auto."
    )
    with pytest.raises(ConfigError) as err:
        Trainer(compose_run([*BASE, "parallel.attention=flex", f"out_dir={tmp_path}"]))
    assert str(err.value) == (
        "parallel.attention='flex' needs a CUDA GPU (torch's FlexAttention has no backward on "
        "the CPU), which this cpu run lacks; use 'auto' or 'sdpa'."
    )
    assert not (tmp_path / "checkpoints").exists()


def test_gradients_stay_inside_their_document():
    cfg = _variants()["olmoe-style"]
    model = build_model(cfg, seed=0)
    inputs, spans = _packed([[6, 10]], cfg.vocab_size, seed=2)
    docs = documents_of(inputs, EOS)
    h = model.embed(inputs).detach().requires_grad_()
    rope = model.rope(inputs.shape[1], h.device, docs.positions_BS)
    out, _ = model.layers["0"](h, torch.zeros(()), rope, docs)
    _, start, end = spans[1]
    out[0, start:end].sum().backward()
    assert h.grad[0, :start].abs().max() == 0  # the first document gets nothing from the second
    assert h.grad[0, start:end].abs().max() > 0


def test_the_mask_is_refused_without_documents_or_with_captured_graphs():
    with pytest.raises(ConfigError, match=r"train.document_mask=True is not allowed: false with"):
        compose_run([*BASE, "train.document_mask=true"])  # synthetic walks
    with pytest.raises(ConfigError, match=r"parallel.cuda_graph=True is not allowed"):
        compose_run(
            [*BASE, "data.kind=tokens", "train.document_mask=true", "parallel.cuda_graph=true"]
        )
    cfg = compose_run([*BASE, "data.kind=tokens", "train.document_mask=true"])
    assert not cfg.parallel.cuda_graph_on("cuda", cfg.train.document_mask)
    assert cfg.parallel.cuda_graph_on("cuda", False)


def _documents(n_tokens: int, vocab: int, seed: int) -> np.ndarray:
    """Tokens with an EOS after documents of 3 to 20 tokens: sequences split them unevenly."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, n_tokens)
    ends = np.cumsum(rng.integers(3, 21, n_tokens))
    tokens[ends[ends < n_tokens]] = EOS
    return tokens


@pytest.fixture(scope="module")
def packed_data(tmp_path_factory) -> Path:
    vocab = 4096
    splits = {"train": _documents(12_000, vocab, 0), "validation": _documents(2_000, vocab, 1)}
    return write_token_dir(tmp_path_factory.mktemp("docs"), splits, 4096, vocab_size=vocab)


def _masked_run(packed_data: Path) -> list[str]:
    # DeepSeek-V3's block at a small size with an MTP depth: latent attention and the MTP
    # block attend within documents too
    base = [o for o in BASE if o != "model=tiny"]
    return [
        *base,
        "model=small-mla",
        "model.n_layers=4",
        "model.mtp_depth=1",
        "data.kind=tokens",
        f"data.dir={packed_data}",
        "train.document_mask=true",
        "train.eval_every=5",
        "train.eval_batches=2",
    ]


def test_the_trainer_hands_each_micro_batch_its_documents(packed_data, tmp_path):
    trainer = Trainer(compose_run([*_masked_run(packed_data), f"out_dir={tmp_path}"]))
    batches = trainer.micro_batches()
    docs = trainer.batches.documents
    assert docs is not None and len(docs) == len(batches)
    for tokens, d in zip(batches, docs, strict=True):
        expected = documents_of(tokens[:, :-1], EOS)
        assert torch.equal(d.positions_BS, expected.positions_BS)
        assert torch.equal(d.cu_seqlens_N, expected.cu_seqlens_N)
        assert d.max_len < tokens.shape[1] - 1  # the data's documents are shorter than a row
    # the step's loss is the masked model's: the same batches without documents differ
    masked = trainer._forward_backward(batches, forward_only=True, documents=docs).ce
    plain = trainer._forward_backward(batches, forward_only=True).ce
    assert abs(masked.item() - plain.item()) > 1e-4
    trainer._stop_prefetching()
    trainer.release()


@pytest.fixture(scope="module")
def masked_reference(packed_data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("masked-reference")
    Trainer(compose_run([*_masked_run(packed_data), f"out_dir={out}"])).fit(show_progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.ep=2"],
        ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    ],
    ids=["ep2", "pp2-interleaved"],
)
def test_layouts_train_the_single_process_masked_model(
    layout, packed_data, masked_reference, tmp_path
):
    command = ["-m", "moe_core.cli", "train", *_masked_run(packed_data), *layout]
    result = torchrun(2, [*command, f"out_dir={tmp_path}"])
    assert result.returncode == 0, explain(result)
    assert_trains_like(masked_reference, tmp_path, steps=5, keys=("loss", "mtp_losses"))


def test_documents_move_with_their_tensors():
    docs = documents_of(torch.tensor([[1, EOS, 2]]), EOS)
    moved = docs.to(torch.device("cpu"))
    assert isinstance(moved, Documents) and moved.max_len == docs.max_len


def test_the_evaluate_stage_scores_a_masked_run_as_it_trained_in_both_models(tmp_path):
    """The pipeline's perplexity (ours against transformers') takes the documents too: both
    agree under the mask, and the mask changes the loss."""
    from transformers import AutoModelForCausalLM

    from moe_core.convert.hf import save_hf
    from moe_core.eval.perplexity import score

    cfg = _variants()["gqa-head-norm"]
    ours = build_model(cfg, seed=4).eval()
    theirs = AutoModelForCausalLM.from_pretrained(
        save_hf(ours.state_dict(), cfg, tmp_path / "hf"), dtype=torch.float32
    ).eval()
    tokens, _ = _packed([[7, 12, 14], [20, 10, 3]], cfg.vocab_size, seed=5)
    masked, hf_masked = score(ours, theirs, tokens, EOS)
    plain, hf_plain = score(ours, theirs, tokens, None)
    assert abs(masked - hf_masked) < 1e-5 * masked
    assert abs(plain - hf_plain) < 1e-5 * plain
    assert abs(masked - plain) > 1e-4
