"""Where the tokenize stage's units of work run: a Dask cluster, or this process for one worker.

``data.scheduler`` names a running cluster (``dask scheduler`` and ``dask worker`` started by a
Slurm job or Kubernetes pods; every worker must see the data folder); without it a local cluster
of ``data.workers`` single-threaded worker processes is started on 127.0.0.1 and stopped when
the stage ends, also on an error or Ctrl-C. ``data.workers=1`` runs the units in this process,
one after the other, without starting anything.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from moe_core.config import DataConfig
from moe_core.data.errors import DataError

CONNECT_TIMEOUT_S = 60  # a scheduler a batch job has just started may take a while to answer
WORKERS_TIMEOUT_S = 300  # and its workers longer still (they start on other nodes)
IN_FLIGHT_PER_WORKER = 2  # units submitted ahead per worker: one running, one queued


def local_workers(cfg: DataConfig) -> int:
    """The processes of a local run: ``data.workers``, or one per core this process may use."""
    return cfg.workers or len(os.sched_getaffinity(0))


class Engine:
    """Runs functions as tasks: on a Dask client's cluster, or here when ``client`` is None."""

    def __init__(self, client: Any = None, where: str = "this process") -> None:
        self.client = client
        threads = sum(client.nthreads().values()) if client is not None else 1
        self.slots = IN_FLIGHT_PER_WORKER * max(threads, 1)
        self.where = where  # for the summary, e.g. "a local Dask cluster of 2 workers"

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A future of ``fn(*args)`` (its ``result()`` re-raises what the task raised)."""
        if self.client is not None:
            return self.client.submit(fn, *args, pure=False)
        return done(fn, *args)


def done(fn: Callable[..., Any], *args: Any) -> Future:
    """``fn(*args)`` run now, as a finished future."""
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as err:
        future.set_exception(err)
    return future


@contextmanager
def open_engine(cfg: DataConfig) -> Iterator[Engine]:
    """The engine ``cfg`` asks for, torn down (a local cluster stopped) when the block ends."""
    if cfg.scheduler is not None:
        with _connected(cfg.scheduler) as client:
            workers = len(client.scheduler_info()["workers"])
            yield Engine(client, f"the Dask cluster at {cfg.scheduler} ({workers} workers)")
        return
    workers = local_workers(cfg)
    if workers == 1:
        yield Engine()
        return
    from distributed import Client, LocalCluster

    scratch = tempfile.mkdtemp(prefix="moe-dask-")  # not a dask-scratch-space in the cwd
    try:
        with (
            LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                host="127.0.0.1",
                dashboard_address=None,
                scheduler_kwargs={"dashboard": False},
                local_directory=scratch,
                silence_logs=logging.ERROR,
                env={"TOKENIZERS_PARALLELISM": "false"},
            ) as cluster,
            Client(cluster) as client,
        ):
            yield Engine(client, f"a local Dask cluster of {workers} workers")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def _connected(address: str) -> Iterator[Any]:
    from distributed import Client

    try:
        client = Client(address, timeout=CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError) as err:
        raise DataError(
            f"data.scheduler={address!r} did not answer within {CONNECT_TIMEOUT_S} s "
            f"({type(err).__name__}): start the cluster's dask scheduler and workers first, or "
            "leave data.scheduler unset to tokenize on a local cluster."
        ) from None
    try:
        try:
            client.wait_for_workers(1, timeout=WORKERS_TIMEOUT_S)
        except TimeoutError:
            raise DataError(
                f"data.scheduler={address!r} has had no worker for {WORKERS_TIMEOUT_S} s: start "
                "dask worker processes that connect to it (on machines that see data.dir)."
            ) from None
        yield client
    finally:
        client.close()


def stop_cluster(address: str) -> None:
    """Stop the scheduler at ``address`` and its workers (a cluster job's last step); one that
    is gone already is fine."""
    from distributed import Client

    try:
        with Client(address, timeout=10) as client:
            client.shutdown()
    except (OSError, TimeoutError):
        pass


if __name__ == "__main__":  # python -m moe_core.data.engine stop tcp://HOST:PORT
    import sys

    if len(sys.argv) != 3 or sys.argv[1] != "stop":
        sys.exit(f"usage: python -m moe_core.data.engine stop tcp://HOST:PORT, not {sys.argv[1:]}")
    stop_cluster(sys.argv[2])
