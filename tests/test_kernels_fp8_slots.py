"""FP8 row operands written by the passes that produce them (issue 41, item 2): the permute
quantizes token rows into their slots (``quantize_to_slots``: Triton equals the permuted copy
quantized by rows, bit for bit, on every slot layout), and ``fp8_routed_mlp`` equals the
permute, ``fp8_expert_mlp`` and the sum it replaces, output and every gradient bit for bit,
without keeping a permuted copy for backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from kernel_cases import DEVICE, E, T, assert_triton_path, drop_assignments, randn, routing

from moe_kernels import fp8_triton
from moe_kernels.fp8 import fp8_expert_mlp, fp8_routed_mlp, quantize_to_slots
from moe_kernels.fp8_quantize import quantize_to_slots_reference
from moe_kernels.routing import expert_slots_reference
from moe_kernels.slot_permute import permute_to_slots, slot_weights, sum_from_slots

# (routing, dropped assignments, segment alignment): every row mapped, padded segments, and
# dropped assignments (an EP receiver's map) into a padded buffer
LAYOUTS = [
    ("two-empty-experts", None, 1),
    ("with-repeats", None, 8),
    ("all-on-one", None, 8),
    ("with-repeats", "mixed", 8),
]
LAYOUT_IDS = ["all-mapped", "padded", "all-on-one", "dropped"]


def slot_layout(name: str, dropped: str | None, align: int, k: int = 2, seed: int = 0):
    experts_TK = routing(name, T, E, k, seed)
    if dropped:
        experts_TK = drop_assignments(experts_TK, dropped, seed=seed + 1)
    slot_TK, _, offs_E, n_rows = expert_slots_reference(experts_TK, E, align)
    return slot_TK, offs_E, n_rows


def token_rows(D: int, dtype: torch.dtype, seed: int = 2) -> torch.Tensor:
    """Rows over six decades, a zero row, an all-equal row and an outlier (no bf16
    subnormals: Triton's interpreter flushes those as it loads)."""
    x = randn(T, D, seed=seed) * torch.logspace(-3, 3, T, device=DEVICE)[:, None]
    x[1] = 0.0
    x[2] = 0.37
    x[3, 5] = 1e4
    return x.to(dtype)


@pytest.mark.parametrize(("name", "dropped", "align"), LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("D", [40, 1100], ids=["one-pass", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_to_slots_is_the_permuted_copy_quantized_bit_for_bit(
    name, dropped, align, D, dtype
):
    slot_TK, _, n_rows = slot_layout(name, dropped, align)
    x_TD = token_rows(D, dtype)
    assert_triton_path(x_TD)
    block_d = 256 if D > 256 else 0  # the chunked walk (two reads of a row) at a small D
    zero = n_rows != slot_TK.numel()
    q, s, rows = fp8_triton.scatter_quantize_rows(
        x_TD, slot_TK, n_rows, zero_unmapped=zero, keep_rows=True, block_d=block_d
    )
    rq, rs, rrows = quantize_to_slots_reference(x_TD, slot_TK, n_rows, keep_rows=True)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32 and rows.dtype == dtype
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s, rs)
    assert torch.equal(rows, rrows)
    # the public entry point (default blocks, no bf16 rows) gives the same bytes
    q2, s2, none = quantize_to_slots(x_TD, slot_TK, n_rows)
    assert none is None and torch.equal(q2.view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s2, rs)
    # the zero token's slots are zero rows of scale 1, as are unmapped (padding) rows
    zero_slots = slot_TK[1][slot_TK[1] >= 0]
    assert torch.all(s[zero_slots] == 1.0) and not q[zero_slots].view(torch.uint8).any()
    used = torch.zeros(n_rows, dtype=torch.bool, device=DEVICE)
    used[slot_TK[slot_TK >= 0]] = True
    assert bool((~used).any()) == (align > 1)
    assert torch.all(s[~used] == 1.0) and not q[~used].view(torch.uint8).any()
    assert not rows[~used].any()


@contextlib.contextmanager
def poisoned_empty() -> Iterator[None]:
    """Inside: ``torch.empty`` fills what it allocates with NaN (E4M3's NaN byte, 0x7F, for
    the FP8 values; torch's deterministic mode), so a row a kernel leaves unwritten shows."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_quantize_to_slots_on_a_buffer_every_row_fills_leaves_no_row_unwritten():
    # every_row_mapped=True skips the zero-fill pass: every row must come from a slot (the
    # outputs start as uninitialized memory, filled with NaN bytes here to show it)
    slot_TK, _, n_rows = slot_layout("two-empty-experts", None, 1)
    assert n_rows == slot_TK.numel()
    x_TD = token_rows(40, torch.bfloat16)
    with poisoned_empty():
        q, s, rows = quantize_to_slots(x_TD, slot_TK, n_rows, keep_rows=True, every_row_mapped=True)
    rq, rs, rrows = quantize_to_slots_reference(x_TD, slot_TK, n_rows, keep_rows=True)
    assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s, rs)
    assert torch.equal(rows, rrows)
    # the poison shows where no slot writes: a padded buffer's rows without the zero-fill pass
    slot_TK, _, n_rows = slot_layout("with-repeats", None, 8)
    pad = torch.ones(n_rows, dtype=torch.bool, device=DEVICE)
    pad[slot_TK[slot_TK >= 0]] = False
    assert bool(pad.any())
    with poisoned_empty():
        q, s, _ = fp8_triton.scatter_quantize_rows(
            x_TD, slot_TK, n_rows, zero_unmapped=False, keep_rows=False
        )
    assert (q[pad].view(torch.uint8) == 0x7F).all() and s[pad].isnan().all()


def test_quantize_to_slots_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \[T, D\] and slots \[T, K\]"):
        quantize_to_slots(torch.zeros(4, 8), torch.zeros(5, 2, dtype=torch.int64), 10)


def routed_case(name: str, dropped: str | None, align: int, weighted: bool, seed: int = 4):
    slot_TK, offs_E, n_rows = slot_layout(name, dropped, align)
    gen = torch.Generator().manual_seed(seed)
    D, F = 64, 48  # 2F != D: the kept pre-activation is no [M, D] tensor

    def leaf(*shape: int, scale: float = 1.0) -> torch.Tensor:
        t = torch.randn(*shape, generator=gen) * scale
        return t.to(DEVICE, torch.bfloat16).requires_grad_()

    x, w_gu, w_d = leaf(T, D), leaf(E, 2 * F, D, scale=0.1), leaf(E, D, F, scale=0.1)
    w_TK = torch.rand(*slot_TK.shape, generator=gen).to(DEVICE).requires_grad_()
    dy = torch.randn(T, D, generator=gen).to(DEVICE, torch.bfloat16)
    leaves = [x, w_gu, w_d] + ([w_TK] if weighted else [])
    return slot_TK, offs_E, n_rows, x, w_gu, w_d, w_TK, dy, leaves


# each layout once, weighted (the router weights applied in the SwiGLU) on every other one
ROUTED = [(*layout, i % 2 == 1) for i, layout in enumerate(LAYOUTS)]
ROUTED_IDS = [f"{n}-{'weighted' if i % 2 else 'plain'}" for i, n in enumerate(LAYOUT_IDS)]


@pytest.mark.parametrize(("name", "dropped", "align", "weighted"), ROUTED, ids=ROUTED_IDS)
def test_fp8_routed_mlp_equals_permute_expert_mlp_sum_and_keeps_no_permuted_copy(
    name, dropped, align, weighted
):
    slot_TK, offs_E, n_rows, x, w_gu, w_d, w_TK, dy, leaves = routed_case(
        name, dropped, align, weighted
    )
    assert_triton_path(x)
    mapped = None if dropped is None else False  # dropped slots into a padded buffer
    shapes: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(t.shape))
        return t

    def weights() -> torch.Tensor | None:
        return slot_weights(w_TK, slot_TK, n_rows) if weighted else None

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fp8_routed_mlp(
            x, slot_TK, n_rows, w_gu, w_d, offs_E, weights(), every_row_mapped=mapped
        )
    got = (y, *torch.autograd.grad(y, leaves, dy))
    assert (n_rows, x.shape[1]) not in shapes, "a permuted copy of the rows is kept"
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        x_MD = permute_to_slots(x, slot_TK, n_rows, every_row_mapped=mapped)
        y_MD = fp8_expert_mlp(x_MD, w_gu, w_d, offs_E, weights())
        y = sum_from_slots(y_MD, slot_TK, every_row_mapped=mapped)
    assert (n_rows, x.shape[1]) in shapes, "the composition keeps the permuted rows"
    ref = (y, *torch.autograd.grad(y, leaves, dy))
    for g, r in zip(got, ref, strict=True):
        assert g.dtype == r.dtype and torch.equal(g, r)
    assert all(g.abs().sum() > 0 for g in got)


def test_fp8_routed_mlp_refuses_shapes_that_are_no_routed_mlp():
    slot_TK, offs_E, n_rows, x, w_gu, w_d, *_ = routed_case("two-empty-experts", None, 1, False)
    with pytest.raises(ValueError, match=r"x \[T, D\] and slots \[T, K\]"):
        fp8_routed_mlp(x[:-1], slot_TK, n_rows, w_gu, w_d, offs_E)
    with pytest.raises(ValueError, match=r"must be \[G, 2F, D\]"):
        fp8_routed_mlp(x[:, :-1], slot_TK, n_rows, w_gu, w_d, offs_E)
    with pytest.raises(ValueError, match=r"weight_M must be \[M\]"):
        fp8_routed_mlp(x, slot_TK, n_rows, w_gu, w_d, offs_E, torch.ones(n_rows + 1))
    with pytest.raises(TypeError, match="offs_G must be int32"):
        fp8_routed_mlp(x, slot_TK, n_rows, w_gu, w_d, offs_E.long())


@pytest.mark.parametrize("fast_accum", ["none", "forward", "all"])
def test_fp8_routed_mlp_accumulates_fast_where_told(fast_accum, monkeypatch):
    # the routed op's two forward products take fast accumulation under "forward" and "all",
    # its two input gradients under "all" only; the values are the CPU path's
    from kernel_cases import recording_fp8_gemms

    slot_TK, offs_E, n_rows, x, w_gu, w_d, *_ = routed_case("with-repeats", None, 8, False)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(x)

    def run(**kw):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w_gu, w_d)]
        y = fp8_routed_mlp(leaves[0], slot_TK, n_rows, *leaves[1:], offs_E, **kw)
        return (y, *torch.autograd.grad(y, leaves, dy))

    expected = run()
    calls = recording_fp8_gemms(monkeypatch)
    got = run(fast_accum=fast_accum)
    fwd, grad = fast_accum != "none", fast_accum == "all"
    assert calls == [fwd, fwd, grad, grad]
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
