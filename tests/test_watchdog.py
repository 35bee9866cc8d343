"""The hang watchdog (``train.hang_factor``): a rank that stalls is named with where it and the
others stand, every rank exits, and the relaunch finishes the run as if nothing had happened."""

from __future__ import annotations

import json
import pickle
import time
from pathlib import Path

import pytest
from helpers import BASE, assert_trains_like, explain, torchrun

from moe_core.compose import compose_run
from moe_core.config import ConfigError, TrainConfig
from moe_core.parallel.trace import DISPATCH, Trace
from moe_core.train.trainer import Trainer
from moe_core.train.watchdog import HANG_EXIT, LATEST, Watchdog, hangs_dir, name_lagging


def _report(rank: int, entered: int, where: str) -> dict:
    return {"rank": rank, "step": 3, "elapsed_s": 12.0, "entered": entered, "where": where}


def test_the_ranks_behind_are_named_with_where_the_others_wait():
    reports = {
        0: _report(0, 4, "all_to_all (token dispatch) of layers.2.moe"),
        1: _report(1, 3, "all_to_all (token dispatch) of layers.1.moe"),
        2: _report(2, 4, "all_to_all (token dispatch) of layers.2.moe"),
    }
    sentence = name_lagging(reports, 3, world=4)
    assert sentence.startswith("hang at step 3 after 12 s: rank 1 fell behind (last entered ")
    assert (
        "layers.1.moe) while the others wait in all_to_all (token dispatch) of layers.2" in sentence
    )
    assert "rank 3 wrote no report" in sentence
    # at dp 2 x ep 2 the ranks ahead wait in different places: each named with its ranks,
    # the stalled rank's expert-parallel partner (waiting on it directly) first
    split = {
        0: _report(0, 9, "reduce_scatter (gradient bucket) over dp x ep (dense)"),
        1: _report(1, 9, "reduce_scatter (gradient bucket) over dp x ep (dense)"),
        2: _report(2, 1, "all_to_all (token dispatch) of layers.0.moe over ep"),
        3: _report(3, 0, "no collective yet in this step"),
    }
    assert (
        "rank 3 fell behind (last entered no collective yet in this step) while rank 2 waits in "
        "all_to_all (token dispatch) of layers.0.moe over ep and ranks 0, 1 wait in "
        "reduce_scatter (gradient bucket) over dp x ep (dense);"
    ) in name_lagging(split, 3, world=4)
    same = {r: _report(r, 4, "all_reduce (step values)") for r in range(2)}
    assert "every rank stands at the same place (all_reduce (step values))" in name_lagging(
        same, 3, world=2
    )


def test_a_step_past_its_limit_is_reported_and_ends_the_process(tmp_path):
    cfg = TrainConfig(hang_factor=2.0, hang_min_s=0.2, hang_first_s=0.5)
    trace, exits = Trace(), []
    dog = Watchdog(cfg, tmp_path, 0, 1, lambda: {"0": [3.0, 1.0]}, trace, exits.append)
    with dog.watch(0):
        trace.micro_batch = 1
        trace.enter(DISPATCH, "layers.0.moe", "ep", 4096)
        deadline = time.monotonic() + 60
        while not exits and time.monotonic() < deadline:  # the step "hangs" until it fires
            time.sleep(0.05)
    dog.close()
    assert exits == [HANG_EXIT]
    report = json.loads((hangs_dir(tmp_path) / "step_0" / "rank_0.json").read_text())
    assert report["where"] == (
        "all_to_all (token dispatch) of layers.0.moe over ep, micro-batch 1 (4,096 bytes)"
    )
    assert report["router_counts"] == {"0": [3.0, 1.0]} and report["limit_s"] == 0.5
    assert "every rank stands at the same place" in (hangs_dir(tmp_path) / LATEST).read_text()


def test_a_hang_again_at_the_same_step_ignores_the_earlier_attempts_reports(tmp_path):
    """A relaunch that hangs at the same step finds ``step_N`` from the earlier attempt: its
    reports are not this hang's, and its summary does not let the other ranks exit before rank
    0 has said this one (the launcher would stop rank 0 before it wrote it)."""
    import os
    import threading

    folder = hangs_dir(tmp_path) / "step_3"
    folder.mkdir(parents=True)
    (folder / "rank_1.json").write_text(json.dumps(_report(1, 9, "an OLD place")))
    (folder / "summary.txt").write_text("the earlier attempt's sentence\n")
    for p in folder.iterdir():
        os.utime(p, (time.time() - 600,) * 2)
    cfg = TrainConfig(hang_factor=2.0, hang_min_s=0.2, hang_first_s=0.5)
    exits: dict[int, int] = {}
    dogs = [
        Watchdog(cfg, tmp_path, r, 2, exit=lambda code, r=r: exits.setdefault(r, code))
        for r in range(2)
    ]
    behind = threading.Thread(target=dogs[1].fire, args=(3, 9.0, 0.5))
    behind.start()
    deadline = time.monotonic() + 30
    while json.loads((folder / "rank_1.json").read_text())["where"] == "an OLD place":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.2)
    assert 1 not in exits, "rank 1 left on the earlier attempt's summary"
    dogs[0].fire(3, 9.0, 0.5)
    behind.join()
    assert exits == {0: HANG_EXIT, 1: HANG_EXIT}
    sentence = (folder / "summary.txt").read_text()
    assert "OLD" not in sentence and "every rank stands at the same place" in sentence


def test_a_hang_report_that_cannot_be_written_still_ends_the_process(tmp_path, capsys):
    """A full disk (here: ``hangs`` is a file) must not kill the watchdog before it ends the
    process, or the hang would run on until the scheduler's time limit."""
    (tmp_path / "hangs").write_text("not a folder")
    exits: list[int] = []
    dog = Watchdog(TrainConfig(hang_factor=2.0), tmp_path, 0, 1, exit=exits.append)
    dog.fire(3, 9.0, 0.5)
    assert exits == [HANG_EXIT]
    err = capsys.readouterr().err
    assert "hang watchdog: rank 0 has been in step 3 for 9.0 s" in err
    assert "rank 0 could not write its hang report in " in err and "it exits all the same" in err


def test_the_limit_follows_the_recent_steps_after_warm_up():
    dog = Watchdog(TrainConfig(hang_factor=4.0, hang_min_s=1.0, hang_first_s=100.0), ".", 0, 1)
    assert dog.limit_s() == 100.0
    dog.recent.extend([0.5, 2.0, 0.7])
    assert dog.limit_s() == pytest.approx(4 * 0.7)
    dog.recent.extend([0.1] * 10)
    assert dog.limit_s() == 1.0  # never below hang_min_s


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.hang_factor=1", "train.hang_factor=1.0 is not allowed: 0 (no watchdog) or more"),
        ("train.hang_min_s=0", "train.hang_min_s=0.0 is not allowed: it must be positive."),
        (
            "parallel.backend=gloo parallel.ep=2 parallel.dispatcher=nvshmem_rowwise",
            "parallel.dispatcher='nvshmem_rowwise' is not allowed: 'all_to_all' with "
            "parallel.backend=gloo",
        ),
    ],
)
def test_bad_watchdog_options_are_refused(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        compose_run([*BASE, *override.split()])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    Trainer(compose_run([*BASE, f"out_dir={out}"])).fit(show_progress=False)
    return out


@pytest.mark.slow
def test_a_stalled_rank_is_named_and_the_relaunch_trains_the_same_model(
    uninterrupted, tmp_path, monkeypatch
):
    """4 ranks under torchrun (dp 2 x ep 2): rank 3 stalls on its way to step 3's first token
    dispatch; every watchdog fires, rank 0 names rank 3, every rank exits with HANG_EXIT; the
    relaunch (as the pipeline's launcher makes it) resumes from step 2's checkpoint and ends as
    the uninterrupted single-process run does."""
    marker = tmp_path / "stalled-once"
    monkeypatch.setenv("MOE_TEST_STALL", f"3:3:120:{marker}")
    out = tmp_path / "run"
    watch = ["train.hang_factor=10", "train.hang_min_s=5", "train.checkpoint_every=2"]
    layout = ["parallel.dp=2", "parallel.ep=2"]
    args = ["-m", "moe_core.cli", "train", *BASE, *layout, *watch, f"out_dir={out}"]
    hung = torchrun(4, args, timeout=400)
    assert hung.returncode != 0 and marker.is_file()  # the stall happened, the job ended
    assert f"exitcode  : {HANG_EXIT}" in hung.stderr, explain(hung)
    result = torchrun(4, args, timeout=400)  # the relaunch: no stall this time (the marker)
    assert result.returncode == 0, explain(result)
    sentence = (hangs_dir(out) / LATEST).read_text()
    assert sentence.startswith("hang at step 3 after "), sentence
    # its expert-parallel partner waits for it in the token dispatch, the other two ahead
    assert (
        "rank 3 fell behind (last entered no collective yet in this step) while rank 2 "
        + ("waits in all_to_all (token dispatch) of layers.0.moe over ep, micro-batch 0")
        in sentence
    ), sentence
    assert "and ranks 0, 1 wait in " in sentence, sentence
    stalled = json.loads((hangs_dir(out) / "step_3" / "rank_3.json").read_text())
    assert stalled["entered"] == 0 and stalled["router_counts"]  # counts of its layers
    # each rank's flight record (torch's): rank 2 entered one collective more than its
    # expert-parallel partner, the token dispatch it waits in (gloo records every collective as
    # scheduled, with no state or group names to match: NCCL's records have them)
    records = hangs_dir(out) / "step_3" / "flight_recorder"
    assert sorted(p.name for p in records.iterdir()) == [f"rank_{r}" for r in range(4)]
    assert stalled["flight_recorder"] == str(records / "rank_3")
    entries = {r: pickle.loads((records / f"rank_{r}").read_bytes())["entries"] for r in (2, 3)}
    assert len(entries[2]) == len(entries[3]) + 1
    assert entries[2][-1]["profiling_name"] == "gloo:all_to_all", entries[2][-1]
    assert "hang watchdog: rank 3 has been in step 3" in hung.stderr
    assert_trains_like(uninterrupted, out, steps=5)


def test_the_pipeline_gives_the_hang_as_its_reason_to_relaunch(tmp_path):
    """The launcher's attempt that the watchdog ended carries the sentence: in the relaunch's
    reason (the log, the summary's launches row) and in the tracking run's params."""
    import logging

    from flows.launch import launch_attempts
    from flows.launchers import Attempt

    run = compose_run([*BASE, "cluster.launch_retries=1", f"out_dir={tmp_path}"])
    sentence = "hang at step 3 after 12 s: rank 1 fell behind (...)"

    class Launcher:
        def __init__(self) -> None:
            self.run, self.train_dir, self.calls = run, tmp_path, 0

        def attempt(self, number: int) -> Attempt:
            self.calls += 1
            if self.calls == 1:
                hangs_dir(tmp_path).mkdir()
                (hangs_dir(tmp_path) / LATEST).write_text(sentence + "\n")
                return Attempt(number, "7", None, "exit 1", False, "torchrun 7 exited 1")
            return Attempt(number, "8", None, "exit 0", True, "torchrun 8 finished")

    class Tracker:
        def __init__(self) -> None:
            self.params_seen: list[dict] = []

        def params(self, run_id, values) -> None:
            self.params_seen.append(values)

        def send_metrics_file(self, run_id, path) -> None:
            pass

    tracker = Tracker()
    attempts = launch_attempts(Launcher(), tracker, None, logging.getLogger("test"))
    assert [a.ok for a in attempts] == [False, True]
    assert attempts[0].detail == f"torchrun 7 exited 1 ({sentence})"
    assert tracker.params_seen[0]["launch"]["attempt_1"]["hang"] == sentence
    assert "hang" not in tracker.params_seen[1]["launch"]["attempt_2"]
