"""The sum of the squares of every element of a list of tensors, accumulated in fp32: the pass
over the gradients that the global gradient norm takes before every optimizer step
(``moe_core.parallel.optimizer.sum_of_squares``).

The pass only reads, so its bound is the GPU's read bandwidth. Triton for contiguous CUDA tensors
(``sum_squares_triton``: programs of fixed size, each reducing a contiguous run of one tensor
into a partial sum, every tensor's partials in one buffer summed once at the end); the PyTorch
reference (one ``torch.linalg.vector_norm`` per tensor) elsewhere and for other accumulation
dtypes (the CPU's fp64).
"""

from __future__ import annotations

import torch

from moe_kernels._triton import use_triton


def sum_squares_reference(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The definition: one reduction per tensor, accumulated in ``dtype``, summed."""
    parts = [torch.linalg.vector_norm(t, dtype=dtype).square() for t in tensors]
    return torch.stack(parts).sum()


def sum_squares(tensors: list[torch.Tensor], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sum of ``t.square()`` over every element of every tensor of ``tensors`` (at least one, all
    on one device), accumulated in ``dtype``, as a 0-d ``dtype`` tensor on their device."""
    if not tensors:
        raise ValueError("sum_squares needs at least one tensor")
    nonempty = [t for t in tensors if t.numel()]
    if not nonempty:
        return torch.zeros((), dtype=dtype, device=tensors[0].device)
    if (
        dtype == torch.float32
        and use_triton(*nonempty)
        and all(t.is_contiguous() and t.is_floating_point() for t in nonempty)
    ):
        from moe_kernels import sum_squares_triton

        return sum_squares_triton.sum_squares(nonempty)
    return sum_squares_reference(nonempty, dtype)
