"""QuACK's grouped GEMMs (the ``[gpu]`` extra) against ``torch._grouped_mm`` on the experts'
shapes and layouts: forward, input gradient and both weight-gradient layouts, incl. empty
groups, every row in one group, and rows past the last group end (static buffers), which
QuACK must neither read into a weight gradient nor fail on."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
quack_gemm = pytest.importorskip("kernels.grouped_gemm_quack", reason="needs quack-kernels")

K, N = 256, 384
SIZES = {
    "uneven": [300, 17, 0, 512, 129, 64],
    "empty-groups": [0, 0, 640, 0, 384, 0],
    "all-in-one": [0, 0, 0, 1024, 0, 0],
}


def bf16(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)


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
    from kernels import grouped_gemm as gg

    gen = torch.Generator(device="cuda").manual_seed(1)
    groups = SIZES["uneven"]
    offs_G = torch.tensor(groups).cumsum(0).to("cuda", torch.int32)
    x = bf16(sum(groups), K, gen=gen).requires_grad_()
    w_GNK = bf16(len(groups), N, K, gen=gen, scale=0.05).requires_grad_()
    dy = bf16(sum(groups), N, gen=gen)
    results = {}
    try:
        for backend in ("torch", "auto"):
            gg.set_backend(backend)
            assert gg._quack_runs(x) == (backend == "auto")
            y = gg.grouped_mm(x, w_GNK.transpose(-2, -1), offs_G)
            results[backend] = (y, *torch.autograd.grad(y, (x, w_GNK), dy))
    finally:
        gg.set_backend("auto")
    for got, ref in zip(results["auto"], results["torch"], strict=True):
        scale = ref.float().abs().max().item()
        torch.testing.assert_close(got.float(), ref.float(), rtol=1.6e-2, atol=2**-8 * scale)
