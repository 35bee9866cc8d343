"""On a GPU, the trainer's count of the CUDA allocator's retries is the allocator's own."""

from __future__ import annotations

import pytest
import torch

from moe_core.train.trainer import allocator_retries

pytestmark = pytest.mark.gpu


def test_a_cache_the_allocator_must_empty_to_allocate_counts_one_retry():
    """A freed block kept in the cache, then a larger one that fits the process's share only
    once the cache is emptied: the allocator retries, and ``allocator_retries`` says so."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    limit = torch.cuda.memory_reserved(device) + 4 * 2**30
    assert free > 4 * 2**30, "the test needs 4 GiB free"
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit / total), device)
    try:
        before = allocator_retries(device)
        cached = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
        del cached  # 2 GiB stays reserved in the cache
        larger = torch.empty(3 * 2**30, dtype=torch.uint8, device=device)  # 2 + 3 > 4
        del larger
        assert allocator_retries(device) == before + 1
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
