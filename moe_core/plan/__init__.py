"""The layout planner: parameters, GPUs, memory per GPU and communication per step of a run.

``plan(run)`` (``planner``) sizes a layout from the config alone: ``memory`` holds what one rank
of each pipeline stage allocates, ``communication`` what it sends per step, ``timing`` the
predicted step time, ``report`` the table ``moe plan`` prints and ``checks`` the one-sentence
refusals of a layout a cluster, a machine or a GPU cannot hold. Each module's docstring gives
its formulas; this package re-exports what its callers use.
"""

from moe_core.plan.checks import (
    InsufficientResourcesError,
    check_cluster,
    check_conversion,
    check_memory,
    check_resources,
    check_shrink_fits,
    fit_refusal,
    free_disk_bytes,
    host_memory_bytes,
)
from moe_core.plan.communication import Communication, all_to_all_rows_per_token
from moe_core.plan.memory import (
    DTYPE_BYTES,
    GIB,
    REMAT_BACKWARD,
    RUNTIME_RESERVE_GIB,
    ParameterCounts,
    StageMemory,
    dense_layer_activation_bytes,
    experts_keep,
    layer_activation_bytes,
    max_in_flight,
    parameter_counts,
)
from moe_core.plan.planner import Plan, plan
from moe_core.plan.report import plan_rows, plan_table, plan_text
from moe_core.plan.timing import BLOCK_RECOMPUTE_FLOPS, StepTime, step_time

__all__ = [
    "BLOCK_RECOMPUTE_FLOPS",
    "DTYPE_BYTES",
    "GIB",
    "REMAT_BACKWARD",
    "RUNTIME_RESERVE_GIB",
    "Communication",
    "InsufficientResourcesError",
    "ParameterCounts",
    "Plan",
    "StageMemory",
    "StepTime",
    "all_to_all_rows_per_token",
    "check_cluster",
    "check_conversion",
    "check_memory",
    "check_resources",
    "check_shrink_fits",
    "dense_layer_activation_bytes",
    "experts_keep",
    "fit_refusal",
    "free_disk_bytes",
    "host_memory_bytes",
    "layer_activation_bytes",
    "max_in_flight",
    "parameter_counts",
    "plan",
    "plan_rows",
    "plan_table",
    "plan_text",
    "step_time",
]
