"""Refusals that ``moe`` prints as one sentence, without a traceback (beside ``ConfigError`` and
``DataError``). Kept free of heavy imports: the CLI imports it at start."""

from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint or model directory that cannot be used as asked (another model's shapes,
    files pointing outside their folder), explained in one sentence."""


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory's lock (its pid and host are named)."""


class RunFileError(ValueError):
    """A run directory's file that could not be written (disk full, no permission) or read
    (a corrupt metrics log), named in one sentence with what was kept."""


class RunFailedError(RuntimeError):
    """A run that ended without its result (training out of launches, an export that does not
    compute the model), explained in one sentence that names what was kept."""


def refusals() -> tuple[type[Exception], ...]:
    """The errors whose message is the whole story: the CLI prints them and a pipeline ends
    with them as one sentence, without a traceback."""
    from moe_core.config import ConfigError
    from moe_core.data.errors import DataError

    return (
        ConfigError,
        DataError,
        CheckpointError,
        RunDirLockedError,
        RunFileError,
        RunFailedError,
    )
