"""Prompt lookup's continuation (or the datastore's) as a branch of the drafter's tree, one forward
verifying both.

Why: beside a learned drafter, prompt lookup is drafted instead of it on the steps where the gate
values it more (lookup_source.py). Choosing one source per step gets the one that is better on
average; the two fail on different steps (the drafter misses a name the prompt spelled out, the
continuation misses where the rewrite changes a word), and a tree can hold both, so verifying
both gets the better of the two on every step for a few more rows of the one verification
forward (on the 2-core CPU, two threads: 8 rows cost 1.13 of one, 15 rows 1.37). Where a
tree drafter's steps left lookup fewer steps of its own, rewrites lost acceptance (docs/dflash.md).

How many of the continuation's tokens join the tree: its first `shared` tokens may already be a
path of the tree (they cost nothing); each one after that adds a row. A position j past them adds
the chance that the continuation is right through j: the tree holds none of its path beyond
`shared`, so where it is right, the tree's own nodes past there are not, and the step gains
exactly those tokens. That chance is the product of the source's running estimates per position
(lookup_source.py), except at the position where the continuation leaves a node of the tree that
has other children: there the two sources disagree, and the source is right less often than
overall (where both are likely right they agree, and the continuation is a path of the tree), so
that position takes the source's branch estimate, counted on such branches only (`branch_point`,
`graft_survival`). The width kept maximises expected committed tokens per unit cost, as the
gate's widths do. The same graft takes a second source, the datastore of the target's own
answers (datastore.py), after prompt lookup's. Drafts stay point masses, so verification, and
with it losslessness, is unchanged.

The gate's estimates are the drafter's own: after verification it is told the depth of the
drafter's nodes and how many of the accepted path's nodes were the drafter's (`own_share`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import accumulate
from operator import mul
from typing import Any

from ..trace import ROOT
from ..tree import DraftTree
from .base import Draft
from .lookup_source import Continuation


def survival(rates: Sequence[float], depth: int) -> list[float]:
    """S(j) for j = 1..depth: the chance a chain's first j tokens are all accepted, from the
    acceptance rates of each position given the one before."""
    return list(accumulate(rates[:depth], mul))


def branch_point(tree: DraftTree, tokens: Sequence[int]) -> tuple[int, int | None]:
    """How many of the continuation's first tokens the tree already holds as a path, and the
    position where the continuation leaves it if the tree holds other tokens there (None where it
    leaves from a leaf, holds all of it, or the tree is empty)."""
    held = tree.follow(list(tokens))
    node = held[-1] if held else ROOT
    branches = len(held) < len(tokens) and node in tree.parents
    return len(held), len(held) if branches else None


def graft_survival(found: Continuation, branch: int | None) -> list[float]:
    """The chance the continuation's first j tokens are all accepted, j = 1..len: its running
    rates, except at the position where it branches off the tree, which takes `found.branch`."""
    out, alive = [], 1.0
    for j, rate in enumerate(found.rates[: len(found.tokens)]):
        alive *= found.branch if j == branch else rate
        out.append(alive)
    return out


def best_graft(tree_survival: Sequence[float], lookup_survival: Sequence[float], shared: int, nodes: int,
               cost: Sequence[float], draft_cost: float = 0.0) -> tuple[int, float]:
    """How many of the continuation's tokens to graft onto a tree of `nodes` nodes that already
    holds its first `shared` (0 when no new token is worth its row), and what the step is then
    worth, expected committed tokens per unit cost. A new node j adds the chance the continuation
    is right through j (`lookup_survival`, graft_survival's): the tree holds none of its path past
    `shared`, so where it is right the tree's nodes past there are not. `cost` [c(1), c(2), ...]:
    verifying n rows costs c(n) plain steps; a width needing more rows than the curve has is out."""
    expected = 1.0 + sum(tree_survival)
    best, best_value, gain = 0, expected / (cost[nodes] + draft_cost), 0.0
    for m in range(shared + 1, len(lookup_survival) + 1):
        rows = nodes + m - shared + 1
        if rows > len(cost):
            break
        gain += lookup_survival[m - 1]
        value = (expected + gain) / (cost[rows - 1] + draft_cost)
        if value > best_value:
            best, best_value = m, value
    return best, best_value


def grafted_value(tree_rates: Sequence[float], nodes: int, found: Continuation, cost: Sequence[float],
                  draft_cost: float = 0.0) -> float:
    """What drafting `nodes` with the continuation grafted on is worth, judged before drafting:
    the drafter's nodes as a chain at its running rates, the continuation branching off at its
    first token (for a step that chooses between drafting and prompt lookup alone,
    lookup_source.py)."""
    return best_graft(survival(tree_rates, nodes), graft_survival(found, 0 if nodes else None), 0, nodes, cost,
                      draft_cost)[1]


GRAFTS = ("graft", "datastore")  # the extras keys of grafted sources: prompt lookup's, the datastore's


def graft(draft: Draft, found: Continuation, tree_rates: Sequence[float], cost: Sequence[float],
          draft_cost: float = 0.0, source: str = "graft") -> Draft:
    """The drafter's point-mass draft with as much of the continuation added as pays (best_graft):
    new nodes come after the tree's, with no drafter probability (q None), and the draft's
    extras say which (under `source`, one of GRAFTS: the grafted tokens, the n-gram, how many the
    tree already held, the first grafted node)."""
    tree = draft.tree
    if not len(tree) or draft.q is not None:
        return draft
    whole, shared = tree.with_chain(found.tokens)
    depth = max(tree.depths())
    width, _ = best_graft(survival(tree_rates, depth), graft_survival(found, branch_point(tree, found.tokens)[1]),
                          shared, len(tree), cost, draft_cost)
    if not width:
        return draft
    added = width - shared  # the continuation's new nodes come in its order, after the drafter's
    kept = len(tree) + added
    grown = DraftTree(whole.tokens[:kept], whole.parents[:kept])
    q_token = None if draft.q_token is None else [*draft.q_token, *[None] * added]
    extras = {**draft.extras, source: {"tokens": found.tokens[:width], "ngram": found.ngram, "shared": shared,
                                       "first_node": len(tree)}}
    return Draft(grown, q=None, q_token=q_token, extras=extras, lookahead=draft.lookahead)


def graft_spans(extras: Mapping[str, Any], nodes: int) -> list[tuple[str, int, int]]:
    """Each grafted source's nodes in a draft of `nodes` nodes, in node order: (its extras key,
    first node, last node). Grafts append after the tree they were grafted onto, so each runs to
    the next one's first."""
    starts = sorted((extras[key]["first_node"], key) for key in GRAFTS if key in extras)
    ends = [first for first, _ in starts[1:]] + [nodes]
    return [(key, first, end - 1) for (first, key), end in zip(starts, ends)]


def own_nodes(tree_len: int, extras: Mapping[str, Any]) -> int:
    """How many of a draft's nodes its drafter proposed: the ones before the first grafted node."""
    return min((extras[key]["first_node"] for key in GRAFTS if key in extras), default=tree_len)


def own_share(tree: DraftTree, extras: Mapping[str, Any], path: Sequence[int]) -> tuple[int, int]:
    """The drafter's part of a verified draft: the depth of its own nodes, and how many of the
    accepted path's nodes were its own (grafted nodes come after the drafter's, and a grafted
    branch leaves the drafter's nodes for good)."""
    own = own_nodes(len(tree), extras)
    depth = max(tree.depths()[:own], default=0)
    return depth, sum(1 for node in path if node < own)
