"""Modules built on the meta device without running their initializers.

Meta tensors hold no values, so filling them does nothing; yet PyTorch fills a meta tensor
through its reference implementations, whose wrapper imports TorchDynamo: about 2 s for every
process that builds a model on the meta device (each rank of every launch, ``moe plan``, ``moe
info``), compiled or not. Inside ``on_meta()`` modules are built on the meta device with
``torch.nn.init``'s fills as no-ops; their values are set afterwards, as before (the model's
``init_weights`` or a checkpoint).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# The ``torch.nn.init`` functions that write values (the ones module constructors call).
FILLS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


def _keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``with on_meta(): model = Transformer(cfg)``: built on the meta device, nothing filled."""
    saved = {name: getattr(torch.nn.init, name) for name in FILLS}
    try:
        for name in FILLS:
            setattr(torch.nn.init, name, _keep)
        with torch.device("meta"):
            yield
    finally:
        for name, fill in saved.items():
            setattr(torch.nn.init, name, fill)
