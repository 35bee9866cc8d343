"""Issue 21's runs on 2 and 8 H200s, as device calls of at most 10 minutes each.

    python benchmarks/multi_gpu.py list [--machine x2|x8]   # every call: its commands, its time
    python benchmarks/multi_gpu.py check                     # anywhere: scripts, configs, plans
    python benchmarks/multi_gpu.py run CALL --out DIR [--peer-kit DIR --peer-wheels DIR]

One call is one command line for the device tool (``run x2-step --out $OUT``); its JSONs and logs
land in ``--out``, to be committed under ``benchmarks/results/`` with a section of RESULTS.md.
``run`` refuses, before it starts anything, a call on a machine with fewer GPUs than the call
needs, and a call whose inputs (the peer kit) were not given. NVLink multicast stays
off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``).

``check`` is what can be verified without the GPUs: every script a call runs exists, every
``moe`` config it trains composes and validates (also the ``moe train`` that
``trainer_step.py`` launches, after that script's own refusals), and ``moe plan`` of each
layout fits the machine's memory (the figure the 47B run is compared with). The test suite
runs it.

What is not a benchmark script lives here: ``pipeline-kill`` runs ``moe pipeline`` and kills one
training rank once the run has passed ``--kill-at`` steps; the train stage must relaunch
training from its newest checkpoint and the pipeline finish; a second run of the same pipeline
must find it done, and the export load in ``transformers`` (issue 21, run 7). On this CPU machine
with ``--config-name pretrain-tiny`` (two gloo ranks, one killed after step 60 or 62 in two
tries): the stage relaunched from step 50 and finished, the rerun skipped every stage as
verified and ``transformers`` loaded the export; 2 min 40-46 s in all.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}
PY = "python3"
TORCHRUN = [PY, "-m", "torch.distributed.run", "--standalone"]
STEP = [PY, "benchmarks/trainer_step.py", "--layers", "16", "--precision", "pure-bf16"]
# Rowwise receive buffers on 8 GPUs: dropless they hold every rank's rows in every layer's
# activations (173.5 GiB planned at EP=8, over an H200); twice the uniform load plans 66.3 GiB
# (Olmo-core 3's rowwise path defaults to 1.25; ours stops the step on an overflow).
ROWWISE_EP8 = ["--ep-capacity-factor", "2.0"]
# moe train at EP=2 (all-to-all) with FP8 parts (the argument after this list)
FP8_STEP = [
    *[PY, "benchmarks/trainer_step.py", "--layers", "16", "--precision", "fp8", "--skip-bare"],
    *["--ep", "2", "--dispatcher", "all_to_all", "--fp8-parts"],
]
# OLMoE-1B-7B's pipeline on one 8-GPU node, a couple of hundred steps on the kjv-gpt2 corpus.
PIPELINE = [
    "--config-name",
    "pretrain-olmoe-1b-7b",
    "precision=pure-bf16",  # bf16 state: each checkpoint ~42 GB of the node's disk
    "train.steps=200",
    "train.global_batch_size=32",
    "train.micro_batch_size=4",
    "train.checkpoint_every=50",
    "train.eval_every=100",
]
# pretrain-47b at EP=8 on the 8 GPUs of one node: its plan's PP=2 x EP=8 needs 16 GPUs, so one
# stage and one data-parallel replica, with block recompute to fit.
P47B = [
    "--config-name",
    "pretrain-47b",
    "data=synthetic",  # a few timed steps: no shards needed
    "parallel=ep8",
    "parallel.recompute=block",  # 121.5 of 141 GiB planned; without it 153.4
    "cluster=local-gpu",
    "cluster.nodes=1",
    "train.global_batch_size=8",
    "train.steps=6",
    "train.checkpoint_at_end=false",
    "train.save_model=false",
]


@dataclass
class Call:
    """One device call: ``commands`` in order (each a list of arguments, ``{out}`` etc.
    filled in by ``run``), on a machine of at least ``gpus`` GPUs, planned to take
    ``minutes``; ``needs`` names the ``run`` options it cannot go without."""

    name: str
    gpus: int
    minutes: float
    what: str
    commands: list[list[str]]
    needs: list[str] = field(default_factory=list)


def calls() -> list[Call]:
    peer = ["bash", "benchmarks/peer_ep.sh", "{peer_kit}", "{peer_wheels}"]
    return [
        Call(
            "x2-tests",
            2,
            9,
            "1. pytest -m gpu in full, incl. the 2-GPU tests (the NCCL parity test among them)",
            [[PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"]],
        ),
        Call(
            "x2-dispatch",
            2,
            5,
            "2. dispatch + combine at 512 MiB/rank, each dispatcher; the MoE layer EP=1 vs EP=2",
            [
                [
                    *TORCHRUN,
                    "--nproc-per-node=2",
                    "benchmarks/ep_dispatch.py",
                    "--out",
                    "{out}/ep_dispatch_2xh200.json",
                ],
                [
                    *TORCHRUN,
                    "--nproc-per-node=2",
                    "benchmarks/moe_layer_ep.py",
                    "--dispatchers",
                    "all_to_all,nvshmem_rowwise",
                    "--expert-gemm",
                    "auto",
                    "--out",
                    "{out}/moe_layer_ep_2xh200.json",
                ],
            ],
        ),
        Call(
            "x2-step",
            2,
            9,
            "3-4. moe train at EP=2 (each dispatcher) and DP=2 against the bare EP=1 step",
            [
                [
                    *STEP,
                    "--ep",
                    "2",
                    "--dispatcher",
                    "nvshmem_rowwise",
                    "--out",
                    "{out}/trainer_step_ep2_rowwise_2xh200.json",
                ],
                [
                    *STEP,
                    "--ep",
                    "2",
                    "--dispatcher",
                    "all_to_all",
                    "--skip-bare",
                    "--out",
                    "{out}/trainer_step_ep2_all_to_all_2xh200.json",
                ],
                [*STEP, "--dp", "2", "--skip-bare", "--out", "{out}/trainer_step_dp2_2xh200.json"],
            ],
        ),
        Call(
            "x2-fp8",
            2,
            5,
            "4. moe train at EP=2 with FP8 experts, token rows sent in bf16 and in FP8 (issue "
            "17's dispatch part)",
            [
                [
                    *FP8_STEP,
                    "experts",
                    "--out",
                    "{out}/trainer_step_ep2_fp8_experts_2xh200.json",
                ],
                [
                    *FP8_STEP,
                    "experts,dispatch",
                    "--out",
                    "{out}/trainer_step_ep2_fp8_experts_dispatch_2xh200.json",
                ],
            ],
        ),
        Call(
            "x2-peer",
            2,
            8,
            "3. Olmo-core 3's EP=2 step, rowwise NVSHMEM and sync 1D (the peer kit)",
            [
                [*peer, "2", "rowwise_nvshmem", "{out}/peer_ep2_rowwise_2xh200.json"],
                [*peer, "2", "sync_1d", "{out}/peer_ep2_sync_1d_2xh200.json"],
            ],
            needs=["peer_kit", "peer_wheels"],
        ),
        Call(
            "x8-step",
            8,
            9,
            "5. moe train at EP=8 (8 experts per GPU, each dispatcher) and DP=2 x EP=4",
            [
                [
                    *STEP,
                    "--ep",
                    "8",
                    "--dispatcher",
                    "nvshmem_rowwise",
                    *ROWWISE_EP8,
                    "--out",
                    "{out}/trainer_step_ep8_rowwise_8xh200.json",
                ],
                [
                    *STEP,
                    "--ep",
                    "8",
                    "--dispatcher",
                    "all_to_all",
                    "--skip-bare",
                    "--out",
                    "{out}/trainer_step_ep8_all_to_all_8xh200.json",
                ],
                [
                    *STEP,
                    "--ep",
                    "4",
                    "--dp",
                    "2",
                    "--dispatcher",
                    "nvshmem_rowwise",
                    *ROWWISE_EP8,
                    "--skip-bare",
                    "--out",
                    "{out}/trainer_step_dp2_ep4_rowwise_8xh200.json",
                ],
            ],
        ),
        Call(
            "x8-peer",
            8,
            5,
            "5. Olmo-core 3's EP=8 step, rowwise NVSHMEM (the peer kit)",
            [[*peer, "8", "rowwise_nvshmem", "{out}/peer_ep8_rowwise_8xh200.json"]],
            needs=["peer_kit", "peer_wheels"],
        ),
        Call(
            "x8-pool",
            8,
            6,
            "6. expert pool 8 -> 128 at fixed active parameters, EP=1 vs EP=8, one MoE layer",
            [
                [
                    *TORCHRUN,
                    "--nproc-per-node=8",
                    "benchmarks/moe_layer_ep.py",
                    "--experts",
                    "8,16,32,64,128",
                    "--top-k",
                    "4",
                    "--expert-gemm",
                    "auto",
                    "--dispatchers",
                    "nvshmem_rowwise,all_to_all",
                    "--out",
                    "{out}/pool_ep8_8xh200.json",
                ],
            ],
        ),
        Call(
            "x8-pipeline",
            8,
            10,
            "7. moe pipeline end to end on token shards, one rank killed mid-train, resumed",
            [
                [
                    PY,
                    "benchmarks/multi_gpu.py",
                    "pipeline-kill",
                    "--out",
                    "{out}",
                    "--kill-at",
                    "100",
                    "--",
                    *PIPELINE,
                ]
            ],
        ),
        Call(
            "x8-47b",
            8,
            8,
            "8. pretrain-47b (EP=8) for a few steps against moe plan's memory and time",
            [
                [PY, "-m", "moe_core.cli", "plan", *P47B],
                [
                    *TORCHRUN,
                    "--nproc-per-node=8",
                    "-m",
                    "moe_core.cli",
                    "train",
                    *P47B,
                    "train.log_every=1",
                    "out_dir={out}/p47b",
                ],
            ],
        ),
    ]


def by_name(name: str) -> Call:
    known = {c.name: c for c in calls()}
    if name not in known:
        raise SystemExit(f"call {name!r} is not allowed: one of {', '.join(known)}.")
    return known[name]


def fill(command: list[str], values: dict[str, str]) -> list[str]:
    return [arg.format(**values) for arg in command]


def moe_overrides(command: list[str]) -> tuple[list[str], str] | None:
    """The Hydra overrides and config name of a ``moe`` command (train, plan, pipeline-kill,
    and the ``moe train`` that ``trainer_step.py`` launches); a ``trainer_step.py`` argument
    list that script refuses raises ``ValueError`` with its sentence."""
    if "moe_core.cli" in command:
        args = command[command.index("moe_core.cli") + 2 :]
    elif "pipeline-kill" in command:
        args = command[command.index("--") + 1 :]
    elif "benchmarks/trainer_step.py" in command:
        import trainer_step

        step_args = trainer_step.parser().parse_args(
            command[command.index("benchmarks/trainer_step.py") + 1 :]
        )
        problem = trainer_step.refusal(step_args)
        if problem is not None:
            raise ValueError(problem)
        # as trainer_step launches it: one process per GPU of this machine that it uses
        world = step_args.ep * step_args.dp
        cluster = [
            "cluster=local-gpu",
            f"cluster.procs_per_node={world}",
            f"cluster.gpus_per_node={world}",
        ]
        return [*trainer_step.trainer_overrides(step_args, "OUT", "DATA"), *cluster], "config"
    else:
        return None
    name = "config"
    if "--config-name" in args:
        i = args.index("--config-name")
        name, args = args[i + 1], args[:i] + args[i + 2 :]
    return args, name


def check() -> list[str]:
    """What each call needs that can be checked here (see the module doc): the problems."""
    from moe_core.compose import compose_run
    from moe_core.plan import check_cluster, fit_refusal, plan

    problems = []
    placeholders = {"out": "OUT", "peer_kit": "KIT", "peer_wheels": "WHEELS"}
    for call in calls():
        if call.minutes > 10:
            problems.append(f"{call.name}: planned {call.minutes} min, over a call's 10")
        for command in call.commands:
            command = fill(command, placeholders)
            scripts = [a for a in command if a.startswith(("benchmarks/", "tests"))]
            problems += [f"{call.name}: {s} is missing" for s in scripts if not (ROOT / s).exists()]
            try:
                found = moe_overrides(command)
            except ValueError as err:
                problems.append(f"{call.name}: {shlex.join(command)}: {err}")
                continue
            if found is None:
                continue
            overrides, name = found
            try:
                run = compose_run(overrides, config_name=name)
            except Exception as err:  # the refusal, in its own words
                problems.append(f"{call.name}: {shlex.join(command)}: {err}")
                continue
            if run.parallel.world_size > call.gpus:
                problems.append(f"{call.name}: {run.parallel.world_size} ranks on {call.gpus} GPUs")
            try:
                check_cluster(run)
            except Exception as err:
                problems.append(f"{call.name}: {err}")
            refusal = fit_refusal(plan(run))
            if refusal is not None:
                problems.append(f"{call.name}: {refusal}")
    return problems


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except ImportError:
        return 0


def run_call(call: Call, values: dict[str, str | None]) -> int:
    missing = [f"--{n.replace('_', '-')}" for n in call.needs if not values.get(n)]
    if missing:
        raise SystemExit(f"{call.name} needs {' and '.join(missing)}: {call.what}.")
    have = gpu_count()
    if have < call.gpus:
        raise SystemExit(
            f"{call.name} needs {call.gpus} GPUs and this machine has {have}: run it on "
            f"nvidia-h200-x{call.gpus}."
        )
    out = Path(str(values["out"]))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENV}
    filled = {k: str(v) for k, v in values.items() if v is not None}
    log: list[dict] = []
    worst = 0
    for command in call.commands:
        argv = fill(command, filled)
        start = time.time()
        print(f"$ {shlex.join(argv)}", flush=True)
        done = subprocess.run(argv, cwd=ROOT, env=env)
        log.append({"command": argv, "rc": done.returncode, "seconds": time.time() - start})
        worst = worst or done.returncode
    record = {"call": call.name, "what": call.what, "gpus": have, "commands": log}
    (out / f"{call.name}.json").write_text(json.dumps(record, indent=2) + "\n")
    return worst


def newest_step(run_dir: Path) -> int:
    """The last step the train stage logged whole (-1 before any)."""
    metrics = run_dir / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):  # a line still being written
            continue
    return -1


def training_ranks(run_dir: Path) -> list[int]:
    """Process ids of the train stage's ranks: their command line names the stage's config
    (``moe_core.cli train --config RUN_DIR/train/config.json``); torchrun's does too, and is
    left out."""
    marker = str(run_dir / "train" / "config.json").encode()
    ranks = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker in cmdline and b"torch.distributed.run" not in cmdline:
            ranks.append(int(pid))
    return sorted(ranks)


def loads_in_transformers(hf_dir: Path) -> dict:
    """Whether ``transformers`` loads the exported checkpoint (in a child process: 14 GB)."""
    code = (
        "import sys, torch; from transformers import AutoModelForCausalLM as M; "
        "m = M.from_pretrained(sys.argv[1], dtype=torch.bfloat16); "
        "print(sum(p.numel() for p in m.parameters()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(hf_dir)], capture_output=True, text=True, timeout=600
    )
    params = done.stdout.split()[-1] if done.returncode == 0 and done.stdout.split() else None
    return {"rc": done.returncode, "parameters": params, "stderr_tail": done.stderr[-400:]}


def pipeline_kill(out: Path, kill_at: int, overrides: list[str], timeout_s: float) -> dict:
    """``moe pipeline`` until training has logged ``kill_at`` steps, then one rank SIGKILLed:
    the train stage relaunches training from its newest checkpoint (``cluster.launch_retries``;
    with none left the run fails and the second run resumes it). Then the same pipeline again,
    which must find every stage done (or finish it), and the export loaded in ``transformers``.
    Both runs' output goes to ``pipeline_{first,second}.log`` in ``out``; the record holds the
    kill, the stage's relaunch lines, the exit codes and the load."""
    run_dir = out / "pipeline"
    cmd = [sys.executable, "-m", "moe_core.cli", "pipeline", *overrides, f"run_dir={run_dir}"]
    env = {**os.environ, **ENV}
    start = time.time()
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / "pipeline_first.log", out / "pipeline_second.log"]
    with logs[0].open("w") as log:
        first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        killed = None
        while first.poll() is None and time.time() - start < timeout_s:
            step = newest_step(run_dir)
            if killed is None and step >= kill_at and (ranks := training_ranks(run_dir)):
                killed = {"pid": ranks[-1], "ranks": len(ranks), "after_step": step}
                os.kill(ranks[-1], signal.SIGKILL)
            time.sleep(1)
        if first.poll() is None:
            first.kill()
    record = {"command": cmd[2:], "killed": killed, "first_rc": first.wait()}
    resumed_at = time.time()
    with logs[1].open("w") as log:
        second = subprocess.run(
            cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s
        )
    text = logs[0].read_text() + logs[1].read_text()
    record |= {
        "relaunched": [line[-200:] for line in text.splitlines() if "launching again" in line],
        "resumed": [line[-200:] for line in text.splitlines() if "resumed from" in line],
        "second_rc": second.returncode,
        "second_seconds": time.time() - resumed_at,
        "last_step": newest_step(run_dir),
        "hf_load": loads_in_transformers(run_dir / "hf") if second.returncode == 0 else None,
        "seconds": time.time() - start,
    }
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    listing = sub.add_parser("list")
    listing.add_argument("--machine", choices=["x2", "x8"])
    sub.add_parser("check")
    one = sub.add_parser("run")
    one.add_argument("call")
    one.add_argument("--out", required=True)
    one.add_argument("--peer-kit")
    one.add_argument("--peer-wheels")
    kill = sub.add_parser("pipeline-kill")
    kill.add_argument("--out", required=True)
    kill.add_argument("--kill-at", type=int, required=True)
    kill.add_argument("--timeout-s", type=float, default=300.0, help="for each pipeline run")
    kill.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if args.what == "list":
        for c in calls():
            if args.machine in (None, f"x{c.gpus}"):
                print(f"{c.name} ({c.gpus} GPUs, ~{c.minutes:g} min): {c.what}")
                for command in c.commands:
                    print(f"    {shlex.join(command)}")
    elif args.what == "check":
        problems = check()
        for line in problems:
            print(line)
        print(f"{len(calls())} calls, {len(problems)} problems")
        sys.exit(1 if problems else 0)
    elif args.what == "run":
        values = {
            "out": args.out,
            "peer_kit": args.peer_kit,
            "peer_wheels": args.peer_wheels,
        }
        sys.exit(run_call(by_name(args.call), values))
    else:
        record = pipeline_kill(Path(args.out), args.kill_at, args.overrides, args.timeout_s)
        (Path(args.out) / "pipeline_kill.json").write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record))
        resumed = record["relaunched"] or record["first_rc"] != 0
        loaded = record["hf_load"] is not None and record["hf_load"]["rc"] == 0
        ok = record["killed"] and resumed and record["second_rc"] == 0 and loaded
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
