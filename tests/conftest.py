"""Test setup: offline hubs, quiet Prefect, GPU tests skipped (and reported) without a GPU, and
Triton kernels run by Triton's interpreter on CPU tensors where there is no GPU."""

from __future__ import annotations

import os
from pathlib import Path

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
# imports the kernels; torch does not import triton). With it, the kernel tests run the Triton
# kernels on CPU tensors (see _interpret_kernel_tests), comparing them with the references.
# On a GPU machine the kernels compile for the GPU and the tests run them on CUDA tensors.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _interpret_kernel_tests(request: pytest.FixtureRequest):
    """Kernel tests on a machine without a GPU run the Triton kernels in the interpreter; other
    tests (the model on CPU) take the PyTorch references, as CPU training does."""
    kernel_test = request.module.__name__.startswith(("test_kernels", "test_baselines"))
    if kernel_test and not torch.cuda.is_available():
        from moe_kernels._triton import interpret_on_cpu

        with interpret_on_cpu():
            yield
    else:
        yield


@pytest.fixture(scope="session")
def prefect_home(tmp_path_factory):
    """One Prefect API for the session (a temporary local server), in a private home, given as
    long to start as ``moe pipeline`` gives it (a loaded machine needs minutes)."""
    home = tmp_path_factory.mktemp("prefect")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    from flows.cli import SERVER_STARTUP_S

    with prefect_test_harness(server_startup_timeout=SERVER_STARTUP_S):
        yield home


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the long end-to-end tests marked extended (the default run skips them)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skips = {}
    if not config.getoption("--extended"):
        skips["extended"] = pytest.mark.skip(
            reason="a long end-to-end run whose parts faster tests cover (run `pytest --extended`)"
        )
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(
            reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)"
        )
    for item in items:
        for keyword, skip in skips.items():
            if keyword in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_run(prefect_home, tmp_path_factory) -> tuple[Path, dict]:
    """The tiny pipeline (``helpers.SMALL``) run once for the whole session: tests that read it
    share it; tests that change it work on a copy."""
    from helpers import run_pipeline

    run_dir = tmp_path_factory.mktemp("tiny-run") / "tiny"
    return run_dir, run_pipeline(run_dir, [])


@pytest.fixture(scope="session")
def dp2_ep2_run(tmp_path_factory) -> Path:
    """``moe train`` on 4 gloo processes, ``parallel.dp=2 parallel.ep=2`` (``helpers.BASE``),
    run once for the session: the layout parity test, the two-node test and the shrink test
    (which resumes its step-2 checkpoint on half the ranks) compare against it (each torchrun
    of 4 processes costs ~20 s on 2 cores)."""
    from helpers import BASE, explain, torchrun

    out = tmp_path_factory.mktemp("dp2-ep2") / "run"
    layout = ["parallel.dp=2", "parallel.ep=2", "train.checkpoint_every=2"]
    overrides = [*BASE, *layout, f"out_dir={out}"]
    result = torchrun(4, ["-m", "moe_core.cli", "train", *overrides])
    assert result.returncode == 0, explain(result)
    return out
