"""Replaying a recorded PTD step: the forest rebuilt from its trace snapshot, and Draft.feed (the
ids, visibility and positions of one verification forward) against the engine's own forward."""

from __future__ import annotations

import torch

from specflash.api import generate
from specflash.config import SamplingConfig
from specflash.drafters.base import Draft
from specflash.drafters.ptd_tree import DraftForest
from specflash.sampling import probabilities
from specflash.tree import DraftTree


def test_feed_of_a_chain_and_of_a_tree_with_lookahead():
    ids, allow, positions = Draft(DraftTree.chain([7, 8])).feed(root=5, start=10)
    assert ids == [5, 7, 8] and positions == [10, 11, 12]
    assert torch.equal(allow, torch.ones(3, 3, dtype=torch.bool).tril())

    forest = DraftForest()
    a, b = forest.new_node(10), forest.new_node(20)
    a.children.append(forest.new_node(11))
    forest.roots = [a, b]  # feed order 10, 11, 20
    guess = DraftTree((30, 31, 32), (-1, 0, -1))
    ids, allow, positions = Draft(guess, lookahead=forest.lookahead(len(guess))).feed(root=5, start=10)
    assert ids == [5, 30, 31, 32, 10, 11, 20]
    assert positions == [10, 11, 12, 11, 11, 12, 12]
    rows = [sorted(allow[i].nonzero().flatten().tolist()) for i in range(len(ids))]
    assert rows == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 4], [0, 4, 5], [0, 4, 6]]


def test_forest_from_snapshot_round_trips():
    forest = DraftForest()
    r0, r1 = forest.new_node(10), forest.new_node(20)
    c = forest.new_node(11)
    c.children = [forest.new_node(12), forest.new_node(13)]
    r0.children = [c, forest.new_node(14)]
    forest.roots = [r0, r1]
    again = DraftForest.from_snapshot(forest.snapshot())
    assert again.snapshot() == forest.snapshot()
    old, new = forest.lookahead(3), again.lookahead(3)
    assert old.tokens == new.tokens and old.positions == new.positions and torch.equal(old.allow, new.allow)


def test_recorded_step_replays_to_its_target_probabilities(tiny_targets):
    """From a trace alone (guess tree + draft_before snapshot), Draft.feed rebuilds the forward
    the engine ran: the target's p of every guess node comes out as recorded."""
    target = tiny_targets["llama"]
    ids = target.tokenizer("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").input_ids
    run = generate(target, ids, "ptd", max_new_tokens=12, options={"preset": "paper"})
    steps = [s for s in run.steps if s.phase == "decode" and s.tokens and s.extras["ptd"]["lookahead_size"]]
    assert steps, "the repetitive prompt should give a step with both a guess tree and a draft tree"
    for step in steps[:3]:
        context = run.prompt_ids + run.output_ids[: step.context_len - len(run.prompt_ids)]
        guess = DraftTree(tuple(step.tokens), tuple(step.parents))
        forest = DraftForest.from_snapshot(step.extras["ptd"]["draft_before"])
        fed, allow, positions = Draft(guess, lookahead=forest.lookahead(len(guess))).feed(context[-1], len(context) - 1)
        assert len(fed) == step.verified
        cache = target.new_cache()
        target.forward(context[:-1], cache, 0)
        out = target.forward(fed, cache, len(context) - 1, allow=allow, positions=positions)
        probs = probabilities(out.logits[: len(guess) + 1], SamplingConfig())
        p = [float(probs[parent + 1, token]) for token, parent in zip(guess.tokens, guess.parents)]
        assert torch.allclose(torch.tensor(p), torch.tensor(step.p), atol=1e-5)
