"""Inputs shared by the kernel tests: routings with empty and overloaded experts, the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from moe_kernels._triton import use_triton
from moe_kernels.routing import expert_slots_reference
from moe_kernels.slot_permute import (
    combine_from_slots_reference,
    permute_to_slots,
    permute_to_slots_reference,
)

# CUDA where there is a GPU; elsewhere CPU tensors, run by Triton's interpreter (see conftest).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Small on purpose: the interpreter costs about half a millisecond per program instance.
T, E, D = 37, 12, 40  # T no power of two or block multiple, E and D no power of two


def assert_triton_path(t: torch.Tensor) -> None:
    """The kernel tests must run the kernels: fail (never skip) if they would take the reference."""
    assert use_triton(t), "Triton is not selected for this tensor: set TRITON_INTERPRET=1 on CPU"


def routings(
    n_tokens: int, n_experts: int, k: int, seed: int = 0
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, experts_TK int64 on DEVICE): two starved experts, one expert taking every token
    (with K > 1 every token picks the same K experts), and choices drawn with replacement (a
    token may pick an expert twice: the slot map must still be a bijection)."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([e for e in range(n_experts) if e not in (0, 3)])
    distinct = torch.stack(
        [allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(n_tokens)]
    )
    yield "two-empty-experts", distinct.to(DEVICE)
    same = torch.arange(n_experts - 1, n_experts - 1 - k, -1).expand(n_tokens, k)
    yield "all-on-one", same.contiguous().to(DEVICE)
    yield "with-repeats", torch.randint(0, n_experts, (n_tokens, k), generator=gen).to(DEVICE)


def routing(name: str, n_tokens: int, n_experts: int, k: int, seed: int = 0) -> torch.Tensor:
    return dict(routings(n_tokens, n_experts, k, seed))[name]


ROUTING_NAMES = ["two-empty-experts", "all-on-one", "with-repeats"]


def drop_assignments(experts_TK: torch.Tensor, pattern: str, seed: int = 0) -> torch.Tensor:
    """Mark assignments dropped (expert id -1, as an expert-parallel receiver marks choices that
    live on other ranks). ``mixed``: tokens cycle through all kept, a random subset dropped, and
    all dropped (every kind of row in one routing); ``all``: every assignment dropped."""
    T, K = experts_TK.shape
    if pattern == "all":
        return torch.full_like(experts_TK, -1)
    assert pattern == "mixed", pattern
    gen = torch.Generator().manual_seed(seed)
    drop_TK = torch.rand(T, K, generator=gen) < 0.5
    kind_T = torch.arange(T) % 3
    drop_TK[kind_T == 0] = False
    drop_TK[kind_T == 2] = True
    return torch.where(drop_TK.to(experts_TK.device), -1, experts_TK)


def valid_rows(experts_TK: torch.Tensor, n_experts: int, align: int) -> int:
    """The exact row count a caller would pass: the kept assignments, each segment padded."""
    kept = experts_TK[experts_TK >= 0].cpu()
    counts_E = torch.bincount(kept, minlength=n_experts)
    return int(((counts_E + align - 1) // align * align).sum())


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    """Standard normal values on DEVICE (drawn on the CPU, so every device sees the same)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def rand_weights(n_tokens: int, k: int, seed: int = 0) -> torch.Tensor:
    """fp32 combine weights in [0.1, 1): random and away from zero."""
    gen = torch.Generator().manual_seed(seed)
    return (0.1 + 0.9 * torch.rand(n_tokens, k, generator=gen)).to(DEVICE)


FP32_ATOL_ULPS = 2**-20  # 8 fp32 ulps (2**-23 each) of the output's largest magnitude


def fp32_atol(ref: torch.Tensor) -> float:
    """Absolute fp32 tolerance: 1e-5, or 8 ulps of max|ref| where that is larger.

    Each element is a sum (over K choices, or over D for a weight gradient) that the kernel and
    the reference add in different orders. Rounding error is relative to the size of the terms,
    not of the result: a length-2048 dot product that cancels to ~0.1 still carries ~1e-5 of
    error when its terms are O(1) and the largest outputs O(100). The largest output bounds the
    term scale from below, so the error allowance follows it; a real bug (a wrong or missing
    term) moves an element by a term's size, orders of magnitude above 8 ulps of the maximum.
    """
    scale = ref.detach().abs().max().item() if ref.numel() else 0.0
    return max(1e-5, FP32_ATOL_ULPS * scale)


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Kernel output vs reference: same dtype and shape; fp32 to 1e-5 relative plus a few ulps
    of the output's scale (sums in another order, see ``fp32_atol``); bf16 to a couple of bf16
    ulps of the output's scale and 1% in norm, because Triton's interpreter rounds fp32 -> bf16
    toward zero where the GPU (and torch) round to nearest."""
    assert got.dtype == ref.dtype and got.shape == ref.shape, (got.dtype, got.shape, ref.shape)
    if got.numel() == 0:
        return
    if got.dtype == torch.bfloat16:
        a, b = got.float(), ref.float()
        scale = b.abs().max().item()
        torch.testing.assert_close(a, b, rtol=2**-6, atol=2**-6 * scale)
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 1e-2, f"relative error {err:.2e}"
    else:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=fp32_atol(ref))


def permute_combine_round_trip(
    permute: Callable,
    combine: Callable,
    x_TD: torch.Tensor,
    slot_TK: torch.Tensor,
    n_rows: int,
    w_TK: torch.Tensor,
    g_MD: torch.Tensor,
    dy_TD: torch.Tensor,
    **flags,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Permute, scale the expert rows by ``g_MD`` (so the ops' gradients differ from a plain
    copy), combine with weights, backward of ``dy_TD``: (x_MD, y_TD, dx_TD, dw_TK)."""
    x = x_TD.clone().requires_grad_()
    w = w_TK.clone().requires_grad_()
    x_MD = permute(x, slot_TK, n_rows, **flags)
    y_TD = combine(x_MD * g_MD, slot_TK, w, **flags)
    y_TD.backward(dy_TD)
    return x_MD.detach(), y_TD.detach(), x.grad, w.grad


def output_and_grad(
    fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(fn(x), d fn(x) / dx applied to dy) for an elementwise-style op."""
    x = x.clone().requires_grad_()
    y = fn(x)
    y.backward(dy)
    return y.detach(), x.grad


def assert_cast_once(low: torch.Tensor, master: torch.Tensor) -> None:
    """``low`` is ``master`` rounded to its dtype: exactly (round to nearest even) on the GPU;
    Triton's interpreter truncates instead, so on the CPU within one bf16 step."""
    if low.is_cuda:
        assert torch.equal(low, master.to(low.dtype)), "not the master rounded once"
    else:
        torch.testing.assert_close(low.float(), master, rtol=2**-7, atol=0.0)


# Slot-permutation cases shared by the library's tests and the weighted combine baseline's.
SLOT_DTYPES = [torch.float32, torch.bfloat16]


def padding_mask(slot_TK: torch.Tensor, n_rows: int) -> torch.Tensor:
    used = torch.zeros(n_rows, dtype=torch.bool, device=slot_TK.device)
    used[slot_TK.reshape(-1)] = True
    return ~used


def slot_case(name: str, k: int, align: int, dtype: torch.dtype, seed: int = 0):
    """(slot_TK, n_rows, x_TD) for a named routing."""
    experts_TK = routing(name, T, E, k, seed)
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, align)
    return slot_TK, n_rows, randn(T, D, dtype=dtype, seed=seed + 1)


def round_trips(combine, slot_TK, n_rows, x_TD, k, dtype, mapped=None):
    """(ours, reference): permute, perturb the rows, ``combine`` with random weights, backward;
    each (x_MD, y_TD, dx_TD, dw_TK) as ``permute_combine_round_trip`` gives them."""
    w_TK = rand_weights(T, k, seed=2)
    g_MD = randn(n_rows, D, dtype=dtype, seed=3)  # perturbs the expert rows between the ops
    dy_TD = randn(T, D, dtype=dtype, seed=4)
    args = (x_TD, slot_TK, n_rows, w_TK, g_MD, dy_TD)
    got = permute_combine_round_trip(permute_to_slots, combine, *args, every_row_mapped=mapped)
    references = (permute_to_slots_reference, combine_from_slots_reference)
    return got, permute_combine_round_trip(*references, *args)


def dropped_slot_case(name: str, k: int, pattern: str, align: int, exact: bool, dtype, seed=0):
    """(slot_TK, n_rows, every_row_mapped, x_TD): the flag as a caller would set it."""
    experts_TK = drop_assignments(routing(name, T, E, k, seed), pattern, seed=seed + 1)
    n_rows = valid_rows(experts_TK, E, align) if exact else None
    slot_TK, _, _, n_rows = expert_slots_reference(experts_TK, E, align, n_rows)
    mapped = exact and align == 1  # only then does every row hold a kept assignment
    return slot_TK, n_rows, mapped, randn(T, D, dtype=dtype, seed=seed + 2)


def recording_fp8_gemms(monkeypatch) -> list[bool]:
    """Take the GPU's FP8 GEMMs as runnable here: ``torch._scaled_grouped_mm`` and
    ``torch._scaled_mm`` become the dequantized products they stand for (the CPU path's
    arithmetic, so the same values), and each call appends its ``use_fast_accum`` to the list
    returned, in call order."""
    from moe_kernels import fp8
    from moe_kernels.grouped_gemm import grouped_mm_reference

    calls: list[bool] = []

    def grouped(qa_MK, qb_GKN, sa_M, sb_GN, *, offs, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        G, K, N = qb_GKN.shape
        qb_GNK = qb_GKN.transpose(-2, -1)
        w_GNK = fp8.dequantize(qb_GNK.reshape(G * N, K), sb_GN.reshape(G * N)).view(G, N, K)
        a_MK = fp8.dequantize(qa_MK, sa_M)
        return grouped_mm_reference(a_MK, w_GNK.transpose(-2, -1), offs).to(out_dtype)

    def dense(qa_MK, qb_KN, *, scale_a, scale_b, out_dtype, use_fast_accum=False):
        calls.append(use_fast_accum)
        a_MK, b_NK = fp8.dequantize(qa_MK, scale_a[:, 0]), fp8.dequantize(qb_KN.t(), scale_b[0])
        return (a_MK @ b_NK.t()).to(out_dtype)

    monkeypatch.setattr(fp8, "scaled_grouped_mm_supported", lambda x: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", grouped, raising=False)
    monkeypatch.setattr(torch, "_scaled_mm", dense)
    return calls
