"""FP8 weights quantized once per optimizer step (``moe_kernels.fp8_cache``, filled by
``parallel.optimizer``): training with the cache is training without it, bit for bit, with one
quantization per weight and step instead of one per micro-batch, and a weight changed outside
the optimizer never meets its stale copy."""

from __future__ import annotations

import functools

import pytest
import torch

import moe_kernels.fp8 as fp8_ops
import moe_kernels.fp8_cache as fp8_cache
from moe_core.compose import compose_run
from moe_core.config import RunConfig
from moe_core.model.fp8 import FP8Linear
from moe_core.model.moe import Experts
from moe_core.parallel import optimizer as optimizer_module
from moe_core.parallel.mesh import Mesh
from moe_core.train.stack import Stack, build_stack
from moe_kernels.fp8_cache import cache_of

SMALL = [
    "model=tiny",
    "model.n_layers=1",
    "model.vocab_size=256",
    "model.expert_hidden=64",
    "model.d_model=64",
    "train.seq_len=16",
    "train.micro_batch_size=1",
    "train.global_batch_size=2",  # two micro-batches a step
]
PRESETS = {
    # bf16 moments, the bf16 weights updated in place (autograd's gradients, one per weight)
    "fp8": ["precision=fp8", "precision.fp8_parts=[experts,attention]"],
    # an fp32 master writing the bf16 weights (``out``), gradients in one flat fp32 buffer
    "bf16-master": ["precision=bf16", "precision.fp8_parts=[experts]"],
}
CACHE = ["precision.fp8_weight_cache=true"]
STEPS = 2


class Counts:
    """Weight quantizations inside the GEMM calls, and the cache's columnwise ones."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.in_gemm = 0
        self.cache_cols = 0

        def counted(fn, attr):
            def wrapper(*args, **kwargs):
                setattr(self, attr, getattr(self, attr) + 1)
                return fn(*args, **kwargs)

            return wrapper

        for module, name, attr in (
            (fp8_ops, "_quantize_weight_rows", "in_gemm"),  # experts, forward
            (fp8_ops, "_quantize_dense_rows", "in_gemm"),  # FP8Linear, forward
            (fp8_ops, "quantize_columnwise", "in_gemm"),  # both, input gradient
            (fp8_cache, "quantize_columnwise", "cache_cols"),  # every fill of a cache
        ):
            monkeypatch.setattr(module, name, counted(getattr(module, name), attr))


def train(run: RunConfig, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor], Stack]:
    """``steps`` optimizer steps of the trainer's calls (``Trainer._compute``, ``update``) on
    fixed token batches: the summed cross-entropy of each step, the weights after, the stack."""
    stack = build_stack(run, Mesh(run.parallel))
    model = stack.chunks[0]
    gen = torch.Generator().manual_seed(0)
    shape = (run.train.micro_batch_size, run.train.seq_len + 1)
    losses = []
    for _ in range(steps):
        stack.optimizer.set_lr(1e-2)
        stack.buckets.start_step()
        total = torch.zeros(())
        for _ in range(run.micro_batches):
            tokens = torch.randint(0, run.model.vocab_size, shape, generator=gen)
            h, aux, e = model.hidden(tokens[:, :-1])
            parts = model.losses(h, aux, e, tokens, stack.loss_fn)
            (parts.objective(stack.mtp_weight) / run.micro_batches).backward()
            total += parts.ce.detach()
        stack.buckets.finish()
        stack.optimizer.update(stack.optimizer.grad_norm(), 1.0)
        losses.append(total.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, stack


def fp8_gemm_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The weights of the model's FP8 GEMMs: the experts' stacks and the FP8 linears'."""
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    return experts + [m.weight for m in model.modules() if isinstance(m, FP8Linear)]


def unfused(b):
    """Every piece as one: the optimizer then quantizes both copies after the gather, as it
    does where a ZeRO-1 shard cuts tensors."""
    return [(start, g, None) for start, g in b.gradients()]


@functools.cache
def reference(preset: str) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Training without the cache (once per preset): losses, weights, the FP8 GEMMs' weights;
    each weight quantized in every micro-batch, both layouts."""
    run = compose_run([*SMALL, *PRESETS[preset]])  # precision.fp8_weight_cache off
    with pytest.MonkeyPatch.context() as m:
        counts = Counts(m)
        losses, weights, stack = train(run)
    fp8_weights = len(fp8_gemm_weights(stack.chunks[0]))
    assert counts.in_gemm == 2 * fp8_weights * run.micro_batches * STEPS
    assert counts.cache_cols == 0
    return losses, weights, fp8_weights


@pytest.mark.parametrize(
    "preset, refresh", [("fp8", "fused"), ("fp8", "after-gather"), ("bf16-master", "fused")]
)
def test_training_with_the_cache_is_bit_identical_and_quantizes_once_per_step(
    preset, refresh, monkeypatch
):
    run = compose_run([*SMALL, *PRESETS[preset], *CACHE])
    assert run.micro_batches == 2
    ref_losses, ref_weights, fp8_weights = reference(preset)
    with monkeypatch.context() as m:
        counts = Counts(m)
        if refresh == "after-gather":
            m.setattr(optimizer_module, "_pieces", unfused)
        losses, weights, stack = train(run)
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        assert torch.equal(w, ref_weights[name]), name
    model = stack.chunks[0]
    cached = [p for p in model.parameters() if cache_of(p) is not None]
    assert {id(p) for p in cached} == {id(p) for p in fp8_gemm_weights(model)}
    assert len(cached) == fp8_weights == (6 if preset == "fp8" else 2)  # 2 experts + 4 q,k,v,o
    # the GEMMs never quantize a weight; each weight is quantized once before the first step
    # (its first micro-batch) and once after every step, whatever the micro-batches
    assert counts.in_gemm == 0
    assert counts.cache_cols == len(cached) * (STEPS + 1)
    assert all(cache_of(p).fills == STEPS + 1 for p in cached)
    # what the caches hold now is the final weights' bytes
    for p in cached:
        ops, want = cache_of(p).current(p), fp8_cache.quantize_weight(p)
        assert ops is not None
        assert torch.equal(ops.rows[0].view(torch.uint8), want.rows[0].view(torch.uint8))
        assert torch.equal(ops.cols[0].view(torch.uint8), want.cols[0].view(torch.uint8))


def test_weights_changed_outside_the_optimizer_never_meet_their_stale_copies():
    """A checkpoint's weights loaded into the model (``load_state_dict``) make every cache
    stale: the next forward quantizes the loaded weights (once), and its output is the one of a
    model that never had a cache. A load through the optimizer (``publish_weights``, how a
    resumed run loads) refreshes the copies right away."""
    run = compose_run([*SMALL, *PRESETS["fp8"], *CACHE])
    _, _, stack = train(run, steps=1)
    model = stack.chunks[0]
    cached = [p for p in model.parameters() if cache_of(p) is not None]
    assert all(cache_of(p).current(p) is not None for p in cached)
    tokens = torch.randint(0, run.model.vocab_size, (1, 16), generator=torch.Generator())
    other = {k: v * 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.load_state_dict(other)
    assert all(cache_of(p).current(p) is None for p in cached)
    with torch.no_grad():
        got = model(tokens)[0]
        fills = [cache_of(p).fills for p in cached]
        again = model(tokens)[0]
        assert [cache_of(p).fills for p in cached] == fills  # refilled once, then reused
        caches = [cache_of(p) for p in cached]
        for p in cached:
            p.fp8_cache = None  # the same model quantizing in every call
        want = model(tokens)[0]
        for p, cache in zip(cached, caches, strict=True):
            p.fp8_cache = cache
    assert torch.equal(got, want) and torch.equal(again, want)

    # through the optimizer: masters changed, published, the copies already the new weights'
    opt = stack.optimizer
    for m in opt.masters:
        m.mul_(0.5)
    opt.publish_weights()
    for p in cached:
        ops = cache_of(p).current(p)
        assert ops is not None
        want_cols = fp8_cache.quantize_weight(p).cols[0]
        assert torch.equal(ops.cols[0].view(torch.uint8), want_cols.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_the_trainer_on_a_gpu_trains_alike_with_and_without_the_cache(graph, tmp_path):
    """``moe train precision=fp8`` on one GPU, two micro-batches a step, eager or replayed as
    CUDA graphs: the losses of the run with the cache track the run without it (the same
    operand bytes; the GPU's reductions need not repeat bit for bit), and after the last step,
    graphs replayed included, every cache holds the final weights' bytes."""
    from helpers import BASE

    from moe_core.train.trainer import Trainer

    args = [*BASE, "precision=fp8", "train.steps=6", "train.checkpoint_every=1000"]
    args += ["train.micro_batch_size=2", "train.global_batch_size=4"]
    args.append(f"parallel.cuda_graph={str(graph).lower()}")
    losses = {}
    for cached in (False, True):
        cache = [f"precision.fp8_weight_cache={str(cached).lower()}"]
        trainer = Trainer(compose_run([*args, *cache, f"out_dir={tmp_path / str(cached)}"]))
        assert trainer.device.type == "cuda" and (trainer.graphs is not None) == graph
        losses[cached] = [s.loss for s in trainer.fit(show_progress=False)]
    for a, b in zip(losses[True], losses[False], strict=True):
        assert abs(a - b) <= 1e-3 * abs(b), losses
    caches = [(p, cache_of(p)) for p in trainer.chunks[0].parameters() if cache_of(p)]
    assert len(caches) == 2 * trainer.cfg.model.n_layers
    for p, cache in caches:
        want = fp8_cache.quantize_weight(p)
        assert torch.equal(cache.operands.rows[0].view(torch.uint8), want.rows[0].view(torch.uint8))
        assert torch.equal(cache.operands.cols[0].view(torch.uint8), want.cols[0].view(torch.uint8))
        assert torch.equal(cache.operands.rows[1], want.rows[1])


@pytest.mark.extended
def test_zero1_shards_cutting_tensors_train_alike_with_and_without_the_cache(tmp_path):
    """Data parallelism (dp=2, gloo): the ZeRO-1 shards cut the flat buckets anywhere, so the
    copies are quantized after the gather (the single-process tests take that path by hand):
    on each rank, losses and weights bit-equal with and without the cache, every cache the
    final weights' bytes. Extended: two processes; ``after-gather`` above covers the path."""
    import json

    from helpers import BASE, TESTS, explain, torchrun

    out = tmp_path / "fp8-cache.json"
    layout = [*BASE, "train.steps=3", "parallel.dp=2", *PRESETS["fp8"]]
    result = torchrun(2, [str(TESTS / "dist_jobs.py"), "fp8-cache", str(out), *layout])
    assert result.returncode == 0, explain(result)
    ranks = json.loads(out.read_text())
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["losses_equal"] and rank["weights_equal"], rank
        assert rank["cached"] == 2 * 4 + 4 * 4 and rank["caches_hold"], rank  # BASE: 4 layers
        assert all(size == 2 for _, size in rank["groups"]), rank  # every bucket sharded
