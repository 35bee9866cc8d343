"""The Triton grouped GEMM baseline (benchmarks/baselines/grouped_gemm_triton.py): the forward
and both orientations of the weight gradient equal the per-group references of
moe_kernels/grouped_gemm.py on every group
layout (empty groups first, in the middle and last; all rows in one group; sizes off the block
grid), for a weight given transposed (stride(-2) == 1, the model's layout) or contiguous, in
fp32 and bf16, writing every output element. On CPU they run in Triton's interpreter with
16 x 16 x 16 blocks (ragged K and N edges, several row tiles per group); the last test compares
with ``torch._grouped_mm`` at a production shape on a GPU.

Tolerances (``assert_matches``): both sides accumulate products of the same inputs in fp32 in
different orders, so fp32 agrees to 1e-5 relative plus a few ulps of the output's scale. In
bf16 both then round the fp32 sum once, but Triton's interpreter truncates where torch rounds
to nearest: up to one bf16 ulp (2**-8 relative) apart, hence 2**-6 relative and of the output's
scale, and 1 % in norm.
"""

from __future__ import annotations

import pytest
import torch
from helpers import no_host_sync
from kernel_cases import DEVICE, assert_matches, assert_triton_path, randn

from benchmarks.baselines import grouped_gemm_triton as ggt
from moe_kernels.grouped_gemm import grouped_mm_reference, grouped_mm_wgrad_reference

BLOCK = (16, 16, 16)
SIZES = {
    "empty-first": [0, 5, 17, 33, 45],  # 9 row tiles of 16: two swizzle bands
    "empty-middle": [21, 0, 0, 45, 34],
    "empty-last": [37, 29, 34, 0, 0],
    "all-in-one-of-four": [0, 0, 100, 0],
    "single-group": [100],
    "block-multiples": [16, 48, 0, 32],
}
# (K, N): ragged K and N edges (40 = 16 + 16 + 8, 24 = 16 + 8), and both block multiples.
SHAPES = [(40, 24), (32, 48)]
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


def offsets(sizes: list[int]) -> torch.Tensor:
    return torch.tensor(sizes).cumsum(0).to(DEVICE, torch.int32)


def weight(G: int, K: int, N: int, transposed: bool, dtype: torch.dtype) -> torch.Tensor:
    """w_GKN: the transpose of a contiguous [G, N, K] tensor (stride(-2) == 1), or contiguous."""
    if transposed:
        w = randn(G, N, K, dtype=dtype, seed=2).transpose(-2, -1)
        assert w.stride(-2) == 1
        return w
    return randn(G, K, N, dtype=dtype, seed=2)


def nan(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("transposed", [True, False], ids=["w-transposed", "w-contiguous"])
@pytest.mark.parametrize(("K", "N"), SHAPES, ids=["ragged", "even"])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_grouped_mm_equals_reference(sizes, K, N, transposed, dtype):
    """Every output element written (NaN-poisoned ``out``) and equal to the per-group loop."""
    offs_G, M = offsets(sizes), sum(sizes)
    x_MK = randn(M, K, dtype=dtype, seed=1)
    w_GKN = weight(len(sizes), K, N, transposed, dtype)
    assert_triton_path(x_MK)
    y_MN = ggt.grouped_mm(x_MK, w_GKN, offs_G, out=nan(M, N, dtype=dtype), block=BLOCK)
    assert_matches(y_MN, grouped_mm_reference(x_MK, w_GKN, offs_G))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("K", "N"), SHAPES, ids=["ragged", "even"])
@pytest.mark.parametrize("sizes", list(SIZES.values()), ids=list(SIZES))
def test_grouped_wgrad_equals_reference_in_both_orientations(sizes, K, N, dtype):
    """dw_GKN = x^T @ dy and (transposed) the contiguous dw_GNK = dy^T @ x per group; empty
    groups give zero matrices (``out`` is NaN-poisoned first)."""
    offs_G, M = offsets(sizes), sum(sizes)
    x_MK, dy_MN = randn(M, K, dtype=dtype, seed=3), randn(M, N, dtype=dtype, seed=4)
    G = len(sizes)
    ref_GKN = grouped_mm_wgrad_reference(x_MK, dy_MN, offs_G)
    dw_GKN = ggt.grouped_wgrad(x_MK, dy_MN, offs_G, out=nan(G, K, N, dtype=dtype), block=BLOCK)
    assert_matches(dw_GKN, ref_GKN)
    dw_GNK = ggt.grouped_wgrad(
        x_MK, dy_MN, offs_G, transposed=True, out=nan(G, N, K, dtype=dtype), block=BLOCK
    )
    assert dw_GNK.is_contiguous()
    assert_matches(dw_GNK, ref_GKN.transpose(-2, -1).contiguous())
    empty = torch.tensor(sizes, device=DEVICE) == 0
    assert (dw_GKN[empty] == 0).all() and (dw_GNK[empty] == 0).all()


def test_operands_with_other_strides_and_default_blocks():
    """x and dy column slices of wider buffers (row stride != width), w with a column stride
    of 2: passed by strides, not copied; the default (CPU) blocks."""
    sizes = SIZES["empty-middle"]
    offs_G, M, K, N = offsets(sizes), sum(sizes), 40, 24
    x_MK = randn(M, K + 8, seed=5)[:, 4 : 4 + K]
    w_GKN = randn(len(sizes), K, 2 * N, seed=6)[..., ::2]
    dy_MN = randn(M, N + 3, seed=7)[:, :N]
    assert_triton_path(x_MK)
    assert_matches(ggt.grouped_mm(x_MK, w_GKN, offs_G), grouped_mm_reference(x_MK, w_GKN, offs_G))
    ref_GKN = grouped_mm_wgrad_reference(x_MK, dy_MN, offs_G)
    assert_matches(ggt.grouped_wgrad(x_MK, dy_MN, offs_G), ref_GKN)
    dw_GNK = ggt.grouped_wgrad(x_MK, dy_MN, offs_G, transposed=True)
    assert_matches(dw_GNK, ref_GKN.transpose(-2, -1).contiguous())


def test_each_tile_writes_only_its_groups_rows():
    """A tile that runs past its group's end stores none of the following rows. The programs of
    the next group overwrite such rows in the interpreter's sequential order (not on a GPU), so
    look at rows after the last group (``offs_G[-1] < M``): they keep their NaN, and the weight
    gradient ignores them."""
    sizes, M, K, N = [7, 0, 20], 40, 32, 32  # the last group ends mid-tile, at row 27
    offs_G = offsets(sizes)
    x_MK, dy_MN = randn(M, K, seed=8), randn(M, N, seed=9)
    w_GKN = randn(3, K, N, seed=10)
    y_MN = ggt.grouped_mm(x_MK, w_GKN, offs_G, out=nan(M, N, dtype=torch.float32), block=BLOCK)
    assert y_MN[27:].isnan().all() and not y_MN[:27].isnan().any()
    assert_matches(y_MN[:27], grouped_mm_reference(x_MK[:27], w_GKN, offs_G))
    ref_GKN = grouped_mm_wgrad_reference(x_MK[:27], dy_MN[:27], offs_G)
    assert_matches(ggt.grouped_wgrad(x_MK, dy_MN, offs_G, block=BLOCK), ref_GKN)


def test_no_rows_and_bad_arguments():
    """No rows at all (every group empty): an empty product, zero weight gradients; offsets
    must be int32 and match the weight's group count."""
    offs_G = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    x_MK, dy_MN = randn(0, 8), randn(0, 16)
    assert ggt.grouped_mm(x_MK, randn(3, 8, 16), offs_G).shape == (0, 16)
    assert (ggt.grouped_wgrad(x_MK, dy_MN, offs_G) == 0).all()
    assert ggt.grouped_wgrad(x_MK, dy_MN, offs_G, transposed=True).shape == (3, 16, 8)
    with pytest.raises(TypeError, match="int32"):
        ggt.grouped_mm(randn(4, 8), randn(3, 8, 16), offs_G.long())
    with pytest.raises(ValueError, match="disagree"):
        ggt.grouped_mm(randn(4, 8), randn(2, 8, 16), offs_G)


def skewed_sizes(M: int, G: int, seed: int = 0) -> list[int]:
    """Group sizes summing to M where a few groups take most rows (Zipf-like, in random order)
    and a few get none."""
    gen = torch.Generator().manual_seed(seed)
    p_G = 1.0 / torch.arange(1, G + 1, dtype=torch.float64) ** 1.2
    p_G[-3:] = 0.0  # the three lightest groups: empty
    p_G = p_G[torch.randperm(G, generator=gen)]
    rows = torch.multinomial(p_G, M, replacement=True, generator=gen)
    return torch.bincount(rows, minlength=G).tolist()


@pytest.mark.gpu
def test_grouped_gemms_equal_torch_grouped_mm_gpu():
    """M = 4 x 16384 rows, K = N = 2048, 64 groups of skewed sizes, bf16: the autotuned kernels
    equal ``torch._grouped_mm`` (forward with the weight transposed and contiguous, the weight
    gradient both ways), repeat bitwise, and (after a warm-up that autotunes) never sync."""
    M, K, N, G = 16384 * 4, 2048, 2048, 64
    sizes = skewed_sizes(M, G)
    assert max(sizes) > 8 * M // G and min(sizes) == 0
    offs_G = offsets(sizes)
    bf16 = torch.bfloat16
    x_MK, dy_MN = randn(M, K, dtype=bf16, seed=1), randn(M, N, dtype=bf16, seed=2)
    w_GNK = randn(G, N, K, dtype=bf16, seed=3) * 0.02
    w_GKN = w_GNK.transpose(-2, -1)

    def run() -> list[torch.Tensor]:
        return [
            ggt.grouped_mm(x_MK, w_GKN, offs_G),
            ggt.grouped_mm(dy_MN, w_GNK, offs_G),  # the input gradient: dy @ w[g]^T
            ggt.grouped_wgrad(x_MK, dy_MN, offs_G),
            ggt.grouped_wgrad(x_MK, dy_MN, offs_G, transposed=True),
        ]

    first = run()
    with no_host_sync():
        again = run()
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    refs = [
        torch._grouped_mm(x_MK, w_GKN, offs=offs_G),
        torch._grouped_mm(dy_MN, w_GNK, offs=offs_G),
        torch._grouped_mm(x_MK.t(), dy_MN, offs=offs_G),
        torch._grouped_mm(dy_MN.t(), x_MK, offs=offs_G),
    ]
    for got, ref in zip(first, refs, strict=True):
        assert_matches(got, ref)
