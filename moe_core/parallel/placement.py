"""Where a token's routed rows go under expert parallelism: expert groups on ranks and nodes.

Experts lie contiguously: expert-parallel rank ``p`` of ``ep`` holds experts ``[p n, (p + 1) n)``,
``n = E / ep``, and the group's ranks fill nodes in order, ``ranks_per_node`` to a node (the mesh
puts expert peers next to each other; the group starting at global rank 0 is the one described
where ``ep`` and the node size do not divide each other). Group-limited routing (``Router``:
``G = model.n_expert_groups`` equal contiguous groups of ``g = E / G`` experts, a token keeps
its ``kg = model.top_k_groups`` best groups and picks its ``k = model.top_k`` experts among
them) is the model's; where a group lies is the layout's. This module relates the two, for the
planner (``plan.communication``), the page (``planner.js`` mirrors it) and the rowwise
dispatcher's capacity (``dispatch.rowwise_capacity``).

Bound. A group touches the ranks its experts lie on, so a token's rows reach at most
``min(ep, k, the sum of the kg largest numbers of ranks one group touches)`` ranks, its own
included, and likewise nodes. Where groups and ranks nest (each group on whole ranks, ``g`` a
multiple of ``n``, or each rank holding whole groups) a group touches ``max(1, g / n)`` ranks:
``kg x max(1, g / n)``. DeepSeek-V3 (256 experts, 8 groups, top-4 groups, EP 64 on 8 nodes of
8 GPUs) puts one group on each node, so a token reaches at most 4 of the 8 nodes (top-8 alone
would allow 8). Layouts that do not nest are planned with the bound they have (a group
straddling a boundary touches one rank more), never refused: routing, and so training, is the
same under any layout (a checkpoint's groups do not follow the cluster it continues on); only
the saving shrinks, and ``moe plan`` says so.

Expectation, under uniform group-limited routing: a token keeps ``kg`` of the ``G`` groups
uniformly, then ``k`` of their ``M = kg g`` experts uniformly (plain top-k is ``G = kg = 1``).
A block of experts (a rank) meets a few groups: at most two partly (overlaps ``o``) and ``f``
wholly. It is missed with probability

    q = sum over the partly met groups kept (A) and j of the whole ones kept of
        C(f, j) C(G - t, kg - |A| - j) / C(G, kg) * C(M - c, k) / C(M, k),

``t`` the groups it meets, ``c = sum(o of A) + j g`` its experts among the kept groups' (the
first factor: those ``|A| + j`` groups kept, the other ``t - |A| - j`` not). Evaluated in exact
integers (``math.comb``), rounded once; with one group it is ``C(E - n, k) / C(E, k)``, the
plain top-k figure to the bit. A token of rank ``r`` sends ``sum over p != r of (1 - q_p)``
rows to the other ranks; the planner takes the busiest source (the rank least visited
itself; every rank alike where groups and ranks nest), and the rows of those on other nodes
(what crosses the network). Routing that does not depend on the token's rank visits every
other rank with the same probability where the layout nests, so the share of rows crossing
nodes is ``(ep - ranks on the node) / (ep - 1)`` with or without groups: the step-time model's
split of the all-to-all stays exact and its bytes shrink with the rows.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction

from moe_core.config import ModelConfig


@dataclass(frozen=True)
class RoutingRule:
    """What routing decides about placement: ``top_k`` of ``n_experts``, limited to the
    ``top_k_groups`` best of ``n_groups`` equal contiguous groups (1 and 1: plain top-k)."""

    n_experts: int
    top_k: int
    n_groups: int = 1
    top_k_groups: int = 1

    @classmethod
    def of(cls, m: ModelConfig) -> RoutingRule:
        return cls(m.n_experts, m.top_k, m.n_expert_groups, m.top_k_groups)

    @property
    def plain(self) -> RoutingRule:
        """The same top-k without groups (what group-limited routing is compared with)."""
        return RoutingRule(self.n_experts, self.top_k)


@dataclass(frozen=True)
class Reach:
    """Where one token's rows go over ``ep`` ranks, ``ranks_per_node`` to a node (module doc)."""

    ep: int
    nodes: int  # nodes the expert-parallel group spans
    group_ranks: int  # the most ranks one expert group touches
    group_nodes: int  # the most nodes one expert group touches
    nests_ranks: bool  # every group on whole ranks, or every rank holding whole groups
    nests_nodes: bool  # likewise for nodes
    max_ranks: int  # ranks a token's rows can reach, its own included
    max_nodes: int  # nodes they can reach, its own included
    rows_per_token: float  # expected rows to other ranks (the busiest source rank)
    cross_node_rows: float  # expected rows to ranks on other nodes (the busiest source rank)
    nodes_per_token: float  # expected other nodes reached (the busiest source rank)


def _nests(size: int, unit: int) -> bool:
    return size % unit == 0 or unit % size == 0


def _touched(rule: RoutingRule, unit: int) -> list[int]:
    """How many consecutive blocks of ``unit`` experts each group's experts lie on."""
    g = rule.n_experts // rule.n_groups
    return [((i + 1) * g - 1) // unit - (i * g) // unit + 1 for i in range(rule.n_groups)]


def _bound(rule: RoutingRule, unit: int, units: int) -> tuple[int, int]:
    """(the most blocks one group touches, the most blocks a token reaches)."""
    touched = sorted(_touched(rule, unit), reverse=True)
    return touched[0], min(units, rule.top_k, sum(touched[: rule.top_k_groups]))


def _miss(rule: RoutingRule, start: int, size: int) -> float:
    """The probability that a token picks none of the experts ``[start, start + size)`` under
    uniform group-limited routing (the module doc's ``q``)."""
    g = rule.n_experts // rule.n_groups
    first, last = start // g, (start + size - 1) // g
    # within one group, or a partial (or whole) group at each end and whole ones between
    ends = [(first + 1) * g - start, start + size - last * g]
    overlaps = [size] if first == last else ends
    partial = tuple(sorted(o for o in overlaps if o < g))
    whole = last - first + 1 - len(partial)
    return _miss_of(rule, whole, partial)


@functools.lru_cache(maxsize=4096)
def _miss_of(rule: RoutingRule, f: int, partial: tuple[int, ...]) -> float:
    """``_miss`` of a block meeting ``f`` groups wholly and the others by ``partial`` experts,
    rounded once from exact integers."""
    E, k, G, kg = rule.n_experts, rule.top_k, rule.n_groups, rule.top_k_groups
    g, t = E // G, f + len(partial)
    M = kg * g
    total = Fraction(0)
    for mask in range(1 << len(partial)):
        kept = [o for i, o in enumerate(partial) if mask >> i & 1]
        for j in range(min(f, kg - len(kept)) + 1):
            ways = math.comb(f, j) * math.comb(G - t, kg - len(kept) - j)
            c = sum(kept) + j * g
            total += Fraction(ways * math.comb(M - c, k), math.comb(G, kg) * math.comb(M, k))
    return float(total)


def visit_probabilities(rule: RoutingRule, ep: int) -> list[float]:
    """Each rank's probability of receiving a given token's row (``1 - q``, module doc)."""
    n = rule.n_experts // ep
    return [1.0 - _miss(rule, p * n, n) for p in range(ep)]


def rows_per_token(rule: RoutingRule, ep: int) -> float:
    """Expected rows a token of the busiest source rank sends to the other ``ep - 1`` ranks:
    ``(ep - 1)(1 - q)`` where every rank is alike (plain top-k's formula, to the bit)."""
    if ep == 1:
        return 0.0
    visit = visit_probabilities(rule, ep)
    if len(set(visit)) == 1:
        return (ep - 1) * visit[0]
    return sum(visit) - min(visit)


def reach(rule: RoutingRule, ep: int, ranks_per_node: int) -> Reach:
    """The bound on ranks and nodes a token's rows reach over ``ep`` ranks, ``ranks_per_node``
    to a node, and the rows it is expected to send (module doc)."""
    E = rule.n_experts
    n, per_node = E // ep, max(1, min(ranks_per_node, ep))
    nodes = -(-ep // per_node)
    group_ranks, max_ranks = _bound(rule, n, ep)
    group_nodes, max_nodes = _bound(rule, n * per_node, nodes)
    g = E // rule.n_groups
    visit = visit_probabilities(rule, ep)
    reached = [
        1.0 - _miss(rule, i * n * per_node, n * min(per_node, ep - i * per_node))
        for i in range(nodes)
    ]
    if len(set(visit)) == 1:  # every rank alike (nested, or plain top-k)
        cross = (ep - min(per_node, ep - (nodes - 1) * per_node)) * visit[0]
    else:
        node_sums = [sum(visit[i * per_node : (i + 1) * per_node]) for i in range(nodes)]
        cross = sum(visit) - min(node_sums)
    return Reach(
        ep=ep,
        nodes=nodes,
        group_ranks=group_ranks,
        group_nodes=group_nodes,
        nests_ranks=_nests(g, n),
        nests_nodes=_nests(g, n * per_node),
        max_ranks=max_ranks,
        max_nodes=max_nodes,
        rows_per_token=rows_per_token(rule, ep),
        cross_node_rows=cross if nodes > 1 else 0.0,
        nodes_per_token=sum(reached) - min(reached) if nodes > 1 else 0.0,
    )
