"""Symmetric memory on one GPU: torch's symmetric memory against nvshmem4py (issue 13's choice).

    python benchmarks/symmetric_memory.py --mib 512 --out symm.json

One process, one PE (the peer is this GPU itself, so the copies are device-local): for each
backend, the time to allocate and register a buffer of ``--mib`` MiB (host clock, the first
and a second allocation), a put into the symmetric buffer and a get back out of it (CUDA
events, median; bytes counted read + write), and the latency of a barrier and of a
signal round trip (a signal set, then waited for, on the stream; median of many). Anything a
backend cannot do here is recorded as its error rather than stopping the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from report import save, stamp
from timing import cuda_times_ms

for key in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(key, "1")  # no multicast objects on these machines
os.environ.setdefault("NVSHMEM_REMOTE_TRANSPORT", "none")


def copy_rates(put, get, dst: torch.Tensor, src: torch.Tensor, iters: int) -> dict:
    """Median put and get of ``src``'s bytes (read + write counted), then a check that the
    round trip brought the data back into ``dst``."""
    put_ms = statistics.median(cuda_times_ms(put, 3, iters))
    get_ms = statistics.median(cuda_times_ms(get, 3, iters))
    torch.cuda.synchronize()
    assert torch.equal(dst, src), "the round trip must return the data"
    moved = 2 * src.numel() * src.element_size()
    return {
        "put_ms": put_ms,
        "get_ms": get_ms,
        "put_GBps": moved / put_ms / 1e6,
        "get_GBps": moved / get_ms / 1e6,
    }


def latency_us(fn) -> float:
    """Median microseconds of ``fn`` on the stream, back to back."""
    return 1e3 * statistics.median(cuda_times_ms(fn, 10, 200))


def bench_torch(n: int, iters: int) -> dict:
    import torch.distributed._symmetric_memory as symm_mem

    if not dist.is_initialized():
        dist.init_process_group(
            "nccl",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    out: dict = {"backend": f"torch symmetric memory ({symm_mem.get_backend('cuda')})"}
    times = []
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        buf = symm_mem.empty(n, dtype=torch.bfloat16, device="cuda")
        handle = symm_mem.rendezvous(buf, dist.group.WORLD)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    out["alloc_ms_first"], out["alloc_ms_second"] = times
    peer = handle.get_buffer(0, (n,), torch.bfloat16)
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    out |= copy_rates(lambda: peer.copy_(src), lambda: dst.copy_(peer), dst, src, iters)
    out["barrier_us"] = latency_us(lambda: handle.barrier(channel=0))

    def signal_round_trip() -> None:
        handle.put_signal(0, channel=1)
        handle.wait_signal(0, channel=1)

    out["signal_round_trip_us"] = latency_us(signal_round_trip)
    return out


def bench_nvshmem(n: int, iters: int) -> dict:
    import nvshmem.core as nvshmem
    from cuda.core import Device

    dev = Device(torch.cuda.current_device())
    dev.set_current()
    uid = nvshmem.get_unique_id()
    nvshmem.init(device=dev, uid=uid, rank=0, nranks=1, initializer_method="uid")
    out: dict = {"backend": "nvshmem4py"}
    stream = torch.cuda.current_stream()
    try:
        times, bufs = [], []
        for _ in range(2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            bufs.append(nvshmem.tensor((n,), dtype=torch.bfloat16))
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        out["alloc_ms_first"], out["alloc_ms_second"] = times
        # nvshmem4py moves data between symmetric tensors only (both ends on its heap)
        src, sym = bufs
        src.copy_(torch.randn(n, device="cuda").to(torch.bfloat16))
        dst = nvshmem.tensor((n,), dtype=torch.bfloat16)
        bufs.append(dst)
        out |= copy_rates(
            lambda: nvshmem.put(sym, src, remote_pe=0, stream=stream),
            lambda: nvshmem.get(dst, sym, remote_pe=0, stream=stream),
            dst,
            src,
            iters,
        )
        out["barrier_us"] = latency_us(lambda: nvshmem.barrier(nvshmem.Teams.TEAM_WORLD, stream))
        signal = nvshmem.buffer(8)
        count = [0]

        def signal_round_trip() -> None:
            count[0] += 1
            nvshmem.signal_op(signal, count[0], nvshmem.SignalOp.SIGNAL_SET, 0, stream)
            nvshmem.signal_wait(signal, count[0], nvshmem.ComparisonType.CMP_GE, stream)

        out["signal_round_trip_us"] = latency_us(signal_round_trip)
        torch.cuda.synchronize()
        for b in bufs:
            nvshmem.free_tensor(b)
        nvshmem.free(signal)
    finally:
        nvshmem.finalize()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mib", type=int, default=512)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--commit", default="unknown")
    p.add_argument("--out", default="")
    args = p.parse_args()
    n = args.mib * 2**20 // 2  # bf16 elements
    result = {
        "benchmark": "symmetric_memory_one_gpu",
        **stamp(args.commit),
        "mib": args.mib,
        "backends": [],
    }
    for bench in (bench_torch, bench_nvshmem):
        try:
            result["backends"].append(bench(n, args.iters))
        except Exception as e:  # recorded: what a backend cannot do here is a result too
            result["backends"].append(
                {"backend": bench.__name__, "error": f"{type(e).__name__}: {e}"[:500]}
            )
            traceback.print_exc()
    print("RESULT " + json.dumps(result))
    save(result, args.out)


if __name__ == "__main__":
    main()
