"""Test setup: offline hubs, quiet Prefect, GPU tests skipped (and reported) without a GPU, and
Triton kernels run by Triton's interpreter on CPU tensors where there is no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
    if request.module.__name__.startswith("test_kernels") and not torch.cuda.is_available():
        from kernels._triton import interpret_on_cpu

        with interpret_on_cpu():
            yield
    else:
        yield


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    """One Prefect API for the module (a temporary local server), in a private home."""
    home = tmp_path_factory.mktemp("prefect")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness():
        yield home


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny pipeline (``helpers.SMALL``) run once for the whole session, by the flow in a
    process of its own (with its own temporary Prefect API, so it nests in no module's; what
    that API recorded is kept in ``prefect.json`` beside the run folder): tests that read it
    share it; tests that change it work on a copy."""
    run_dir = tmp_path_factory.mktemp("tiny-run") / "tiny"
    # What Prefect recorded of the run (final state, artifacts, logs) is read back from the
    # process's own temporary API before it ends, into prefect.json beside the run folder.
    code = (
        "import json, sys; from pathlib import Path; "
        "from helpers import artifacts, flow_runs, run_logs, run_pipeline; "
        "run_dir = Path(sys.argv[1]); outcome = run_pipeline(run_dir, []); "
        "r = flow_runs(run_dir)[0]; "
        "record = {'state': r.state.type.value, 'message': r.state.message, "
        "'artifacts': artifacts(r.id), 'logs': run_logs(r.id)}; "
        "run_dir.with_name('prefect.json').write_text(json.dumps(record)); "
        "print('OUTCOME', json.dumps(outcome))"
    )
    tests = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    env.pop("PREFECT_API_URL", None)  # the flow starts its own temporary API
    env["PREFECT_HOME"] = str(tmp_path_factory.mktemp("tiny-run-prefect"))
    env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"  # a busy machine is slow
    done = subprocess.run(
        [sys.executable, "-c", code, str(run_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [x for x in done.stdout.splitlines() if x.startswith("OUTCOME ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir, json.loads(lines[-1].removeprefix("OUTCOME "))
