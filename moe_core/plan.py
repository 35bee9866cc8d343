"""The layout planner: parameters, GPUs, memory per GPU and communication per step of a run.

Everything is computed from the config alone (parameter shapes from a meta-device model), so a
1.2T-parameter layout is checked on a laptop before any process starts. The numbers follow what
this package's code allocates (``parallel.ddp``, ``parallel.optimizer``, ``parallel.pipeline``,
the model's saved tensors); they are estimates of the peak, not measurements.

Memory of one rank of pipeline stage ``s`` (every rank of a stage holds the same), in bytes:

- weights: ``(N_dense + N_expert) * b_p``, with ``N_dense`` the stage's attention, norm, router,
  shared-expert (plus embedding on the first, final norm and LM head on the last stage)
  parameters, ``N_expert`` its routed-expert parameters divided by ``ep``, ``b_p`` 2 for bf16
  and 4 for fp32 weights.
- gradient buffers, in ``b_o`` (``precision.optimizer``: 4 for fp32, 2 for bf16):
  ``b_o * (N_dense + N_expert)``, plus the reduced shard ``b_o * (N_dense / (dp * ep) +
  N_expert / dp)`` where that group has more than one rank. A rank that reduces nothing
  (``dp x ep = 1``) with one micro-batch per step, or with ``b_o = b_p``, keeps autograd's
  gradients instead: ``b_p * (N_dense + N_expert)`` and no transient.
- optimizer (ZeRO-1): two Adam moments in ``b_o`` and, when the weights are less precise than
  that, an fp32 master copy: ``12`` bytes per element for bf16 weights under fp32 state, ``8``
  for fp32 weights (their own masters), ``4`` for the pure-bf16 preset (bf16 moments, no
  master), over ``N_dense / (dp * ep) + N_expert / dp`` elements.
- activations: ``in_flight * layers_per_chunk * T * A`` with ``T = micro_batch_size * seq_len``
  tokens per micro-batch, ``in_flight`` the most forwards whose backward is still pending in
  the stage's schedule (``pp - s`` for 1F1B) and ``A`` the bytes one layer saves per token
  (``layer_activation_bytes``); block recompute keeps ``d_model * b_p`` per layer and token
  instead, plus one rematerialized layer (``T * A``) during backward. The stage holding the LM
  head adds ``T * (V * (b_c + 8) + d_model * (4 + b_p + b_c))`` for the logits, their fp32
  copy and log-softmax, and the head's inputs (``b_c``: 2 under bf16 autocast, else 4).
- pipeline send buffers: ``messages * micro_batches * T * d_model * b_p`` (activations
  forward, gradients backward; the runner holds each until the step ends).
- expert-parallel receive buffers (``parallel.dispatcher=nvshmem_rowwise``): the symmetric
  staging of ``RowwiseExchange.buffer_bytes`` for the rows ``rowwise_capacity`` allows, and,
  per layer, the expert-ordered buffers sized for its assignment capacity ``M`` instead of the
  ``T * k`` rows the exact-size dispatchers keep: ``(M - T k) (b_p (d + 3 h) + 4)`` more
  activation bytes (``b_p h`` less per row under selective recompute).
- transient: the gradient of the stage's largest parameter in ``b_p`` (autograd writes it
  before the hook adds it to the fp32 buffer).
- runtime reserve: ``RUNTIME_RESERVE_GIB`` for the CUDA context, NCCL communicators and
  library workspaces (none for CPU processes).

Communication (bytes one rank sends; ring collectives send ``(g - 1) / g`` of the buffer):

- all-to-all per MoE layer and micro-batch, under uniform routing: each token goes once to each
  other expert-parallel rank holding one of its top-k experts, ``r = T * (ep - 1) * (1 - q)``
  rows with ``q = C(E - E/ep, k) / C(E, k)``; forward sends ``r * (d_model * b_p + 12 k)``
  (row, expert ids, weights) and ``r * d_model * b_p`` back; backward the same rows with
  ``4 k`` instead of ``12 k``; block recompute repeats the forward.
- reduce-scatter of the gradients (``b_o``) and all-gather of the updated weights, once per step.
- pipeline: one ``T * d_model * b_p`` message per micro-batch and chunk boundary, each way.

Time per step (``step_time``; a model, not a measurement): the busiest rank's model FLOPs
(``n_mb * T * flops_per_token / pp``, 4/3 of that under block recompute) at the fraction of
the GPU's peak one H200 reached in ``moe train`` (``hardware.MEASURED``); each message at its
link's rate (``hardware.GPUS``: NVLink inside a node, the NIC between nodes; an all-to-all
whose group spans nodes sends ``(ep - local) / (ep - 1)`` of its bytes over the NIC, the rest
over NVLink, at once); nothing overlapped. The pipeline's idle slots, ``(pp - 1) / v``
micro-batches per rank, stretch compute, all-to-all and sends:
``step = (compute + all_to_all + sends) * (n_mb + (pp - 1) / v) / n_mb + reduce_scatter +
all_gather``; the bubble is the share ``((pp - 1) / v) / (n_mb + (pp - 1) / v)``.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass

import torch
from rich.table import Table

from moe_core.config import ClusterConfig, ConfigError, ModelConfig, ParallelConfig, RunConfig
from moe_core.hardware import GPU, GPUS, MEASURED, Measurement
from moe_core.model.flops import count
from moe_core.model.moe import Experts
from moe_core.model.transformer import Transformer
from moe_core.parallel.dispatch import RowwiseExchange, rowwise_capacity
from moe_core.parallel.parallelize import DTYPES
from moe_core.parallel.pipeline import rank_chunks, schedule

GIB = 2**30
RUNTIME_RESERVE_GIB = 4.0
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}
BLOCK_RECOMPUTE_FLOPS = 4 / 3  # block recompute runs each forward twice: 8 of 6 FLOPs per param


class InsufficientResourcesError(ConfigError):
    """The run needs more GPUs (or GPU memory) than the machine offers; one sentence."""


# --------------------------------------------------------------------------------------------
# parameters


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts by place, read off a one-layer meta-device model."""

    layer_dense: int  # attention, norms, router, shared expert of one block
    layer_expert: int  # all routed experts of one block
    largest_dense: int  # the largest dense tensor of a block
    largest_expert: int  # the largest routed-expert tensor of a block (all experts)
    embedding: int
    head: int  # LM head
    final_norm: int


def parameter_counts(m: ModelConfig) -> ParameterCounts:
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(m, n_layers=1))
    block = model.layers["0"]
    experts = [p for mod in block.modules() if isinstance(mod, Experts) for p in mod.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in block.parameters() if id(p) not in expert_ids]
    assert model.embed is not None and model.lm_head is not None and model.norm is not None
    return ParameterCounts(
        layer_dense=sum(p.numel() for p in dense),
        layer_expert=sum(p.numel() for p in experts),
        largest_dense=max(p.numel() for p in dense),
        largest_expert=max(p.numel() for p in experts),
        embedding=model.embed.weight.numel(),
        head=model.lm_head.weight.numel(),
        final_norm=model.norm.weight.numel(),
    )


# --------------------------------------------------------------------------------------------
# activations


def layer_activation_bytes(
    m: ModelConfig, param_dtype: str, compute_dtype: str, recompute: str = "none"
) -> int:
    """Bytes one transformer block keeps for backward per token (no recompute, or selective).

    ``b_p`` (hidden states, experts: they run in the weights' dtype), ``b_c`` (autocast matmul
    outputs); per token:

    - four RMSNorms keep an fp32 copy of their input and the normalized output:
      ``2 d (4 + b_p) + (d + d_kv)(4 + b_c) + 16``;
    - attention keeps the projections' input, rotated q and k, v and its output (which is the
      o-projection's input): ``b_c (3 d + 2 d_kv) + 4 n_heads`` (log-sum-exp);
    - the router keeps its fp32 input, logits, scores and choices: ``4 d + 12 E + 20 k``;
    - routed experts keep rows in, gate+up out and SwiGLU out, plus each row's fp32 router
      weight (applied in the SwiGLU, so the plain-sum combine keeps no rows out):
      ``b_p k (d + 3 h) + 4 k``, less ``b_p k h`` under selective recompute;
    - a shared expert of width ``h_s`` keeps gate, up, SwiGLU and product, ``4 b_c h_s``, and
      its input, ``b_c d``, unless that is the router's fp32 input already (all fp32).

    - under bf16 autocast each layer keeps its own bf16 copies of the RoPE cos/sin tables for q
      and k, ``4 head_dim b_c`` per token of a one-sequence micro-batch (an upper bound; the
      fp32 tables are one copy for the whole model).
    ``recompute="block"`` is accounted by the caller (a block then keeps only its input).
    """
    if recompute not in ("none", "selective", "block"):
        raise ConfigError(
            f"recompute={recompute!r} is not allowed: one of 'none', 'selective', 'block'."
        )
    bp, bc = DTYPE_BYTES[param_dtype], DTYPE_BYTES[compute_dtype]
    d, d_kv, h, k, e = m.d_model, m.kv_heads * m.head_dim, m.expert_hidden, m.top_k, m.n_experts
    h_shared = m.n_shared_experts * h
    norms = 2 * d * (4 + bp) + (d + d_kv) * (4 + bc) + 16
    attention = bc * (3 * d + 2 * d_kv) + 4 * m.n_heads
    router = 4 * d + 12 * e + 20 * k
    experts = bp * k * (d + 3 * h) + 4 * k
    if recompute == "selective":
        experts -= bp * k * h
    shared_input = 0 if bp == bc == 4 else bc * d
    shared = bc * 4 * h_shared + shared_input if h_shared else 0
    rope = 4 * m.head_dim * bc if bc < 4 else 0
    return norms + attention + router + experts + shared + rope


def max_in_flight(par: ParallelConfig, pp_rank: int, micro_batches: int) -> int:
    """The most chunk-forwards of ``pp_rank`` whose backward has not run yet (its schedule)."""
    if par.pp == 1:
        return 1
    live = peak = 0
    for action in schedule(par, pp_rank, micro_batches):
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


# --------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class StageMemory:
    """Peak memory of one rank of pipeline stage ``stage`` (bytes)."""

    stage: int
    layers: int
    dense_params: int
    expert_params: int  # this rank's experts (1 / ep of the stage's)
    in_flight: int
    weights: int
    grad_buffers: int
    optimizer: int
    activations: int
    p2p_buffers: int
    transient: int
    reserve: int
    ep_buffers: int = 0  # symmetric receive buffers of the rowwise dispatcher

    @property
    def total(self) -> int:
        return (
            self.weights
            + self.grad_buffers
            + self.optimizer
            + self.activations
            + self.p2p_buffers
            + self.transient
            + self.reserve
            + self.ep_buffers
        )


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends per optimizer step (all-to-all also per layer and micro-batch)."""

    all_to_all_per_layer: int  # one MoE layer, one micro-batch, forward + backward
    all_to_all: int  # the step: every MoE layer of the busiest rank, every micro-batch
    reduce_scatter: int  # gradients in the optimizer's dtype, dense and expert groups
    all_gather: int  # updated weights in the model dtype
    pipeline: int  # the busiest rank's activation and gradient messages


@dataclass(frozen=True)
class Plan:
    """What a run needs: parameters, GPUs, the busiest rank's memory and traffic per step."""

    name: str
    total_params: int
    active_params: int
    parallel: ParallelConfig
    cluster: ClusterConfig
    param_dtype: str
    compute_dtype: str
    optimizer_dtype: str
    tokens_per_micro_batch: int
    micro_batches: int
    stages: tuple[StageMemory, ...]
    comm: Communication
    flops_per_token: int  # model FLOPs, forward + backward, at train.seq_len

    @property
    def gpus(self) -> int:
        return self.parallel.world_size

    @property
    def memory(self) -> StageMemory:
        """The most loaded rank (ties: the first stage)."""
        return max(self.stages, key=lambda s: s.total)

    @property
    def per_gpu_gib(self) -> float:
        return self.memory.total / GIB

    def fits(self, cluster: ClusterConfig | None = None) -> bool:
        """Whether the busiest rank's memory fits ``cluster.gpu_memory_gib`` (default: the run's
        cluster). A cluster without GPUs (CPU processes) sets no per-device limit: True."""
        c = cluster or self.cluster
        if c.gpus_per_node == 0 or c.gpu_memory_gib <= 0:
            return True
        return self.memory.total <= c.gpu_memory_gib * GIB

    def text(self, width: int = 110) -> str:
        """The table as plain text (for logs)."""
        from rich.console import Console

        console = Console(record=True, width=width, file=io.StringIO())
        console.print(self.table())
        return console.export_text()

    def table(self) -> Table:
        """A rich table of the plan (what ``moe plan`` prints)."""
        par, mem, c = self.parallel, self.memory, self.comm
        t = Table(title=f"plan: {self.name}", show_header=False)
        t.add_row(
            "parameters", f"{_count(self.total_params)} total, {_count(self.active_params)} active"
        )
        unit = "GPUs" if self.cluster.gpus_per_node else "CPU processes"
        t.add_row(
            "layout",
            f"pp {par.pp} x dp {par.dp} x ep {par.ep} = {self.gpus} {unit} "
            f"({par.pp_schedule}, recompute {par.recompute}, {self.param_dtype} weights, "
            f"{self.compute_dtype} compute)",
        )
        t.add_row(
            "batch",
            f"{self.micro_batches} micro-batches of {self.tokens_per_micro_batch:,} tokens "
            "per rank and step",
        )
        t.add_row(
            "busiest rank",
            f"stage {mem.stage}: {mem.layers} layers, {_count(mem.dense_params)} dense + "
            f"{_count(mem.expert_params)} expert parameters, micro-batches in flight: "
            f"{mem.in_flight}",
        )
        dense_group, expert_group = par.dp * par.ep, par.dp
        od = self.optimizer_dtype
        rows = (
            ("  weights", mem.weights, f"{self.param_dtype}"),
            ("  gradient buffers", mem.grad_buffers, f"{od}, plus the reduced shard"),
            (
                "  optimizer",
                mem.optimizer,
                ("fp32 master + " if self.param_dtype != od else "")
                + f"2 {od} moments, dense / {dense_group}, experts / {expert_group}",
            ),
            ("  activations", mem.activations, f"recompute {par.recompute}"),
            ("  pipeline send buffers", mem.p2p_buffers, "held until the step ends"),
            ("  expert-parallel receive buffers", mem.ep_buffers, "symmetric memory, rowwise"),
            ("  transient", mem.transient, "largest parameter's gradient"),
            ("  runtime reserve", mem.reserve, "CUDA context, NCCL, workspaces"),
        )
        for name, value, note in rows:
            t.add_row(name, f"{value / GIB:,.2f} GiB ({note})")
        per = "GPU" if self.cluster.gpus_per_node else "process"
        t.add_row(f"  total per {per}", f"[bold]{mem.total / GIB:,.2f} GiB[/]")
        t.add_row("per stage (GiB)", ", ".join(f"{s.total / GIB:.1f}" for s in self.stages))
        cl = self.cluster
        if cl.gpus_per_node and cl.gpu_memory_gib > 0:
            verdict = "[green]fits[/]" if self.fits() else "[red]does not fit[/]"
            t.add_row(
                "fits",
                f"{verdict}: {mem.total / GIB:,.1f} of {cl.gpu_memory_gib:g} GiB ({cl.gpu_type})",
            )
        procs = cl.world_size
        match = "matches" if procs == self.gpus else "[red]does not match[/]"
        t.add_row(
            "cluster",
            f"{cl.name} ({cl.kind}): {cl.nodes} nodes x {cl.procs_per_node} = {procs} processes, "
            f"{match} the layout",
        )
        t.add_row(
            "all-to-all",
            f"{c.all_to_all_per_layer / GIB:,.3f} GiB per MoE layer and micro-batch, "
            f"{c.all_to_all / GIB:,.1f} GiB per step",
        )
        t.add_row(
            "ZeRO-1",
            f"reduce-scatter {c.reduce_scatter / GIB:,.2f} GiB + all-gather "
            f"{c.all_gather / GIB:,.2f} GiB per step",
        )
        t.add_row("pipeline p2p", f"{c.pipeline / GIB:,.2f} GiB per step")
        return t


def _count(n: int) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)


def _ring(nbytes: float, group: int) -> float:
    return nbytes * (group - 1) / group


def all_to_all_rows_per_token(m: ModelConfig, ep: int) -> float:
    """Expected rows one token sends to other expert-parallel ranks (uniform routing)."""
    if ep == 1:
        return 0.0
    per_rank = m.n_experts // ep
    q = math.comb(m.n_experts - per_rank, m.top_k) / math.comb(m.n_experts, m.top_k)
    return (ep - 1) * (1.0 - q)


def plan(run: RunConfig) -> Plan:
    """Plan ``run``'s layout; see the module docstring for every formula."""
    m, t, par = run.model, run.train, run.parallel
    counts = count(m, t.seq_len)
    sh = parameter_counts(m)
    prec = run.precision
    bp = DTYPE_BYTES[prec.params]
    bc = DTYPE_BYTES[prec.compute]
    bo = DTYPE_BYTES[prec.optimizer]
    tokens = t.micro_batch_size * t.seq_len
    n_mb = run.micro_batches
    n_chunks = par.pp * par.virtual_stages
    per_chunk = m.n_layers // n_chunks
    dense_group, expert_group = par.dp * par.ep, par.dp
    autograd_grads = par.data_parallel == 1 and (n_mb == 1 or bp == bo)  # see parallel.ddp
    a_layer = layer_activation_bytes(m, prec.params, prec.compute, par.recompute)
    a_full = layer_activation_bytes(m, prec.params, prec.compute, "none")
    head_act = tokens * (m.vocab_size * (bc + 8) + m.d_model * (4 + bp + bc))
    ep_buffers, extra_layer, extra_full = 0, 0, 0
    if par.ep > 1 and par.dispatcher == "nvshmem_rowwise":
        rows_cap, assign_cap = rowwise_capacity(
            m.n_experts, m.top_k, par.ep, tokens, par.ep_capacity_factor
        )
        ep_buffers = RowwiseExchange.buffer_bytes(
            par.ep, rows_cap, m.d_model, m.top_k, DTYPES[prec.params]
        )
        more_rows = assign_cap - tokens * m.top_k
        extra_full = more_rows * (bp * (m.d_model + 3 * m.expert_hidden) + 4)
        extra_layer = extra_full - more_rows * bp * m.expert_hidden * (par.recompute == "selective")
    message = tokens * m.d_model * bp + 4  # hidden states + the running aux loss
    reserve = round(RUNTIME_RESERVE_GIB * GIB) if run.cluster.gpus_per_node else 0

    stages: list[StageMemory] = []
    p2p_sent: list[int] = []
    for s in range(par.pp):
        chunks = rank_chunks(par, s)
        layers = per_chunk * len(chunks)
        dense = layers * sh.layer_dense
        largest = sh.largest_dense
        if 0 in chunks:
            dense += sh.embedding
            largest = max(largest, sh.embedding)
        last = n_chunks - 1 in chunks
        if last:
            dense += sh.final_norm + sh.head
            largest = max(largest, sh.head)
        experts = layers * sh.layer_expert // par.ep
        largest = max(largest, sh.largest_expert // par.ep)

        dense_shard = dense / dense_group if dense_group > 1 else 0
        expert_shard = experts / expert_group if expert_group > 1 else 0
        grads = bo * (dense + experts) + bo * (dense_shard + expert_shard)
        transient = largest * bp
        if autograd_grads:
            grads, transient = bp * (dense + experts), 0
        state_bytes = 2 * bo + (4 if bp < bo else 0)
        optimizer = state_bytes * (dense / dense_group + experts / expert_group)

        in_flight = max_in_flight(par, s, n_mb)
        if par.recompute == "block":
            acts = in_flight * per_chunk * tokens * m.d_model * bp + tokens * a_full + extra_full
        else:
            acts = in_flight * per_chunk * (tokens * a_layer + extra_layer)
        if last:
            acts += head_act
        messages = sum(c < n_chunks - 1 for c in chunks) + sum(c > 0 for c in chunks)
        sent = messages * n_mb * message
        p2p_sent.append(sent)
        stages.append(
            StageMemory(
                stage=s,
                layers=layers,
                dense_params=dense,
                expert_params=experts,
                in_flight=in_flight,
                weights=(dense + experts) * bp,
                grad_buffers=round(grads),
                optimizer=round(optimizer),
                activations=acts,
                p2p_buffers=sent if par.pp > 1 else 0,
                transient=transient,
                reserve=reserve,
                ep_buffers=ep_buffers,
            )
        )

    rows = all_to_all_rows_per_token(m, par.ep)
    k = m.top_k
    forward = rows * (m.d_model * bp + 12 * k) + rows * m.d_model * bp
    backward = rows * m.d_model * bp + rows * (m.d_model * bp + 4 * k)
    sizes = _ring(par.ep * (1 + m.n_experts // par.ep) * 8, par.ep) if par.ep > 1 else 0
    per_layer = tokens * (forward + backward) + sizes
    if par.recompute == "block":
        per_layer += tokens * forward + sizes
    layers_per_rank = m.n_layers // par.pp
    busiest = max(stages, key=lambda s: s.dense_params + s.expert_params)
    comm = Communication(
        all_to_all_per_layer=round(per_layer),
        all_to_all=round(per_layer * layers_per_rank * n_mb),
        reduce_scatter=round(
            _ring(bo * busiest.dense_params, dense_group)
            + _ring(bo * busiest.expert_params, expert_group)
        ),
        all_gather=round(
            _ring(bp * busiest.dense_params, dense_group)
            + _ring(bp * busiest.expert_params, expert_group)
        ),
        pipeline=max(p2p_sent) if par.pp > 1 else 0,
    )
    return Plan(
        name=_run_name(run),
        total_params=counts.total_params,
        active_params=counts.active_params,
        parallel=par,
        cluster=run.cluster,
        param_dtype=prec.params,
        compute_dtype=prec.compute,
        optimizer_dtype=prec.optimizer,
        tokens_per_micro_batch=tokens,
        micro_batches=n_mb,
        stages=tuple(stages),
        comm=comm,
        flops_per_token=counts.flops_per_token,
    )


def _run_name(run: RunConfig) -> str:
    return f"model {run.model.name}"


# --------------------------------------------------------------------------------------------
# time per step


@dataclass(frozen=True)
class StepTime:
    """A step's predicted time by part (seconds) and what it gives (see the module docstring)."""

    compute: float  # the busiest rank's forward + backward of every micro-batch
    all_to_all: float
    reduce_scatter: float
    all_gather: float
    pipeline: float  # activation and gradient sends
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
    span = par.dp * par.ep
    reduce_scatter = _ring_seconds(c.reduce_scatter, span, per_node, g)
    all_gather = _ring_seconds(c.all_gather, span, per_node, g)
    sends = _ring_seconds(c.pipeline, par.world_size, per_node, g)
    idle = (par.pp - 1) / par.virtual_stages
    bubble = idle / (n_mb + idle)
    step = (compute + a2a + sends) / (1 - bubble) + reduce_scatter + all_gather
    tps = tokens / par.pp / step
    return StepTime(
        compute=compute,
        all_to_all=a2a,
        reduce_scatter=reduce_scatter,
        all_gather=all_gather,
        pipeline=sends,
        bubble=bubble,
        step=step,
        tokens_per_s_per_gpu=tps,
        mfu=tps * p.flops_per_token / (g.peak_tflops * 1e12),
    )


# --------------------------------------------------------------------------------------------
# refusals


def fit_refusal(p: Plan) -> str | None:
    """One sentence when the busiest rank does not fit ``cluster.gpu_memory_gib``, else None."""
    if p.fits():
        return None
    par, c = p.parallel, p.cluster
    return (
        f"{p.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
        f"{p.per_gpu_gib:.1f} GiB per GPU but a {c.gpu_type} has {c.gpu_memory_gib:g} GiB: "
        "raise parallel.ep or parallel.pp, lower train.micro_batch_size or turn on "
        "parallel.recompute."
    )


def check_cluster(run: RunConfig) -> None:
    """The cluster must start exactly the layout's processes (``nodes x procs_per_node``)."""
    c, par = run.cluster, run.parallel
    if c.world_size == par.world_size:
        return
    hint = (
        f"set cluster.nodes={par.world_size // c.procs_per_node}"
        if par.world_size % c.procs_per_node == 0
        else "change cluster.nodes/procs_per_node or parallel.pp/dp/ep"
    )
    raise ConfigError(
        f"cluster {c.name!r} starts cluster.nodes x cluster.procs_per_node = {c.nodes} x "
        f"{c.procs_per_node} = {c.world_size} processes but the layout parallel.pp x dp x ep = "
        f"{par.pp} x {par.dp} x {par.ep} needs {par.world_size}: {hint}."
    )


def check_resources(
    run: RunConfig, available_gpus: int, available_gpu_memory_gib: float | None
) -> None:
    """Refuse, in one sentence, a run this machine cannot hold: too few GPUs, or (when the
    memory is known) GPUs smaller than the plan's busiest rank. CPU layouts (a cluster with
    ``gpus_per_node == 0``) need no GPU."""
    if run.cluster.gpus_per_node == 0:
        return
    par = run.parallel
    needed = par.world_size
    if needed > available_gpus:
        raise InsufficientResourcesError(
            f"model {run.model.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
            f"{needed} GPUs but this machine has {available_gpus}: launch it on a cluster "
            "(cluster=slurm or cluster=kubernetes) or choose a smaller layout."
        )
    if available_gpu_memory_gib is None:
        return
    p = plan(run)
    if p.memory.total > available_gpu_memory_gib * GIB:
        raise InsufficientResourcesError(
            f"model {run.model.name} with layout pp {par.pp} x dp {par.dp} x ep {par.ep} needs "
            f"{p.per_gpu_gib:.1f} GiB per GPU but this machine's GPUs have "
            f"{available_gpu_memory_gib:.1f} GiB: raise parallel.ep or parallel.pp, lower "
            "train.micro_batch_size or turn on parallel.recompute."
        )
