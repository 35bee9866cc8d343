"""The token loader: exact epoch coverage across data-parallel ranks, exact resume, validation."""

from __future__ import annotations

import json
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from helpers import write_token_dir

from moe_core.data.dataset import TokenDataset
from moe_core.data.errors import DataError
from moe_core.data.loader import TokenLoader
from moe_core.data.shuffle import Permutation

SEQ = 7  # instances of 8 tokens
MICRO = 2
# 200 instances: a multiple of MICRO * dp for dp in 1, 2, 4; 8-token instances cross the
# 100-token shard boundaries
TRAIN_TOKENS = 200 * (SEQ + 1)


@pytest.fixture(scope="module")
def exact_dir(tmp_path_factory):
    """Train tokens 0..1599 (each value once), validation 5000..5099, 100-token shards."""
    path = tmp_path_factory.mktemp("exact")
    splits = {"train": np.arange(TRAIN_TOKENS), "validation": 5000 + np.arange(100)}
    return write_token_dir(path, splits, shard_tokens=100)


def take(loader: TokenLoader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def nexts(it: Iterator[torch.Tensor], n: int) -> torch.Tensor:
    """The next ``n`` micro-batches of a running iterator, stacked."""
    return torch.stack([next(it) for _ in range(n)])


def test_permutation_is_a_bijection_that_changes_with_seed_and_epoch():
    for n in (1, 2, 3, 5, 16, 17, 100, 1000, 4097):
        image = Permutation(n, seed=3, epoch=0)(np.arange(n))
        assert np.array_equal(np.sort(image), np.arange(n)), n
    a, b, c = (Permutation(1000, s, e)(np.arange(1000)) for s, e in ((0, 0), (0, 1), (1, 0)))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.array_equal(a, Permutation(1000, 0, 0)(np.arange(1000)))
    assert np.array_equal(a[[5, 900, 17]], Permutation(1000, 0, 0)(np.array([5, 900, 17])))


def test_instances_span_shard_boundaries(exact_dir):
    dataset = TokenDataset(exact_dir, "train", SEQ)
    assert len(dataset) == 200 and dataset.tokens == TRAIN_TOKENS
    assert np.array_equal(dataset[12], np.arange(96, 104))  # shard 0 -> shard 1
    assert dataset.batch(np.array([0, 199])).tolist() == [
        list(range(8)),
        list(range(1592, 1600)),
    ]


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_every_train_token_served_exactly_once_per_epoch_across_ranks(exact_dir, dp):
    loaders = [TokenLoader(exact_dir, "train", SEQ, MICRO, r, dp, seed=5) for r in range(dp)]
    per_rank = loaders[0].instances_per_epoch // MICRO
    assert all(lo.instances_per_epoch * dp == 200 for lo in loaders)
    iterators = [iter(lo) for lo in loaders]
    orders = []
    for _epoch in range(2):
        batches = [nexts(it, per_rank) for it in iterators]
        served = torch.cat([b.reshape(-1) for b in batches]).sort().values
        assert torch.equal(served, torch.arange(TRAIN_TOKENS)), "overlap or gap"
        for b in batches:
            assert b.shape == (per_rank, MICRO, SEQ + 1) and b.dtype == torch.int64
            assert torch.equal(b[..., 1:] - b[..., :-1], torch.ones_like(b[..., 1:]))
        orders.append(torch.cat([b[:, :, 0].reshape(-1) for b in batches]))
    assert not torch.equal(orders[0], orders[1]), "each epoch has its own order"


def test_leftover_instances_rotate_and_the_tail_is_never_served(tmp_path):
    tokens = 103 * (SEQ + 1) + 5  # 103 instances and 5 tokens that complete none
    data = write_token_dir(tmp_path, {"train": np.arange(tokens)}, shard_tokens=64)
    loaders = [TokenLoader(data, "train", SEQ, MICRO, r, 2, seed=1) for r in range(2)]
    assert loaders[0].instances_per_epoch == 50  # 25 micro-steps of 4 instances
    iterators = [iter(lo) for lo in loaders]
    missing = []
    for _epoch in range(3):
        served = torch.cat([nexts(it, 25).reshape(-1) for it in iterators])
        assert len(served.unique()) == len(served) == 100 * (SEQ + 1), "overlap"
        left_out = sorted(set(range(103 * (SEQ + 1))) - set(served.tolist()))
        assert len(left_out) == 3 * (SEQ + 1)  # 3 whole instances, different each epoch
        missing.append(left_out)
        assert served.max() < 103 * (SEQ + 1)
    assert len({tuple(m) for m in missing}) == 3


@pytest.mark.parametrize("split", ["train", "validation"])
def test_resume_mid_epoch_continues_with_exactly_the_uninterrupted_batches(exact_dir, split):
    seq, dp = (SEQ, 2) if split == "train" else (3, 1)
    for rank in range(dp):
        whole = TokenLoader(exact_dir, split, seq, MICRO, rank, dp, seed=9)
        n = 2 * whole.batches_per_epoch + 7 if split == "train" else whole.batches_per_epoch
        reference = take(whole, n)
        first = TokenLoader(exact_dir, split, seq, MICRO, rank, dp, seed=9)
        cut = whole.batches_per_epoch + 3 if split == "train" else n // 2
        head = take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        second = TokenLoader(exact_dir, split, seq, MICRO, rank, dp, seed=9)
        second.load_state_dict(state)
        tail = take(second, n - cut)
        assert all(torch.equal(a, b) for a, b in zip(head + tail, reference, strict=True))


def test_one_global_step_holds_the_same_instances_for_any_dp_size(exact_dir):
    single = take(TokenLoader(exact_dir, "train", SEQ, MICRO, 0, 1, seed=2), 8)
    for dp in (2, 4):
        ranks = [
            take(TokenLoader(exact_dir, "train", SEQ, MICRO, r, dp, seed=2), 8 // dp)
            for r in range(dp)
        ]
        for step in range(8 // dp):
            merged = torch.cat([ranks[r][step] for r in range(dp)])
            expected = torch.cat(single[step * dp : (step + 1) * dp])
            assert torch.equal(merged, expected)


def test_state_resumes_under_another_layout_when_steps_align(exact_dir):
    two = [TokenLoader(exact_dir, "train", SEQ, MICRO, r, 2, seed=4) for r in range(2)]
    for lo in two:
        take(lo, 6)
    single = TokenLoader(exact_dir, "train", SEQ, MICRO, 0, 1, seed=4)
    single.load_state_dict(two[0].state_dict())
    reference = take(TokenLoader(exact_dir, "train", SEQ, MICRO, 0, 1, seed=4), 14)
    assert all(torch.equal(a, b) for a, b in zip(take(single, 2), reference[12:], strict=True))
    four = TokenLoader(exact_dir, "train", SEQ, MICRO, 0, 8, seed=4)
    with pytest.raises(ValueError, match="consumed=24 is not allowed"):
        four.load_state_dict(two[0].state_dict())


def test_state_from_other_data_or_seed_is_refused(exact_dir, tmp_path):
    state = TokenLoader(exact_dir, "train", SEQ, MICRO, seed=0).state_dict()
    with pytest.raises(ValueError, match="seed is 0 there, 1 here"):
        TokenLoader(exact_dir, "train", SEQ, MICRO, seed=1).load_state_dict(state)
    other = write_token_dir(tmp_path, {"train": np.arange(TRAIN_TOKENS) + 1}, shard_tokens=100)
    with pytest.raises(ValueError, match=r"sha256 is .* belongs to other data"):
        TokenLoader(other, "train", SEQ, MICRO, seed=0).load_state_dict(state)


def test_validation_loader_reads_the_held_out_split_in_order_once_per_pass(exact_dir):
    loader = TokenLoader(exact_dir, "validation", 9, 2, dp_rank=1, dp_size=2)
    assert loader.instances_per_epoch == 4  # 10 instances of 10 tokens, 2 per micro-step
    first = list(loader)
    assert len(first) == 2 and all(b.shape == (2, 10) for b in first)
    assert first[0][:, 0].tolist() == [5020, 5030] and first[1][:, 0].tolist() == [5060, 5070]
    second = list(loader)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_too_little_data_for_one_micro_batch_is_one_sentence(exact_dir):
    with pytest.raises(DataError) as err:
        TokenLoader(exact_dir, "validation", 63, 4, dp_size=2)
    message = str(err.value)
    assert "\n" not in message and "fewer than one micro-batch on each of 2 ranks" in message


def test_loader_throughput_is_far_above_any_training_step_rate(exact_dir, tmp_path):
    import time

    data = write_token_dir(tmp_path, {"train": np.arange(4097 * 200)}, shard_tokens=1 << 16)
    loader = TokenLoader(data, "train", 4096, 4)
    it = iter(loader)
    start = time.perf_counter()
    n = 0
    while time.perf_counter() - start < 0.5:
        next(it)
        n += 4
    rate = n / (time.perf_counter() - start)
    assert rate > 500, f"{rate:.0f} instances/s"  # olmoe-1b-7b needs ~15/s per GPU at seq 4096


def test_an_epoch_is_whole_global_steps_so_every_layout_serves_the_same_sequence(tmp_path):
    """cluster.on_node_loss=shrink resumes a run at another dp: with ``global_batch`` an epoch
    serves whole optimizer steps, so dp 1, 2 and 4 (micro-steps of 2, 4 and 8 instances) serve
    the same instances step by step across epoch ends, and a state taken after an epoch ended
    mid-way through a step of another layout resumes under it (per micro-step epochs served 100
    instances at dp 1 but 96 at dp 4, and dp 4 refused dp 2's state one step into epoch 1)."""
    tokens = 100 * (SEQ + 1)  # 100 instances: 12 steps of 8 and 4 left
    splits = {"train": np.arange(tokens), "validation": np.arange(64)}
    data = write_token_dir(tmp_path, splits, shard_tokens=64, vocab_size=4096)

    def steps(dp: int, n: int, state: dict | None = None) -> list[torch.Tensor]:
        loaders = [
            TokenLoader(data, "train", SEQ, MICRO, r, dp, seed=3, global_batch=8) for r in range(dp)
        ]
        for lo in loaders:
            if state is not None:
                lo.load_state_dict(state)
        its = [iter(lo) for lo in loaders]
        per_step = 8 // (MICRO * dp)  # micro-steps of one optimizer step
        out = []
        for _ in range(n):
            micro = [nexts(it, per_step) for it in its]  # [rank][micro-step]
            out.append(torch.cat([micro[r][m] for m in range(per_step) for r in range(dp)]))
        steps.state = loaders[0].state_dict()  # type: ignore[attr-defined]
        return out

    one = steps(1, 30)  # two and a half epochs
    for dp in (2, 4):
        assert all(torch.equal(a, b) for a, b in zip(steps(dp, 30), one, strict=True)), dp
    steps(2, 13)  # one step into the second epoch
    resumed = steps(4, 17, steps.state)  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(resumed, one[13:], strict=True))
    assert TokenLoader(data, "train", SEQ, MICRO, 0, 1, global_batch=8).instances_per_epoch == 96
    # the trainer's loader is built so (train.global_batch_size=8, micro-batches of 2)
    from helpers import BASE
    from rich.console import Console

    from moe_core.compose import compose_run
    from moe_core.config import ParallelConfig
    from moe_core.parallel.mesh import Mesh
    from moe_core.train.batches import Batches

    for dp in (1, 4):
        over = ["data.kind=tokens", f"data.dir={data}", f"train.seq_len={SEQ}", f"parallel.dp={dp}"]
        run = compose_run([*BASE, *over, "data.verify_checksums=false"])
        loader = Batches(run, Mesh(ParallelConfig()), Console(quiet=True), print).loader
        assert loader is not None and loader.instances_per_epoch * dp == 96, dp
