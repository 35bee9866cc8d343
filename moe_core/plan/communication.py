"""Communication of one rank per optimizer step, in bytes it sends.

Ring collectives send ``(g - 1) / g`` of the buffer.

- all-to-all per MoE layer and micro-batch (leading dense blocks dispatch nothing; a step
  counts the MoE layers of the rank holding the most), under uniform routing: each token goes
  once to each other expert-parallel rank holding one of its top-k experts,
  ``r = T * (ep - 1) * (1 - q)`` rows with ``q = C(E - E/ep, k) / C(E, k)``; under
  group-limited routing (``model.n_expert_groups`` > 1) ``r = T`` times the busiest source
  rank's expected rows of ``parallel.placement`` (a token keeps ``top_k_groups`` groups
  uniformly, then ``k`` of their experts), with the bound on ranks and nodes a token reaches
  and the same figures for plain top-k beside them (``Communication.reach``,
  ``Communication.plain``: what ``moe plan`` prints as the saving); forward sends
  ``r * (d_model * b_p + 12 k)`` (row, expert ids, weights) and ``r * d_model * b_p`` back;
  backward the same rows with ``4 k`` instead of ``12 k``; block recompute repeats the
  forward. FP8 rows (``precision.fp8_parts`` naming "dispatch") send ``d_model + 4`` bytes
  (E4M3 and a scale) instead of ``d_model * b_p`` for each row forward.
- reduce-scatter of the gradients (``b_o``) and all-gather of the updated weights, once per step.
- pipeline: one ``T * d_model * b_p`` message per micro-batch and chunk boundary, each way
  (``memory.pipeline_send_bytes``).
- context parallelism (``parallel.cp`` > 1), per attention layer (every block) and micro-batch:
  the all-gather of the keys and values forward, ``(cp - 1) T w b_c`` with ``w = 2 d_kv``
  (latent attention gathers its compressed key-value and rotary key, ``w = kv_lora_rank +
  qk_rope_head_dim``), the reduce-scatter of their gradients backward, the same bytes; the
  forward again under block recompute, and under selective recompute for latent attention
  (its gather is in the recomputed part). ``T`` is a rank's tokens, a cp-th of the sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.config import ModelConfig, RunConfig
from moe_core.parallel.ddp import reduce_groups
from moe_core.parallel.placement import Reach, RoutingRule, reach, rows_per_token
from moe_core.plan.memory import StageMemory, element_bytes, tokens_per_micro_batch


@dataclass(frozen=True)
class Communication:
    """Bytes one rank sends per optimizer step (all-to-all also per layer and micro-batch)."""

    all_to_all_per_layer: int  # one MoE layer, one micro-batch, forward + backward
    all_to_all: int  # the step: every MoE layer of the rank with the most, every micro-batch
    reduce_scatter: int  # gradients in the optimizer's dtype, dense and expert groups
    all_gather: int  # updated weights in the model dtype
    pipeline: int  # the busiest rank's activation and gradient messages
    context_per_layer: int  # K/V all-gather + gradient reduce-scatter, one layer and micro-batch
    context: int  # the step: every layer of the busiest stage, every micro-batch
    reach: Reach  # where a token's rows go under the model's routing (parallel.placement)
    plain: Reach  # the same under plain top-k (no expert groups), to compare


def ring(nbytes: float, group: int) -> float:
    """What one rank of a ring collective over ``group`` ranks sends of ``nbytes``."""
    return nbytes * (group - 1) / group


def all_to_all_rows_per_token(m: ModelConfig, ep: int) -> float:
    """Expected rows one token sends to other expert-parallel ranks under uniform routing,
    group-limited where the model is (``placement.rows_per_token``: the busiest source)."""
    return rows_per_token(RoutingRule.of(m), ep)


def ranks_per_node(run: RunConfig) -> int:
    """Expert-parallel peers sharing a node: the cluster's GPUs per node (its processes per
    node on CPU clusters)."""
    return run.cluster.gpus_per_node or run.cluster.procs_per_node


def all_to_all_bytes_per_layer(run: RunConfig) -> float:
    """One MoE layer and micro-batch: rows forward (with ids and weights) and back, the same
    backward, the forward again under block recompute, and the exchange of per-expert sizes."""
    m, par = run.model, run.parallel
    bp, _, _ = element_bytes(run)
    rows = all_to_all_rows_per_token(m, par.ep)
    k = m.top_k
    row_out = m.d_model + 4 if "dispatch" in run.precision.fp8_parts else m.d_model * bp
    forward = rows * (row_out + 12 * k) + rows * m.d_model * bp
    backward = rows * m.d_model * bp + rows * (m.d_model * bp + 4 * k)
    sizes = ring(par.ep * (1 + m.n_experts // par.ep) * 8, par.ep) if par.ep > 1 else 0
    tokens = tokens_per_micro_batch(run)
    per_layer = tokens * (forward + backward) + sizes
    if par.recompute == "block":
        per_layer += tokens * forward + sizes
    return per_layer


def context_bytes_per_layer(run: RunConfig) -> float:
    """One attention layer and micro-batch under context parallelism (module docstring)."""
    m, par = run.model, run.parallel
    if par.cp == 1:
        return 0.0
    _, bc, _ = element_bytes(run)
    if m.latent:
        assert m.kv_lora_rank is not None and m.qk_rope_head_dim is not None
        width = m.kv_lora_rank + m.qk_rope_head_dim
    else:
        assert m.head_dim is not None
        width = 2 * m.kv_heads * m.head_dim
    once = (par.cp - 1) * tokens_per_micro_batch(run) * width * bc
    again = par.recompute == "block" or (par.recompute == "selective" and m.latent)
    return once * (3 if again else 2)


def zero1_bytes(run: RunConfig, dense: int, experts: int) -> tuple[float, float]:
    """Reduce-scatter of the gradients (``b_o``) and all-gather of the weights (``b_p``) of a
    rank holding ``dense`` and ``experts`` parameters, over their groups ``dp x ep`` and
    ``dp``."""
    bp, _, bo = element_bytes(run)
    groups = reduce_groups(run.parallel)
    reduce_scatter = ring(bo * dense, groups.dense) + ring(bo * experts, groups.expert)
    all_gather = ring(bp * dense, groups.dense) + ring(bp * experts, groups.expert)
    return reduce_scatter, all_gather


def communication(run: RunConfig, stages: tuple[StageMemory, ...]) -> Communication:
    """The busiest rank's traffic per step, given every stage's memory (its parameters and
    pipeline sends)."""
    per_layer = all_to_all_bytes_per_layer(run)
    moe_layers = max(s.moe_layers for s in stages)
    busiest = max(stages, key=lambda s: s.dense_params + s.expert_params)
    reduce_scatter, all_gather = zero1_bytes(run, busiest.dense_params, busiest.expert_params)
    rule, per_node = RoutingRule.of(run.model), ranks_per_node(run)
    context = context_bytes_per_layer(run)
    return Communication(
        all_to_all_per_layer=round(per_layer),
        all_to_all=round(per_layer * moe_layers * run.micro_batches),
        reduce_scatter=round(reduce_scatter),
        all_gather=round(all_gather),
        pipeline=max(s.p2p_buffers for s in stages),
        context_per_layer=round(context),
        context=round(context * max(s.layers for s in stages) * run.micro_batches),
        reach=reach(rule, run.parallel.ep, per_node),
        plain=reach(rule.plain, run.parallel.ep, per_node),
    )
