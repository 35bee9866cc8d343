"""The plan as a table: what ``moe plan`` prints and the train stage logs."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text

from moe_core.parallel.ddp import reduce_groups
from moe_core.plan.checks import layout_text
from moe_core.plan.memory import GIB

if TYPE_CHECKING:
    from moe_core.plan.planner import Plan

Rows = list[tuple[str, str]]


def plan_rows(p: Plan) -> Rows:
    """The plan's rows: the layout, the busiest rank's memory by part (names indented), whether
    it fits the cluster, and the traffic per step."""
    rows = _layout_rows(p) + _memory_rows(p) + _cluster_rows(p) + _checkpoint_rows(p)
    return rows + _traffic_rows(p)


def plan_table(p: Plan) -> Table:
    """A rich table of the plan (what ``moe plan`` prints)."""
    t = Table(title=f"plan: {p.name}", show_header=False)
    for name, value in plan_rows(p):
        t.add_row(name, value)
    return t


def plan_text(p: Plan) -> str:
    """The plan as plain lines (for logs), a row each, never a box: a log viewer or a
    terminal of any width (``prefect deployment run --watch`` at 80 columns) wraps a long line
    whole instead of cutting a table into fragments."""
    return "\n".join(f"{name}: {Text.from_markup(value).plain}" for name, value in plan_rows(p))


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _layout_rows(p: Plan) -> Rows:
    par, mem = p.parallel, p.memory
    unit = "GPUs" if p.cluster.gpus_per_node else "CPU processes"
    dense = mem.layers - mem.moe_layers
    layers = f"{mem.layers} layers" + (f" ({dense} dense)" if dense else "")
    return [
        ("parameters", f"{_count(p.total_params)} total, {_count(p.active_params)} active"),
        (
            "layout",
            f"{layout_text(par)} = {p.gpus} {unit} "
            f"({par.pp_schedule}, recompute {par.recompute}, {p.param_dtype} weights, "
            f"{p.compute_dtype} compute)",
        ),
        (
            "batch",
            f"{p.micro_batches} micro-batches of {p.tokens_per_micro_batch:,} tokens "
            "per rank and step",
        ),
        (
            "busiest rank",
            f"stage {mem.stage}: {layers}, {_count(mem.dense_params)} dense + "
            f"{_count(mem.expert_params)} expert parameters, micro-batches in flight: "
            f"{mem.in_flight}",
        ),
    ]


def _memory_rows(p: Plan) -> Rows:
    """The busiest rank's memory part by part, its total and every stage's total."""
    par, mem, od = p.parallel, p.memory, p.optimizer_dtype
    groups = reduce_groups(par)
    master = "fp32 master + " if p.param_dtype != od else ""
    grads = f"{od}, plus the reduced shard"
    if mem.grads_follow_activations:
        grads = f"autograd's {p.param_dtype}, those beyond the activations backward frees"
    compiled = ", compiled blocks" if mem.compiled else ""
    copies = ""
    if mem.fp8_copies:
        copies = f", with {mem.fp8_copies / GIB:,.2f} GiB of the experts' FP8 copies"
    parts = (
        ("  weights", mem.weights, f"{p.param_dtype}{copies}"),
        ("  gradients at the peak", mem.grad_buffers, grads),
        (
            "  optimizer",
            mem.optimizer,
            f"{master}2 {od} moments, dense / {groups.dense}, experts / {groups.expert}",
        ),
        ("  activations", mem.activations, f"recompute {par.recompute}{compiled}"),
        ("  pipeline send buffers", mem.p2p_buffers, "held until the step ends"),
        ("  expert-parallel receive buffers", mem.ep_buffers, "symmetric memory, rowwise"),
        ("  transient", mem.transient, "largest parameter's gradient"),
        ("  runtime reserve", mem.reserve, "CUDA context, NCCL, workspaces"),
    )
    rows = [(name, f"{value / GIB:,.2f} GiB ({note})") for name, value, note in parts]
    per = "GPU" if p.cluster.gpus_per_node else "process"
    rows.append((f"  total per {per}", f"[bold]{mem.total / GIB:,.2f} GiB[/]"))
    rows.append(("per stage (GiB)", ", ".join(f"{s.total / GIB:.1f}" for s in p.stages)))
    return rows


def _cluster_rows(p: Plan) -> Rows:
    """Whether the busiest rank fits the cluster's GPUs, and its processes the layout."""
    cl, total = p.cluster, p.memory.total
    rows = []
    if cl.gpus_per_node and cl.gpu_memory_gib > 0:
        verdict = "[green]fits[/]" if p.fits() else "[red]does not fit[/]"
        rows.append(
            ("fits", f"{verdict}: {total / GIB:,.1f} of {cl.gpu_memory_gib:g} GiB ({cl.gpu_type})")
        )
    match = "matches" if cl.world_size == p.gpus else "[red]does not match[/]"
    rows.append(
        (
            "cluster",
            f"{cl.name} ({cl.kind}): {cl.nodes} nodes x {cl.procs_per_node} = {cl.world_size} "
            f"processes, {match} the layout",
        )
    )
    if p.shrinks_to:
        ways = ", ".join(f"{n} nodes (dp {dp}, accumulation {acc})" for n, dp, acc in p.shrinks_to)
        rows.append(("shrinks to", f"{ways} when nodes are lost (cluster.on_node_loss=shrink)"))
    return rows


def _checkpoint_rows(p: Plan) -> Rows:
    """The bytes of one checkpoint and the busiest node's time to write them, and against the
    predicted time between checkpoints what that costs the run."""
    c = p.checkpoint
    size = f"{c.total / GIB:,.1f} GiB" if c.total < 2**40 else f"{c.total / 2**40:,.2f} TiB"
    return [
        (
            "checkpoint",
            f"{c.per_rank / GIB:,.2f} GiB per rank (its shard's masters and moments), "
            f"{c.per_node / GIB:,.1f} GiB per node, {size} in all; {c.seconds:,.1f} s to write "
            f"at {c.write_gbps:g} GB/s per node (cluster.storage_write_gbps)"
            + (
                f"; async saves keep a host copy of {c.staged_per_node / GIB:,.1f} GiB per node "
                "(pinned on GPUs)"
                if c.staged_per_node
                else ""
            )
            + _checkpoint_interval(p),
        )
    ]


def _checkpoint_interval(p: Plan) -> str:
    """The time between periodic checkpoints at the predicted step time (a GPU cluster of a
    known type only), against the write: a synchronous save stops training for it, and an
    async one that is still writing when the next save comes makes that save wait."""
    from moe_core.hardware import GPUS
    from moe_core.plan.timing import step_time

    c = p.checkpoint
    if not c.every or not p.cluster.gpus_per_node or p.cluster.gpu_type not in GPUS:
        return ""
    step_s = step_time(p).step
    interval = c.every * step_s
    shown = f"{interval:.1f}" if interval < 10 else f"{interval:,.0f}"
    said = f"; every {c.every} steps, about {shown} s at the predicted step time"
    if not c.background:
        share = c.seconds / (interval + c.seconds)
        return (
            f"{said}, a synchronous save stops training for its write "
            f"({share * 100:.0f} % of the run's time)"
        )
    if c.seconds > interval:
        fewest = math.ceil(c.seconds / step_s)
        return (
            f"{said}, shorter than the write, so each save would wait for the one before: "
            f"raise train.checkpoint_every to {fewest} or more, or the write rate"
        )
    return said


def _reach_rows(p: Plan) -> Rows:
    """Where a token's rows go (expert parallelism only): the bound and the expected rows, and
    under group-limited routing the same for plain top-k beside them (the saving)."""
    r, plain, ep = p.comm.reach, p.comm.plain, p.parallel.ep
    if ep == 1:
        return []
    nodes = r.nodes > 1
    most = f"at most {r.max_ranks} of {ep} ranks" + (
        f", {r.max_nodes} of {r.nodes} nodes" if nodes else ""
    )
    rows = f"rows per token {r.rows_per_token:.2f}"
    across = f"{r.cross_node_rows:.2f} across nodes"
    same = ("max_ranks", "max_nodes", "rows_per_token")
    if all(getattr(r, k) == getattr(plain, k) for k in same):  # no groups, or no limit
        return [("EP rows", f"a token reaches {most}; {rows}" + (f", {across}" if nodes else ""))]
    fewer = 1 - r.rows_per_token / plain.rows_per_token
    alone = f"{plain.max_ranks} ranks" + (f", {plain.max_nodes} nodes" if nodes else "")
    line = (
        f"a token reaches {most} (top-k alone: {alone}); {rows} instead of "
        f"{plain.rows_per_token:.2f} ({fewer:.1%} fewer)"
    )
    if nodes:
        line += f", {across} instead of {plain.cross_node_rows:.2f}"
    loose = [f"a group touches up to {r.group_ranks} ranks"] if not r.nests_ranks else []
    if nodes and not r.nests_nodes:
        loose.append(f"up to {r.group_nodes} nodes")
    if loose:
        line += f"; groups do not nest in this layout: {', '.join(loose)}"
    return [("group-limited routing", line)]


def _traffic_rows(p: Plan) -> Rows:
    c = p.comm
    return [
        (
            "all-to-all",
            f"{c.all_to_all_per_layer / GIB:,.3f} GiB per MoE layer and micro-batch, "
            f"{c.all_to_all / GIB:,.1f} GiB per step",
        ),
        *_reach_rows(p),
        (
            "ZeRO-1",
            f"reduce-scatter {c.reduce_scatter / GIB:,.2f} GiB + all-gather "
            f"{c.all_gather / GIB:,.2f} GiB per step",
        ),
        ("pipeline p2p", f"{c.pipeline / GIB:,.2f} GiB per step"),
        *(
            [
                (
                    "context K/V",
                    f"{c.context_per_layer / GIB:,.3f} GiB per layer and micro-batch "
                    f"(all-gather + gradient reduce-scatter), {c.context / GIB:,.1f} GiB per step",
                )
            ]
            if p.parallel.cp > 1
            else []
        ),
    ]
