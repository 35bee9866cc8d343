"""Multi-token prediction (``model.mtp_depth``, DeepSeek-V3's MTP modules): the config's
refusals, the loss against a reference written here, the weight schedule, where gradients go,
and training through the trainer (one process, layouts, resume)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import BASE, assert_trains_like, explain, small_config, torchrun

from moe_core.compose import compose_run
from moe_core.config import ConfigError, ModelConfig, TrainConfig
from moe_core.model import build_model, lm_loss
from moe_core.train.schedule import mtp_weight
from moe_core.train.trainer import Trainer

# ---- config -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("mtp_depth", -1, "a whole number from 0"),
        ("mtp_depth", 17, "to 16"),
        ("mtp_loss_weight", -0.1, "zero or positive"),
        ("mtp_loss_weight_late", -1.0, "zero or positive"),
        ("mtp_late_start", 1.5, "a fraction of train.steps from 0 to 1"),
        ("mtp_late_start", -0.1, "a fraction of train.steps from 0 to 1"),
        ("mtp_loss_weight", float("nan"), "a finite number"),
    ],
)
def test_mtp_options_out_of_range_are_refused_in_one_sentence(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        small_config(**{field: value})
    message = str(err.value)
    assert message.startswith(f"model.{field}={value!r} is not allowed: ")
    assert allowed in message and message.count(". ") == 0


def test_an_mtp_depth_a_sequence_cannot_hold_is_refused():
    with pytest.raises(ConfigError, match=r"model.mtp_depth=8 .* less than train.seq_len \(8\)"):
        compose_run([*BASE, "train.seq_len=8", "model.mtp_depth=8"])
    assert compose_run([*BASE, "train.seq_len=8", "model.mtp_depth=7"]).model.mtp_depth == 7


def test_the_weight_is_constant_then_lower_from_the_late_fraction_of_the_steps():
    model = ModelConfig(mtp_depth=1, mtp_loss_weight=0.3, mtp_loss_weight_late=0.1)
    train = TrainConfig(steps=148)  # DeepSeek-V3's 10 of 14.8T tokens: step 100 of 148
    weights = [mtp_weight(s, model, train) for s in range(148)]
    assert weights[:100] == [0.3] * 100 and weights[100:] == [0.1] * 48
    half = ModelConfig(mtp_depth=1, mtp_late_start=0.5, mtp_loss_weight_late=0.0)
    assert [mtp_weight(s, half, TrainConfig(steps=10)) for s in (4, 5)] == [0.3, 0.0]
    assert mtp_weight(0, ModelConfig(), train) == 0.0  # no MTP, no weight


# ---- the loss against a reference ---------------------------------------------------------


def ce64(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """``lm_loss`` without its fp32 upcast (the reference comparison runs in fp64)."""
    return F.cross_entropy(logits_BSV.reshape(-1, logits_BSV.shape[-1]), targets_BS.reshape(-1))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as the model defines it (statistics in fp32, as OLMoE)."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def reference_mtp_losses(model, tokens_BS1: torch.Tensor) -> list[torch.Tensor]:
    """DeepSeek-V3's MTP written out: depth k runs on the S - 1 - k positions that have a
    token k + 2 ahead (the sequence shortened, no padding), from the model's weights. The
    blocks are the model's own (tested elsewhere); everything MTP adds is spelled out here."""
    cfg = model.cfg
    S = tokens_BS1.shape[1] - 1
    h_prev, _, _ = model.hidden(tokens_BS1[:, :S])
    emb = model.embed.weight
    head = emb if cfg.tie_embeddings else model.lm_head.weight
    out = []
    for k in range(cfg.mtp_depth):
        m = model.mtp[str(k)]
        n = S - 1 - k
        e = emb[tokens_BS1[:, k + 1 : k + 1 + n]]
        e_normed = _rms(e, m.enorm.weight, cfg.norm_eps)
        h_normed = _rms(h_prev[:, :n], m.hnorm.weight, cfg.norm_eps)
        x = torch.cat([e_normed, h_normed], dim=-1) @ m.eh_proj.weight.T  # embedding first
        aux = torch.zeros((), dtype=torch.float32)
        h_prev, _ = m.block(x, aux, model.rope(n, x.device))
        logits = _rms(h_prev, m.norm.weight, cfg.norm_eps) @ head.T
        target = tokens_BS1[:, k + 2 : k + 2 + n]
        out.append(ce64(logits, target))
    return out


@pytest.mark.parametrize(
    ("depth", "options"),
    [(1, {}), (2, {}), (2, {"tie_embeddings": True, "n_dense_layers": 1, "dense_hidden": 48})],
)
def test_the_mtp_loss_equals_a_reference_written_from_the_weights(depth, options):
    torch.manual_seed(0)
    model = build_model(small_config(mtp_depth=depth, **options), seed=3).double()
    tokens = torch.randint(0, 256, (2, 13))
    h, aux, e = model.hidden(tokens[:, :-1])
    losses = model.losses(h, aux, e, tokens, ce64)
    ref = reference_mtp_losses(model, tokens)
    assert losses.mtp_D.shape == (depth,)
    for k in range(depth):
        assert abs(losses.mtp_D[k].item() - ref[k].item()) < 1e-10, f"depth {k}"
    # the objective: main loss + aux + weight / D * sum over depths
    logits, aux_forward = model(tokens[:, :-1])
    main = ce64(logits, tokens[:, 1:])
    want = main + aux_forward + losses.aux - aux_forward + 0.3 / depth * sum(ref)
    assert abs(losses.objective(0.3).item() - want.item()) < 1e-10
    assert abs(losses.ce.item() - main.item()) < 1e-12  # the main loss is the forward's
    # the MTP blocks' router losses join the aux loss beside the model's own
    assert losses.aux.item() > aux_forward.item()

    # gradients: the MTP loss reaches the shared embedding and LM head as the reference's does
    shared = [model.embed.weight] + ([] if model.lm_head is None else [model.lm_head.weight])
    mtp_params = list(model.mtp.parameters())
    got = torch.autograd.grad(losses.mtp_D.sum(), shared + mtp_params)
    want_g = torch.autograd.grad(sum(reference_mtp_losses(model, tokens)), shared + mtp_params)
    for g, w in zip(got, want_g, strict=True):
        assert w.abs().max() > 0
        assert (g - w).abs().max() < 1e-10


def test_forward_never_runs_the_mtp_modules():
    model = build_model(small_config(mtp_depth=1), seed=0)
    calls = []
    model.mtp["0"].register_forward_hook(lambda *args: calls.append(1))
    tokens = torch.randint(0, 256, (2, 9))
    logits, _ = model(tokens)
    assert logits.shape == (2, 9, 256) and not calls
    h, aux, e = model.hidden(tokens[:, :-1])
    model.losses(h, aux, e, tokens, lm_loss, mtp=False)  # evaluation's held-out loss
    assert not calls
    model.losses(h, aux, e, tokens, lm_loss)
    assert calls == [1]


def test_mtp_parameters_have_deepseeks_names_and_distinct_init():
    cfg = small_config(mtp_depth=2)
    model = build_model(cfg, seed=0)
    names = [n for n, _ in model.named_parameters() if n.startswith("mtp.1.")]
    assert names[:3] == ["mtp.1.enorm.weight", "mtp.1.hnorm.weight", "mtp.1.eh_proj.weight"]
    assert names[-1] == "mtp.1.norm.weight"
    assert model.mtp["1"].eh_proj.weight.shape == (cfg.d_model, 2 * cfg.d_model)
    assert all(n.startswith("mtp.1.block.") for n in names[3:-1])
    assert model.mtp["1"].block.moe is not None  # an MoE block, like the model's
    # each block draws from its own seeds: the MTP blocks differ from the model's and each other
    q = [model.layers["1"].attn.q_proj.weight] + [
        model.mtp[k].block.attn.q_proj.weight for k in "01"
    ]
    assert not torch.equal(q[0], q[1]) and not torch.equal(q[1], q[2])


# ---- training -----------------------------------------------------------------------------


def records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_logs_the_mtp_loss_apart_and_resumes_it_exactly(tmp_path):
    """A tiny run with two MTP depths: ``loss`` stays the next-token loss, ``mtp_loss`` and
    ``mtp_losses`` come beside it; the model folder keeps the MTP weights and loads for
    inference without them; a run resumed from an earlier checkpoint (the weight switching
    after it) repeats the steps exactly."""
    import shutil

    from moe_core.convert.load import load_model
    from moe_core.convert.native import load_model_dir

    args = [
        *BASE,
        "model.n_layers=2",
        "model.mtp_depth=2",
        "model.mtp_late_start=0.5",
        "train.steps=4",
        "train.checkpoint_every=2",
        f"out_dir={tmp_path}",
    ]
    first = Trainer(compose_run(args))
    history = first.fit(show_progress=False)
    rows = records(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for m, r in zip(history, rows, strict=True):
        assert len(r["mtp_losses"]) == 2 and r["mtp_loss"] == sum(r["mtp_losses"]) / 2
        assert r["loss"] == m.loss and r["mtp_loss"] != r["loss"]
    # ``loss`` is the next-token loss: at step 0 (same weights, same batch) that of a run
    # without MTP
    plain = [a for a in args if not a.startswith(("model.mtp", "out_dir"))]
    without = Trainer(compose_run([*plain, "train.steps=1", f"out_dir={tmp_path / 'plain'}"]))
    assert without.fit(show_progress=False)[0].loss == rows[0]["loss"]
    assert "mtp_loss" not in records(tmp_path / "plain")[0]
    _, state = load_model_dir(tmp_path / "model")
    assert any(n.startswith("mtp.1.block.moe.experts") for n in state)

    model = load_model(tmp_path / "model")
    assert model.mtp is None
    tokens = torch.randint(0, 4096, (1, 8))
    full = build_model(first.cfg.model)
    full.load_state_dict(state)
    assert torch.allclose(model(tokens)[0], full(tokens)[0])

    shutil.rmtree(tmp_path / "checkpoints" / "step_00000004")
    resumed = Trainer(compose_run(args))
    assert resumed.step == 2
    resumed.fit(show_progress=False)
    again = records(tmp_path)
    for r, a in zip(rows, again, strict=True):
        for key in ("loss", "mtp_loss", "mtp_losses", "aux_loss", "grad_norm"):
            assert a[key] == r[key], (r["step"], key)
    _, state_again = load_model_dir(tmp_path / "model")
    for name, t in state.items():
        assert torch.equal(t, state_again[name]), name


# Layouts as tests/test_parallel.py runs them, MTP on: the expert-parallel dispatcher takes the
# MTP blocks' experts, and pipeline stages carry the embeddings to the MTP modules on the last
# stage (through two middle chunks when interleaved) and their gradient back.
# DeepSeek-V3's block at a small size (latent attention, a dense first block, sigmoid routing
# in groups with the expert bias, a shared expert) with two MTP depths
MTP = [*(o for o in BASE if o != "model=tiny"), "model=small-mla", "model.n_layers=4"]
MTP += ["model.mtp_depth=2"]
MTP_LAYOUTS = {
    "ep2": (2, ["parallel.ep=2"]),
    "pp2-1f1b": (2, ["parallel.pp=2"]),
    "pp2-interleaved": (
        2,
        ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.virtual_stages=2"],
    ),
}


@pytest.fixture(scope="module")
def mtp_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("mtp-reference")
    Trainer(compose_run([*MTP, f"out_dir={out}"])).fit(show_progress=False)
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        "ep2",
        "pp2-1f1b",
        # the interleaved schedule's own parity is test_parallel's; MTP on the last stage, 1f1b's
        pytest.param("pp2-interleaved", marks=pytest.mark.extended),
    ],
)
def test_layouts_train_the_single_process_mtp_model(layout, mtp_reference, tmp_path):
    nproc, overrides = MTP_LAYOUTS[layout]
    command = ["-m", "moe_core.cli", "train", *MTP, *overrides, f"out_dir={tmp_path}"]
    result = torchrun(nproc, command)
    assert result.returncode == 0, explain(result)
    assert_trains_like(mtp_reference, tmp_path, steps=5, keys=("loss", "mtp_losses", "aux_loss"))
    rows = records(tmp_path)
    assert "layer_5" in rows[0]["router"]  # the second MTP block's router (4 layers + 2)


# ---- planner and FLOPs --------------------------------------------------------------------


def test_the_plan_holds_the_mtp_modules_on_the_last_stage_and_sends_the_embeddings():
    """Over two pipeline stages the last holds the MTP modules (every parameter whose name
    starts with ``mtp.``, its MoE blocks dispatching like the others), and each message carries
    the embeddings beside the hidden states."""
    from moe_core.model.flops import count
    from moe_core.model.transformer import parameter_shapes
    from moe_core.plan import plan

    def run(depth: int):
        return compose_run([*BASE, f"model.mtp_depth={depth}", "parallel.pp=2"])

    with_mtp, without = plan(run(2)), plan(run(0))
    shapes = parameter_shapes(run(2).model)
    numel = {n: torch.Size(s).numel() for n, s in shapes.items()}
    last = ("layers.2.", "layers.3.", "norm.", "lm_head.", "mtp.")
    first, final = with_mtp.stages
    assert final.dense_params + final.expert_params == sum(
        v for n, v in numel.items() if n.startswith(last)
    )
    assert first.dense_params + first.expert_params == sum(
        v for n, v in numel.items() if not n.startswith(last)
    )
    assert final.moe_layers == without.stages[1].moe_layers + 2
    assert with_mtp.total_params == count(run(2).model).total_params == sum(numel.values())
    hidden = 2 * 32 * 128 * 4  # micro-batch x seq_len x d_model x fp32
    assert first.p2p_buffers == without.stages[0].p2p_buffers + 4 * hidden  # 4 micro-batches
    # activations: each depth's share on the last stage only
    one = plan(run(1)).stages[1].activations - without.stages[1].activations
    assert one > 0 and final.activations - without.stages[1].activations == 2 * one
    assert first.activations == without.stages[0].activations


def test_the_flops_of_a_depth_are_its_projection_block_and_head():
    from moe_core.model.flops import count

    m = small_config(mtp_depth=1, n_shared_experts=1)
    base = count(small_config(n_shared_experts=1), 32)
    d, v, h = m.d_model, m.vocab_size, m.expert_hidden
    block = 4 * d * d + m.top_k * 3 * d * h + 3 * d * h  # attention, top-k experts, shared
    per_depth = 6 * (2 * d * d + block + d * v) + 6 * 32 * d
    assert count(m, 32).flops_per_token - base.flops_per_token == per_depth
