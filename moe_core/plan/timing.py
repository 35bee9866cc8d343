"""Time per step, predicted from a plan (a model, not a measurement).

The busiest rank's model FLOPs (``n_mb * T * flops_per_token / pp``, 4/3 of that under block
recompute) at the fraction of the GPU's peak one H200 reached in ``moe train``
(``hardware.MEASURED``); each message at its link's rate (``hardware.GPUS``: NVLink inside a
node, the NIC between nodes; an all-to-all whose group spans nodes sends
``(ep - local) / (ep - 1)`` of its bytes over the NIC, the rest over NVLink, at once); nothing
overlapped. The pipeline's idle slots, ``(pp - 1) / v`` micro-batches per rank, stretch
compute, all-to-all, sends and context parallelism's key/value exchange: ``step = (compute +
all_to_all + sends + context) * (n_mb + (pp - 1) / v) / n_mb + reduce_scatter +
all_gather``; the bubble is the share ``((pp - 1) / v) / (n_mb + (pp - 1) / v)``.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ConfigError
from moe_core.hardware import GPU, GPUS, MEASURED, Measurement
from moe_core.parallel.ddp import reduce_groups
from moe_core.plan.planner import Plan

BLOCK_RECOMPUTE_FLOPS = 4 / 3  # block recompute runs each forward twice: 8 of 6 FLOPs per param


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time by part (seconds) and what it gives (see the module docstring)."""

    compute: float  # the busiest rank's forward + backward of every micro-batch
    all_to_all: float
    reduce_scatter: float
    all_gather: float
    pipeline: float  # activation and gradient sends
    context: float  # context parallelism's key/value all-gathers and gradient reduce-scatters
    bubble: float  # share of the step a pipeline rank idles
    step: float
    tokens_per_s_per_gpu: float
    mfu: float


def _a2a_seconds(nbytes: float, ep: int, gpus_per_node: int, gpu: GPU) -> float:
    """An all-to-all over ``ep`` consecutive ranks: NVLink to the node's peers and the NIC to
    the others, both at once."""
    if ep == 1:
        return 0.0
    local = min(ep, gpus_per_node)
    inside = nbytes * (local - 1) / (ep - 1)
    outside = nbytes * (ep - local) / (ep - 1)
    return max(inside / (gpu.nvlink_gb_s * 1e9), outside / (gpu.network_gb_s * 1e9))


def _ring_seconds(nbytes: float, span: int, gpus_per_node: int, gpu: GPU) -> float:
    """A ring collective whose ranks lie within ``span`` consecutive ranks: NVLink when they
    share a node, else the NIC (a ring runs at its slowest link)."""
    rate = gpu.nvlink_gb_s if span <= gpus_per_node else gpu.network_gb_s
    return nbytes / (rate * 1e9)


def step_time(p: Plan, gpu: GPU | None = None, measured: Measurement = MEASURED) -> StepTime:
    """Predict ``p``'s step on ``gpu`` (default: the cluster's ``gpu_type``), one rank per GPU,
    ``cluster.gpus_per_node`` to a node, calibrated on ``measured``."""
    if gpu is None and p.cluster.gpu_type not in GPUS:
        raise ConfigError(
            f"cluster.gpu_type={p.cluster.gpu_type!r} is not allowed for a step time: one of "
            f"{', '.join(GPUS)}."
        )
    g = gpu or GPUS[p.cluster.gpu_type]
    par, c, n_mb = p.parallel, p.comm, p.micro_batches
    per_node = max(p.cluster.gpus_per_node, 1)
    tokens = n_mb * p.tokens_per_micro_batch
    rerun = BLOCK_RECOMPUTE_FLOPS if par.recompute == "block" else 1
    flops = tokens * p.flops_per_token / par.pp * rerun
    compute = flops / (g.peak_tflops * 1e12 * measured.fraction_of_peak)
    a2a = _a2a_seconds(c.all_to_all, par.ep, per_node, g)
    span = reduce_groups(par).dense  # the dense group spans the expert one
    reduce_scatter = _ring_seconds(c.reduce_scatter, span, per_node, g)
    all_gather = _ring_seconds(c.all_gather, span, per_node, g)
    sends = _ring_seconds(c.pipeline, par.world_size, per_node, g)
    # a context-parallel group spans its cp x ep consecutive ranks (mesh order)
    context = _ring_seconds(c.context, par.cp * par.ep, per_node, g) if par.cp > 1 else 0.0
    idle = (par.pp - 1) / par.virtual_stages
    bubble = idle / (n_mb + idle)
    step = (compute + a2a + sends + context) / (1 - bubble) + reduce_scatter + all_gather
    tps = tokens / par.pp / step
    return StepTime(
        compute=compute,
        all_to_all=a2a,
        reduce_scatter=reduce_scatter,
        all_gather=all_gather,
        pipeline=sends,
        context=context,
        bubble=bubble,
        step=step,
        tokens_per_s_per_gpu=tps,
        mfu=tps * p.flops_per_token / (g.peak_tflops * 1e12),
    )
