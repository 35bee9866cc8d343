"""The FP8 formats' numbers, shared by the quantizers' references and their Triton kernels (a
leaf: it imports nothing of ours, so ``moe_kernels.fp8_triton`` and ``moe_kernels.swiglu_triton``
read them without importing the modules that launch them)."""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # E4M3's largest finite value
AMAX_FLOOR = 2.0**-116  # 448 / 2^-116 is finite in fp32
E8M0 = torch.float8_e8m0fnu  # MX scales: a biased exponent byte
MX_BLOCK = 32  # MXFP8: values per E8M0 scale along K
