"""Prompt lookup grafted onto the drafter's tree: the tree operation, how much is grafted, what the
gate is told, and that output stays exactly greedy."""

from __future__ import annotations

import pytest

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.base import Draft
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter, verify_rows
from specflash.drafters.gate import DraftGate
from specflash.drafters.lookup_graft import (best_graft, branch_point, graft, graft_survival, grafted_value, own_share,
                                             survival)
from specflash.drafters.lookup_source import Continuation
from specflash.errors import MethodConfigError
from specflash.trace import ROOT
from specflash.tree import DraftTree, best_first_tree
from test_draft_vocab import vocab_drafter
from test_lookup_source import _looping

FLAT = [1.0] * 15
# a tree: 5 -> 6 -> 7 and a sibling 8 of 6
TREE = DraftTree((5, 6, 8, 7), (ROOT, 0, 0, 1))


def test_chain_follows_the_tree_then_branches_off():
    grown, shared = TREE.with_chain([5, 8, 9, 10])
    assert shared == 2
    assert grown.tokens == (5, 6, 8, 7, 9, 10) and grown.parents == (ROOT, 0, 0, 1, 2, 4)
    grown, shared = TREE.with_chain([4, 5])
    assert shared == 0 and grown.parents[4:] == (ROOT, 4) and grown.tokens[4:] == (4, 5)
    assert TREE.with_chain([5, 6, 7]) == (TREE, 3)
    assert TREE.with_chain([]) == (TREE, 0)
    assert DraftTree((), ()).with_chain([3, 4]) == (DraftTree.chain([3, 4]), 0)


def test_best_first_tree_keeps_the_likeliest_paths_and_asks_only_while_there_is_room():
    """Worked by hand: the root's children 5 (0.6) and 6 (0.4); under 5, 7 (0.9) and 8 (0.1). Paths
    5: 0.6, 5-7: 0.54, 6: 0.4, 5-8: 0.06; 3 nodes keep 5, 7, 6. Equal probabilities go to the
    smaller tie key. Successors are asked for the root and each kept node but the last."""
    children = {ROOT: [(0.6, 0, 5, 0), (0.4, 1, 6, 1)], 0: [(0.9, 2, 7, 2), (0.1, 3, 8, 3)]}
    asked = []

    def successors(node, payload):
        asked.append(node)
        return children.get(payload if payload is not None else ROOT, [])

    tree, q = best_first_tree(successors, 3)
    assert tree == DraftTree((5, 7, 6), (ROOT, 0, ROOT)) and q == pytest.approx([0.6, 0.9, 0.4])
    assert asked == [ROOT, 0, 1]
    tied, _ = best_first_tree(lambda node, payload: [(0.5, 1, 9, None), (0.5, 0, 4, None)] if node == ROOT else [], 2)
    assert tied.tokens == (4, 9)


def test_graft_width_weighs_each_row_against_what_it_adds():
    tree, look = [0.5, 0.25], [0.9, 0.81, 0.729]
    assert survival([0.5, 0.5, 0.5], 2) == [0.5, 0.25]
    assert best_graft(tree, look, shared=0, nodes=2, cost=FLAT)[0] == 3  # free rows: all of it
    assert best_graft(tree, look, shared=0, nodes=2, cost=[1, 1, 1, 5, 5, 5])[0] == 0  # a row costs 4 more steps
    # the tree alone: 1.75 tokens for 1.0. One more row costs 0.1 and adds 0.9: 2.65 / 1.1, worth it;
    # the second adds 0.81 for another 0.1: 3.46 / 1.2, worth it; the third 0.73 at 4.3: 4.19 / 4.3, not
    assert best_graft(tree, look, shared=0, nodes=2, cost=[1, 1, 1, 1.1, 1.2, 4.3])[0] == 2
    assert best_graft(tree, look, shared=1, nodes=2, cost=[1, 1, 1, 1.1])[0] == 2  # its first token is in the tree
    assert best_graft(tree, look, shared=3, nodes=2, cost=FLAT)[0] == 0  # nothing new
    assert best_graft(tree, look, shared=0, nodes=2, cost=[1, 1, 1, 1])[0] == 1  # the curve ends at 4 rows
    # drafting 3 nodes (a chain at 0.5: 1 + 0.5 + 0.25 + 0.125) with all 3 lookup tokens grafted on
    # free rows, branching off at the first (the drafter has its own token there): + 0.2, 0.2 * 0.9, 0.2 * 0.81
    found = Continuation([7, 8, 9], ngram=2, rates=[0.9] * 3, branch=0.2)
    assert grafted_value([0.5] * 7, 3, found, FLAT) == pytest.approx(1.875 + 0.2 + 0.18 + 0.162)
    assert grafted_value([0.5] * 7, 3, found, [1, 1, 1, 1, 9, 9, 9], draft_cost=0.5) == pytest.approx(1.875 / 1.5)


def test_where_a_continuation_leaves_the_tree_and_what_it_is_then_worth():
    """TREE holds 5 -> 6 -> 7 and 5 -> 8. A continuation that leaves a node with other children is
    a branch, scored by the branch estimate at that position; one that goes on from a leaf, or that
    the tree holds whole, is not."""
    assert branch_point(TREE, [5, 9, 1]) == (1, 1)  # 5 held; 6 and 8 are the tree's tokens where it says 9
    assert branch_point(TREE, [4, 5]) == (0, 0)  # the root's children are 5 only
    assert branch_point(TREE, [5, 8, 9]) == (2, None)  # 8 is a leaf: 9 competes with nothing of the tree
    assert branch_point(TREE, [5, 6, 7]) == (3, None)
    assert branch_point(DraftTree((), ()), [1, 2]) == (0, None)
    found = Continuation([5, 9, 1], ngram=3, rates=[0.9, 0.8, 0.7], branch=0.2)
    assert graft_survival(found, 1) == pytest.approx([0.9, 0.18, 0.126])
    assert graft_survival(found, None) == pytest.approx([0.9, 0.72, 0.504])


def test_graft_appends_after_the_drafters_nodes_and_says_so():
    draft = Draft(TREE, q_token=[0.9, 0.5, 0.3, 0.4], extras={"dflash": {"block_size": 8}})
    found = Continuation([5, 8, 9, 10], ngram=3, rates=[0.9] * 4)
    out = graft(draft, found, tree_rates=[0.5] * 7, cost=FLAT)
    assert out.tree.tokens == (5, 6, 8, 7, 9, 10) and out.q_token == [0.9, 0.5, 0.3, 0.4, None, None]
    assert out.extras["graft"] == {"tokens": [5, 8, 9, 10], "ngram": 3, "shared": 2, "first_node": 4}
    assert out.extras["dflash"] == {"block_size": 8}
    # the accepted path 5 -> 8 -> 9: two of its nodes were the drafter's, whose own nodes reach depth 3
    assert own_share(out.tree, out.extras, [0, 2, 4]) == (3, 2)
    assert own_share(TREE, {}, [0, 1]) == (3, 2)
    assert graft(draft, found, tree_rates=[0.5] * 7, cost=[1, 1, 1, 1, 1, 9, 9, 9]) is draft  # not worth a row
    assert graft(Draft.empty(), found, [0.5] * 7, FLAT).tree == DraftTree((), ())  # nothing drafted: nothing grafted


def test_graft_knob_is_checked():
    with pytest.raises(MethodConfigError, match="graft_lookup must be"):
        DFlashConfig(graft_lookup="yes")
    with pytest.raises(MethodConfigError, match="graft_lookup must be"):
        AdaFlashConfig(graft_lookup=1)
    assert DFlashConfig().graft_lookup and AdaFlashConfig().graft_lookup
    assert verify_rows(8) == 15


class _Recorder(DraftGate):
    """A gate that keeps what each verification told it."""

    def verified(self, drafted: int, accepted: int, rows: int | None = None) -> None:
        self.told.append((drafted, accepted, rows))
        super().verified(drafted, accepted, rows)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("method", ["dflash", "adaflash"])
def test_grafted_trees_stay_greedy_and_the_gate_hears_the_drafters_part(tiny_targets, arch, method, monkeypatch):
    """A drafter that knows only part of the text of a target that repeats itself: lookup's
    continuations join its trees, grafted nodes get accepted, the output is exactly greedy, and
    the gate is told the drafter's own depth and acceptance, and every row the forward verified."""
    import specflash.drafters.dflash as dflash_module

    told: list = []

    def recorder(*args, **kwargs):
        gate = _Recorder(*args, **{**kwargs, "draft_cost": 0.0})
        gate.told = told
        return gate

    monkeypatch.setattr(dflash_module, "DraftGate", recorder)
    period = [11, 42, 7, 93, 25, 60]
    target = _looping(tiny_targets[arch], period)
    prompt_ids = period * 2 + period[:2]
    reference = hf_greedy(target, prompt_ids, 40)
    model = vocab_drafter(target, [11, 42, 7, 93], feature_layers=(1,))
    cls, cfg = {"dflash": (DFlashEngineDrafter, DFlashConfig()),
                "adaflash": (AdaFlashDrafter, AdaFlashConfig(rule="fixed", fixed_len=7))}[method]

    class Doubting(cls):  # lookup alone never beats the drafter, so what lookup adds comes by grafts
        def begin(self, prompt_ids, sampling, generator) -> None:
            super().begin(prompt_ids, sampling, generator)
            self.lookups.accept = {n: [0.6] * len(r) for n, r in self.lookups.accept.items()}
            self.gate.accept = [0.9] * self.draft_len

    run = generate(target, prompt_ids, drafter=Doubting(model, cfg, FLAT), max_new_tokens=40)
    assert run.output_ids == reference
    grafted = [s for s in run.steps if "graft" in s.extras]
    assert grafted and all("lookup" not in s.extras for s in grafted)
    first = [s.extras["graft"]["first_node"] for s in grafted]
    assert sum(any(node >= f for node in s.accepted) for s, f in zip(grafted, first)) >= 1
    verified = [s for s in run.steps[1:] if s.tokens]
    assert len(told) == len(run.steps) - 1
    for step, (depth, accepted, rows) in zip(run.steps[1:], told):
        if step.tokens:
            tree = DraftTree(tuple(step.tokens), tuple(step.parents))
            assert (depth, accepted) == own_share(tree, step.extras, step.accepted) and rows == len(step.tokens) + 1
    assert verified


def test_no_graft_without_trees_or_when_switched_off(tiny_targets):
    """Chains stay chains (tree=false), and graft_lookup=false keeps the drafter's tree as drafted."""
    period = [11, 42, 7, 93, 25, 60]
    target = _looping(tiny_targets["qwen3"], period)
    prompt_ids = period * 2 + period[:2]
    model = vocab_drafter(target, [11, 42, 7, 93], feature_layers=(1,))
    for cfg in (DFlashConfig(tree=False), DFlashConfig(graft_lookup=False)):
        drafter = DFlashEngineDrafter(model, cfg, FLAT)
        run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=30)
        assert run.output_ids == hf_greedy(target, prompt_ids, 30)
        assert not any("graft" in s.extras for s in run.steps)


def test_drafting_with_the_graft_is_what_lookup_alone_must_beat(tiny_targets, monkeypatch):
    """Lookup's estimates at 0.95, the drafter's at 0.9, verification and drafting free: prompt
    lookup alone beats the drafter's chain (6.6 against 5.2 expected tokens for 7), so without
    grafts it drafts steps alone; with grafts, drafting and grafting it is worth more still (7.0),
    so no step goes to lookup alone and the continuation rides on the drafter's trees."""
    import specflash.drafters.dflash as dflash_module

    monkeypatch.setattr(dflash_module, "DraftGate", lambda *a, **kw: DraftGate(*a, **{**kw, "draft_cost": 0.0}))
    period = [11, 42, 7, 93, 25, 60]
    target = _looping(tiny_targets["qwen3"], period)
    prompt_ids = period * 2 + period[:2]
    model = vocab_drafter(target, [11, 42, 7, 93], feature_layers=(1,))

    class Confident(DFlashEngineDrafter):
        def begin(self, prompt_ids, sampling, generator) -> None:
            super().begin(prompt_ids, sampling, generator)
            self.lookups.accept = {n: [0.95] * len(r) for n, r in self.lookups.accept.items()}
            self.gate.accept = [0.9] * self.draft_len

        def verified(self, draft, logits, path, committed) -> None:  # keep the estimates where they were set
            pass

    runs = {graft_on: generate(target, prompt_ids, drafter=Confident(model, DFlashConfig(graft_lookup=graft_on), FLAT),
                               max_new_tokens=24) for graft_on in (False, True)}
    assert runs[False].output_ids == runs[True].output_ids == hf_greedy(target, prompt_ids, 24)
    looked_up = {g: sum("lookup" in s.extras for s in run.steps) for g, run in runs.items()}
    assert looked_up[False] > 0 and looked_up[True] == 0
    assert any("graft" in s.extras for s in runs[True].steps)
