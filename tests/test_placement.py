"""Group-limited routing under expert parallelism (``moe_core.parallel.placement``): the bound
on the ranks and nodes a token's rows reach, against the real router and the dispatcher's
``rank_slots``; the expected rows against a Monte-Carlo simulation of the routing rule; what
``moe plan`` makes of them (issue 38)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from moe_core.compose import compose_run
from moe_core.config import ConfigError, ModelConfig
from moe_core.model.moe import Router
from moe_core.parallel.dispatch import rank_slots, rowwise_capacity
from moe_core.parallel.placement import RoutingRule, reach, rows_per_token, visit_probabilities
from moe_core.plan import plan, plan_text


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_layout(rng: random.Random, nested: bool) -> tuple[RoutingRule, int, int]:
    """A routing rule and an expert-parallel layout (ep, ranks per node) whose groups nest in
    the ranks (``nested``) or need not."""
    while True:
        G = rng.choice([1, 2, 3, 4, 6, 8, 16])
        g = rng.choice([2, 3, 4, 6, 8])
        E = G * g
        ep = rng.choice(divisors(E))
        n = E // ep
        if nested != (g % n == 0 or n % g == 0):
            continue
        kg = rng.randint(1, G)
        k = rng.randint(1, min(kg * g, 12))
        return RoutingRule(E, k, G, kg), ep, rng.choice(divisors(ep))


def routed(rule: RoutingRule, T: int, gen: torch.Generator) -> torch.Tensor:
    """The real router's choices for T random tokens (softmax or sigmoid, with or without a
    selection bias, so ties of scores and shifted groups both occur)."""
    kind = "softmax" if torch.rand((), generator=gen) < 0.5 else "sigmoid"
    bias = bool(torch.rand((), generator=gen) < 0.5)
    cfg = ModelConfig(
        d_model=16,
        n_heads=2,
        n_experts=rule.n_experts,
        top_k=rule.top_k,
        n_expert_groups=rule.n_groups,
        top_k_groups=rule.top_k_groups,
        router=kind,
        expert_bias=bias,
    )
    router = Router(cfg)
    with torch.no_grad():
        router.weight.normal_(0.0, 1.0, generator=gen)
        if router.expert_bias is not None:
            router.expert_bias.normal_(0.0, 0.3, generator=gen)
        x_TD = torch.randn(T, 16, generator=gen)
        return router(x_TD).experts_TK


@pytest.mark.parametrize("nested", [True, False])
def test_a_token_never_reaches_more_groups_ranks_or_nodes_than_the_bound(nested):
    """Property test over random rules and layouts (100 seeds each): the router keeps a token's
    experts within ``top_k_groups`` groups; ``rank_slots`` never sends it to more ranks than
    ``reach``'s bound, nor to more nodes (and where groups nest in nodes, ``top_k_groups``
    nodes at most); the bound is met by some token where a layout allows it."""
    rng, gen = random.Random(38 + nested), torch.Generator().manual_seed(38 + nested)
    met = 0
    for _ in range(100):
        rule, ep, per_node = random_layout(rng, nested)
        experts_TK = routed(rule, 64, gen)
        g, n = rule.n_experts // rule.n_groups, rule.n_experts // ep
        groups_T = torch.tensor([len(set((row // g).tolist())) for row in experts_TK])
        assert int(groups_T.max()) <= rule.top_k_groups, rule
        visits_TP, slots = rank_slots(experts_TK, ep, n)
        ranks_T = visits_TP.sum(1)
        assert int(slots.counts_E.sum()) == int(ranks_T.sum())  # one send row per visit
        r = reach(rule, ep, per_node)
        assert int(ranks_T.max()) <= r.max_ranks, (rule, ep)
        nodes_T = torch.tensor(
            [len(set(p // per_node for p in row.nonzero().flatten().tolist())) for row in visits_TP]
        )
        assert int(nodes_T.max()) <= r.max_nodes, (rule, ep, per_node)
        if r.group_nodes == 1:  # every group inside one node
            assert int(nodes_T.max()) <= rule.top_k_groups
        met += int(ranks_T.max()) == r.max_ranks
        assert r.nests_ranks == nested
    assert met >= 30  # the bound is tight, not merely safe


def rule_routing(rule: RoutingRule, T: int, gen: torch.Generator) -> torch.Tensor:
    """The routing rule the expectation assumes: ``top_k_groups`` groups uniformly, then
    ``top_k`` of their experts uniformly."""
    G, kg, g = rule.n_groups, rule.top_k_groups, rule.n_experts // rule.n_groups
    groups_TK = torch.rand(T, G, generator=gen).argsort(1)[:, :kg]
    candidates = (groups_TK[:, :, None] * g + torch.arange(g)).reshape(T, kg * g)
    picks = torch.rand(T, kg * g, generator=gen).argsort(1)[:, : rule.top_k]
    return candidates.gather(1, picks)


CASES = [  # (rule, ep, ranks per node)
    (RoutingRule(64, 8, 8, 4), 8, 4),  # a group per rank
    (RoutingRule(256, 8, 8, 4), 64, 8),  # DeepSeek-V3: a group per node
    (RoutingRule(48, 6, 4, 2), 16, 4),  # a group over 4 ranks
    (RoutingRule(12, 2, 2, 1), 3, 2),  # groups of 6 over ranks of 4: no nesting
    (RoutingRule(40, 5, 10, 3), 8, 2),  # groups of 4 over ranks of 5: no nesting
    (RoutingRule(32, 4), 4, 2),  # plain top-k
]


@pytest.mark.parametrize("rule, ep, per_node", CASES)
def test_expected_rows_are_a_simulation_of_the_rule(rule, ep, per_node):
    """Each rank's visit probability and the busiest source's rows (to other ranks, across
    nodes) against 40,000 tokens routed by the rule through ``rank_slots``, within five
    standard errors."""
    T = 40_000
    gen = torch.Generator().manual_seed(ep)
    visits_TP, _ = rank_slots(rule_routing(rule, T, gen), ep, rule.n_experts // ep)
    seen_P = visits_TP.double().mean(0)
    expected_P = torch.tensor(visit_probabilities(rule, ep), dtype=torch.float64)
    err = 5 * (expected_P * (1 - expected_P) / T).sqrt() + 1e-9
    assert ((seen_P - expected_P).abs() <= err).all(), (seen_P, expected_P)
    node_P = torch.arange(ep) // per_node
    r, tol = reach(rule, ep, per_node), 5 * math.sqrt(ep / T)
    # a token of source rank s sends a row to every other rank it visits: the busiest source
    rows_S = [float(seen_P.sum() - seen_P[s]) for s in range(ep)]
    assert max(rows_S) == pytest.approx(r.rows_per_token, abs=tol)
    cross_S = [float(seen_P[node_P != node_P[s]].sum()) for s in range(ep)]
    assert max(cross_S) == pytest.approx(r.cross_node_rows, abs=tol)
    # and the other nodes a token reaches
    nodes_TN = torch.zeros(T, int(node_P.max()) + 1, dtype=torch.float64)
    nodes_TN.index_add_(1, node_P, visits_TP.double())
    reached_N = (nodes_TN > 0).double().mean(0)
    nodes_seen = max(float(reached_N.sum() - reached_N[i]) for i in range(len(reached_N)))
    assert nodes_seen == pytest.approx(r.nodes_per_token, abs=tol)


def test_plain_top_k_gives_the_plain_formula_to_the_bit():
    """One group: ``(ep - 1)(1 - C(E - E/ep, k) / C(E, k))``, exactly the float the planner
    computed before groups were counted, and the rowwise capacity it sized."""
    for E, k in [(8, 2), (64, 8), (128, 1), (240, 100), (256, 8), (60, 7)]:
        for ep in divisors(E):
            n = E // ep
            visit = 1.0 - math.comb(E - n, k) / math.comb(E, k)
            assert rows_per_token(RoutingRule(E, k), ep) == ((ep - 1) * visit if ep > 1 else 0.0)
            rows = min(ep * 100, math.ceil(1.5 * ep * 100 * visit))
            assert rowwise_capacity(E, k, ep, 100, 1.5)[0] == rows


def test_rowwise_capacity_takes_the_group_limited_visit():
    """With a capacity factor the rowwise buffers hold the factor times the busiest rank's
    group-limited load (fewer rows than plain top-k's); dropless sizes are unchanged."""
    E, k, ep, T = 64, 8, 8, 1000
    plain = rowwise_capacity(E, k, ep, T, 1.25)
    grouped = rowwise_capacity(E, k, ep, T, 1.25, 8, 2)
    visit = max(visit_probabilities(RoutingRule(E, k, 8, 2), ep))
    assert grouped == (math.ceil(1.25 * ep * T * visit), plain[1]) and grouped[0] < plain[0]
    assert rowwise_capacity(E, k, ep, T, None, 8, 2) == rowwise_capacity(E, k, ep, T, None)
    uneven = RoutingRule(40, 5, 10, 3)  # ranks of 5 over groups of 4 are visited unequally
    assert len(set(visit_probabilities(uneven, 8))) > 1
    assert rowwise_capacity(40, 5, 8, T, 1.0, 10, 3)[0] == math.ceil(
        8 * T * max(visit_probabilities(uneven, 8))
    )


DEEPSEEK = [  # DeepSeek-V3's routing at a small width, EP 64 over 8 nodes of 8 GPUs
    "model=tiny",
    "model.n_experts=256",
    "model.top_k=8",
    "model.n_expert_groups=8",
    "model.top_k_groups=4",
    "parallel.ep=64",
    "cluster=local-gpu",
    "cluster.nodes=8",
    "train.micro_batch_size=1",
    "train.global_batch_size=64",
    "train.eval_batches=64",
]


def test_deepseek_v3_plan_counts_the_saving_of_node_limited_routing():
    """256 experts in 8 groups, top-4 groups, top-8, EP 64 on 8 nodes of 8: each node holds a
    group, so a token reaches at most 4 nodes (8 without groups); the all-to-all's bytes per
    layer and step drop with the expected rows, and ``moe plan`` says so."""
    grouped = plan(compose_run(DEEPSEEK))
    plain = plan(compose_run([*DEEPSEEK, "model.n_expert_groups=1", "model.top_k_groups=1"]))
    r, p = grouped.comm.reach, plain.comm.reach
    assert (r.nodes, r.max_nodes, p.max_nodes) == (8, 4, 8)
    assert r.max_ranks == p.max_ranks == 8  # top-8 bounds ranks already
    assert r.nests_nodes and r.group_nodes == 1 and grouped.comm.plain == p
    assert r.rows_per_token < p.rows_per_token and r.cross_node_rows < p.cross_node_rows
    assert r.nodes_per_token < p.nodes_per_token <= 7
    ratio = r.rows_per_token / p.rows_per_token
    c, cp = grouped.comm, plain.comm
    assert c.all_to_all_per_layer < cp.all_to_all_per_layer and c.all_to_all < cp.all_to_all
    # the rows' bytes scale with the rows (the size exchange is the same for both)
    assert c.all_to_all / cp.all_to_all == pytest.approx(ratio, rel=1e-3)
    text = plan_text(grouped)
    line = next(x for x in text.splitlines() if "group-limited routing" in x)
    assert "at most 8 of 64 ranks, 4 of 8 nodes (top-k alone: 8 ranks, 8 nodes)" in line
    assert f"rows per token {r.rows_per_token:.2f} instead of {p.rows_per_token:.2f}" in line
    assert "group-limited routing" not in plan_text(plain)


def test_layouts_where_groups_do_not_nest_are_planned_with_their_bound():
    """Groups of 8 experts over ranks of 6 (48 experts at EP 8): accepted, not refused (the
    router and training are the same under any layout), planned with the bound a straddling
    group gives (2 ranks per group) and said so; the group checks themselves still refuse."""
    run = compose_run(
        [
            "model=tiny",
            "model.n_experts=48",
            "model.top_k=6",
            "model.n_expert_groups=6",
            "model.top_k_groups=2",
            "parallel.ep=8",
            "train.micro_batch_size=2",
            "train.global_batch_size=16",
            "train.eval_batches=8",
        ]
    )
    r = plan(run).comm.reach
    assert not r.nests_ranks and r.group_ranks == 2 and r.max_ranks == 4
    assert "groups do not nest in this layout: a group touches up to 2 ranks" in plan_text(
        plan(run)
    )
    for bad, field in [
        (["model.n_expert_groups=5"], "model.n_expert_groups=5"),  # 48 / 5
        (["model.n_expert_groups=6", "model.top_k_groups=7"], "model.top_k_groups=7"),
        (["model.n_expert_groups=6", "model.top_k_groups=1", "model.top_k=9"], "model.top_k=9"),
    ]:
        with pytest.raises(ConfigError) as err:
            compose_run(["model=tiny", "model.n_experts=48", "model.top_k=6", *bad])
        assert str(err.value).startswith(f"{field} is not allowed")
