"""PTD: lossless at temperature 0 and above, and the draft tree's mask, positions, growth, window,
pruning, EOS handling and trace on hand-built trees."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from test_lossless_sampling import PROMPT, RUNS, SAMPLING, V, _exact, _model, _tv
from specflash.api import generate
from specflash.config import SamplingConfig
from specflash.drafters import method_config
from specflash.drafters.base import Draft, Drafter
from specflash.drafters.ptd import PTDConfig, PTDDrafter, build
from specflash.drafters.ptd_pool import NGramPool
from specflash.drafters.ptd_tree import DraftForest
from specflash.engine import Decoding
from specflash.errors import MethodConfigError
from specflash.models.target import TargetModel
from specflash.tree import DraftTree

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,",
    "What is 12 * 7?",
]
OPTIONS = [{}, {"preset": "paper"}, {"update": "top-k", "top_k": 3}]


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("options", OPTIONS, ids=["cpu", "paper", "top-k"])
def test_greedy_equals_transformers(tiny_targets, arch, options):
    target = tiny_targets[arch]
    accepted = 0
    for prompt, n in zip(PROMPTS, (24, 40, 30, 17)):
        ids = target.tokenizer(prompt).input_ids
        ref = hf_greedy(target, ids, n)
        run = generate(target, ids, "ptd", max_new_tokens=n, options=options)
        assert run.output_ids == ref, f"{arch}/{options} diverged on {prompt!r}"
        accepted += sum(len(s.accepted) for s in run.steps)
    assert accepted > 0, "the pool should hit on repetitive prompts, or the test proves little"


class _BranchyPTD(PTDDrafter):
    """PTD whose pool also holds two made-up continuations of every token, so that even a
    three-token run verifies guess trees with several candidates per node."""

    def begin(self, prompt_ids, sampling, generator):
        super().begin(prompt_ids, sampling, generator)
        for token in range(V):
            self.pool.add(token, [(token + 3) % V])
            self.pool.add(token, [(token + 1) % V])


def test_sampled_output_follows_target():
    """Same bound as tests/test_lossless_sampling.py: multi-candidate point-mass guess trees from
    the pool, with the draft tree fed alongside, leave the output distribution exact."""
    target = TargetModel(_model(0))
    exact = _exact(target)
    joint23: dict = {}
    for key, prob in exact.items():
        joint23[key[1:]] = joint23.get(key[1:], 0.0) + prob
    seen23: dict = {}
    drafted = branched = 0
    for seed in range(RUNS):
        drafter = _BranchyPTD(PTDConfig(update="top-k", top_k=3), frozenset(), target.context_length)
        dec = Decoding(target, drafter, PROMPT, SamplingConfig(seed=seed, **SAMPLING), max_new_tokens=3)
        steps = list(dec)
        drafted += sum(len(s.tokens) for s in steps)
        branched += any(len(s.tokens) > 1 for s in steps)
        seen23[tuple(dec.output[1:])] = seen23.get(tuple(dec.output[1:]), 0) + 1
    assert drafted > RUNS // 2 and branched > RUNS // 10, f"too few guesses ({drafted}) or branches ({branched})"
    assert _tv(seen23, joint23, RUNS) < 0.16


def _forest(spec: list[tuple[int, list]]) -> DraftForest:
    """A forest from nested (token, children) pairs."""
    forest = DraftForest()

    def make(token, kids):
        node = forest.new_node(token)
        node.children = [make(t, k) for t, k in kids]
        return node

    forest.roots = [make(t, k) for t, k in spec]
    return forest


def test_lookahead_mask_and_positions():
    # sub-tree 0: 10 -> 11 -> 12; sub-tree 1: 20 -> 21; feed order 10, 11, 12, 20, 21
    forest = _forest([(10, [(11, [(12, [])])]), (20, [(21, [])])])
    look = forest.lookahead(n_guess=2)
    assert look.tokens == [10, 11, 12, 20, 21]
    assert look.positions == [1, 2, 3, 2, 3]
    cols = 1 + 2  # root, two guess nodes, then the lookahead tokens
    seen = [sorted(c - cols for c in look.allow[i].nonzero().flatten().tolist() if c >= cols) for i in range(5)]
    assert seen == [[0], [0, 1], [0, 1, 2], [0, 3], [0, 3, 4]]
    assert look.allow[:, 0].all() and not look.allow[:, 1:cols].any()


def test_lookahead_rows_equal_sequential_decoding(tiny_targets):
    """Each draft row's logits are those of plain decoding of the context its mask and position
    imply (earlier sub-tree roots, then its own ancestors), with a guess tree fed alongside."""
    target = tiny_targets["llama"]
    ctx = target.tokenizer(PROMPTS[0]).input_ids
    forest = _forest([(10, [(11, [(12, [])]), (13, [])]), (20, [(21, [])])])
    guess = DraftTree((30, 31, 32), (-1, 0, -1))
    draft = Draft(guess, lookahead=forest.lookahead(len(guess)))
    dec = Decoding(target, Drafter(), ctx, SamplingConfig(), max_new_tokens=4)
    cache = target.new_cache()
    target.forward(ctx[:-1], cache, 0)
    out = dec._verify_forward(ctx[-1], draft, cache, len(ctx) - 1)
    implied = {0: [10], 1: [10, 11], 2: [10, 11, 12], 3: [10, 13], 4: [10, 20], 5: [10, 20, 21]}
    for row, extra in implied.items():
        with torch.no_grad():
            ref = target.model(torch.tensor([ctx + extra])).logits[0, -1]
        assert torch.allclose(out.logits[1 + len(guess) + row], ref, atol=1e-4), row
    with torch.no_grad():
        ref = target.model(torch.tensor([ctx + [30, 31]])).logits[0, -1]
    assert torch.allclose(out.logits[2], ref, atol=1e-4), "guess rows must not see the draft tree"


def test_grow_adds_predictions_capped_and_not_after_eos():
    forest = _forest([(10, [(11, [])]), (2, [])])
    flat = forest.flat()  # 10, 11, 2
    forest.record(flat, [[11, 12, 13], [14], [15]])
    forest.grow(flat, max_children=2, eos=frozenset({2}))
    assert forest.snapshot() == {"tokens": [10, 11, 14, 12, 2], "parents": [-1, 0, 1, 0, -1]}
    grown = forest.flat()
    forest.grow(grown, max_children=2, eos=frozenset({2}))  # new nodes have no predictions yet
    assert forest.snapshot()["tokens"] == [10, 11, 14, 12, 2]


def test_shift_and_slide_window():
    forest = _forest([(10, []), (20, []), (30, [])])
    forest.roots[2].preds = [40]
    forest.slide(window=4, anchor=1, guess_next=lambda t: t + 1000, eos=frozenset())
    assert [r.token for r in forest.roots] == [10, 20, 30, 40], "a new root is the last root's prediction"
    forest.slide(window=5, anchor=1, guess_next=lambda t: t + 1000, eos=frozenset())
    assert forest.roots[-1].token == 1040, "an unfed last root falls back to guess_next"
    forest.slide(window=3, anchor=1, guess_next=lambda t: t + 1000, eos=frozenset())
    assert [r.token for r in forest.roots] == [30, 40, 1040], "the oldest sub-trees leave the window"
    forest.shift(2)
    assert [r.token for r in forest.roots] == [1040]
    forest.shift(5)
    forest.slide(window=2, anchor=7, guess_next=lambda t: t + 1000, eos=frozenset())
    assert [r.token for r in forest.roots] == [1007, 2007], "an empty window restarts from the root"


def test_slide_never_roots_at_eos():
    forest = _forest([(10, [])])
    forest.roots[0].preds = [2]
    forest.slide(window=2, anchor=1, guess_next=lambda t: 99, eos=frozenset({2}))
    assert [r.token for r in forest.roots] == [10, 99]


def test_prune_depth_goes_deeper():
    forest = _forest([(10, [(11, [(12, [(13, [])])]), (14, [])]), (20, [(10, [(1, [])])]), (30, [(2, [(3, [(4, [])])])])])
    forest.prune_depth(max_depth=3, eos=frozenset({2}))
    # 10's oldest child 11 becomes the root (14 goes); 20 is shallow enough; 30's heir is EOS: dropped
    assert forest.snapshot() == {"tokens": [11, 12, 13, 20, 10, 1], "parents": [-1, 0, 1, -1, 3, 4]}
    forest = _forest([(10, [(20, [(21, [])])]), (20, [])])
    forest.prune_depth(max_depth=2, eos=frozenset())
    assert [r.token for r in forest.roots] == [20], "an heir that already roots a sub-tree is dropped"


def test_cap_children_and_token_budget():
    forest = _forest([(10, [(11, [(12, [])]), (13, []), (14, [])]), (20, [(21, [])])])
    forest.cap_children(2)
    assert forest.snapshot()["tokens"] == [10, 11, 12, 13, 20, 21]
    forest.cap_tokens(4)  # roots 10, 20, then level 2 oldest first: 11, 13
    assert forest.snapshot() == {"tokens": [10, 11, 13, 20], "parents": [-1, 0, 0, -1]}
    forest.cap_tokens(1)
    assert forest.snapshot() == {"tokens": [10], "parents": [-1]}


def test_pool_tries_are_bounded_recent_first_and_budgeted():
    pool = NGramPool(max_nodes=5, max_depth=3)
    pool.add_text([1, 2, 3, 4, 1, 5, 6])
    assert pool.guess(1, budget=10, max_depth=3) == DraftTree((5, 6, 2, 3, 4), (-1, 0, -1, 2, 3))
    assert pool.guess(1, budget=2, max_depth=3) == DraftTree((5, 6), (-1, 0))
    assert pool.guess(1, budget=10, max_depth=1) == DraftTree((5, 2), (-1, -1))
    assert pool.first_continuation(1, 5) == [5, 6]
    pool.add(1, [7, 8, 9])
    assert pool.guess(1, budget=10, max_depth=3).tokens == (7, 8, 9, 5, 6), "the oldest branch is evicted"
    pool.add_tree(4, [8, 9, 10], [-1, 0, -1], {1: 11})
    assert pool.guess(4, 10, 3) == DraftTree((10, 8, 9, 11), (-1, -1, 1, 2))
    assert pool.guess(42, 10, 3) == DraftTree((), ())


def test_eos_from_the_tokenizer_and_generation_stops(tiny_targets):
    target = tiny_targets["llama"]
    drafter = build(target, PTDConfig(), None)
    assert target.tokenizer.eos_token_id in drafter.eos and drafter.eos == target.eos_ids
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    ref = hf_greedy(target, ids, 60)
    assert any(t in target.eos_ids for t in ref), "fixture prompt should reach EOS within 60 tokens"
    run = generate(target, ids, "ptd", max_new_tokens=60, options={"preset": "paper"})
    assert run.output_ids == ref and run.finish_reason == "eos"
    for step in run.steps[1:]:
        after = step.extras["ptd"]["draft_after"]
        assert not any(after["parents"][i] == -1 and t in target.eos_ids for i, t in enumerate(after["tokens"]))
        assert not any(p >= 0 and after["tokens"][p] in target.eos_ids for p in after["parents"])


def test_trace_is_json_and_consistent(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[1]).input_ids
    run = generate(target, ids, "ptd", max_new_tokens=30, options={"preset": "paper"})
    decode = run.steps[1:]
    for step, nxt in zip(decode, decode[1:]):
        ptd = json.loads(json.dumps(step.extras))["ptd"]
        before, after = ptd["draft_before"], ptd["draft_after"]
        assert ptd["lookahead_size"] == len(before["tokens"]) and ptd["guess_size"] == len(step.tokens)
        assert sorted(ptd["added"] + ptd["inherited"]) == list(range(len(after["tokens"])))
        assert all(0 <= i < len(before["tokens"]) for i in ptd["pruned"])
        assert len(before["tokens"]) - len(ptd["pruned"]) == len(ptd["inherited"])
        if nxt is not decode[-1]:  # the last step has no room for a draft and feeds none
            assert nxt.extras["ptd"]["draft_before"] == after, "what is grown is what is fed next"
        assert step.verified == 1 + ptd["guess_size"] + ptd["lookahead_size"]


@pytest.mark.parametrize("bad", [{"max_depth": 0}, {"window": -1}, {"update": "sample"}, {"preset": "huge"},
                                 {"seed_prompt": "yes"}, {"guess_budget": 1.5}, {"max_children": True}])
def test_bad_config_raises(bad):
    with pytest.raises(MethodConfigError):
        PTDConfig(**bad)


def test_unknown_option_and_preset_defaults():
    with pytest.raises(MethodConfigError):
        method_config("ptd", {"depth": 3})
    assert PTDConfig(preset="paper").max_depth == 6 and PTDConfig(preset="paper", max_depth=2).max_depth == 2
