"""The runs that wait for device machines, as calls of at most 10 minutes each: issue 21's and
later issues' on 2 and 8 H200s, and what one-GPU work still needs on one (``h1-*``).

    python benchmarks/multi_gpu.py list [--machine x1|x2|x8]  # every call: its commands, time
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

The calls are data, ``multi_gpu.toml`` (each call's GPUs, minutes, what it covers, its
commands); this file reads it and runs it. ``pipeline-kill`` (the call x8-pipeline) is the
fault-injection run of ``pipeline_kill.py``; ``ep_rows.py`` (the call x8-route) trains with
group-limited routing off and on.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNBOOK = tomllib.loads((HERE / "multi_gpu.toml").read_text())
ENV: dict[str, str] = RUNBOOK["env"]
WORDS = {name: shlex.split(text) for name, text in RUNBOOK["words"].items()}
STEP, FP8_STEP = WORDS["STEP"], WORDS["FP8_STEP"]


def words(command: str) -> list[str]:
    """A command of the runbook as arguments, each ``$NAME`` replaced by ``WORDS[NAME]``."""
    out: list[str] = []
    for word in shlex.split(command):
        out += WORDS[word[1:]] if word.startswith("$") else [word]
    return out


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
    return [
        Call(
            c["name"],
            c["gpus"],
            c["minutes"],
            c["what"],
            [words(command) for command in c["commands"]],
            c.get("needs", []),
        )
        for c in RUNBOOK["call"]
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
    elif "benchmarks/ep_rows.py" in command:  # its group-limited run (the plain one differs
        import ep_rows  # only in the model's routing, the same memory)

        rows_args = ep_rows.parser().parse_args(
            command[command.index("benchmarks/ep_rows.py") + 1 :]
        )
        groups = ep_rows.group_overrides(rows_args.groups, rows_args.top_k_groups)
        return [*rows_args.overrides, *groups], "config"
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
            f"nvidia-h200{f'-x{call.gpus}' if call.gpus > 1 else ''}."
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="what", required=True)
    listing = sub.add_parser("list")
    listing.add_argument("--machine", choices=["x1", "x2", "x8"])
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
        import pipeline_kill

        sys.exit(
            pipeline_kill.run(Path(args.out), args.kill_at, args.overrides, args.timeout_s, ENV)
        )


if __name__ == "__main__":
    main()
