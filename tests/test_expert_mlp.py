"""``moe_kernels.expert_mlp``: the fused path (QuACK's epilogues, here through a CPU stand-in
written from QuACK's documented semantics, ``tests/fake_quack.py``) equals the unfused definition in
output and every gradient, incl. the router weights' gradient, empty experts, all rows in one
expert and rows past the last group end; the MoE layer takes it exactly when it fuses. The GPU
test (``test_grouped_gemm_quack_gpu.py``) holds the real library to the same."""

from __future__ import annotations

import pytest
import torch

from moe_core.model.kernel_choice import Kernels
from moe_kernels import expert_mlp as em
from tests import fake_quack

SIZES = {
    "uneven": [5, 0, 9, 3],
    "empty-experts": [0, 0, 12, 0],
    "all-in-one": [0, 17, 0, 0],
}


def reference(x, w_gate_up, w_down, offs, weight):
    """Per-expert loop in fp64: ``weight * (silu(x Wg^T) * (x Wu^T)) Wd^T``; rows past the end 0."""
    x, w_gate_up, w_down = x.double(), w_gate_up.double(), w_down.double()
    y = torch.zeros(x.shape[0], w_down.shape[1], dtype=torch.float64)
    start = 0
    F_ = w_down.shape[-1]
    for g, end in enumerate(offs.tolist()):
        h = x[start:end] @ w_gate_up[g].t()
        a = torch.nn.functional.silu(h[:, :F_]) * h[:, F_:]
        if weight is not None:
            a = a * weight[start:end].double().unsqueeze(1)
        y[start:end] = a @ w_down[g].t()
        start = end
    return y


def make(sizes, extra_rows, with_weight, seed=0):
    gen = torch.Generator().manual_seed(seed)
    G, D, F_ = len(sizes), 8, 6
    M = sum(sizes) + extra_rows
    x = torch.randn(M, D, generator=gen)
    w_gate_up = torch.randn(G, 2 * F_, D, generator=gen) * 0.3
    w_down = torch.randn(G, D, F_, generator=gen) * 0.3
    weight = torch.rand(M, generator=gen) if with_weight else None
    offs = torch.tensor(sizes).cumsum(0).to(torch.int32)
    return x, w_gate_up, w_down, offs, weight


@pytest.fixture
def fused(monkeypatch):
    """QuACK "runs" (the stand-in) for the fused op."""
    with fake_quack.installed():
        monkeypatch.setattr(em, "_quack_runs", lambda x, backend: True)
        yield


@pytest.mark.parametrize("with_weight", [True, False], ids=["weighted", "unweighted"])
@pytest.mark.parametrize("extra_rows", [0, 3], ids=["exact", "rows-past-the-end"])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_fused_expert_mlp_equals_the_definition_in_output_and_gradients(
    fused, sizes, extra_rows, with_weight
):
    x, w_gate_up, w_down, offs, weight = make(SIZES[sizes], extra_rows, with_weight)
    M = int(offs[-1])
    leaves = [t.clone().requires_grad_() for t in (x, w_gate_up, w_down)]
    w_leaf = weight.clone().requires_grad_() if with_weight else None
    assert em.fuses(leaves[0], leaves[1], leaves[2])
    y = em.expert_mlp(*leaves, offs, w_leaf)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    dy[M:] = float("nan")  # the caller never reads, nor sends gradient into, rows past the end
    (y[:M] * dy[:M]).sum().backward()

    ref_leaves = [t.double().requires_grad_() for t in (x, w_gate_up, w_down)]
    ref_w = weight.double().requires_grad_() if with_weight else None
    ref = reference(*ref_leaves, offs, ref_w)
    (ref[:M] * dy[:M].double()).sum().backward()

    tol = {"rtol": 1e-5, "atol": 1e-5}  # fp32 against fp64
    torch.testing.assert_close(y[:M].double(), ref[:M], **tol)
    for name, got, want in zip(("x", "w_gate_up", "w_down"), leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad[:M].double(), want.grad[:M], msg=name, **tol)
        if name != "x":
            torch.testing.assert_close(got.grad.double(), want.grad, msg=name, **tol)
    empty = [g for g, n in enumerate(SIZES[sizes]) if n == 0]
    assert torch.equal(leaves[1].grad[empty], torch.zeros_like(leaves[1].grad[empty]))
    if with_weight:
        torch.testing.assert_close(w_leaf.grad[:M].double(), ref_w.grad[:M], **tol)


def test_unfused_path_is_the_three_op_composition():
    """Off the fused path (no QuACK: CPU) the op is the grouped GEMMs and the SwiGLU pass."""
    x, w_gate_up, w_down, offs, weight = make(SIZES["uneven"], 0, True)
    assert not em.fuses(x, w_gate_up, w_down)
    torch.testing.assert_close(
        em.expert_mlp(x, w_gate_up, w_down, offs, weight).double(),
        reference(x, w_gate_up, w_down, offs, weight),
        rtol=1e-5,
        atol=1e-5,
    )


def test_fused_off_and_references_only_take_the_unfused_path(fused):
    from moe_kernels._triton import references_only

    x, w_gate_up, w_down, _, _ = make(SIZES["uneven"], 0, True)
    assert em.fuses(x, w_gate_up, w_down)
    with references_only():
        assert not em.fuses(x, w_gate_up, w_down)
    assert not em.fuses(x, w_gate_up, w_down, fused=False)
    assert not em.fuses(x.t().contiguous().t(), w_gate_up, w_down)  # rows not contiguous
    assert not em.fuses(x[:0], w_gate_up, w_down)  # no rows (an expert-parallel rank's share)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((5, 8), (2, 12, 8), (2, 8, 5)), "must be \\[G, 2F, D\\]"),
        (((5, 7), (2, 12, 8), (2, 8, 6)), "must be \\[G, 2F, D\\]"),
        (((5, 8), (2, 11, 8), (2, 8, 6)), "must be \\[G, 2F, D\\]"),
    ],
)
def test_mismatched_shapes_are_refused_naming_them(shapes, match):
    x, wgu, wd = (torch.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        em.expert_mlp(x, wgu, wd, torch.tensor([2, 5], dtype=torch.int32))
    with pytest.raises(TypeError, match="int32"):
        x, wgu, wd = torch.zeros(5, 8), torch.zeros(2, 12, 8), torch.zeros(2, 8, 6)
        em.expert_mlp(x, wgu, wd, torch.tensor([2, 5]))


def test_moe_layer_takes_the_fused_mlp_where_it_fuses_and_matches_unfused(fused, monkeypatch):
    """The local dispatcher's experts run the fused op (no SwiGLU pass) and the layer's output
    and gradients equal the unfused layer's."""
    from moe_core.config import ModelConfig
    from moe_core.model import moe as moe_mod

    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=16, n_layers=1, n_heads=2, n_experts=4, top_k=2, expert_hidden=8, vocab_size=32
    )
    layer = moe_mod.MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(2, 5, 16)
    calls = []
    real_swiglu = moe_mod.swiglu
    monkeypatch.setattr(moe_mod, "swiglu", lambda *a: calls.append(1) or real_swiglu(*a))

    def run():
        layer.zero_grad()
        xi = x.clone().requires_grad_()
        y, aux = layer(xi)
        (y.square().sum() + aux).backward()
        return y.detach(), xi.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}

    y_fused, dx_fused, g_fused = run()
    assert calls == []  # the SwiGLU ran in the (stand-in) epilogue
    layer.experts.kernels = Kernels(fused_mlp=False)
    y_ref, dx_ref, g_ref = run()
    assert calls  # and here as its own pass
    torch.testing.assert_close(y_fused, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx_fused, dx_ref, rtol=1e-5, atol=1e-6)
    for name in g_ref:
        torch.testing.assert_close(g_fused[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_quack_stand_in_sets_an_imported_real_library_aside_and_restores_it():
    """On a GPU machine the real QuACK may be imported by an earlier test of the same process:
    inside ``fake_quack.installed()`` no part of it may answer (its submodules, the
    ``moe_kernels`` package's attribute that ``from moe_kernels import ...`` reads first), and after
    it everything is as before."""
    import sys
    import types

    import moe_kernels

    real_sub, real_ours = types.ModuleType("quack.epilogue.library"), types.ModuleType("ours")
    had = moe_kernels.__dict__.get("grouped_gemm_quack")
    sys.modules["quack.epilogue.library"] = real_sub
    sys.modules["moe_kernels.grouped_gemm_quack"] = moe_kernels.grouped_gemm_quack = real_ours
    try:
        with fake_quack.installed():
            from moe_kernels import grouped_gemm_quack as inside

            assert inside is not real_ours and inside.gemm is fake_quack.gemm
            assert "quack.epilogue.library" not in sys.modules
        assert sys.modules["quack.epilogue.library"] is real_sub
        from moe_kernels import grouped_gemm_quack as after

        assert after is real_ours and sys.modules["moe_kernels.grouped_gemm_quack"] is real_ours
    finally:
        sys.modules.pop("quack.epilogue.library", None)
        sys.modules.pop("moe_kernels.grouped_gemm_quack", None)
        moe_kernels.__dict__.pop("grouped_gemm_quack", None)
        if had is not None:
            moe_kernels.grouped_gemm_quack = had
