"""torchrun as the pipeline's local launcher runs it: ``python -m moe_core.train.torchrun
--failure FILE <torchrun arguments>``.

It is torch's own launcher (``torch.distributed.run``) with one difference: when a rank fails,
torchrun's error summary (a traceback of the launcher and the "Root Cause" table, ~30 lines on
the console) goes to ``torchrun.log`` beside ``FILE`` together with the launcher's own log, and
``FILE`` receives the first failure as JSON (``FailedRank``), which the launcher turns into one
sentence (``failure_detail``, ``failure_context``). Each line a rank prints is prefixed with its
rank (``split_rank``). The exit status is torchrun's: 0, or 1 when a rank failed.

On a cluster each node runs one: ``NODE`` in any argument becomes the node's number
(``SLURM_NODEID`` under Slurm, ``JOB_COMPLETION_INDEX`` in a Kubernetes Indexed Job), so each
node keeps its own folder, and ``cluster_failure`` reads the folders of a failed job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LAST_LINES = 3  # lines of the failed rank's own log the sentence quotes
LINE_CHARS = 200  # each cut to this many characters
REPORT = "torchrun.log"  # beside the failure file: torchrun's log and its full error summary
# With ``--tee``, each line a rank writes reaches the console as "[rank<global rank>]:<line>".
PREFIX = re.compile(r"\[rank(\d+)\]:")
NODE = "{node}"  # in an argument: this node's number (see the module doc)
NODE_VARIABLES = ("SLURM_NODEID", "JOB_COMPLETION_INDEX")
# ``cluster_failure``'s detail of a failed job none of whose nodes recorded a failed rank
KILLED_FROM_OUTSIDE = (
    "no node recorded a failed rank, so the job's processes were killed from outside "
    "(a lost node, the out-of-memory killer or a cancellation)"
)


@dataclass
class FailedRank:
    """The first rank that failed (torchrun's "root cause"), as the JSON file holds it."""

    rank: int
    local_rank: int
    pid: int
    exitcode: int
    signal: str | None  # "SIGKILL" when a signal ended it
    message: str | None  # the rank's own error record (an entry point under ``@record``)
    log_dir: str | None  # the rank's stdout.log / stderr.log (torchrun --log-dir --redirects)


def _rank_log_dir(log_dir: str | None, local_rank: int) -> str | None:
    """torchrun keeps rank ``local_rank``'s output in ``<log-dir>/<run id>_<tmp>/attempt_<k>/
    <local rank>/``; the newest such folder."""
    if not log_dir:
        return None
    found = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}"), key=lambda p: p.stat().st_mtime)
    return str(found[-1]) if found else None


def node_number() -> str:
    """This node's number from the first of ``NODE_VARIABLES`` set ("0" when none is), refused
    unless it is one: it names the node's folder, so "../x" would write (and remove an earlier
    run's failure file) outside the job's folder."""
    variable = next((v for v in NODE_VARIABLES if os.environ.get(v)), None)
    node = "0" if variable is None else os.environ[variable]
    if not re.fullmatch(r"[0-9]+", node):
        raise SystemExit(
            f"{variable}={node!r} is not allowed: this node's number (0, 1, 2, ...), which names "
            "its log folder."
        )
    return node


def main(argv: list[str] | None = None) -> int:
    """torchrun with ``argv`` (after ``--failure FILE``); returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(NODE in a for a in argv):
        argv = [a.replace(NODE, node_number()) for a in argv]
    if len(argv) < 2 or argv[0] != "--failure":
        raise SystemExit("usage: python -m moe_core.train.torchrun --failure FILE <torchrun args>")
    failure_file = Path(argv[1])
    failure_file.parent.mkdir(parents=True, exist_ok=True)
    # an earlier run's record here (a requeued Slurm job keeps its id) is not this run's
    failure_file.unlink(missing_ok=True)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = "[rank${rank}]:"  # see PREFIX
    args = parse_args(argv[2:])
    # The launcher's own log (workers closed, "failed (exitcode: -9)") goes to the report
    # file, not the console: the caller's one sentence says what happened and where that is.
    report = failure_file.with_name(REPORT)
    handler = logging.FileHandler(report)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    elastic = logging.getLogger("torch.distributed.elastic")
    elastic.addHandler(handler)
    elastic.propagate = False
    try:
        run(args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        with report.open("a") as f:  # the summary torchrun would have printed, kept whole
            f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {err}\n")
        own = None
        if failure.error_file != "<N/A>":  # the rank wrote its own record
            data = failure.message
            own = data.get("message") if isinstance(data, dict) else str(data)
        signal = failure.signal_name() if failure.exitcode < 0 else None
        failed = FailedRank(
            rank,
            failure.local_rank,
            failure.pid,
            failure.exitcode,
            signal if signal != "<N/A>" else f"signal {-failure.exitcode}",
            own,
            _rank_log_dir(args.log_dir, failure.local_rank),
        )
        failure_file.write_text(json.dumps(asdict(failed), indent=1))
        return 1
    return 0


def split_rank(line: str) -> tuple[int | None, str]:
    """The rank a console line of ``--tee`` came from (None: torchrun's own) and its text."""
    found = PREFIX.match(line)
    return (int(found.group(1)), line[found.end() :]) if found else (None, line)


def read_failure(path: Path) -> FailedRank | None:
    """The failure ``main`` recorded in ``path`` (None: no rank failed, or torchrun itself
    was killed before it could say)."""
    try:
        return FailedRank(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _last_lines(folder: Path) -> list[str]:
    """The last lines of the rank's output, from whichever of its stdout/stderr it wrote last
    (progress bars dropped)."""
    logs = [p for p in (folder / "stdout.log", folder / "stderr.log") if p.is_file()]
    newest = sorted(logs, key=lambda p: (p.stat().st_mtime, p.name == "stderr.log"), reverse=True)
    for log in newest:
        text = log.read_text(errors="replace").replace("\r", "\n")
        lines = [x.strip() for x in text.splitlines() if x.strip() and "━" not in x]
        if lines:
            return [x[:LINE_CHARS] for x in lines[-LAST_LINES:]]
    return []


def failure_detail(failed: FailedRank) -> str:
    """Which rank ended how: "rank 1 was killed by SIGKILL (exit code -9)"."""
    how = (
        f"was killed by {failed.signal} (exit code {failed.exitcode})"
        if failed.exitcode < 0
        else f"exited with code {failed.exitcode}"
    )
    own = f" ({failed.message[:LINE_CHARS]})" if failed.message else ""
    return f"rank {failed.rank} {how}{own}"


def failure_context(failed: FailedRank, report: Path) -> str:
    """The rank's last words and where its log and torchrun's full report are kept."""
    text = ""
    if failed.log_dir is not None:
        lines = _last_lines(Path(failed.log_dir))
        said = " | ".join(lines) if lines else "nothing"
        text = f"its last lines: {said} (its log: {failed.log_dir}); "
    return text + f"torchrun's report: {report}"


def cluster_failure(root: Path) -> tuple[str, str] | None:
    """What a failed cluster job's nodes recorded under ``root`` (one ``node-N`` folder each,
    made when its launcher started), as (detail, context) for ``Attempt``: the first rank that
    failed (the earliest record: a rank's crash is recorded before its node's launcher exits,
    and only that exit makes the cluster stop the other nodes), or, when no node recorded one,
    that the job's processes were killed from outside. None when no node started."""
    nodes = sorted(root.glob("node-*"))
    if not nodes:
        return None
    failed = [(n, f) for n in nodes if (f := read_failure(n / "failure.json")) is not None]
    if not failed:
        return KILLED_FROM_OUTSIDE, f"the nodes' logs: {root}"
    node, first = min(failed, key=lambda nf: (nf[0] / "failure.json").stat().st_mtime)
    number = node.name.removeprefix("node-")
    return f"{failure_detail(first)} on node {number}", failure_context(first, node / REPORT)


if __name__ == "__main__":
    sys.exit(main())
