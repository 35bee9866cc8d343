"""Build this rank's share of the model: its pipeline chunks, its experts, its dispatcher.

Chunks are constructed on the meta device, pruned to their layers and local experts, then
allocated and initialized; ``Transformer.init_weights`` seeds every tensor (every expert) by its
global name, so each shard holds exactly the values of the single-process model. Under expert
parallelism every MoE layer gets the configured dispatcher; the rowwise ones share one set of
symmetric receive buffers (the layers use them one at a time).
"""

from __future__ import annotations

import torch

from moe_core.config import (
    ConfigError,
    ModelConfig,
    OptionNotImplementedError,
    ParallelConfig,
    PrecisionConfig,
)
from moe_core.model import Transformer
from moe_core.model.attention import flash4_installed
from moe_core.model.context import ContextShard
from moe_core.model.dtypes import DTYPES
from moe_core.model.fp8 import apply_fp8, attach_fp8_caches
from moe_core.model.kernel_choice import Kernels
from moe_core.model.meta import on_meta
from moe_core.model.moe import Experts, MoE
from moe_core.model.transformer import apply_context, apply_kernels
from moe_core.parallel.compile import apply_compile
from moe_core.parallel.dispatch import (
    AllToAllDispatcher,
    RowwiseDispatcher,
    RowwiseExchange,
    rowwise_capacity,
)
from moe_core.parallel.mesh import Mesh
from moe_core.parallel.pipeline import chunk_layers, rank_chunks
from moe_core.parallel.recompute import apply_recompute
from moe_core.parallel.symmetric import symmetric_heap
from moe_kernels.grouped_gemm import quack_installed


def choose_kernels(
    pcfg: ParallelConfig, precision: PrecisionConfig, device: torch.device
) -> Kernels:
    """The model's kernel choice for this run's device, resolved once (``parallel.expert_gemm``,
    ``parallel.attention``, ``parallel.gather_rows``, FP8 experts from ``precision``); a library
    asked for by name, or FP8 (``precision.fp8_parts``), that cannot run here is refused in one
    sentence. (FP8 on the CPU runs its emulation: the dequantized product.)"""
    gpu = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    if pcfg.expert_gemm == "quack" and not (gpu and quack_installed()):
        raise ConfigError(
            "parallel.expert_gemm='quack' needs quack-kernels (pip install -e '.[gpu]') and a "
            f"Hopper or newer GPU, which this {device.type} run lacks; use 'auto' or 'torch'."
        )
    if pcfg.attention == "flash4" and not (gpu and flash4_installed()):
        raise ConfigError(
            "parallel.attention='flash4' needs flash-attn-4 (pip install -e '.[gpu]') and a "
            f"Hopper or newer GPU, which this {device.type} run lacks; use 'auto' or 'sdpa'."
        )
    if pcfg.attention == "flex" and device.type != "cuda":
        raise ConfigError(
            "parallel.attention='flex' needs a CUDA GPU (torch's FlexAttention has no backward "
            f"on the CPU), which this {device.type} run lacks; use 'auto' or 'sdpa'."
        )
    if precision.fp8_parts and device.type == "cuda" and not gpu:
        raise ConfigError(
            f"precision.fp8_parts={list(precision.fp8_parts)} needs FP8 tensor cores (Hopper or "
            "newer), which this GPU lacks; use precision=pure-bf16."
        )
    if precision.fp8_parts and precision.fp8_scaling == "mx" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 10:
            raise ConfigError(
                f"precision.fp8_scaling='mx' (precision=mxfp8) needs MX tensor cores (sm_100, "
                f"Blackwell, or newer), which this sm_{major}{minor} GPU lacks; use "
                "precision=fp8 (rowwise scales)."
            )
        raise OptionNotImplementedError(
            "precision.fp8_scaling='mx' (precision=mxfp8) on a GPU is not built yet: its "
            "numerics run emulated on CPU, and the Blackwell GEMM path awaits a machine to "
            "measure it on; use precision=fp8."
        )
    attention = pcfg.attention
    if attention == "auto":
        attention = "flash4" if gpu and flash4_installed() else "sdpa"
    return Kernels(
        gemm=pcfg.expert_gemm,
        attention=attention,
        gather_rows=pcfg.gather_rows,
        fp8_experts="experts" in precision.fp8_parts,
        fp8_scaling=precision.fp8_scaling,
        fp8_fast_accum=precision.fp8_fast_accum,
    )


def rowwise_exchange(
    cfg: ModelConfig,
    pcfg: ParallelConfig,
    mesh: Mesh,
    tokens: int,
    dtype: torch.dtype,
    fp8_rows: bool = False,
) -> RowwiseExchange:
    """The symmetric receive buffers of this rank's rowwise dispatchers, for ``tokens`` rows of
    ``dtype`` (the weights') per micro-batch, sent as E4M3 with ``fp8_rows`` (collective over
    the expert-parallel group)."""
    rows, assignments = rowwise_capacity(
        cfg.n_experts,
        cfg.top_k,
        pcfg.ep,
        tokens,
        pcfg.ep_capacity_factor,
        cfg.n_expert_groups,
        cfg.top_k_groups,
    )
    heap = symmetric_heap(mesh.ep_group, mesh.device)
    return RowwiseExchange(heap, rows, assignments, cfg.d_model, cfg.top_k, dtype, fp8_rows)


def build_chunk(
    cfg: ModelConfig,
    pcfg: ParallelConfig,
    chunk: int,
    mesh: Mesh,
    exchange: RowwiseExchange | None = None,
    fp8_rows: bool = False,
) -> Transformer:
    """Chunk ``chunk`` of ``pp x virtual_stages``, with this rank's experts, on the meta device
    (``exchange``: the rowwise dispatchers' buffers, when that is the dispatcher; ``fp8_rows``:
    the all-to-all sends token rows in FP8)."""
    n_chunks = pcfg.pp * pcfg.virtual_stages
    with on_meta():
        model = Transformer(cfg)
    keep = {str(i) for i in chunk_layers(cfg.n_layers, n_chunks, chunk)}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if chunk != 0:
        model.embed = None
    if chunk != n_chunks - 1:
        model.norm = None
        model.lm_head = None
        model.mtp = None  # beside the LM head they share
    if pcfg.ep > 1:
        n_local = cfg.n_experts // pcfg.ep
        for where, moe in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
            with on_meta():
                moe.experts = Experts(n_local, cfg.d_model, cfg.expert_hidden)
            moe.experts.expert_offset = mesh.ep_rank * n_local
            if exchange is not None:
                moe.dispatcher = RowwiseDispatcher(exchange, n_local)
            else:
                moe.dispatcher = AllToAllDispatcher(mesh.ep_group, pcfg.ep, n_local, fp8_rows)
            moe.dispatcher.where = where  # type: ignore[attr-defined]
    return model


def parallelize(
    cfg: ModelConfig,
    pcfg: ParallelConfig,
    precision: PrecisionConfig,
    mesh: Mesh,
    seed: int,
    tokens: int,
    seq_len: int | None = None,
) -> dict[int, Transformer]:
    """This rank's chunks by global chunk id, allocated on ``mesh.device`` and initialized, in
    ``precision`` (``tokens``: this rank's per micro-batch, which sizes the rowwise dispatcher's
    buffers; ``seq_len``: the sequences' length, which ``parallel.cp > 1`` splits)."""
    kernels = choose_kernels(pcfg, precision, mesh.device)
    dtype = DTYPES[precision.params]
    exchange = None
    fp8_rows = "dispatch" in precision.fp8_parts
    if pcfg.rowwise_ep:
        exchange = rowwise_exchange(cfg, pcfg, mesh, tokens, dtype, fp8_rows)
    chunks: dict[int, Transformer] = {}
    for c in rank_chunks(pcfg, mesh.pp_rank):
        model = build_chunk(cfg, pcfg, c, mesh, exchange, fp8_rows)
        model.to_empty(device=mesh.device)
        model.init_weights(seed)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        apply_kernels(model, kernels)
        if pcfg.cp > 1:
            assert seq_len is not None, "context parallelism splits sequences of a known length"
            apply_context(model, ContextShard(pcfg.cp, mesh.cp_rank, seq_len, mesh.cp_group))
        apply_fp8(model, precision.fp8_parts, mesh.device, precision.fp8_fast_accum)
        compiled = pcfg.compile_on(mesh.device.type)
        if precision.fp8_weight_cache:
            attach_fp8_caches(model, precision.fp8_parts, precision.fp8_scaling, compiled)
        apply_recompute(model, pcfg.recompute)
        if pcfg.compile_on(mesh.device.type):
            apply_compile(model)
        chunks[c] = model
    return chunks
