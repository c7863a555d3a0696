"""Each acceptance rule on its own: hand-built greedy cases, and exactness above temperature 0.

The distribution tests run a synthetic bigram target p(x_t | x_{t-1}) and drafter q on a
4-token vocabulary, generate 3 tokens with speculative steps, and compare the empirical joint
distribution of the 64 possible outputs with the exact one. Bound: total variation < 0.035 at
N = 20,000 samples (the sampling noise alone gives about 0.02); a rule with the classic bugs
(argmax fallback on rejection, forgetting to renormalise the residual, sampling the bonus from
q) lands far above it, as test_bound_catches_a_biased_rule checks.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from specflash.tree import DraftTree
from specflash.verify import accept_token, greedy_chain, sampled_chain, walk_greedy, walk_sampled

V, LENGTH, N, TV_BOUND = 4, 3, 20_000, 0.035


def _bigram(seed: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(V + 1, V, generator=g), dim=-1)  # row V = start


P = _bigram(1, 1.5)
Q = _bigram(2, 1.5)


def _exact_joint() -> dict[tuple[int, ...], float]:
    joint = {}
    for seq in itertools.product(range(V), repeat=LENGTH):
        prob, prev = 1.0, V
        for x in seq:
            prob *= float(P[prev, x])
            prev = x
        joint[seq] = prob
    return joint


def _tv(samples: list[tuple[int, ...]]) -> float:
    exact = _exact_joint()
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    return 0.5 * sum(abs(counts.get(k, 0) / len(samples) - v) for k, v in exact.items())


def _run(propose, verify, seed: int = 0) -> list[tuple[int, ...]]:
    """Generate LENGTH tokens N times with a propose/verify pair, like the engine does."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(N):
        seq: list[int] = []
        while len(seq) < LENGTH:
            prev = seq[-1] if seq else V
            tree, q = propose(prev, g)
            rows = [prev] + list(tree.tokens)  # target distribution after root and after each node
            p = P[torch.tensor(rows)]
            verdict = verify(tree, p, g, q)
            seq += [tree.tokens[i] for i in verdict.path] + [verdict.token]
        out.append(tuple(seq[:LENGTH]))
    return out


def _sampled_chain_proposal(prev, g, k=2):
    tokens, dists = [], []
    for _ in range(k):
        dist = Q[prev]
        prev = int(torch.multinomial(dist, 1, generator=g))
        tokens.append(prev)
        dists.append(dist)
    return DraftTree.chain(tokens), torch.stack(dists)


def _argmax_chain_proposal(prev, g, k=2):
    tokens = []
    for _ in range(k):
        prev = int(Q[prev].argmax())
        tokens.append(prev)
    return DraftTree.chain(tokens), None


def _tree_proposal(prev, g):
    """Two candidates at depth 1 (Q's top-2), each with its argmax child: a point-mass tree."""
    top2 = torch.topk(Q[prev], 2).indices.tolist()
    tokens = (top2[0], top2[1], int(Q[top2[0]].argmax()), int(Q[top2[1]].argmax()))
    return DraftTree(tokens, (-1, -1, 0, 1)), None


def _walk(tree, p, g, q):
    return walk_sampled(tree, p, g, q)


def test_proposal_rule_is_exact():
    assert _tv(_run(_sampled_chain_proposal, _walk)) < TV_BOUND


def test_point_mass_rule_is_exact():
    assert _tv(_run(_argmax_chain_proposal, _walk)) < TV_BOUND


def test_tree_walk_is_exact():
    assert _tv(_run(_tree_proposal, _walk)) < TV_BOUND


def test_bound_catches_a_biased_rule():
    """An argmax fallback on rejection (PTD's reference pitfall) must fail the same bound."""

    def biased(tree, p, g, q):
        verdict = walk_sampled(tree, p, g, q)
        if verdict.kind == "resample":
            row = verdict.path[-1] + 1 if verdict.path else 0
            masked = p[row].clone()
            masked[tree.tokens[tree.children(verdict.path[-1] if verdict.path else -1)[0]]] = 0
            return type(verdict)(verdict.path, int(masked.argmax()), verdict.kind)
        return verdict

    assert _tv(_run(_argmax_chain_proposal, biased)) > 2 * TV_BOUND


def test_greedy_chain_cases():
    assert greedy_chain([5, 6, 7], [5, 6, 7, 8]).path == [0, 1, 2]
    full = greedy_chain([5, 6, 7], [5, 6, 7, 8])
    assert (full.token, full.kind) == (8, "bonus")
    partial = greedy_chain([5, 9, 7], [5, 6, 7, 8])
    assert (partial.path, partial.token, partial.kind) == ([0], 6, "resample")
    none = greedy_chain([1], [2, 3])
    assert (none.path, none.token) == ([], 2)
    empty = greedy_chain([], [4])
    assert (empty.path, empty.token) == ([], 4)


def test_greedy_tree_walk_picks_the_matching_branch():
    #        root
    #       /    \
    #     3(0)   4(1)
    #      |     /   \
    #     5(2) 6(3)  7(4)
    tree = DraftTree((3, 4, 5, 6, 7), (-1, -1, 0, 1, 1))
    # target argmax: after root 4; after node1 (4) -> 7; after node4 (7) -> 9
    argmax = [4, 0, 7, 0, 0, 9]
    verdict = walk_greedy(tree, argmax)
    assert verdict.path == [1, 4] and verdict.token == 9 and verdict.kind == "bonus"
    argmax[2] = 8  # after node1 the target wants 8: neither child matches
    verdict = walk_greedy(tree, argmax)
    assert verdict.path == [1] and verdict.token == 8 and verdict.kind == "resample"


def test_accept_token_residuals():
    p = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    # point mass: the residual is p without the token, renormalised
    kept = [accept_token(p, None, 0, g)[0] for _ in range(4000)]
    assert abs(sum(kept) / 4000 - 0.5) < 0.03
    while True:
        ok, residual = accept_token(p, None, 0, g)
        if not ok:
            break
    assert torch.allclose(residual, torch.tensor([0.0, 0.6, 0.4]))
    # with q: accept min(1, p/q), residual norm(max(0, p - q))
    q = torch.tensor([0.2, 0.6, 0.2])
    assert all(accept_token(p, q, 0, g)[0] for _ in range(200))  # p/q > 1: always kept
    while True:
        ok, residual = accept_token(p, q, 1, g)
        if not ok:
            break
    assert torch.allclose(residual, torch.tensor([1.0, 0.0, 0.0]))


def test_q_requires_a_chain():
    tree = DraftTree((1, 2), (-1, -1))
    with pytest.raises(ValueError):
        walk_sampled(tree, torch.full((3, V), 1 / V), None, torch.full((2, V), 1 / V))
    assert sampled_chain([1], torch.tensor([[0.0, 1.0, 0, 0], [1.0, 0, 0, 0]]), None).path == [0]
