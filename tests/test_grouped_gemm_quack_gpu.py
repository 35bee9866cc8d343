"""QuACK's grouped GEMMs (the ``[gpu]`` extra) against ``torch._grouped_mm`` on the experts'
shapes and layouts: forward, input gradient and both weight-gradient layouts, incl. empty
groups, every row in one group, and rows past the last group end (static buffers), which
QuACK must neither read into a weight gradient nor fail on; and its gathered-row GEMMs
(``gathered_grouped_mm``) against permute + ``torch._grouped_mm``, alone and in the MoE layer."""

from __future__ import annotations

import pytest
import torch

from moe_core.model.kernel_choice import Kernels

pytestmark = pytest.mark.gpu
quack_gemm = pytest.importorskip("moe_kernels.grouped_gemm_quack", reason="needs quack-kernels")

K, N = 256, 384
SIZES = {
    "uneven": [300, 17, 0, 512, 129, 64],
    "empty-groups": [0, 0, 640, 0, 384, 0],
    "all-in-one": [0, 0, 0, 1024, 0, 0],
}


def bf16(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


def bf16_moe_layer():
    """A small bf16 MoE layer on the GPU (8 experts, top-2) and an input needing a gradient."""
    from helpers import small_config

    from moe_core.model.moe import MoE

    cfg = small_config(n_experts=8, top_k=2, d_model=256, expert_hidden=128)
    torch.manual_seed(0)
    layer = MoE(cfg).cuda()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    layer = layer.to(torch.bfloat16)
    x = torch.randn(2, 64, cfg.d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return cfg, layer, x


@pytest.mark.parametrize("extra_rows", [0, 100], ids=["exact", "rows-past-the-end"])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_quack_grouped_gemms_equal_torch_grouped_mm(sizes, extra_rows):
    gen = torch.Generator(device="cuda").manual_seed(0)
    groups = SIZES[sizes]
    M = sum(groups)
    offs_G = torch.tensor(groups).cumsum(0).to("cuda", torch.int32)
    x_MK, dy_MN = bf16(M + extra_rows, K, gen=gen), bf16(M + extra_rows, N, gen=gen)
    w_GNK = bf16(len(groups), N, K, gen=gen, scale=0.05)  # stored [G, N, K], used transposed
    w_GKN = w_GNK.transpose(-2, -1)
    real_x, real_dy = x_MK[:M], dy_MN[:M]
    cases = {
        "fwd": (
            quack_gemm.grouped_mm(x_MK, w_GKN, offs_G)[:M],
            torch._grouped_mm(real_x, w_GKN, offs=offs_G),
        ),
        "dgrad": (
            quack_gemm.grouped_mm(dy_MN, w_GNK, offs_G)[:M],
            torch._grouped_mm(real_dy, w_GNK, offs=offs_G),
        ),
        "wgrad": (
            quack_gemm.grouped_wgrad(x_MK, dy_MN, offs_G),
            torch._grouped_mm(real_x.t(), real_dy, offs=offs_G),
        ),
        "wgrad_nk": (
            quack_gemm.grouped_wgrad(x_MK, dy_MN, offs_G, transposed=True),
            torch._grouped_mm(real_dy.t(), real_x, offs=offs_G),
        ),
    }
    for name, (got, ref) in cases.items():
        assert got.shape == ref.shape and got.dtype == ref.dtype, name
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(
            got.float(), ref.float(), rtol=1.6e-2, atol=2**-8 * max(scale, 1e-30), msg=name
        )
    empty = [g for g, n in enumerate(groups) if n == 0]
    assert torch.equal(cases["wgrad"][0][empty], torch.zeros_like(cases["wgrad"][0][empty]))


def test_auto_backend_takes_quack_and_gives_torchs_outputs_and_gradients():
    """``auto`` (the default) runs QuACK where it is installed; through the differentiable op,
    in the experts' transposed layout, outputs and gradients equal torch's path."""
    from moe_kernels import grouped_gemm as gg

    gen = torch.Generator(device="cuda").manual_seed(1)
    groups = SIZES["uneven"]
    offs_G = torch.tensor(groups).cumsum(0).to("cuda", torch.int32)
    x = bf16(sum(groups), K, gen=gen).requires_grad_()
    w_GNK = bf16(len(groups), N, K, gen=gen, scale=0.05).requires_grad_()
    dy = bf16(sum(groups), N, gen=gen)
    results = {}
    for backend in ("torch", "auto"):
        assert gg._quack_runs(x, backend) == (backend == "auto")
        y = gg.grouped_mm(x, w_GNK.transpose(-2, -1), offs_G, backend=backend)
        results[backend] = (y, *torch.autograd.grad(y, (x, w_GNK), dy))
    for got, ref in zip(results["auto"], results["torch"], strict=True):
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=2**-8 * scale)


@pytest.mark.parametrize("align", [1, 8])
@pytest.mark.parametrize("drops", ["none", "mixed"])
@pytest.mark.parametrize("routing_name", ["two-empty-experts", "all-on-one", "with-repeats"])
def test_gathered_gemm_on_quack_equals_permute_then_torch_grouped_mm(routing_name, drops, align):
    """QuACK's gathered rows (``A_idx``, forward and varlen-K weight gradient) give what
    permute + ``torch._grouped_mm`` gives, output and both gradients, on empty experts, every
    token on one expert, dropped slots and padding rows (zero outputs, nothing in dw), keeping
    no [M, D] row copy for backward."""
    from kernel_cases import drop_assignments, routing

    from moe_kernels import grouped_gemm as gg
    from moe_kernels.routing import expert_slots
    from moe_kernels.slot_permute import permute_to_slots, slot_tokens

    T, E = 500, 8
    experts_TK = routing(routing_name, T, E, 2).cuda()
    if drops != "none":
        experts_TK = drop_assignments(experts_TK, drops)
    slots = expert_slots(experts_TK, E, align)
    mapped = None if drops == "none" else False
    idx_M = slot_tokens(slots.slot_TK, slots.n_rows)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = bf16(T, K, gen=gen).requires_grad_()
    w_GNK = bf16(E, N, K, gen=gen, scale=0.05).requires_grad_()
    dy = bf16(slots.n_rows, N, gen=gen)
    assert gg.gathers_in_gemm(x), "QuACK must run the gathered GEMM here"
    results = {}
    for backend in ("auto", "torch"):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(tuple(t.shape)) or t, lambda t: t
        ):
            if backend == "auto":
                y = gg.gathered_grouped_mm(
                    x,
                    idx_M,
                    w_GNK.mT,
                    slots.offs_E,
                    slots.slot_TK,
                    every_row_mapped=mapped,
                    backend=backend,
                )
            else:
                x_MD = permute_to_slots(x, slots.slot_TK, slots.n_rows, every_row_mapped=mapped)
                y = gg.grouped_mm(x_MD, w_GNK.mT, slots.offs_E, backend=backend)
        results[backend] = (y, *torch.autograd.grad(y, (x, w_GNK), dy), saved)
    (y, dx, dw, saved), ref = results["auto"], results["torch"]
    for name, got, want in zip(("y", "dx", "dw"), (y, dx, dw), ref[:3], strict=True):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(
            got.float(), want.float(), rtol=1.6e-2, atol=2**-8 * max(scale, 1e-30), msg=name
        )
    valid_M = torch.zeros(slots.n_rows, dtype=torch.bool, device="cuda")
    valid_M[slots.slot_TK[slots.slot_TK >= 0]] = True
    assert not y[~valid_M].any(), "a padding row is not zero"
    empty_E = slots.counts_E == 0
    assert not dw[empty_E].any(), "an empty expert has a weight gradient"
    assert dw.is_contiguous(), "dw must arrive in the weight's own [G, N, K] layout"
    assert (slots.n_rows, K) in ref[3] and (slots.n_rows, K) not in saved, saved


def test_moe_layer_gathers_rows_under_quack_and_matches_torch():
    """Asked to gather (``parallel.gather_rows``), the MoE layer takes the gathered GEMM
    exactly when QuACK runs (``auto``), not under ``torch``, and both give the same output and
    gradients."""
    cfg, layer, x = bf16_moe_layer()
    params = [x, layer.experts.w_gate_up, layer.experts.w_down]
    results = {}
    for backend in ("auto", "torch"):
        layer.experts.kernels = Kernels(gemm=backend, gather_rows=True)  # parallel.gather_rows
        assert layer.experts.gathers_rows(x.view(-1, cfg.d_model)) == (backend == "auto")
        y, _ = layer(x)
        results[backend] = (y, *torch.autograd.grad(y.float().square().sum(), params))
    for got, want in zip(results["auto"], results["torch"], strict=True):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2**-7 * scale)


@pytest.mark.parametrize("with_weight", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("extra_rows", [0, 100], ids=["exact", "rows-past-the-end"])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_fused_expert_mlp_on_quack_equals_the_unfused_ops(sizes, extra_rows, with_weight):
    """The experts' MLP with the SwiGLU, the router weights and their gradient in QuACK's GEMM
    epilogues (``moe_kernels.expert_mlp``) gives the unfused ops' output and every gradient (the
    weights' included), on empty experts, all rows in one expert and rows past the last end;
    it keeps no [M, F] SwiGLU output for backward."""
    from moe_kernels import expert_mlp as em

    gen = torch.Generator(device="cuda").manual_seed(3)
    groups = SIZES[sizes]
    M, F_ = sum(groups), N // 2
    offs_G = torch.tensor(groups).cumsum(0).to("cuda", torch.int32)
    x = bf16(M + extra_rows, K, gen=gen).requires_grad_()
    w_gate_up = bf16(len(groups), 2 * F_, K, gen=gen, scale=0.1).requires_grad_()
    w_down = bf16(len(groups), K, F_, gen=gen, scale=0.1).requires_grad_()
    weight = None
    if with_weight:
        weight = torch.rand(M + extra_rows, device="cuda", generator=gen).requires_grad_()
    dy = bf16(M + extra_rows, K, gen=gen)
    inputs = [t for t in (x, w_gate_up, w_down, weight) if t is not None]
    results = {}
    for fused in (True, False):
        assert em.fuses(x, w_gate_up, w_down, fused=fused) == fused
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t, saved=saved: saved.append(tuple(t.shape)) or t, lambda t: t
        ):
            y = em.expert_mlp(x, w_gate_up, w_down, offs_G, weight, fused=fused)
        grads = torch.autograd.grad(y[:M], inputs, dy[:M])
        results[fused] = ([y[:M], *(g[:M] if g.shape[0] > M else g for g in grads)], saved)
    (got, saved), (want, saved_unfused) = results[True], results[False]
    names = ["y", "dx", "dw_gate_up", "dw_down", "dweight"]
    for name, g, w in zip(names, got, want, strict=False):
        scale = w.float().abs().max().item()
        torch.testing.assert_close(
            g.float(), w.float(), rtol=1.6e-2, atol=2**-7 * max(scale, 1e-30), msg=name
        )
    empty = [g for g, n in enumerate(groups) if n == 0]
    assert not got[2][empty].any() and not got[3][empty].any(), "empty experts got gradients"
    assert (M + extra_rows, F_) in saved_unfused and (M + extra_rows, F_) not in saved, saved


def test_moe_layer_runs_the_fused_mlp_under_quack_and_matches_unfused():
    """Under ``auto`` the MoE layer's experts take the fused MLP (no SwiGLU kernel launched)
    and give the unfused layer's output and gradients, router included."""
    _, layer, x = bf16_moe_layer()
    params = [x, *layer.parameters()]
    results = {}
    for fused in (True, False):
        layer.experts.kernels = Kernels(fused_mlp=fused)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            y, aux = layer(x)
            grads = torch.autograd.grad(y.float().square().sum() + aux, params)
            torch.cuda.synchronize()
        launched = " ".join(e.name for e in prof.events())
        assert ("_swiglu_forward" in launched) != fused, "SwiGLU pass launched (or not)"
        results[fused] = (y, *grads)
    for got, want in zip(results[True], results[False], strict=True):
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2**-7 * scale)
