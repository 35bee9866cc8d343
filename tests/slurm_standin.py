"""Stand-ins for ``sbatch``, ``squeue``, ``sacct``, ``scancel``, ``scontrol`` and ``srun`` on one
machine, for tests: a submitted batch script really runs (``bash``), each of its "nodes" is a
process of ``srun`` here, and job states live in JSON files of a state folder.

``install(bin_dir, state_dir)`` writes the commands into ``bin_dir`` (put it first on PATH). A
file ``hold`` in the state folder keeps new jobs pending; ``calls.log`` lists every sbatch and
scancel call; ``job-<id>.json`` holds a job's state, its nodes' pids and exit code. A file
``nodes_up`` holding a number makes the cluster that many nodes (else as many as asked for): a
job asking for a range ``--nodes=MIN-MAX`` gets as many of the idle ones as it can (``sinfo``
counts those that no running job holds).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("STANDIN_SLURM_DIR", "."))
ENDED = {"COMPLETED", "FAILED", "CANCELLED"}
FIRST_ID = 1001


def install(bin_dir: Path, state_dir: Path) -> None:
    bin_dir.mkdir(parents=True, exist_ok=True)
    state_dir.mkdir(parents=True, exist_ok=True)
    for tool in ("sbatch", "squeue", "sacct", "scancel", "scontrol", "srun", "sinfo"):
        path = bin_dir / tool
        path.write_text(
            f"#!/bin/sh\nSTANDIN_SLURM_DIR='{state_dir}' exec '{sys.executable}' "
            f"'{Path(__file__).resolve()}' {tool} \"$@\"\n"
        )
        path.chmod(0o755)


def job_path(job_id: str) -> Path:
    return STATE / f"job-{job_id}.json"


def load(job_id: str) -> dict:
    return json.loads(job_path(job_id).read_text())


def save(job: dict) -> None:
    tmp = job_path(job["id"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(job))
    tmp.replace(job_path(job["id"]))


def calls(state: Path) -> list[list[str]]:
    """Every sbatch and scancel call so far, as argument lists."""
    log = state / "calls.log"
    return [json.loads(x) for x in log.read_text().splitlines()] if log.is_file() else []


def job(state: Path, job_id: str) -> dict:
    return json.loads((state / f"job-{job_id}.json").read_text())


def set_state(state: Path, job_id: str, value: str) -> None:
    """Put a job in ``value`` as the controller would (for jobs that do not run)."""
    path = state / f"job-{job_id}.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "state": value}))


def _call(args: list[str]) -> None:
    with (STATE / "calls.log").open("a") as f:
        f.write(json.dumps(args) + "\n")


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's ranks run in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def kill_tree(pid: int) -> None:
    for p in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def sbatch(args: list[str]) -> int:
    _call(["sbatch", *args])
    script = Path(args[-1])
    directives = {}
    for line in script.read_text().splitlines():
        if line.startswith("#SBATCH "):
            key, _, value = line.removeprefix("#SBATCH ").partition("=")
            directives[key] = value
    counter = STATE / "next_id"
    job_id = str(int(counter.read_text()) if counter.is_file() else FIRST_ID)
    counter.write_text(str(int(job_id) + 1))
    low, _, high = directives["--nodes"].partition("-")
    nodes = min(int(high or low), idle_nodes())
    job = {
        "id": job_id,
        "state": "PENDING",
        "script": str(script),
        "nodes": max(nodes, int(low)),
        "output": directives["--output"].replace("%j", job_id),
        "chdir": directives["--chdir"],
        "node_pids": [],
        "runner": None,
    }
    save(job)
    if not (STATE / "hold").exists() and nodes >= int(low):  # else it waits for nodes
        runner = subprocess.Popen(
            [sys.executable, __file__, "_run", job_id],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        job["runner"] = runner.pid
        save(job)
    print(job_id)
    return 0


def _run(args: list[str]) -> int:
    """The job: its batch script under bash, output appended to --output."""
    job = load(args[0])
    if job["state"] != "PENDING":
        return 0
    job["state"] = "RUNNING"
    save(job)
    env = {
        **os.environ,
        "SLURM_JOB_ID": job["id"],
        "SLURM_JOB_NODELIST": f"standin[0-{job['nodes'] - 1}]",
        "SLURM_NNODES": str(job["nodes"]),
        "SLURM_JOB_NUM_NODES": str(job["nodes"]),
        "SLURM_CPUS_ON_NODE": "1",
    }
    with open(job["output"], "ab") as out:
        code = subprocess.call(
            ["bash", job["script"]], cwd=job["chdir"], env=env, stdout=out, stderr=out
        )
    job = load(args[0])
    if job["state"] != "CANCELLED":
        job["state"] = "COMPLETED" if code == 0 else "FAILED"
        job["exit_code"] = code
        save(job)
    return 0


def idle_nodes() -> int:
    """Nodes up (``nodes_up``, else plenty) that no running job holds."""
    up = STATE / "nodes_up"
    if not up.is_file():
        return 1 << 20
    held = sum(
        job["nodes"]
        for job in (json.loads(p.read_text()) for p in STATE.glob("job-*.json"))
        if job["state"] == "RUNNING"
    )
    return max(int(up.read_text()) - held, 0)


def squeue(args: list[str]) -> int:
    job_id = args[args.index("--jobs") + 1]
    if job_path(job_id).is_file() and load(job_id)["state"] not in ENDED:
        job = load(job_id)  # jobs that ended have left the queue
        print(job["nodes"] if "--format=%D" in args else job["state"])
    return 0


def sinfo(args: list[str]) -> int:
    assert "--states=idle" in args and "--Node" in args and "--format=%N %P" in args, args
    for i in range(min(idle_nodes(), 1 << 10)):
        print(f"standin-idle{i} standin*")
    return 0


def sacct(args: list[str]) -> int:
    job_id = args[args.index("--jobs") + 1]
    if job_path(job_id).is_file():
        state = load(job_id)["state"]
        print("CANCELLED by 1000" if state == "CANCELLED" else state)
    return 0


def scancel(args: list[str]) -> int:
    _call(["scancel", *args])
    if args[0] == "--signal=TERM":  # to the steps' processes (torchrun passes it on)
        for pid in load(args[1])["node_pids"]:
            for p in descendants(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGTERM)
        return 0
    if not job_path(args[0]).is_file():
        print(f"scancel: error: Kill job error on job id {args[0]}: Invalid job id specified")
        return 1
    job = load(args[0])
    if job["state"] in ENDED:
        return 0
    job["state"] = "CANCELLED"
    save(job)
    for pid in [*job["node_pids"], *([job["runner"]] if job["runner"] else [])]:
        kill_tree(pid)
    return 0


def scontrol(args: list[str]) -> int:
    assert args[:2] == ["show", "hostnames"], args
    text = "127.0.0.1\n" * int(os.environ["SLURM_NNODES"])
    with contextlib.suppress(BrokenPipeError):  # `| head -n 1` may close the pipe early
        os.write(1, text.encode())  # one write, as the real command's
    return 0


def srun(args: list[str]) -> int:
    """One process per node, each in a session of its own (a machine); with
    --kill-on-bad-exit, a node that fails ends the others."""
    n = next(i for i, a in enumerate(args) if not a.startswith("--"))
    options, cmd = args[:n], args[n:]
    job = load(os.environ["SLURM_JOB_ID"])
    count = next((int(o.split("=")[1]) for o in options if o.startswith("--nodes=")), job["nodes"])
    nodes = [
        subprocess.Popen(cmd, env={**os.environ, "SLURM_NODEID": str(i)}, start_new_session=True)
        for i in range(count)
    ]
    job["node_pids"] = [n.pid for n in nodes]
    save(job)
    while True:
        codes = [n.poll() for n in nodes]
        bad = [c for c in codes if c not in (None, 0)]
        if bad and "--kill-on-bad-exit=1" in options:
            for n in nodes:
                kill_tree(n.pid)
            for n in nodes:
                n.wait()
            return bad[0] if bad[0] > 0 else 128 - bad[0]
        if all(c is not None for c in codes):
            return max(codes)
        time.sleep(0.1)


if __name__ == "__main__":
    tool, *rest = sys.argv[1:]
    sys.exit(globals()[tool](rest))
