"""Weighted mixtures (``data.sources``): config refusals, the deterministic dp-independent draw,
realized shares, exact resume under another data-parallel size, repetition, metrics, the plan."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from helpers import BASE, write_token_dir

from moe_core.compose import compose_run
from moe_core.config import SOURCE_FORMATS, ConfigError, RunConfig, SourceConfig, source_shares
from moe_core.config_dict import from_dict, to_dict
from moe_core.data.formats import FORMATS
from moe_core.data.loader import TokenLoader
from moe_core.data.mixture import MixtureLoader, assign

SEQ = 7  # instances of 8 tokens
B_BASE = 2400  # source b's token values start here, so a row says which source it is from
VOCAB = 4096  # the tiny model's


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Source a: 300 instances (tokens 0..2399, each once); b: 100 (tokens B_BASE..3199)."""
    root = tmp_path_factory.mktemp("mix")
    a = write_token_dir(
        root / "a",
        {"train": np.arange(300 * (SEQ + 1)), "validation": 3500 + np.arange(100)},
        shard_tokens=500,
        vocab_size=VOCAB,
    )
    b = write_token_dir(
        root / "b",
        {"train": B_BASE + np.arange(100 * (SEQ + 1)), "validation": 3600 + np.arange(100)},
        shard_tokens=300,
        vocab_size=VOCAB,
    )
    return a, b


def sources(dirs, wa=0.7, wb=0.3) -> list[SourceConfig]:
    return [SourceConfig("a", str(dirs[0]), weight=wa), SourceConfig("b", str(dirs[1]), weight=wb)]


def mixture(dirs, mb=2, dp_rank=0, dp_size=1, seed=0, wa=0.7, wb=0.3) -> MixtureLoader:
    src = sources(dirs, wa, wb)
    shares = source_shares(src, run_tokens=1)
    return MixtureLoader(src, shares, SEQ, mb, dp_rank=dp_rank, dp_size=dp_size, seed=seed)


def global_steps(dirs, dp: int, micro_steps: int, mb: int = 2, state=None) -> torch.Tensor:
    """``micro_steps`` global micro-steps over ``dp`` ranks, each the ranks' micro-batches in
    rank order: ``[micro_steps * dp * mb, SEQ + 1]``."""
    loaders = [mixture(dirs, mb, r, dp) for r in range(dp)]
    if state is not None:
        for loader in loaders:
            loader.load_state_dict(json.loads(json.dumps(state)))
    its = [iter(loader) for loader in loaders]
    rows = [next(it) for _ in range(micro_steps) for it in its]
    return torch.cat(rows)


def run(overrides: list[str]) -> RunConfig:
    return compose_run([*BASE, "data.kind=tokens", *overrides])


# ---- config --------------------------------------------------------------------------------


def data(*items: dict, **extra) -> dict:
    return {"data": {"kind": "tokens", "sources": list(items), **extra}}


@pytest.mark.parametrize(
    "config, sentence",
    [
        (
            data({"name": "a", "dir": "/d/a", "weight": 0.7, "tokens": 10}),
            "data.sources[0].weight=0.7 is not allowed: a weight or a token budget, exactly one "
            "of the two (data.sources[0].tokens=10).",
        ),
        (
            data({"name": "a", "dir": "/d/a"}),
            "data.sources[0].weight=None is not allowed: a weight or a token budget, exactly "
            "one of the two (data.sources[0].tokens=None).",
        ),
        (
            data(
                {"name": "a", "dir": "/d/a", "weight": 1}, {"name": "b", "dir": "/d", "weight": 0}
            ),
            "data.sources[1].weight=0.0 is not allowed: a finite number above 0.",
        ),
        (
            data({"name": "a", "dir": "/d/a", "weight": float("nan")}),
            "data.sources[0].weight=nan is not allowed: a finite number above 0.",
        ),
        (
            data({"name": "a", "dir": "/d/a", "tokens": -5}),
            "data.sources[0].tokens=-5 is not allowed: a positive number of tokens.",
        ),
        (
            data({"name": "web crawl", "dir": "/d/a", "weight": 1}),
            "data.sources[0].name='web crawl' is not allowed: 1 to 64 letters, digits and . _ - "
            "starting with a letter or digit (it names the source's metrics).",
        ),
        (
            data(
                {"name": "a", "dir": "/d/a", "weight": 1}, {"name": "a", "dir": "/d", "weight": 1}
            ),
            "data.sources[1].name='a' is not allowed: a name no other source has.",
        ),
        (
            data({"name": "a", "dir": "/d/a", "weight": 1, "format": "arrow"}),
            "data.sources[0].format='arrow' is not allowed: one of 'moe', 'dolma', 'megatron'.",
        ),
        (
            data(
                {
                    "name": "a",
                    "dir": "/d/a",
                    "weight": 1,
                    "format": "megatron",
                    "token_dtype": "uint16",
                }
            ),
            "data.sources[0].token_dtype='uint16' is not allowed: unset unless "
            "data.sources[0].format='dolma' (the other formats say their dtype).",
        ),
        (
            data({"name": "a", "dir": "/d/a", "weight": 1, "token_dtype": "uint8"}),
            "data.sources[0].token_dtype='uint8' is not allowed: one of 'uint16', 'uint32' "
            "(did you mean 'uint32'?).",
        ),
        (
            data({"name": "a", "dir": "/d/a", "weight": 1}, format="dolma"),
            "data.format='dolma' is not allowed: 'moe' (unset) with data.sources: each source "
            "names its own (data.sources[i].format).",
        ),
        (
            {
                **data({"name": "web", "dir": "/d/web", "weight": 1, "format": "dolma"}),
                "eval": {"every": 5, "tasks": ["toy:rc_0shot"]},
            },
            "eval.every=5 is not allowed: 0 with a mixture none of whose sources has format "
            "'moe' (downstream tasks read the tokenizer files of a moe tokenize folder, which "
            "dolma and megatron sources do not have).",
        ),
        (
            data({"name": "a", "dir": " ", "weight": 1}),
            "data.sources[0].dir=' ' is not allowed: a folder path (it is empty or blank: an "
            "unset variable?).",
        ),
        (
            data({"name": "a", "dir": "/d/a", "wieght": 1}),
            "data.sources[0].wieght is not a known option: data.sources[0] takes dir, format, "
            "name, token_dtype, tokens, weight (did you mean data.sources[0].weight?).",
        ),
        (
            data({"name": "a", "dir": "/d/a", "weight": "heavy"}),
            "data.sources[0].weight='heavy' is not allowed: a number.",
        ),
        (
            {"data": {"sources": [{"name": "a", "dir": "/d/a", "weight": 1}]}},
            "data.sources=['a'] is not allowed: an empty list with data.kind=synthetic, which "
            "reads no files (set data.kind=tokens to train on them).",
        ),
        (
            {
                **data(
                    {"name": "a", "dir": "/d/a", "tokens": 8 * 128 * 100},
                    {"name": "b", "dir": "/d/b", "weight": 1},
                )
            },
            "data.sources=['a', 'b'] is not allowed: token budgets that total less than the "
            "102400 tokens the run trains on (train.steps x global_batch_size x seq_len), so "
            "that the weighted sources get some; they total 102400.",
        ),
    ],
)
def test_bad_sources_are_refused_in_one_sentence(config, sentence):
    with pytest.raises(ConfigError) as err:
        from_dict(RunConfig, config)
    assert str(err.value) == sentence


def test_hydra_composes_a_list_of_sources_and_shares_follow_weights_and_budgets():
    cfg = run(["data.sources=[{name:web,dir:/d/web,weight:7},{name:code,dir:/d/code,weight:3}]"])
    assert [(s.name, s.dir, s.format) for s in cfg.data.sources] == [
        ("web", "/d/web", "moe"),
        ("code", "/d/code", "moe"),
    ]
    assert cfg.source_shares == pytest.approx([0.7, 0.3])
    # a budget takes its exact share of the run's tokens; the weights split the rest
    tokens = 5 * 8 * 32  # BASE: steps x global_batch_size x seq_len
    cfg = run([f"data.sources=[{{name:a,dir:/a,tokens:{tokens // 4}}},{{name:b,dir:/b,weight:2}}]"])
    assert cfg.source_shares == pytest.approx([0.25, 0.75])
    # budgets alone are normalized
    cfg = run(["data.sources=[{name:a,dir:/a,tokens:100},{name:b,dir:/b,tokens:300}]"])
    assert cfg.source_shares == pytest.approx([0.25, 0.75])
    assert run([]).data.sources == []  # the one folder data.dir, as before
    # a resolved config (moe train --config, a checkpoint's) reads back as it was
    assert from_dict(RunConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg


def test_every_format_a_source_may_name_has_a_reader():
    """Each name a source may take is a format ``formats.FORMATS`` reads, and the other way."""
    assert tuple(FORMATS) == SOURCE_FORMATS
    cfg = run(["data.sources=[{name:a,dir:/a,weight:1.0,format:dolma,token_dtype:uint32}]"])
    assert (cfg.data.sources[0].format, cfg.data.sources[0].token_dtype) == ("dolma", "uint32")
    one = cfg.data.of_source(cfg.data.sources[0])
    assert (one.dir, one.format, one.token_dtype, one.sources) == ("/a", "dolma", "uint32", [])


# ---- the draw ------------------------------------------------------------------------------


def test_the_schedule_keeps_every_source_within_one_instance_of_its_share():
    rng = np.random.default_rng(0)
    for k in (2, 3, 5, 8):
        weights = rng.random(k) + 0.01
        shares = (weights / weights.sum()).tolist()
        drawn = [0] * k
        source_N, draw_N = assign(shares, drawn, 0, 5000)
        counts_NK = np.cumsum(np.eye(k, dtype=np.int64)[source_N], axis=0)
        ideal_NK = np.outer(np.arange(1, 5001), shares)
        assert np.abs(counts_NK - ideal_NK).max() < 1.0
        assert drawn == counts_NK[-1].tolist()
        # draw numbers count each source's slots from 0
        for s in range(k):
            assert draw_N[source_N == s].tolist() == list(range(drawn[s]))


def test_the_draw_is_fixed_by_the_seed(dirs):
    first = global_steps(dirs, 1, 20)
    assert torch.equal(first, global_steps(dirs, 1, 20))
    other = torch.cat([next(it) for it in [iter(mixture(dirs, seed=1))] for _ in range(20)])
    assert not torch.equal(first, other)


@pytest.mark.parametrize("dp", [2, 4])
def test_a_global_step_holds_the_same_instances_for_any_dp_size(dirs, dp):
    # 2 * dp instances per global micro-step: dp=1's micro-steps grouped by dp
    straight = global_steps(dirs, 1, 12 * dp)
    sharded = global_steps(dirs, dp, 12)
    assert torch.equal(straight, sharded)
    # no instance twice: 24 * dp draws stay inside both sources' first epochs
    rows = {tuple(r.tolist()) for r in sharded}
    assert len(rows) == len(sharded)


def test_realized_token_shares_of_a_70_30_mixture_stay_within_1_percent_over_1000_steps(dirs):
    """1,000 steps of a global batch of 8 over dp=2: token shares from the rows served (by
    their token values, not the loader's counts), checked after every step."""
    loaders = [mixture(dirs, mb=2, dp_rank=r, dp_size=2) for r in range(2)]
    its = [iter(loader) for loader in loaders]
    from_a = 0
    a_rows: list[int] = []
    for step in range(1000):
        rows = torch.cat([next(it) for _ in range(2) for it in its])  # 2 micro-steps a step
        is_a = rows[:, 0] < B_BASE
        from_a += int(is_a.sum())
        a_rows += (rows[is_a, 0] // (SEQ + 1)).tolist()
        # every step: each source within one instance of its share of the instances so far
        assert abs(from_a - 0.7 * 8 * (step + 1)) < 1, step
    assert abs(from_a / 8000 - 0.7) <= 0.01 * 0.7
    assert abs((8000 - from_a) / 8000 - 0.3) <= 0.01 * 0.3
    # each epoch of a (300 instances) serves every one of its instances once
    for e in range(len(a_rows) // 300):
        assert sorted(a_rows[e * 300 : (e + 1) * 300]) == list(range(300))
    tokens, epochs = loaders[0].seen(loaders[0].state_dict())
    assert tokens == {"a": from_a * SEQ, "b": (8000 - from_a) * SEQ}
    assert epochs == {"a": from_a / 300, "b": (8000 - from_a) / 100}


@pytest.mark.parametrize("dp_before, dp_after, mb_after", [(1, 1, 2), (2, 4, 1), (4, 1, 4)])
def test_resume_mid_run_continues_the_same_sequence_under_another_dp_size(
    dirs, dp_before, dp_after, mb_after
):
    """After 360 instances (b in its second epoch), a state of one layout resumed by another
    continues exactly the uninterrupted run's instances."""
    straight = global_steps(dirs, 1, 200)
    loaders = [mixture(dirs, 2, r, dp_before) for r in range(dp_before)]
    its = [iter(loader) for loader in loaders]
    for _ in range(360 // (2 * dp_before)):
        for it in its:
            next(it)
    state = loaders[0].state_dict()
    assert state == loaders[-1].state_dict() and state["consumed"] == 360
    assert state["drawn"] == {"a": 252, "b": 108}
    per_step = mb_after * dp_after
    resumed = global_steps(dirs, dp_after, (400 - 360) // per_step, mb_after, state)
    assert torch.equal(resumed, straight[360:])


def test_a_state_of_other_sources_weights_or_a_single_folder_is_refused(dirs):
    state = mixture(dirs).state_dict()
    other = mixture(dirs, wa=0.5, wb=0.5)
    assert other.state_problem(state) == "source 'a' has share 0.7 there, 0.5 here"
    swapped = [
        SourceConfig("b", str(dirs[1]), weight=0.3),
        SourceConfig("a", str(dirs[0]), weight=0.7),
    ]
    loader = MixtureLoader(swapped, [0.3, 0.7], SEQ, 2)
    assert loader.state_problem(state) == "the sources are ['a', 'b'] there, ['b', 'a'] here"
    single = TokenLoader(dirs[0], "train", SEQ, 2)
    assert mixture(dirs).state_problem(single.state_dict()) == (
        "the state is a single folder's (data.dir) there, a mixture (data.sources) here"
    )
    assert single.state_problem(state) == (
        "the state is a mixture's (data.sources) there, a single folder's (data.dir) here"
    )
    with pytest.raises(ValueError, match=r"consumed=140 .* must be a multiple of 8"):
        bad = {**state, "consumed": 140, "drawn": {"a": 98, "b": 42}}
        mixture(dirs, mb=4, dp_size=2).load_state_dict(bad)


# ---- training, metrics, plan ---------------------------------------------------------------


def mixture_run(tmp_path, dirs, out: str, steps: int, *extra: str, wa=0.7, wb=0.3):
    from moe_core.train.trainer import Trainer

    spec = f"[{{name:a,dir:'{dirs[0]}',weight:{wa}}},{{name:b,dir:'{dirs[1]}',weight:{wb}}}]"
    overrides = [
        "train.seq_len=7",
        f"data.sources={spec}",
        f"train.steps={steps}",
        f"out_dir={tmp_path / out}",
        *extra,
    ]
    return Trainer(run(overrides))


@pytest.mark.slow
def test_moe_train_resumes_a_mixture_exactly_and_logs_each_sources_tokens(tmp_path, dirs, capsys):
    """Steps of 8 instances from the 70/30 mixture: a checkpoint at step 3 resumed trains the
    same steps; metrics.jsonl has each source's tokens and epochs."""
    from moe_core.train.trainer import Trainer

    every = "train.eval_every=3"  # held-out loss on a's validation split
    straight = mixture_run(tmp_path, dirs, "straight", 6, "train.checkpoint_every=3", every)
    history = straight.fit(show_progress=False)
    metrics = (tmp_path / "straight" / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in metrics.splitlines()]
    assert lines[-1]["data_tokens"] == {"a": 34 * 7, "b": 14 * 7}  # 48 slots: 33.6 and 14.4
    assert lines[0]["data_epochs"] == {"a": 6 / 300, "b": 2 / 100}
    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000003",
        tmp_path / "resumed" / "checkpoints" / "step_00000003",
    )
    resumed = mixture_run(tmp_path, dirs, "resumed", 6, every)
    assert isinstance(resumed, Trainer) and resumed.step == 3
    rest = resumed.fit(show_progress=False)
    assert [m.loss for m in rest] == [m.loss for m in history[3:]]
    assert [m.data_tokens for m in rest] == [m.data_tokens for m in history[3:]]
    assert history[2].eval_loss is not None and rest[-1].eval_loss == history[-1].eval_loss
    for a, b in zip(resumed.chunks[0].parameters(), straight.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_source_that_runs_out_repeats_and_says_so_once(tmp_path, dirs):
    said: list[str] = []
    trainer = mixture_run(tmp_path, dirs, "repeat", 17, wa=0.2, wb=0.8)
    trainer.batches._warn = said.append
    history = trainer.fit(show_progress=False)
    repeats = [s for s in said if "repeats" in s]
    # at 20/80, b's 101st draw is slot 125 (the schedule's): step 15 of 8 slots a step
    assert repeats == [
        "data source 'b' repeats from step 15 on: the run reads more of it than it holds (its "
        "epochs are in metrics.jsonl as data_epochs; moe plan shows how many the run implies)"
    ]
    assert history[14].data_epochs["b"] <= 1 < history[15].data_epochs["b"]


def test_mlflow_rows_carry_each_sources_tokens_and_epochs():
    from flows.tracking import metric_rows

    line = {"loss": 2.0, "data_tokens": {"a": 70, "b": 30}, "data_epochs": {"a": 0.5, "b": 1.5}}
    rows = metric_rows(line)
    assert rows["data_tokens.a"] == 70.0 and rows["data_tokens.b"] == 30.0
    assert rows["data_epochs.b"] == 1.5


def three_sources(dirs) -> RunConfig:
    """a and b at 0.35 and 0.15 of the run, c (a folder that is not there) at 0.5."""
    spec = f"{{name:a,dir:'{dirs[0]}',weight:0.7}},{{name:b,dir:'{dirs[1]}',weight:0.3}}"
    sources = f"data.sources=[{spec},{{name:c,dir:/no,weight:1}}]"
    return run(["train.seq_len=7", "train.steps=100", sources])


def test_plan_shows_each_sources_share_and_the_epochs_the_steps_imply(dirs):
    from rich.console import Console

    from moe_core.cli import source_tokens
    from moe_core.plan.mixture import mixture_plan, mixture_table

    cfg = three_sources(dirs)
    rows = mixture_plan(cfg, source_tokens(cfg))
    # 800 slots: a 0.35 of them over 300 instances, b 0.15 over 100, c unreadable
    assert [(r.name, r.drawn, r.instances) for r in rows] == [
        ("a", 280, 300),
        ("b", 120, 100),
        ("c", 400, None),
    ]
    assert rows[1].epochs == pytest.approx(1.2) and rows[0].epochs == pytest.approx(280 / 300)
    console = Console(record=True, width=100)
    console.print(mixture_table(rows))
    text = console.export_text()
    assert "35.0%" in text and "1.20 (repeats)" in text and "unknown (not readable)" in text


def test_moe_plan_prints_the_mixture_after_the_plan(dirs, monkeypatch, capsys):
    from rich.console import Console

    import moe_core.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=200))
    spec = f"[{{name:a,dir:'{dirs[0]}',weight:0.7}},{{name:b,dir:'{dirs[1]}',weight:0.3}}]"
    overrides = [*BASE, "data.kind=tokens", "train.seq_len=7", "train.steps=100"]
    assert cli.main(["plan", *overrides, f"data.sources={spec}"]) == 0
    out = capsys.readouterr().out
    assert out.index("plan: model tiny") < out.index("data mixture")
    assert "70.0%" in out and "1.87" in out and "2.40 (repeats)" in out  # 560 / 300, 240 / 100


def test_moe_data_shows_a_mixtures_shares_and_each_source(dirs, monkeypatch, capsys):
    from rich.console import Console

    import moe_core.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=200))
    spec = f"[{{name:a,dir:'{dirs[0]}',weight:0.7}},{{name:b,dir:'{dirs[1]}',weight:0.3}}]"
    overrides = [*BASE, "data.kind=tokens", "train.seq_len=7", "train.steps=100"]
    assert cli.main(["data", "--sample-tokens=4", *overrides, f"data.sources={spec}"]) == 0
    out = capsys.readouterr().out
    assert "data mixture" in out and "70.0%" in out and "2.40 (repeats)" in out
    assert out.index("source a") < out.index(str(dirs[0])) < out.index("source b")
    assert out.index("source b") < out.index(str(dirs[1]))
    assert "sample ids  0 1 2 3" in out and f"sample ids  {B_BASE} " in out


def test_the_page_shows_the_mixture_as_moe_plan_does(dirs):
    """planner.js's mixtureRows (QuickJS) against plan.mixture.mixture_plan on a grid of
    global batches and sequence lengths (the page's inputs)."""
    from dataclasses import replace

    from test_plan_page import page_engine

    from moe_core.cli import source_tokens
    from moe_core.plan.mixture import epochs_text, mixture_plan
    from moe_core.planpage import page_data, render

    cfg = three_sources(dirs)
    tokens = source_tokens(cfg)
    js = page_engine(render(page_data(cfg, None, tokens)))
    layouts = [{"global_batch_size": g, "seq_len": q} for g in (8, 24, 998) for q in (7, 63, 255)]
    script = (
        f"JSON.stringify({json.dumps(layouts)}.map((L) => mixtureRows(DATA.mixture, L)"
        ".map((r) => [r.name, r.share, r.drawn, r.tokens, r.instances, r.epochs, "
        "epochsText(r.epochs, r.instances)])))"
    )
    for lay, rows in zip(layouts, json.loads(js.eval(script)), strict=True):
        train = replace(cfg.train, **lay)
        ref = mixture_plan(replace(cfg, train=train), tokens)
        expected = [
            [
                r.name,
                r.share,
                r.drawn,
                r.tokens,
                r.instances,
                r.epochs,
                epochs_text(r.epochs, r.instances),
            ]
            for r in ref
        ]
        assert rows == expected, lay
    assert epochs_text(None, 0) == "none: it holds no whole sequence"
    assert mixture_plan(cfg, tokens)[1].instances == 100  # 800 tokens of 8


# ---- sources in every format ----------------------------------------------------------------


@pytest.fixture(scope="module")
def formats_mix(tmp_path_factory):
    """A Dolma web corpus (listed first: its tail is the held-out split; one file with Dolma's
    metadata, one without), our shards of code and a Megatron math corpus, all in the tiny
    model's 4096 ids with end-of-text 0 (the code folder's tokenizer, which the others are read
    with)."""
    from test_data_formats import documents, write_dolma, write_megatron

    root = tmp_path_factory.mktemp("formats")
    web = documents(120, 21, top=VOCAB)
    write_dolma(root / "web" / "part-0.npy", web[:60])
    write_dolma(root / "web" / "part-1.npy", web[60:], metadata=False)
    code = np.concatenate(documents(80, 22, top=VOCAB))
    splits = {"train": code, "validation": code[:60]}
    write_token_dir(root / "code", splits, shard_tokens=400, vocab_size=VOCAB)
    write_megatron(root / "math" / "a_text_document", documents(90, 23, top=VOCAB))
    return root


def formats_spec(root, web=0.5, code=0.3, math=0.2) -> str:
    return (
        f"data.sources=[{{name:web,dir:'{root}/web',format:dolma,weight:{web}}},"
        f"{{name:code,dir:'{root}/code',weight:{code}}},"
        f"{{name:math,dir:'{root}/math',format:megatron,weight:{math}}}]"
    )


FORMATS_RUN = ["train.seq_len=7", "data.validation_fraction=0.1"]


def test_a_mixture_of_every_format_reads_each_in_place_and_resumes_under_another_dp_size(
    formats_mix,
):
    """Dolma, our shards and Megatron in one mixture: each source read by its format's reader
    with the code folder's vocabulary, the draw served token for token from them, and a state
    taken mid-run on one rank continued exactly on two."""
    from moe_core.data.dataset import TokenDataset
    from moe_core.data.formats import DolmaDataset, MegatronDataset, open_source, sources_vocabulary
    from moe_core.train.batches import check_mixture_fits

    cfg = run([*FORMATS_RUN, formats_spec(formats_mix)])
    check_mixture_fits(cfg)
    vocab = sources_vocabulary(cfg.data, cfg.model.vocab_size)
    assert vocab is not None and (vocab.size, vocab.eos_id) == (VOCAB, 0)
    assert "tokenizer.json" in vocab.files

    def opened():
        return [open_source(cfg.data.of_source(s), "train", SEQ, vocab) for s in cfg.data.sources]

    assert [type(d) for d in opened()] == [DolmaDataset, TokenDataset, MegatronDataset]

    def loaders(dp, mb, state=None):
        out = []
        for r in range(dp):
            src = cfg.data.sources
            loader = MixtureLoader(
                src, cfg.source_shares, SEQ, mb, dp_rank=r, dp_size=dp, seed=5, datasets=opened()
            )
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(state)))
            out.append(loader)
        return out

    one = loaders(1, 2)[0]
    it = iter(one)
    straight = torch.cat([next(it) for _ in range(60)])  # 120 instances
    datasets = opened()
    source_N, instance_N = one.slots(0, 120, [0, 0, 0])
    for row, s, i in zip(straight, source_N.tolist(), instance_N.tolist(), strict=True):
        assert torch.equal(row, torch.from_numpy(datasets[s][i]))  # token for token
    assert np.bincount(source_N, minlength=3).tolist() == [60, 36, 24]
    first = loaders(1, 2)[0]
    it = iter(first)
    for _ in range(20):
        next(it)
    state = first.state_dict()
    assert [s["format"] for s in state["sources"]] == ["dolma", "moe", "megatron"]
    two = [iter(x) for x in loaders(2, 1, state)]
    resumed = torch.cat([next(i) for _ in range(40) for i in two])
    assert torch.equal(resumed, straight[40:])


def test_a_mixture_names_its_tokenizer_once(formats_mix):
    """data.tokenizer may not contradict the tokenizer the moe-format sources were written
    with; with no source of ours the run's vocabulary is data.tokenizer's (bpe: the model's)."""
    from moe_core.data.formats import sources_vocabulary
    from moe_core.train.batches import check_data_fits

    cfg = run([*FORMATS_RUN, formats_spec(formats_mix), "data.tokenizer=gpt2"])
    with pytest.raises(ConfigError) as err:
        check_data_fits(cfg)
    said = str(err.value)
    assert said.startswith("data.tokenizer='gpt2' is not allowed: 'bpe' (unset, to take theirs)")
    assert f"data source 'code' ({formats_mix}/code) records another" in said
    web = f"data.sources=[{{name:web,dir:'{formats_mix}/web',format:dolma,weight:1}}]"
    alone = sources_vocabulary(run([*FORMATS_RUN, web]).data, VOCAB)
    assert alone is not None and (alone.size, alone.files) == (VOCAB, {})
    named = sources_vocabulary(run([*FORMATS_RUN, web, "data.tokenizer=gpt2"]).data, 50304)
    assert named is not None and (named.size, named.eos_id) == (50257, 50256)
    assert "tokenizer.json" in named.files  # what the pipeline's export copies
    assert sources_vocabulary(run(["data.sources=[{name:c,dir:/c,weight:1}]"]).data, 9) is None


@pytest.mark.slow
def test_moe_train_on_every_format_records_checksums_per_source_and_resumes_exactly(
    tmp_path, formats_mix, capsys
):
    """Six steps on the three-format mixture, held-out loss on the Dolma source's tail: each
    corpus of another tool has its checksums recorded in the run folder, our shards are hashed
    against their manifest; a resume from step 3 checks the records and trains the same steps;
    a file changed since is refused by name."""
    from moe_core.data.errors import DataError
    from moe_core.train.trainer import Trainer

    def trainer(out: str, *extra: str) -> Trainer:
        overrides = [*FORMATS_RUN, formats_spec(formats_mix), "train.steps=6", *extra]
        return Trainer(run([*overrides, f"out_dir={tmp_path / out}", "train.eval_every=3"]))

    straight = trainer("straight", "train.checkpoint_every=3")
    said = capsys.readouterr().out.replace("\n", "")
    assert "data source 'web': recorded the sha256 of 3 files in" in said
    assert re.search(r"data source 'code': verified the sha256 of \d+ shards \(", said)
    assert "data source 'math': recorded the sha256 of 2 files in" in said
    history = straight.fit(show_progress=False)
    assert history[2].eval_loss is not None
    assert set(history[-1].data_tokens) == {"web", "code", "math"}
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000003",
        resumed_dir / "checkpoints" / "step_00000003",
    )
    for name in ("web", "math"):
        record = f"data-checksums-{name}.json"
        shutil.copy2(tmp_path / "straight" / record, resumed_dir / record)
    resumed = trainer("resumed")
    said = capsys.readouterr().out.replace("\n", "")
    assert "data source 'math': verified the sha256 of 2 files against" in said
    assert resumed.step == 3
    rest = resumed.fit(show_progress=False)
    assert [m.loss for m in rest] == [m.loss for m in history[3:]]
    assert [m.data_tokens for m in rest] == [m.data_tokens for m in history[3:]]
    assert rest[-1].eval_loss == history[-1].eval_loss
    for a, b in zip(resumed.chunks[0].parameters(), straight.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)
    bin_path = formats_mix / "math" / "a_text_document.bin"
    raw = bin_path.read_bytes()
    try:
        bin_path.write_bytes(bytes([raw[0] ^ 1]) + raw[1:])  # still an id: only the hash sees it
        with pytest.raises(DataError, match=f"{bin_path} changed since this run recorded"):
            trainer("resumed")
    finally:
        bin_path.write_bytes(raw)


def test_plan_and_moe_data_show_a_mixture_of_every_format(formats_mix, monkeypatch, capsys):
    from rich.console import Console

    import moe_core.cli as cli

    monkeypatch.setattr(cli, "console", Console(width=250))
    args = [*BASE, "data.kind=tokens", *FORMATS_RUN, "train.steps=100", formats_spec(formats_mix)]
    tokens = cli.source_tokens(run(args[len(BASE) + 1 :]))
    assert all(isinstance(n, int) and n > 0 for n in tokens.values()), tokens
    assert cli.main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert "data mixture" in out and "50.0%" in out and "unknown" not in out
    assert cli.main(["data", "--sample-tokens=4", *args]) == 0
    out = capsys.readouterr().out
    assert out.index("source web (dolma)") < out.index("source code (moe)")
    assert out.index("source code (moe)") < out.index("source math (megatron)")
    assert f"4,096 ids (data source 'code' ({formats_mix}/code)'s tokenizer), end-of-text 0" in out
    assert "metadata rows, or end-of-text ids 0 counted where a file has none" in out
