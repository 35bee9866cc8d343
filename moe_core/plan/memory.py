"""Memory of one rank: parameter counts by place, saved activations, and the peak per stage.

The numbers follow what this package's code allocates (``parallel.ddp``,
``parallel.optimizer``, ``parallel.pipeline``, the model's saved tensors); they are estimates of
the peak, not measurements. Memory of one rank of pipeline stage ``s`` (every rank of a stage
holds the same), in bytes:

- weights: ``(N_dense + N_expert) * b_p``, with ``N_dense`` the stage's attention, norm, router,
  shared-expert parameters of its MoE blocks, the whole of its leading dense blocks
  (``model.n_dense_layers``: attention, norms, a dense SwiGLU; which global layers a stage
  holds is ``parallel.pipeline.chunk_layers`` of its chunks), plus the embedding on the first,
  final norm and LM head on the last stage (a tied head is the embedding: counted once), and
  ``N_expert`` its MoE blocks' routed-expert parameters divided by ``ep``; ``b_p`` 2 for bf16
  and 4 for fp32 weights. The last stage also holds the ``model.mtp_depth`` multi-token
  prediction modules: an MoE block each, with its norms and projection (``mtp_own``). With FP8
  experts of rowwise scales and ``precision.fp8_weight_cache`` the rank also keeps each expert
  weight's two FP8 copies, made once per step (``moe_kernels.fp8_cache``): ``2 N_expert`` bytes
  and fp32 scales, ``4 (E / ep) (3 h + 2 d)`` per MoE block (``fp8_copy_bytes``; FP8 linears
  keep copies only in uncompiled runs, which this does not count).
- gradient buffers, in ``b_o`` (``precision.optimizer``: 4 for fp32, 2 for bf16):
  ``b_o * (N_dense + N_expert)``, plus the reduced shard ``b_o * (N_dense / (dp * cp * ep) +
  N_expert / (dp * cp))`` where that group has more than one rank. A rank that reduces nothing
  (``dp x cp x ep = 1``) with one micro-batch per step, or with ``b_o = b_p``, keeps autograd's
  gradients instead: ``b_p * (N_dense + N_expert)`` and no transient. With one micro-batch
  those are written while backward frees the activations, so the peak holds
  ``max(activations, gradients)``: only the gradients beyond the activations count; under block
  recompute backward frees little, and the gradients stand beside its rematerialized block.
- optimizer (ZeRO-1): two Adam moments in ``b_o`` and, when the weights are less precise than
  that, an fp32 master copy: ``12`` bytes per element for bf16 weights under fp32 state, ``8``
  for fp32 weights (their own masters), ``4`` for the pure-bf16 preset (bf16 moments, no
  master), over ``N_dense / (dp * cp * ep) + N_expert / (dp * cp)`` elements.
- activations: ``in_flight * T * (n_moe * A + n_dense * A_dense)`` for the rank's chunk with the
  most (an upper bound where interleaved chunks differ), with ``T = micro_batch_size * seq_len /
  cp`` the rank's tokens per micro-batch (``context_activation_bytes`` adds, per attention layer,
  what context parallelism gathers), ``in_flight`` the most forwards whose backward is still
  pending in the stage's schedule (``pp - s`` for 1F1B), ``n_moe`` and ``n_dense`` the chunk's MoE
  and leading dense blocks and ``A``, ``A_dense`` the bytes each saves per token
  (``layer_activation_bytes``, ``dense_layer_activation_bytes``, eager or with compiled blocks, as
  the run compiles: ``parallel.compile``, on by default on GPUs); block recompute keeps ``d_model
  * b_p`` per layer and token instead, and its backward peaks either at the head (below) or at a
  rematerialized layer, which holds ``T * A`` (or ``T * A_dense`` where that is larger and the
  stage holds one) and on a GPU as many bytes again (``REMAT_BACKWARD``). The stage holding the
  LM head adds, eager, ``T * (V * (b_c + 8) + d_model * (4 + b_p + b_c))`` for the logits, their
  fp32 copy and log-softmax, and the head's inputs (``b_c``: 2 under bf16 autocast, else 4);
  compiled (the loss fuses the upcast), ``T * (2 V b_c + d_model * (b_p + b_c))``: the logits,
  their gradient at the start of backward, the final norm's input and output. Each MTP depth adds,
  once as the head (the last chunk's backward follows its forward), an MoE block's ``T * A`` (``T
  * d_model * b_p`` under block recompute), what the head keeps for its own logits, and its norms'
  and projection's inputs, ``T * d_model * (2 (4 + b_p) + 2 b_c)`` (the embeddings and hidden
  state it normalizes, eagerly, and their concatenation).
- pipeline send buffers: ``messages * micro_batches * T * d_model * b_p`` (activations
  forward, gradients backward; the runner holds each until the step ends), twice the
  activations with MTP (the token embeddings travel beside them).
- expert-parallel receive buffers (``parallel.dispatcher=nvshmem_rowwise``): the symmetric
  staging of ``RowwiseExchange.buffer_bytes`` for the rows ``rowwise_capacity`` allows, and,
  per MoE layer, the expert-ordered buffers sized for its assignment capacity ``M`` instead of the
  ``T * k`` rows the exact-size dispatchers keep: ``(M - T k) (b_p (d + 3 h) + 4)`` more
  activation bytes (``b_p h`` less per row under selective recompute or the fused MLP).
- transient: the gradient of the stage's largest parameter in ``b_p`` (autograd writes it
  before the hook adds it to the fp32 buffer).
- runtime reserve: ``RUNTIME_RESERVE_GIB`` for the CUDA context, NCCL communicators and
  library workspaces (none for CPU processes).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from moe_core.config import ConfigError, ModelConfig, ParallelConfig, RunConfig
from moe_core.model.dtypes import DTYPES
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts
from moe_core.model.transformer import Block, Transformer
from moe_core.parallel.ddp import reduce_groups
from moe_core.parallel.dispatch import RowwiseExchange, rowwise_capacity
from moe_core.parallel.pipeline import chunk_layers, rank_chunks, schedule

GIB = 2**30
RUNTIME_RESERVE_GIB = 4.0
# What a rematerialized block's backward holds on a GPU, in the block's activations: they and
# about as many bytes of their gradients and workspaces, measured (one H200, OLMoE-1B-7B's
# compiled blocks under block recompute without CUDA graphs: the plan then within 1 % of the
# steps' peak at 6 layers, 4k x 4 and 32k x 1, and 2.4 % at 16 layers, 64k; RESULTS.md, issues
# 41 and 42). On the CPU the backward frees them as it goes: its peak above its start stays
# under one block's activations (tests/test_plan.py), so CPU runs count one.
REMAT_BACKWARD = 2
DTYPE_BYTES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def element_bytes(run: RunConfig) -> tuple[int, int, int]:
    """``(b_p, b_c, b_o)``: bytes of a weight, of an autocast matmul output and of an optimizer
    state element."""
    return (
        DTYPE_BYTES[run.precision.params],
        DTYPE_BYTES[run.precision.compute],
        DTYPE_BYTES[run.precision.optimizer],
    )


def compiles(run: RunConfig) -> bool:
    """Whether the run's blocks are compiled: ``parallel.compile`` on the cluster's device."""
    return run.parallel.compile_on("cuda" if run.cluster.gpus_per_node else "cpu")


def tokens_per_micro_batch(run: RunConfig) -> int:
    """``T``: the tokens of one micro-batch a rank holds (under context parallelism a
    ``parallel.cp``-th of each sequence: every sequence-proportional part divides by cp)."""
    return run.train.micro_batch_size * run.train.seq_len // run.parallel.cp


def context_activation_bytes(run: RunConfig) -> int:
    """What one attention layer keeps beyond ``layer_activation_bytes`` under context
    parallelism (``parallel.cp`` > 1), per micro-batch: the keys and values gathered from the
    other ``cp - 1`` ranks, which the core keeps for backward, ``(cp - 1) T 2 d_kv b_c``; for
    latent attention the gathered compressed key-value (``cp T r_kv b_c``, the expansion's
    input) and the other ranks' expanded keys and key-value projection, ``(cp - 1) T b_c (q +
    n_heads (nope + v_head_dim))``; nothing under selective recompute, which gathers inside
    the recomputed part. 0 without context parallelism.

    With ``train.document_mask`` the varlen core keeps, instead of the gathered keys and values,
    those each of the rank's document segments picks from them (``context.context_varlen``):
    at most the whole row's and one chunk's more (one document spanning the row: each chunk
    picks its document's keys up to the chunk's end), so ``B c`` keys and values more, ``c =
    seq_len / (2 cp)``."""
    m, par = run.model, run.parallel
    cp = par.cp
    if cp == 1:
        return 0
    _, bc, _ = element_bytes(run)
    tokens = tokens_per_micro_batch(run)
    assert m.head_dim is not None
    picked = 0  # the keys a document mask's segments pick beyond the gathered ones
    if run.train.document_mask:
        picked = run.train.micro_batch_size * (run.train.seq_len // (2 * cp))
    if not m.latent:
        return ((cp - 1) * tokens + picked) * 2 * m.kv_heads * m.head_dim * bc
    if par.recompute == "selective":
        return 0
    assert m.qk_nope_head_dim is not None and m.v_head_dim
    assert m.kv_lora_rank is not None
    expanded = m.n_heads * m.head_dim + m.n_heads * (m.qk_nope_head_dim + m.v_head_dim)
    keys_values = m.n_heads * (m.head_dim + m.v_head_dim)  # what a segment picks, expanded
    return tokens * bc * ((cp - 1) * expanded + cp * m.kv_lora_rank) + picked * keys_values * bc


# --------------------------------------------------------------------------------------------
# parameters


@dataclass(frozen=True)
class ParameterCounts:
    """Parameter counts by place, read off meta-device blocks: an MoE block, a leading dense
    block (``model.n_dense_layers``; zeros without one) and the model's ends."""

    layer_dense: int  # an MoE block's attention, norms, router, shared expert
    layer_expert: int  # all routed experts of an MoE block
    largest_dense: int  # the largest dense tensor of an MoE block
    largest_expert: int  # the largest routed-expert tensor of an MoE block (all experts)
    dense_block: int  # a leading dense block: attention, norms, its SwiGLU (0: none)
    largest_dense_block: int  # its largest tensor (0: none)
    embedding: int
    head: int  # LM head; 0 when tied (the embedding is the head: one parameter, counted once)
    final_norm: int
    mtp_own: int = 0  # an MTP module's parameters beside its block (norms, eh_proj; 0: none)
    largest_mtp_own: int = 0  # the largest of those (eh_proj)


def parameter_counts(m: ModelConfig) -> ParameterCounts:
    """Counts of one MoE block and the ends, from a one-layer model of MoE blocks only (the
    leading dense blocks left out, so any ``n_dense_layers`` builds), and of one dense block."""
    ends_only = dataclasses.replace(m, n_layers=1, n_dense_layers=0, dense_hidden=None)
    with on_meta():
        model = Transformer(ends_only)
        dense_block = Block(m, 0) if m.n_dense_layers else None
    block = model.layers["0"]
    experts = [p for mod in block.modules() if isinstance(mod, Experts) for p in mod.parameters()]
    expert_ids = {id(p) for p in experts}
    dense = [p for p in block.parameters() if id(p) not in expert_ids]
    leading = [p.numel() for p in dense_block.parameters()] if dense_block is not None else [0]
    assert model.embed is not None and model.norm is not None
    own = [0]
    if model.mtp is not None:
        params = model.mtp["0"].named_parameters()
        own = [p.numel() for n, p in params if not n.startswith("block.")]
    return ParameterCounts(
        layer_dense=sum(p.numel() for p in dense),
        layer_expert=sum(p.numel() for p in experts),
        largest_dense=max(p.numel() for p in dense),
        largest_expert=max(p.numel() for p in experts),
        dense_block=sum(leading),
        largest_dense_block=max(leading),
        embedding=model.embed.weight.numel(),
        head=model.lm_head.weight.numel() if model.lm_head is not None else 0,
        final_norm=model.norm.weight.numel(),
        mtp_own=sum(own),
        largest_mtp_own=max(own),
    )


def chunk_blocks(m: ModelConfig, par: ParallelConfig, chunk: int) -> tuple[int, int]:
    """``(dense, moe)``: how many leading dense blocks and MoE blocks model chunk ``chunk``
    holds (its global layers: ``parallel.pipeline.chunk_layers``)."""
    layers = chunk_layers(m.n_layers, par.pp * par.virtual_stages, chunk)
    dense = max(0, min(layers.stop, m.n_dense_layers) - layers.start)
    return dense, len(layers) - dense


@dataclass(frozen=True)
class StageParameters:
    """What one rank of a pipeline stage holds: its chunks' layers and their parameters."""

    chunks: list[int]  # the model chunks this rank runs (``v`` of them under interleaving)
    blocks: list[tuple[int, int]]  # each chunk's (dense, MoE) blocks (``chunk_blocks``)
    layers: int
    moe_layers: int  # the MoE blocks among them (the rest are leading dense blocks), MTP's too
    dense: int  # dense parameters, with the embedding / final norm and head where it has them
    experts: int  # its routed experts: 1 / ep of the stage's
    largest: int  # the largest single tensor (of experts, this rank's slice)
    last: bool  # holds the LM head


def stage_parameters(run: RunConfig, sh: ParameterCounts, stage: int) -> StageParameters:
    par = run.parallel
    n_chunks = par.pp * par.virtual_stages
    chunks = rank_chunks(par, stage)
    blocks = [chunk_blocks(run.model, par, c) for c in chunks]
    dense_blocks = sum(n for n, _ in blocks)
    moe_blocks = sum(n for _, n in blocks)
    dense = moe_blocks * sh.layer_dense + dense_blocks * sh.dense_block
    largest = 0
    if moe_blocks:
        largest = max(sh.largest_dense, sh.largest_expert // par.ep)
    if dense_blocks:
        largest = max(largest, sh.largest_dense_block)
    if 0 in chunks:
        dense += sh.embedding
        largest = max(largest, sh.embedding)
    last = n_chunks - 1 in chunks
    if last:
        dense += sh.final_norm + sh.head
        largest = max(largest, sh.head)
        mtp = run.model.mtp_depth  # MoE blocks with their own norms and projection
        if mtp:
            moe_blocks += mtp
            dense += mtp * (sh.layer_dense + sh.mtp_own)
            largest = max(largest, sh.largest_dense, sh.largest_expert // par.ep)
            largest = max(largest, sh.largest_mtp_own)
    experts = moe_blocks * sh.layer_expert // par.ep
    layers = dense_blocks + moe_blocks
    return StageParameters(chunks, blocks, layers, moe_blocks, dense, experts, largest, last)


# --------------------------------------------------------------------------------------------
# gradients and optimizer state


def fp8_copy_bytes(run: RunConfig, p: StageParameters) -> int:
    """The FP8 copies of the rank's expert weights (module doc): E4M3 by rows and by columns,
    one byte each per element, and their fp32 scales (per row of ``w_gate_up`` [E, 2h, d] and
    ``w_down`` [E, d, h], and per column)."""
    prec, m = run.precision, run.model
    if not prec.fp8_weight_cache or "experts" not in prec.fp8_parts:
        return 0
    local = m.n_experts // run.parallel.ep
    scales = 4 * local * (3 * m.expert_hidden + 2 * m.d_model)
    return 2 * p.experts + p.moe_layers * scales


def autograd_keeps_gradients(run: RunConfig) -> bool:
    """A rank that reduces nothing keeps autograd's gradients (one micro-batch, or gradients
    already in the optimizer's dtype) instead of the buffers of ``parallel.ddp``."""
    bp, _, bo = element_bytes(run)
    return reduce_groups(run.parallel).dense == 1 and (run.micro_batches == 1 or bp == bo)


def gradients_follow_activations(run: RunConfig) -> bool:
    """Autograd's gradients of one micro-batch: written while backward frees the activations,
    so the peak holds the larger of the two, not their sum."""
    return autograd_keeps_gradients(run) and run.micro_batches == 1


def gradient_bytes(run: RunConfig, p: StageParameters) -> tuple[float, int]:
    """The gradient buffers (with the reduced shard) and the transient gradient of the largest
    parameter."""
    bp, _, bo = element_bytes(run)
    if autograd_keeps_gradients(run):
        return bp * (p.dense + p.experts), 0
    groups = reduce_groups(run.parallel)
    dense_shard = p.dense / groups.dense if groups.dense > 1 else 0
    expert_shard = p.experts / groups.expert if groups.expert > 1 else 0
    return bo * (p.dense + p.experts) + bo * (dense_shard + expert_shard), p.largest * bp


def optimizer_bytes(run: RunConfig, p: StageParameters) -> float:
    """ZeRO-1 state: two moments (and an fp32 master for weights less precise than the state)
    over the dense group ``dp x ep`` and the expert group ``dp``."""
    bp, _, bo = element_bytes(run)
    state_bytes = 2 * bo + (4 if bp < bo else 0)
    groups = reduce_groups(run.parallel)
    return state_bytes * (p.dense / groups.dense + p.experts / groups.expert)


# --------------------------------------------------------------------------------------------
# activations


def attention_activation_bytes(
    m: ModelConfig, bp: int, bc: int, compiled: bool, selective: bool = False
) -> int:
    """What every block keeps per token for its norms, attention and RoPE tables (the part
    dense and MoE blocks share; ``layer_activation_bytes`` gives the terms)."""
    if m.latent:
        return latent_attention_activation_bytes(m, bp, bc, compiled, selective)
    assert m.head_dim is not None
    d, q, kv = m.d_model, m.n_heads * m.head_dim, m.kv_heads * m.head_dim
    qk = q + kv if m.qk_norm != "none" else 0  # what QK-norm normalizes
    stats = {"none": 0, "projection": 2, "head": m.n_heads + m.kv_heads}[m.qk_norm]
    scalars = 4 * (2 + stats)  # each norm's fp32 1/rms, per row it normalizes
    if compiled:
        norms = 3 * d * bp + qk * bc + scalars
    else:
        norms = 2 * d * (4 + bp) + qk * (4 + bc) + scalars
    attention = bc * (d + 2 * q + 2 * kv) + 4 * m.n_heads
    if m.rotary_dim < m.head_dim:  # partial RoPE: the o-projection's input is a copy
        attention += bc * q
    rope = 4 * m.rotary_dim * bc if bc < 4 and not compiled else 0
    return norms + attention + rope


def latent_attention_activation_bytes(
    m: ModelConfig, bp: int, bc: int, compiled: bool, selective: bool = False
) -> int:
    """``attention_activation_bytes`` for multi-head latent attention, per token, with ``r_q``
    (``q_lora_rank``; 0 for a full-rank query), ``r_kv`` (``kv_lora_rank``), ``r`` (the rotary
    dims), ``q = n_heads (nope + r)``, ``v = n_heads v_head_dim``: the block norms as there;
    each latent norm keeps its input, an fp32 normalized copy and its output, the key-value
    one's input being the whole compressed projection (``r_kv + r`` wide): ``(r_q + r_kv)
    (4 + 2 b_c) + r b_c`` eagerly, only the inputs compiled; the core keeps the projections'
    input, the full q and k (k's rotary part broadcast into every head), the expanded key-value
    projection whose slice v is (``n_heads (nope + v_head_dim)``), the output (token-major: the
    o-projection's input too) and the log-sum-exp: ``b_c (d + 2 q + n_heads (nope + v_head_dim)
    + v) + 4 n_heads``; bf16 RoPE tables as there. Under selective recompute
    (``LatentAttention.attend`` runs again in backward) the core keeps the projections' input, q,
    the rotated rotary key and the output, ``b_c (d + q + rope + v)``: not the expanded keys and
    values. Autograd keeps exactly this on the CPU where query and value heads are equally wide
    (tests/test_plan.py; unequal ones take the CPU's math SDPA, the GPU's FlashAttention 4 or
    cuDNN keep the same as equal ones)."""
    assert m.qk_rope_head_dim is not None and m.v_head_dim is not None and m.head_dim
    assert m.qk_nope_head_dim is not None and m.kv_lora_rank is not None
    d, r, H = m.d_model, m.qk_rope_head_dim, m.n_heads
    q, v = H * m.head_dim, H * m.v_head_dim
    latent = (m.q_lora_rank or 0) + m.kv_lora_rank
    scalars = 4 * (2 + 1 + (m.q_lora_rank is not None))  # each norm's 1/rms per token
    if compiled:
        norms = 3 * d * bp + (latent + r) * bc + scalars
    else:
        norms = 2 * d * (4 + bp) + latent * (4 + 2 * bc) + r * bc + scalars
    attention = bc * (d + 2 * q + H * (m.qk_nope_head_dim + m.v_head_dim) + v) + 4 * H
    if selective:
        attention = bc * (d + q + r + v)
    tables = 4 * r * bc if bc < 4 and not compiled else 0
    return norms + attention + tables


def layer_activation_bytes(
    m: ModelConfig,
    param_dtype: str,
    compute_dtype: str,
    recompute: str = "none",
    *,
    expert_rows_in: bool = True,
    expert_swiglu_out: bool = True,
    compiled: bool = False,
) -> int:
    """Bytes one MoE block keeps for backward per token (no recompute, or selective), run
    eagerly or, with ``compiled``, as ``torch.compile``'s block (``parallel.compile``).

    ``b_p`` (hidden states, experts: they run in the weights' dtype), ``b_c`` (autocast matmul
    outputs), ``d`` the model width, ``q = n_heads * head_dim`` and ``d_kv = kv_heads *
    head_dim`` the query and key/value widths, ``n_qk`` what QK-norm normalizes (``q + d_kv``,
    over the projection or per head; 0 without QK-norm); per token:

    - the two block norms keep an fp32 copy of their input and the normalized output, QK-norm
      the same of q and k, and every norm an fp32 ``1/rms`` per row it normalizes (one per token
      for a block norm and a projection's norm, one per head for a per-head norm):
      ``2 d (4 + b_p) + n_qk (4 + b_c) + 4 s`` with ``s`` those rows (2, plus 2 over the
      projection, ``n_heads + kv_heads`` per head);
    - attention keeps the projections' input, rotated q and k, v and its output (which is the
      o-projection's input): ``b_c (d + 2 q + 2 d_kv) + 4 n_heads`` (log-sum-exp); biases keep
      nothing more; partial RoPE (``rotary_dim < head_dim``) concatenates the rotated and the
      passed dimensions into a head-major q, so the attention's output is head-major too and
      the o-projection keeps a copy of it, ``b_c q`` more (measured on the CPU's SDPA; an upper
      bound for a core whose output is token-major whatever its input, FlashAttention 4);
    - the router keeps its fp32 input, logits, scores and choices: ``4 d + 12 E + 20 k``; with
      group-limited routing (``n_expert_groups = G > 1``) also each group's two best experts
      and the mask of dropped groups, ``17 G``;
    - routed experts keep rows in, gate+up out and SwiGLU out, plus each row's fp32 router
      weight (applied in the SwiGLU, so the plain-sum combine keeps no rows out):
      ``b_p k (d + 3 h) + 4 k``, less ``b_p k h`` under selective recompute or where the path
      keeps no SwiGLU out (``expert_swiglu_out=False``), less ``b_p (k - 1) d`` where it keeps
      no expert-ordered rows in but one copy of the tokens with a zero row for padding slots
      (``expert_rows_in=False``); see ``expert_activations``;
    - a shared expert of width ``h_s`` keeps gate, up, SwiGLU and product, ``4 b_c h_s``, and
      its input, ``b_c d``, unless that is the router's fp32 input already (all fp32).

    - under bf16 autocast each layer keeps its own bf16 copies of the RoPE cos/sin tables for q
      and k, ``4 rotary_dim b_c`` per token of a one-sequence micro-batch (an upper bound; the
      fp32 tables are one copy for the whole model).
    ``recompute="block"`` is accounted by the caller (a block then keeps only its input).

    A compiled block keeps less around its norms and router (measured on one H200 within 0.3 %
    for OLMoE-1B-7B's layer, RESULTS.md, issue 21): each norm keeps its input, not an fp32 copy,
    and recomputes what it normalized, so the norms keep the two residual inputs ``2 d b_p``,
    the MoE norm's output (the router's and dispatch's input) ``d b_p`` and q and k before
    their norms ``n_qk b_c``, plus ``4 s``; the router keeps ``12 E + 20 k`` (its input is
    that output, plus ``17 G`` when group-limited); RoPE's tables are recomputed, not kept.
    Attention, experts and the shared expert keep what they keep eagerly.
    """
    if recompute not in ("none", "selective", "block"):
        raise ConfigError(
            f"recompute={recompute!r} is not allowed: one of 'none', 'selective', 'block'."
        )
    bp, bc = DTYPE_BYTES[param_dtype], DTYPE_BYTES[compute_dtype]
    d, h, k, e = m.d_model, m.expert_hidden, m.top_k, m.n_experts
    h_shared = m.n_shared_experts * h
    groups = 17 * m.n_expert_groups if m.n_expert_groups > 1 else 0
    router = (0 if compiled else 4 * d) + 12 * e + 20 * k + groups
    experts = bp * k * (d + 3 * h) + 4 * k
    if recompute == "selective" or not expert_swiglu_out:
        experts -= bp * k * h
    if not expert_rows_in:
        experts -= bp * (k - 1) * d
    shared_input = 0 if bp == bc == 4 else bc * d
    shared = bc * 4 * h_shared + shared_input if h_shared else 0
    selective = recompute == "selective"
    return attention_activation_bytes(m, bp, bc, compiled, selective) + router + experts + shared


def dense_layer_activation_bytes(
    m: ModelConfig,
    param_dtype: str,
    compute_dtype: str,
    recompute: str = "none",
    *,
    compiled: bool = False,
) -> int:
    """Bytes one leading dense block keeps for backward per token (no recompute, or selective,
    which touches only its latent attention's core): the norms, attention and RoPE
    tables of an MoE block (``layer_activation_bytes``), and its SwiGLU of ``dense_hidden =
    h_d`` keeps gate, up, SwiGLU and product, ``4 b_c h_d``, and its input, ``b_c d`` (no
    router shares it). Compiled, the block recomputes its MLP norm from the residual input it
    keeps (no router or dispatch reads that norm's output), so neither the output, ``d b_p`` of
    the norms' count, nor the MLP's input is kept. 0 for a model without dense blocks."""
    if not m.n_dense_layers:
        return 0
    assert m.dense_hidden is not None
    bp, bc = DTYPE_BYTES[param_dtype], DTYPE_BYTES[compute_dtype]
    mlp_input = -bp * m.d_model if compiled else bc * m.d_model
    mlp = 4 * bc * m.dense_hidden + mlp_input
    selective = recompute == "selective"
    return attention_activation_bytes(m, bp, bc, compiled, selective) + mlp


def max_in_flight(par: ParallelConfig, pp_rank: int, micro_batches: int) -> int:
    """The most chunk-forwards of ``pp_rank`` whose backward has not run yet (its schedule)."""
    if par.pp == 1:
        return 1
    live = peak = 0
    for action in schedule(par, pp_rank, micro_batches):
        live += 1 if action.kind == "F" else -1
        peak = max(peak, live)
    return peak


def expert_activations(run: RunConfig) -> dict[str, bool]:
    """Which of its rows in and SwiGLU out a layer's routed experts keep for backward, by the
    path the run takes (``layer_activation_bytes``' keywords; ``experts_keep``)."""
    par, prec = run.parallel, run.precision
    quack_bf16 = par.expert_gemm == "quack" and prec.params == "bf16"
    fp8_experts = "experts" in prec.fp8_parts
    local_rowwise = fp8_experts and prec.fp8_scaling == "rowwise" and par.ep == 1
    return experts_keep(fp8_experts, quack_bf16, par.gather_rows, local_rowwise)


def experts_keep(
    fp8_experts: bool,
    quack_bf16: bool = False,
    gather_rows: bool = False,
    fp8_in_permute: bool = False,
) -> dict[str, bool]:
    """With ``parallel.gather_rows`` (bf16 experts) the gate+up GEMM reads the token rows, so
    no expert-ordered copy is kept (one of the tokens with a zero row appended, where slots are
    padded); nor with FP8 experts with rowwise scales on one EP rank (``fp8_in_permute``:
    ``moe_kernels.fp8.fp8_routed_mlp`` quantizes in the permute, keeps the tokens and permutes
    them again in backward); under EP counted kept: the all-to-all receiver's op keeps the
    rows it received, fewer than k a token (an upper bound), the rowwise one a permuted copy
    (with FP8 token rows, the rows it received, as the all-to-all's).
    FP8 experts and the fused bf16 MLP (``moe_kernels.expert_mlp``: ``parallel.expert_gemm=quack``
    with bf16 weights, not gathering) keep no SwiGLU output. ``expert_gemm=auto`` is counted
    unfused: whether QuACK is installed is a property of the machine that runs, not of the
    plan (an upper bound)."""
    gathers = gather_rows and not fp8_experts
    fused = fp8_experts or (quack_bf16 and not gathers)
    return {"expert_rows_in": not (gathers or fp8_in_permute), "expert_swiglu_out": not fused}


@dataclass(frozen=True)
class RowwiseBuffers:
    """What the rowwise dispatcher adds to a rank (all 0 for the exact-size dispatchers)."""

    symmetric: int  # the symmetric staging of its receive buffers
    extra_full: int  # activation bytes of one layer's expert-ordered rows past the ``T k``
    extra_layer: int  # the same under the run's recompute (selective keeps no SwiGLU input)


def rowwise_buffers(run: RunConfig) -> RowwiseBuffers:
    m, par = run.model, run.parallel
    if not par.rowwise_ep:
        return RowwiseBuffers(0, 0, 0)
    bp, _, _ = element_bytes(run)
    tokens = tokens_per_micro_batch(run)
    rows_cap, assign_cap = rowwise_capacity(
        m.n_experts,
        m.top_k,
        par.ep,
        tokens,
        par.ep_capacity_factor,
        m.n_expert_groups,
        m.top_k_groups,
    )
    fp8_rows = "dispatch" in run.precision.fp8_parts
    symmetric = RowwiseExchange.buffer_bytes(
        par.ep, rows_cap, m.d_model, m.top_k, DTYPES[run.precision.params], fp8_rows
    )
    more_rows = assign_cap - tokens * m.top_k
    swiglu_out = expert_activations(run)["expert_swiglu_out"]  # gather_rows needs ep = 1
    extra_full = more_rows * (bp * (m.d_model + (2 + swiglu_out) * m.expert_hidden) + 4)
    extra_layer = extra_full - more_rows * bp * m.expert_hidden * (
        swiglu_out and par.recompute == "selective"
    )
    return RowwiseBuffers(symmetric, extra_full, extra_layer)


def mtp_activation_bytes(run: RunConfig, a_layer: int, extra_layer: int) -> int:
    """What the MTP depths keep for backward per micro-batch (module doc): each an MoE block
    (``a_layer`` per token, ``extra_layer`` of rowwise rows), the head's share and its norms'
    and projection's inputs."""
    m = run.model
    if not m.mtp_depth:
        return 0
    bp, bc, _ = element_bytes(run)
    tokens = tokens_per_micro_batch(run)
    own = tokens * m.d_model * (2 * (4 + bp) + 2 * bc)
    per_depth = tokens * a_layer + extra_layer + head_activation_bytes(run) + own
    return m.mtp_depth * per_depth


def head_activation_bytes(run: RunConfig) -> int:
    """The LM head's logits, their fp32 copy and log-softmax, and the head's inputs; compiled,
    the logits and their gradient, and the final norm's input and output (module doc)."""
    m = run.model
    bp, bc, _ = element_bytes(run)
    if compiles(run):
        return tokens_per_micro_batch(run) * (2 * m.vocab_size * bc + m.d_model * (bp + bc))
    return tokens_per_micro_batch(run) * (m.vocab_size * (bc + 8) + m.d_model * (4 + bp + bc))


def recomputed_block_bytes(run: RunConfig, p: StageParameters, in_flight: int) -> int:
    """Under block recompute, what backward holds at a rematerialized block beside the weights'
    gradients written so far: every block's kept input, and the block's activations with, on a
    GPU, about as many bytes again of their gradients (``REMAT_BACKWARD``); 0 without block
    recompute."""
    m, par, prec = run.model, run.parallel, run.precision
    if par.recompute != "block":
        return 0
    bp, _, _ = element_bytes(run)
    tokens = tokens_per_micro_batch(run)
    kept = {**expert_activations(run), "compiled": compiles(run)}
    gathered = context_activation_bytes(run)
    a_full = layer_activation_bytes(m, prec.params, prec.compute, "none", **kept)
    dense_full = (
        tokens
        * dense_layer_activation_bytes(m, prec.params, prec.compute, compiled=kept["compiled"])
        + gathered
    )
    # one block rematerialized at a time: the largest kind the stage holds
    remat = max(
        tokens * a_full + rowwise_buffers(run).extra_full + gathered if p.moe_layers else 0,
        dense_full if p.layers > p.moe_layers else 0,
    )
    per_chunk = m.n_layers // (par.pp * par.virtual_stages)
    again = REMAT_BACKWARD if run.cluster.gpus_per_node else 1
    return in_flight * per_chunk * tokens * m.d_model * bp + again * remat


def activation_bytes(run: RunConfig, p: StageParameters, in_flight: int) -> int:
    """What a stage's pending forwards keep for backward, at its peak: ``in_flight`` forwards
    of its largest chunk (exact with one chunk per rank; with interleaving, whose chunks may
    differ by their leading dense blocks, an upper bound)."""
    m, par, prec = run.model, run.parallel, run.precision
    bp, _, _ = element_bytes(run)
    tokens = tokens_per_micro_batch(run)
    per_chunk = m.n_layers // (par.pp * par.virtual_stages)
    if par.recompute == "block":
        # backward's two phases: the head's, beside the blocks' kept inputs, then one block at a
        # time rematerialized (``recomputed_block_bytes``)
        kept_inputs = in_flight * per_chunk * tokens * m.d_model * bp
        head = head_activation_bytes(run) + mtp_activation_bytes(run, m.d_model * bp, 0)
        return max(kept_inputs + (head if p.last else 0), recomputed_block_bytes(run, p, in_flight))
    rowwise = rowwise_buffers(run)
    kept = {**expert_activations(run), "compiled": compiles(run)}
    gathered = context_activation_bytes(run)  # every block's attention, each layer
    a_layer = layer_activation_bytes(m, prec.params, prec.compute, par.recompute, **kept)
    dense_layer = (
        tokens
        * dense_layer_activation_bytes(
            m, prec.params, prec.compute, par.recompute, compiled=kept["compiled"]
        )
        + gathered
    )
    chunk = max(
        n_moe * (tokens * a_layer + rowwise.extra_layer + gathered) + n_dense * dense_layer
        for n_dense, n_moe in p.blocks
    )
    acts = in_flight * chunk
    if p.last:
        acts += head_activation_bytes(run) + mtp_activation_bytes(run, a_layer, rowwise.extra_layer)
    return acts


# --------------------------------------------------------------------------------------------
# a stage's peak


def pipeline_send_bytes(run: RunConfig, p: StageParameters) -> int:
    """The messages a stage sends in a step (hidden states + the running aux loss forward,
    their gradients backward), held until the step ends."""
    par = run.parallel
    if par.pp == 1:
        return 0
    n_chunks = par.pp * par.virtual_stages
    carried = 2 if run.model.mtp_depth else 1  # hidden states, and the embeddings for MTP
    hidden = tokens_per_micro_batch(run) * run.model.d_model * element_bytes(run)[0]
    message = carried * hidden + 4
    messages = sum(c < n_chunks - 1 for c in p.chunks) + sum(c > 0 for c in p.chunks)
    return messages * run.micro_batches * message


def runtime_reserve(run: RunConfig) -> int:
    return round(RUNTIME_RESERVE_GIB * GIB) if run.cluster.gpus_per_node else 0


@dataclass(frozen=True)
class StageMemory:
    """Peak memory of one rank of pipeline stage ``stage`` (bytes)."""

    stage: int
    layers: int
    dense_params: int
    expert_params: int  # this rank's experts (1 / ep of the stage's)
    in_flight: int
    weights: int  # with the experts' FP8 copies (``fp8_copies``)
    gradients: int  # every gradient byte the rank holds after backward
    grad_buffers: int  # those alive at the peak (``gradients``, or beyond the activations)
    optimizer: int
    activations: int
    p2p_buffers: int
    transient: int
    reserve: int
    ep_buffers: int = 0  # symmetric receive buffers of the rowwise dispatcher
    moe_layers: int = 0  # its MoE blocks (the all-to-all's layers); the rest are dense blocks
    grads_follow_activations: bool = False  # grad_buffers: only those beyond the activations
    compiled: bool = False  # activations of compiled blocks
    fp8_copies: int = 0  # of ``weights``: the expert weights' FP8 copies (``fp8_copy_bytes``)

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


def stage_memory(run: RunConfig, sh: ParameterCounts, stage: int) -> StageMemory:
    """The peak of one rank of pipeline stage ``stage``, part by part."""
    p = stage_parameters(run, sh, stage)
    in_flight = max_in_flight(run.parallel, stage, run.micro_batches)
    activations = activation_bytes(run, p, in_flight)
    grads, transient = gradient_bytes(run, p)
    follow = gradients_follow_activations(run)
    # autograd's gradients of one micro-batch free no activation under block recompute: by the
    # last block's backward they are nearly all written, beside its rematerialized activations
    beside = recomputed_block_bytes(run, p, in_flight) if follow else 0
    return StageMemory(
        stage=stage,
        layers=p.layers,
        dense_params=p.dense,
        expert_params=p.experts,
        in_flight=in_flight,
        weights=(p.dense + p.experts) * element_bytes(run)[0] + fp8_copy_bytes(run, p),
        gradients=round(grads),
        grad_buffers=round(max(0, grads - (activations - beside)) if follow else grads),
        optimizer=round(optimizer_bytes(run, p)),
        activations=activations,
        p2p_buffers=pipeline_send_bytes(run, p),
        transient=transient,
        reserve=runtime_reserve(run),
        ep_buffers=rowwise_buffers(run).symmetric,
        moe_layers=p.moe_layers,
        grads_follow_activations=follow,
        compiled=compiles(run),
        fp8_copies=fp8_copy_bytes(run, p),
    )
