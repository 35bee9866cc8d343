"""``moe pipeline``: compose a deployment's config with Hydra overrides and run the Prefect flow.

Registered into the ``moe`` command through the ``moe_core.commands`` entry point, so the
library never imports Prefect. ``--multirun`` expands Hydra sweep overrides (``train.lr=1e-3,3e-3``)
into one pipeline per combination, each in its own numbered run directory.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

# Prefect's temporary API server (started by the first flow call when PREFECT_API_URL names
# none) gets 20 s by default; on a loaded 2-core machine (load 15-20) it needed up to 180 s.
SERVER_STARTUP_S = 180


def register(sub) -> None:
    p = sub.add_parser("pipeline", help="run the pretraining pipeline (Prefect) for a config")
    p.add_argument("overrides", nargs="*", help="Hydra overrides; run_dir=PATH sets the run folder")
    p.add_argument("--config-name", default="pretrain-tiny", help="a top-level config in conf/")
    p.add_argument("--config-dir", default=None, help="the conf/ folder (default: the project's)")
    p.add_argument("--multirun", action="store_true", help="one pipeline per sweep combination")
    p.set_defaults(fn=cmd_pipeline)


def split_run_dir(overrides: list[str], default: str) -> tuple[str, list[str]]:
    from moe_core.config import check_folder

    run_dir = default
    rest = []
    for o in overrides:
        if o.startswith("run_dir="):
            run_dir = check_folder("run_dir", o.split("=", 1)[1])  # a sweep's too
        else:
            rest.append(o)
    return run_dir, rest


@contextlib.contextmanager
def server_startup_time() -> Iterator[None]:
    """Inside, Prefect's temporary API server has ``SERVER_STARTUP_S`` to start unless the user
    set ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` (environment or profile); one that
    still does not start is one sentence naming the setting, not Prefect's traceback."""
    from prefect import settings

    from moe_core.errors import RunFailedError

    setting = settings.PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    with settings.temporary_settings(set_defaults={setting: SERVER_STARTUP_S}):
        seconds = setting.value()
        try:
            yield
        except RuntimeError as err:
            if not str(err).startswith("Timed out while attempting to connect to ephemeral"):
                raise
            raise RunFailedError(
                f"Prefect's temporary API server did not start within {seconds} s (a busy "
                f"machine): set {setting.name} higher, or PREFECT_API_URL to a running server."
            ) from None


def cmd_pipeline(args: argparse.Namespace) -> None:
    """Compose and check every run's config, then run the flow for each (one, or one per sweep
    combination), and print each run's summary on stdout."""
    from flows.layout import resolve, run_root
    from moe_core.compose import compose_dict, sweep

    run_dir, overrides = split_run_dir(args.overrides, f"runs/{args.config_name}")
    combos = sweep(overrides) if args.multirun else [overrides]
    planned = []
    for i, combo in enumerate(combos):  # a config error is answered before torch or Prefect
        config = compose_dict(combo, args.config_dir, args.config_name)
        target = str(Path(run_dir) / str(i)) if args.multirun else run_dir
        planned.append((target, config, resolve(config, run_root(target))))
    from flows.launch import preflight  # the launch checks: torch, still no Prefect server

    for _, _, run in planned:
        preflight(run, logging.getLogger(__name__))  # the flow logs the plan
    from prefect.settings import PREFECT_API_URL

    from flows.pretrain import pretrain, verified_rerun
    from flows.report import summary_text

    outcomes = []
    with server_startup_time():
        for target, config, _ in planned:
            # No API to talk to: a flow run would start a temporary server first, which is most
            # of a rerun's time when nothing runs; such a rerun is done without Prefect.
            outcome = None if PREFECT_API_URL.value() else verified_rerun(config, target)
            if outcome is not None:
                print(
                    f"{target}: every stage's outputs verified, nothing to run (no Prefect flow "
                    "run started)",
                    file=sys.stderr,
                    flush=True,
                )
            else:
                outcome = pretrain(config=config, run_dir=target)
            outcomes.append(outcome)
    # The last lines on stdout (Prefect's log goes to stderr): each run's summary, a line a row.
    for outcome in outcomes:
        print(summary_text(outcome), flush=True)
