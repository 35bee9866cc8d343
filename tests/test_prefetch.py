"""Input off the critical path: the prefetcher serves steps in order, synthetic walks are the
walks their definition says, and a trainer that reads token shards one step ahead still saves
and resumes the loader exactly where training stood."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch
from helpers import BASE, write_token_dir

from moe_core.compose import compose_run
from moe_core.data.prefetch import Prefetcher
from moe_core.data.synthetic import SyntheticTokens
from moe_core.train.trainer import Trainer


def reference_walks(data: SyntheticTokens, start: int, count: int, seq_len: int) -> torch.Tensor:
    """The definition, one walk and one token at a time: walk ``i``'s own generator draws its
    first token, then its ``seq_len`` choices among the current token's successors."""
    rows = []
    for i in range(start, start + count):
        g = torch.Generator().manual_seed(data.seed * 1_000_003 + i + 1)
        token = int(torch.randint(0, data.vocab_size, (1,), generator=g))
        choices = torch.randint(0, data.branching, (seq_len,), generator=g).tolist()
        walk = [token]
        for c in choices:
            token = int(data.successors_VB[token, c])
            walk.append(token)
        rows.append(walk)
    return torch.tensor(rows, dtype=torch.int64)


@pytest.mark.parametrize(
    "vocab, branching, start, count, seq_len",
    [(4096, 4, 0, 3, 300), (257, 1, 17, 5, 40), (50304, 16, 1 << 40, 2, 64)],
)
def test_synthetic_walks_are_the_defined_walks(vocab, branching, start, count, seq_len):
    data = SyntheticTokens(vocab, branching, seed=3)
    got = data.sequences(start, count, seq_len)
    assert got.dtype == torch.int64 and got.shape == (count, seq_len + 1)
    assert torch.equal(got, reference_walks(data, start, count, seq_len))
    # any split of the walks reads the same tokens
    split = torch.cat([data.sequences(start + i, 1, seq_len) for i in range(count)])
    assert torch.equal(split, got)


def test_prefetcher_makes_each_step_once_in_order_on_one_background_thread():
    made: list[tuple[int, str]] = []

    def produce(step: int) -> int:
        made.append((step, threading.current_thread().name))
        return step * 10

    pre = Prefetcher(produce)
    assert pre.take(0) == 0  # nothing prepared: made on demand
    pre.prepare(1)
    pre.prepare(1)  # asking twice makes it once
    assert pre.take(1) == 10
    assert [s for s, _ in made] == [0, 1]
    assert all(name.startswith("prefetch") for _, name in made)
    pre.prepare(2)
    with pytest.raises(RuntimeError, match="step 3 asked for, but step 2 was prepared"):
        pre.take(3)
    pre.close()


def test_prefetcher_raises_the_producers_error_at_take():
    def produce(step: int) -> int:
        raise OSError(f"shard {step} unreadable")

    pre = Prefetcher(produce)
    pre.prepare(4)
    with pytest.raises(OSError, match="shard 4 unreadable"):
        pre.take(4)
    pre.close()


def token_run(tmp_path, out: str, steps: int, *extra: str):
    data = tmp_path / "data"
    if not data.exists():
        rng = np.random.default_rng(0)
        splits = {"train": rng.integers(1, 4096, 33 * 40), "validation": rng.integers(1, 4096, 200)}
        write_token_dir(data, splits, shard_tokens=500, vocab_size=4096)
    overrides = [
        *BASE,
        "data.kind=tokens",
        f"data.dir={data}",
        f"train.steps={steps}",
        f"out_dir={tmp_path / out}",
        *extra,
    ]
    return Trainer(compose_run(overrides))


@pytest.mark.slow
def test_token_shards_resume_exactly_although_the_next_step_was_read_ahead(tmp_path):
    """A checkpoint taken while the next step's batches sit prefetched records the loader where
    training stood: resuming it trains exactly the steps the uninterrupted run trained."""
    straight = token_run(tmp_path, "straight", 6, "train.checkpoint_every=3")
    history = straight.fit(show_progress=False)
    assert straight.loader is not None
    # 6 steps x 4 micro-batches of 2 sequences, on one rank; an epoch holds 40 // 2 = 20
    # micro-batches, so the run ends in the second epoch
    state = straight.loader.state_dict()
    assert state == straight._loader_state and (state["epoch"], state["consumed"]) == (1, 8)

    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(
        tmp_path / "straight" / "checkpoints" / "step_00000003",
        tmp_path / "resumed" / "checkpoints" / "step_00000003",
    )
    resumed = token_run(tmp_path, "resumed", 6)
    assert resumed.step == 3
    rest = resumed.fit(show_progress=False)
    assert [m.loss for m in rest] == [m.loss for m in history[3:]]
    for a, b in zip(resumed.chunks[0].parameters(), straight.chunks[0].parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_a_stopped_run_hands_back_the_batches_it_read_ahead(tmp_path):
    """``fit`` may end (a stop request, a halt) with the next step already read: the loader goes
    back, so the same trainer continues with exactly that step."""
    trainer = token_run(tmp_path, "run", 4)
    reference = token_run(tmp_path, "reference", 4)
    trainer.train_step()  # step 0; step 1 is now being read ahead
    trainer._stop_prefetching()
    assert trainer.step == 1
    reference.train_step()
    assert torch.equal(trainer.micro_batches()[0], reference.micro_batches()[0])
