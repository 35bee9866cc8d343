"""The MoE feed-forward: router, stacked experts, token dispatch, optional shared expert.

Everything on the forward and backward path keeps shapes static and reads nothing back to the
host, so a GPU step needs no synchronization (the grouped-GEMM fallback aside, see kernels).
Expert parallelism swaps ``MoE.dispatcher`` from outside; the layer itself knows nothing of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from moe_core.config import ModelConfig
from moe_core.model.eager import eager
from moe_core.model.kernel_choice import Kernels
from moe_kernels.expert_mlp import expert_mlp, fuses
from moe_kernels.fp8 import fp8_expert_mlp, fp8_routed_mlp
from moe_kernels.fp8_cache import cached_operands
from moe_kernels.grouped_gemm import gathered_grouped_mm, gathers_in_gemm, grouped_mm
from moe_kernels.routing import expert_counts, expert_slots
from moe_kernels.slot_permute import permute_to_slots, slot_tokens, slot_weights, sum_from_slots
from moe_kernels.swiglu import swiglu

# A plain global rather than a ContextVar: torch.compile traces (and guards on) globals, and a
# recompute re-runs forwards inside backward while the training loop waits for it.
_record_stats = True


@contextlib.contextmanager
def router_stats_paused() -> Iterator[None]:
    """Forward passes inside do not add to router statistics (used by activation recompute)."""
    global _record_stats
    previous, _record_stats = _record_stats, False
    try:
        yield
    finally:
        _record_stats = previous


def router_stats_recording() -> bool:
    """Whether forward passes add to routing statistics now (false inside
    ``router_stats_paused``: recompute and evaluation); dispatchers keeping counts ask it."""
    return _record_stats


@dataclass
class Routing:
    """One layer's routing decision for T tokens."""

    experts_TK: torch.Tensor  # int64 expert id per (token, choice)
    weights_TK: torch.Tensor  # fp32 combine weight per (token, choice)
    counts_E: torch.Tensor  # int64 assignments per expert
    aux_loss: torch.Tensor  # fp32 scalar: aux_loss_coef * lb_loss + z_loss_coef * z_loss


def load_balancing_loss(probs_TE: torch.Tensor, counts_E: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch-style ``E * sum_e f_e * P_e``: f_e the share of assignments routed to e (no grad),
    P_e the mean router probability of e. Equals 1 when routing is uniform."""
    n_tokens, n_experts = probs_TE.shape
    f_E = counts_E.to(probs_TE.dtype) / (n_tokens * top_k)
    return n_experts * torch.dot(f_E, probs_TE.mean(0))


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean squared log-partition of the router logits."""
    return torch.logsumexp(logits_TE, dim=-1).square().mean()


class _Bf16RouterLogits(torch.autograd.Function):
    """fp32 logits from bf16 tokens and weights on tensor cores. A product of two bf16 numbers is
    exact in fp32 and the sums accumulate in fp32, so the forward equals the fp32 GEMM of the
    upcast inputs (up to summation order) at bf16 GEMM speed, instead of an fp32 GEMM on CUDA
    cores. The backward rounds the logits' gradient to bf16, as every other bf16 GEMM does."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_TD, w_ED)
        return torch.mm(x_TD, w_ED.t(), out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, g_TE: torch.Tensor):  # type: ignore[override]
        x_TD, w_ED = ctx.saved_tensors
        g_TE = g_TE.to(x_TD.dtype)
        dx = g_TE @ w_ED if ctx.needs_input_grad[0] else None
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.mm(g_TE.t(), x_TD, out_dtype=torch.float32).to(w_ED.dtype)
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor) -> torch.Tensor:
    """fp32 router logits ``x @ w^T``: tensor cores for bf16 on the GPU, an fp32 GEMM otherwise."""
    if x_TD.is_cuda and x_TD.dtype == w_ED.dtype == torch.bfloat16:
        return _Bf16RouterLogits.apply(x_TD, w_ED)
    return F.linear(x_TD.float(), w_ED.float())


@eager
def _summed_over(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """``t`` summed over ``group``'s ranks, in place (eagerly: a compile boundary)."""
    dist.all_reduce(t, group=group)
    return t


class Router(nn.Module):
    """fp32 logits -> softmax or sigmoid scores -> top-k (optionally bias-steered, optionally
    group-limited) -> weights (optionally renormalized over the k, times ``routed_scale``).

    With ``expert_bias`` the per-expert bias shifts which experts are *selected* but not the
    combine weights; it is a buffer updated by ``update_bias`` outside autograd. Group-limited
    routing (``n_expert_groups`` > 1) scores each group of experts by the sum of its two best
    selection scores, keeps a token's ``top_k_groups`` best groups and picks its ``top_k``
    experts among them (DeepSeek-V3's rule; the experts of dropped groups are excluded with
    -inf, as DeepSeek's reference does).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.kind = cfg.n_experts, cfg.top_k, cfg.router
        self.normalize_top_k, self.routed_scale = cfg.normalize_top_k, cfg.routed_scale
        self.n_groups, self.top_k_groups = cfg.n_expert_groups, cfg.top_k_groups
        # "mean": each MoE layer's terms count 1 / (its number of MoE layers) of the loss
        layers = len(cfg.moe_layers) if cfg.aux_loss_reduction == "mean" else 1
        self.aux_loss_coef = cfg.aux_loss_coef / layers
        self.z_loss_coef = cfg.z_loss_coef / layers
        self.bias_rate = cfg.expert_bias_rate
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        self.expert_bias: torch.Tensor | None
        if cfg.expert_bias:
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Statistics summed over forward passes until the trainer reads and resets them.
        self.register_buffer("stat_counts_E", torch.zeros(cfg.n_experts, dtype=torch.int64), False)
        self.register_buffer("stat_lb", torch.zeros((), dtype=torch.float32), False)
        self.register_buffer("stat_z", torch.zeros((), dtype=torch.float32), False)
        self.register_buffer("stat_calls", torch.zeros((), dtype=torch.int64), False)
        # parallel.cp > 1 (``apply_context``): the ranks sharing this rank's sequences, over
        # which the load-balancing loss counts its shares (the whole sequences' routing)
        self.context_group: dist.ProcessGroup | None = None
        self.context_size = 1

    @torch.no_grad()
    def reset_buffers(self) -> None:
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        self.reset_stats()

    @torch.no_grad()
    def reset_stats(self) -> None:
        for buf in (self.stat_counts_E, self.stat_lb, self.stat_z, self.stat_calls):
            buf.zero_()

    def forward(self, x_TD: torch.Tensor) -> Routing:
        with torch.autocast(x_TD.device.type, enabled=False):
            logits_TE = router_logits(x_TD, self.weight)
        if self.kind == "softmax":
            probs_TE = torch.softmax(logits_TE, dim=-1)
        else:
            probs_TE = torch.sigmoid(logits_TE)
        select_TE = probs_TE if self.expert_bias is None else probs_TE + self.expert_bias
        if self.n_groups > 1:
            select_TE = self._limit_to_groups(select_TE)
        _, experts_TK = torch.topk(select_TE, self.top_k, dim=-1)
        weights_TK = probs_TE.gather(1, experts_TK)
        if self.normalize_top_k:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        if self.routed_scale != 1.0:
            weights_TK = weights_TK * self.routed_scale

        counts_E = expert_counts(experts_TK, self.n_experts)
        share_TE = probs_TE if self.kind == "softmax" else probs_TE / probs_TE.sum(-1, keepdim=True)
        lb = self._load_balancing(share_TE, counts_E)
        z = z_loss(logits_TE)
        aux = self.aux_loss_coef * lb + self.z_loss_coef * z
        if _record_stats:
            with torch.no_grad():
                self.stat_counts_E += counts_E
                self.stat_lb += lb.detach()
                self.stat_z += z.detach()
                self.stat_calls += 1
        return Routing(experts_TK, weights_TK, counts_E, aux)

    def _load_balancing(self, share_TE: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The load-balancing loss; under context parallelism with the shares routed over the
        whole sequences (summed over the group, no gradient), so that the mean of the ranks'
        losses is the whole sequences' loss and its gradient."""
        if self.context_group is None:
            return load_balancing_loss(share_TE, counts_E, self.top_k)
        total_E = _summed_over(counts_E.clone(), self.context_group)
        # load_balancing_loss divides by this rank's tokens, a context_size-th of the whole
        return load_balancing_loss(share_TE, total_E, self.top_k) / self.context_size

    def _limit_to_groups(self, select_TE: torch.Tensor) -> torch.Tensor:
        """``select_TE`` with every expert outside a token's ``top_k_groups`` best groups at
        -inf; a group's score is the sum of its two best selection scores."""
        T = select_TE.shape[0]
        select_TGe = select_TE.view(T, self.n_groups, -1)
        group_TG = select_TGe.topk(2, dim=-1).values.sum(-1)
        keep_TK = group_TG.topk(self.top_k_groups, dim=-1).indices
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep_TK, True)
        return select_TGe.masked_fill(~keep_TG.unsqueeze(-1), float("-inf")).view(T, -1)

    @torch.no_grad()
    def next_bias(self, counts_E: torch.Tensor) -> torch.Tensor:
        """Auxiliary-loss-free balancing: the bias after a step that routed ``counts_E`` (under-
        loaded experts raised, the rest lowered); ``update_bias`` applies it."""
        if self.expert_bias is None:
            raise RuntimeError("the expert bias needs model.expert_bias=true")
        load_E = counts_E.to(torch.float32)
        return self.expert_bias + self.bias_rate * torch.sign(load_E.mean() - load_E)

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        self.expert_bias.copy_(self.next_bias(counts_E))  # type: ignore[union-attr]


class Experts(nn.Module):
    """SwiGLU experts stacked per layer: ``w_gate_up`` [E, 2F, D] (gate rows first), ``w_down``
    [E, D, F]. Under expert parallelism this holds the experts ``expert_offset ..`` only."""

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.n_experts, self.hidden = n_experts, hidden
        self.expert_offset = 0
        self.w_gate_up = nn.Parameter(torch.empty(n_experts, 2 * hidden, d_model))
        self.w_down = nn.Parameter(torch.empty(n_experts, d_model, hidden))
        # Which kernels run (the grouped GEMMs' backend, FP8, gathering rows, fusing): a frozen
        # value that ``parallelize`` hands over (``transformer.apply_kernels``), a constant to
        # torch.compile.
        self.kernels = Kernels()

    def forward(
        self, x_MD: torch.Tensor, offs_E: torch.Tensor, weights_M: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of ``x_MD`` sorted by expert; ``offs_E`` their int32 cumulative ends;
        ``weights_M`` an optional per-row output scale (the router weights, applied to the
        down projection's input). FP8 experts (``moe_kernels.fp8.fp8_expert_mlp``) and, where
        QuACK runs, bf16 ones (``moe_kernels.expert_mlp``: the SwiGLU and the weights in GEMM
        epilogues) run the whole MLP as one op that keeps no SwiGLU output, so selective
        recompute has nothing left to recompute there."""
        k = self.kernels
        w_gate_up, w_down = self.w_gate_up.to(x_MD.dtype), self.w_down.to(x_MD.dtype)
        if k.fp8_experts:
            cached = (None, None)
            if k.fp8_scaling == "rowwise":
                cached = self._fp8_cached(x_MD.dtype)
            return fp8_expert_mlp(
                x_MD,
                w_gate_up,
                w_down,
                offs_E,
                weights_M,
                k.fp8_scaling,
                backend=k.gemm,
                cached=cached,
                fast_accum=k.fp8_fast_accum,
            )
        if fuses(x_MD, w_gate_up, w_down, backend=k.gemm, fused=k.fused_mlp):
            return expert_mlp(
                x_MD, w_gate_up, w_down, offs_E, weights_M, backend=k.gemm, fused=k.fused_mlp
            )
        gate_up_M2F = self._project(x_MD, self.w_gate_up, offs_E)
        return self.activation_and_down(gate_up_M2F, offs_E, weights_M)

    def _fp8_cached(self, dtype: torch.dtype) -> tuple:
        """Both weights' FP8 copies made once per step (``moe_kernels.fp8_cache``), where
        attached (None each otherwise)."""
        return cached_operands(self.w_gate_up, dtype), cached_operands(self.w_down, dtype)

    def routed(
        self,
        x_TD: torch.Tensor,
        slot_TK: torch.Tensor,
        n_rows: int,
        offs_E: torch.Tensor,
        weights_M: torch.Tensor | None = None,
        *,
        every_row_mapped: bool | None = None,
    ) -> torch.Tensor:
        """``sum_from_slots(forward(permute_to_slots(x_TD, slot_TK, n_rows), offs_E,
        weights_M), slot_TK)`` (slots as ``moe_kernels.slot_permute``). FP8 experts with rowwise
        scales run it as one op (``moe_kernels.fp8.fp8_routed_mlp``: the same values, the rows
        written in E4M3 by the permute and the sum's backward, no bf16 permuted copy), which
        keeps ``x_TD`` for backward: the caller's tokens must stay as they are until then (not
        a buffer that the next layer reuses)."""
        k = self.kernels
        if k.fp8_experts and k.fp8_scaling == "rowwise":
            return fp8_routed_mlp(
                x_TD,
                slot_TK,
                n_rows,
                self.w_gate_up.to(x_TD.dtype),
                self.w_down.to(x_TD.dtype),
                offs_E,
                weights_M,
                backend=k.gemm,
                cached=self._fp8_cached(x_TD.dtype),
                every_row_mapped=every_row_mapped,
                fast_accum=k.fp8_fast_accum,
            )
        x_MD = permute_to_slots(x_TD, slot_TK, n_rows, every_row_mapped=every_row_mapped)
        y_MD = self(x_MD, offs_E, weights_M)
        return sum_from_slots(y_MD, slot_TK, every_row_mapped=every_row_mapped)

    def gathers_rows(self, x_TD: torch.Tensor) -> bool:
        """Whether ``forward_gathered`` reads token rows inside the gate+up GEMM for these
        tokens: asked for (``parallel.gather_rows``, off by default: it saves memory, not time)
        and QuACK running (``moe_kernels.grouped_gemm.gathers_in_gemm``); never for FP8 experts
        (with rowwise scales their permute writes the rows in E4M3 instead, ``routed``; with MX
        scales they quantize a permuted copy)."""
        k = self.kernels
        return k.gather_rows and not k.fp8_experts and gathers_in_gemm(x_TD, k.gemm)

    def forward_gathered(
        self,
        x_TD: torch.Tensor,
        slot_TK: torch.Tensor,
        n_rows: int,
        offs_E: torch.Tensor,
        weights_M: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward(permute_to_slots(x_TD, slot_TK, n_rows), offs_E, weights_M)`` without the
        permuted copy: the gate+up GEMM gathers each slot's token row itself and keeps only
        ``x_TD`` for backward (an [M, D] copy less per layer: 512 MiB at OLMoE-1B-7B's 16,384
        tokens x top-8)."""
        idx_M = slot_tokens(slot_TK, n_rows)
        w_GKN = self.w_gate_up.to(x_TD.dtype).transpose(-2, -1)
        gate_up_M2F = gathered_grouped_mm(
            x_TD, idx_M, w_GKN, offs_E, slot_TK, backend=self.kernels.gemm
        )
        return self.activation_and_down(gate_up_M2F, offs_E, weights_M)

    def activation_and_down(
        self,
        gate_up_M2F: torch.Tensor,
        offs_E: torch.Tensor,
        weights_M: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(Weighted) SwiGLU then the down projection (the region selective recompute re-runs)."""
        return self._project(swiglu(gate_up_M2F, weights_M), self.w_down, offs_E)

    def _project(self, x_MK: torch.Tensor, w_GNK: torch.Tensor, offs_E: torch.Tensor):
        """Each expert's rows times its weight (stored [E, N, K], used transposed)."""
        w_GKN = w_GNK.to(x_MK.dtype).transpose(-2, -1)
        return grouped_mm(x_MK, w_GKN, offs_E, backend=self.kernels.gemm)


class TokenDispatcher(Protocol):
    """Moves routed tokens to their experts and the results back; one per MoE layer."""

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor: ...


class LocalDispatcher:
    """Every expert on this rank: each token row written straight into its expert-ordered
    slots, grouped GEMMs over the expert segments with the router weights applied in the
    SwiGLU (so the combine is a plain sum that keeps no expert output for backward), then
    un-permute and sum in one pass. With ``parallel.gather_rows`` where QuACK runs
    (``Experts.gathers_rows``) the gate+up GEMM gathers the token rows itself instead of
    reading a permuted copy; FP8 experts with rowwise scales take the permute and the sum
    into their op (``Experts.routed``), which writes the rows in FP8."""

    def __call__(self, x_TD: torch.Tensor, routing: Routing, experts: Experts) -> torch.Tensor:
        slots = expert_slots(routing.experts_TK, experts.n_experts)
        weights_M = slot_weights(routing.weights_TK, slots.slot_TK, slots.n_rows)
        if experts.gathers_rows(x_TD):
            y_MD = experts.forward_gathered(
                x_TD, slots.slot_TK, slots.n_rows, slots.offs_E, weights_M
            )
            return sum_from_slots(y_MD, slots.slot_TK)
        return experts.routed(x_TD, slots.slot_TK, slots.n_rows, slots.offs_E, weights_M)


class SwiGLU(nn.Module):
    """Dense SwiGLU feed-forward (the shared expert, and the leading dense blocks' MLP)."""

    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_up = nn.Linear(d_model, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


@eager
def _dispatch(
    dispatcher: TokenDispatcher, x_TD: torch.Tensor, routing: Routing, experts: Experts
) -> torch.Tensor:
    """Token dispatch always runs eagerly: its Triton kernels, grouped GEMMs and collectives
    are fused already, and a compiled block (``parallel.compile.apply_compile``) breaks its graph
    here."""
    return dispatcher(x_TD, routing, experts)


class MoE(nn.Module):
    """Routed experts (+ an always-on shared expert); returns the output and the aux loss."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_hidden)
        self.shared = (
            SwiGLU(cfg.d_model, cfg.n_shared_experts * cfg.expert_hidden)
            if cfg.n_shared_experts
            else None
        )
        self.dispatcher: TokenDispatcher = LocalDispatcher()

    def forward(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        routing = self.router(x_TD)
        y_TD = _dispatch(self.dispatcher, x_TD, routing, self.experts)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        return y_TD.view_as(x_BSD), routing.aux_loss
