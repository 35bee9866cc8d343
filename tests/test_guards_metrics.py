"""Guards skip non-finite steps and halt runs that cannot recover; metrics tell the truth."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import BASE, small_config

from moe_core.compose import compose_run
from moe_core.model.moe import Router, load_balancing_loss
from moe_core.train.guards import Guards, TrainingHaltedError
from moe_core.train.metrics import peak_tflops, router_health, throughput
from moe_core.train.trainer import Trainer


def poison_loss_at(monkeypatch, trainer: Trainer, steps: set[int]) -> None:
    """Make the loss NaN (and so every gradient) on the given steps."""
    real = trainer.loss_fn

    def lm_loss(logits, targets):
        loss = real(logits, targets)
        return loss * float("nan") if trainer.step in steps else loss

    monkeypatch.setattr(trainer, "loss_fn", lm_loss)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.chunks[0].state_dict().items()}


def moments(trainer: Trainer) -> list[torch.Tensor]:
    return [v.clone() for bucket in trainer.optimizer.moments for v in bucket.values()]


@pytest.mark.slow
def test_nan_loss_step_is_skipped_counted_and_training_continues(monkeypatch, tmp_path):
    trainer = Trainer(compose_run([*BASE, "train.steps=6", f"out_dir={tmp_path}"]))
    poison_loss_at(monkeypatch, trainer, {3})
    history = []
    for _ in range(6):
        before, moments_before = weights(trainer), moments(trainer)
        adam_step = trainer.optimizer.step_count
        m = trainer.train_step()
        history.append(m)
        if m.step == 3:
            # The update was queued with the verdict on the device: it changed nothing.
            assert m.skipped and math.isnan(m.loss)
            assert trainer.optimizer.step_count == adam_step, "optimizer state must not change"
            after = weights(trainer)
            assert all(torch.equal(before[k], after[k]) for k in before)
            assert moments_before and all(
                torch.equal(a, b) for a, b in zip(moments_before, moments(trainer), strict=True)
            )
    assert [m.skipped for m in history] == [False, False, False, True, False, False]
    assert trainer.guards.skipped_total == 1 and trainer.guards.consecutive_skips == 0
    assert all(math.isfinite(m.loss) for m in history if m.step != 3)
    assert trainer.optimizer.step_count == 5


@pytest.mark.slow
def test_too_many_consecutive_skips_stop_with_a_checkpoint(monkeypatch, tmp_path):
    args = [*BASE, "train.steps=10", "train.max_consecutive_skips=3", f"out_dir={tmp_path}"]
    trainer = Trainer(compose_run(args))
    poison_loss_at(monkeypatch, trainer, {2, 3, 4, 5, 6, 7, 8, 9})
    with pytest.raises(TrainingHaltedError, match="3 steps in a row had a non-finite loss"):
        trainer.fit(show_progress=False)
    assert (tmp_path / "checkpoints" / "step_00000005").is_dir()
    good = weights(trainer)
    resumed = Trainer(compose_run(args))
    assert resumed.step == 5
    assert all(torch.equal(good[k], v) for k, v in resumed.chunks[0].state_dict().items())
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["skipped"] for x in lines] == [False, False, True, True, True]


def test_loss_spike_rule():
    g = Guards(max_consecutive_skips=5, spike_sigma=6.0, spike_window=50)
    for i in range(30):
        assert not g.check(2.0 + 0.01 * (i % 3), 1.0).spike
    assert not g.check(2.05, 1.0).spike
    assert g.check(3.0, 1.0).spike


def test_imbalance_metrics_equal_a_recomputation_from_routing_decisions():
    torch.manual_seed(0)
    cfg = small_config(n_experts=8, top_k=2, expert_bias=True)
    router = Router(cfg)
    router.reset_buffers()
    torch.nn.init.normal_(router.weight, std=0.3)
    router.expert_bias.copy_(torch.linspace(-0.02, 0.03, 8))
    x = torch.randn(300, cfg.d_model) + 0.2
    r = router(x)
    health = router_health(
        router.stat_counts_E, float(router.stat_lb), ep=2, bias_E=router.expert_bias
    )

    counts = [0] * 8
    for row in r.experts_TK.tolist():
        for e in row:
            counts[e] += 1
    mean = sum(counts) / 8
    assert health["load_imbalance"] == pytest.approx(max(counts) / mean)
    assert health["load_max_share"] == pytest.approx(max(counts) / sum(counts))
    ranks = [sum(counts[:4]), sum(counts[4:])]
    assert health["ep_rank_imbalance"] == pytest.approx(max(ranks) / (sum(ranks) / 2))
    assert health["experts_unused"] == sum(c == 0 for c in counts)
    assert health["bias_abs_max"] == pytest.approx(0.03)
    probs = torch.softmax(x @ router.weight.detach().t(), -1)
    assert health["lb_score"] == pytest.approx(
        float(load_balancing_loss(probs, torch.tensor(counts), 2))
    )


def test_gerrymandering_shows_score_better_while_real_load_is_worse():
    """Two routers over the same tokens: B's balancing score is better than A's, yet B sends
    half the tokens to one expert. The metrics must show both facts."""
    T, E = 400, 4
    # A: a clear favourite, probabilities honest about it.
    logits_a = torch.tensor([[1.0, 0.2, 0.2, 0.2]]).repeat(T, 1)
    logits_a[T // 2 :] = torch.tensor([0.2, 1.0, 0.2, 0.2])  # half to 0, half to 1
    # B: near-uniform probabilities whose argmax still lands on expert 0 for 60 % of tokens.
    logits_b = torch.zeros(T, E)
    logits_b[: int(0.6 * T), 0] = 0.05
    for i, t in enumerate(range(int(0.6 * T), T)):
        logits_b[t, 1 + i % 3] = 0.05

    def health(logits):
        probs = logits.softmax(-1)
        top = probs.argmax(-1, keepdim=True)
        counts = torch.zeros(E, dtype=torch.int64).scatter_add_(
            0, top.view(-1), torch.ones(T, dtype=torch.int64)
        )
        return router_health(
            counts, float(load_balancing_loss(probs, counts, 1)), ep=1, bias_E=None
        )

    a, b = health(logits_a), health(logits_b)
    assert b["lb_score"] < a["lb_score"], (a, b)  # the score says B is better balanced
    assert b["load_imbalance"] > a["load_imbalance"]  # yet B loads its busiest expert more
    assert b["load_max_share"] > a["load_max_share"]  # but B's busiest expert is busier


def test_mfu_needs_a_known_peak():
    assert peak_tflops(torch.device("cpu")) is None
    cpu = throughput(tokens=1000, seconds=2.0, world_size=2, flops_per_token=10**9, peak=None)
    assert "mfu" not in cpu and cpu["tokens_per_s_per_gpu"] == 250.0
    gpu = throughput(tokens=1000, seconds=1.0, world_size=1, flops_per_token=10**12, peak=989.4)
    assert gpu["model_tflops_per_gpu"] == pytest.approx(1000.0)
    assert gpu["mfu"] == pytest.approx(1000.0 / 989.4)


def test_peak_table_matches_device_names(monkeypatch):
    for name, peak in [
        ("NVIDIA H200", 989.4),
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GeForce RTX 4090", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _d=None, n=name: n)
        assert peak_tflops(torch.device("cuda", 0)) == peak, name


def test_step_metrics_are_logged_per_layer(tmp_path):
    Trainer(compose_run([*BASE, "train.steps=2", f"out_dir={tmp_path}"])).fit(show_progress=False)
    line = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert set(line["router"]) == {"layer_0", "layer_1", "layer_2", "layer_3"}
    for key in ("loss", "aux_loss", "z_loss", "grad_norm", "lr", "tokens_per_s_per_gpu"):
        assert key in line
    assert "mfu" not in line  # CPU: no known peak, so no MFU


def test_allocator_retries_are_counted_each_step_and_warned_once(monkeypatch, tmp_path, capsys):
    """The CUDA allocator's retry count (faked here: the CPU has none) reaches each step's
    metrics as the retries since the step before, the first step that has any is warned of
    once, and MLflow charts it."""
    from flows.tracking import metric_rows
    from moe_core.train import trainer as trainer_module

    total = {"n": 7}  # retries before the trainer existed are not its
    monkeypatch.setattr(trainer_module, "allocator_retries", lambda device: total["n"])
    trainer = Trainer(compose_run([*BASE, "train.steps=3", f"out_dir={tmp_path}"]))
    seen = []
    for added in (0, 3, 2):
        total["n"] += added
        seen.append(trainer.train_step())
    assert [m.alloc_retries for m in seen] == [0, 3, 2]
    warned = [x for x in capsys.readouterr().out.split("\n") if "CUDA allocator" in x]
    assert len(warned) == 1 and "at step 1 " in warned[0], warned
    assert metric_rows(seen[1].as_dict())["alloc_retries"] == 3.0
    trainer._stop_prefetching()
    trainer.release()
