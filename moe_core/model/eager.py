"""Functions the model runs eagerly inside compiled blocks (token dispatch, FlashAttention 4's
CuTe call): compile boundaries.

``torch.compiler.disable`` would mark them where they are defined, but calling it imports
TorchDynamo, 1.3-1.7 s for every process that imports the model, compiled or not (each rank of
every CPU test and launch). So ``eager`` only records a function, and ``seal()`` wraps every
recorded one in ``torch.compiler.disable`` once, before anything is compiled
(``moe_core.parallel.compile`` calls it; so must any other code that compiles the model).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_MARKED: list[Eager] = []


class Eager:
    """``fn``, run as is until ``seal()``, then through ``torch.compiler.disable(fn)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = self.run = fn
        self.__doc__, self.__name__ = fn.__doc__, fn.__name__
        _MARKED.append(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(*args, **kwargs)


def eager(fn: Callable[..., Any]) -> Eager:
    """Mark ``fn`` as a compile boundary (module doc)."""
    return Eager(fn)


def seal() -> None:
    """Make every marked function a compile boundary (idempotent)."""
    for marked in _MARKED:
        if marked.run is marked.fn:
            marked.run = torch.compiler.disable(marked.fn)
