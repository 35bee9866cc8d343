"""Test setup: offline hubs, quiet Prefect, GPU tests skipped (and reported) without a GPU, and
Triton kernels run by Triton's interpreter on CPU tensors where there is no GPU."""

from __future__ import annotations

import os

for key, value in {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

import pytest  # noqa: E402
import torch  # noqa: E402

# triton reads TRITON_INTERPRET when it is imported (conftest runs before any test module
# imports the kernels; torch does not import triton). With it, `kernels` runs its Triton path on
# CPU tensors, so the kernel tests compare the kernels, not the references, with the references.
# On a GPU machine the kernels compile for the GPU and the tests run them on CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
