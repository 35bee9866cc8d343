"""Every Triton kernel compiles for an sm_90 GPU target, checked on any machine.

The interpreter that runs the kernel tests on CPU accepts code Triton's compiler rejects (on
triton 3.6 a variable whose dtype changed inside an ``if`` body failed only on the GPU); this
lowers each kernel variant the wrappers launch, in a child process without TRITON_INTERPRET.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import TESTS

pytest.importorskip("triton")


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    result = subprocess.run(
        [sys.executable, str(TESTS / "compile_kernels.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    compiled = [line for line in result.stdout.splitlines() if line.startswith("ok ")]
    assert len(compiled) >= 20, result.stdout


# QuACK's FP8 expert GEMM (the two rowwise scales in its epilogue) lowered for sm_90a without a
# GPU: QuACK's CPU cross-compile (QUACK_ARCH / CUTE_DSL_ARCH), the SM count it asks the driver
# for given by hand. The bf16 row-scaled GEMM the fused MLP runs is compiled beside it.
_QUACK_COMPILE = """
import torch
import quack.gemm_runtime.host as host
import moe_kernels.grouped_gemm_quack as q
host.get_max_active_clusters = lambda cluster_size: 132 // cluster_size  # an H100's SMs
G, N, K, M = 4, 256, 128, 1000
cu = torch.tensor([0, 300, 300, 900, 1000], dtype=torch.int32)
y = torch.empty(M, N, dtype=torch.bfloat16)
qa = torch.zeros(M, K).to(torch.float8_e4m3fn)
qb = torch.zeros(G, N, K).to(torch.float8_e4m3fn)
q._scale_rows_and_columns.plan(
    qa, qb.mT, out={"D": y}, cu_seqlens_m=cu, scale_M=torch.ones(M), scale_GN=torch.ones(G, N)
)
print("ok fp8_scaled_mm")
x, w = torch.zeros(M, K, dtype=torch.bfloat16), torch.zeros(G, K, N, dtype=torch.bfloat16)
q._scale_rows.plan(x, w, out={"D": y}, cu_seqlens_m=cu, scale_M=torch.ones(M))
print("ok row_scaled_mm")
"""


@pytest.mark.slow
def test_quacks_fp8_gemm_compiles_for_sm90(tmp_path):
    pytest.importorskip("quack")
    import torch

    if torch.cuda.is_available():
        pytest.skip("the GPU tests run this kernel (test_kernels_fp8.py)")
    env = {**os.environ, "QUACK_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a"}
    env.update(CUDA_VISIBLE_DEVICES="", QUACK_CACHE_DIR=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", _QUACK_COMPILE], env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.split() == ["ok", "fp8_scaled_mm", "ok", "row_scaled_mm"]
    assert len(list(tmp_path.rglob("*.o"))) == 2  # two kernels, each lowered to an object
