"""Prompt lookup beside a learned drafter: the match, the choice of source, and losslessness."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.config import PromptLookupConfig
from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.gate import DraftGate, chain_value
from specflash.drafters.lookup_source import LookupSource
from specflash.drafters.prompt_lookup import lookup, lookup_match
from specflash.errors import MethodConfigError
from specflash.models.target import TargetModel
from test_draft_vocab import vocab_drafter
from test_gate import PROMPT, STEEP, _cpu_like_costs, _useless


def test_match_says_how_long_the_ngram_was():
    cfg = PromptLookupConfig(k=3, max_ngram=3, min_ngram=1)
    assert lookup_match([5, 6, 7, 8, 9, 5, 6, 7], cfg, 8) == ([8, 9, 5], 3)
    assert lookup_match([4, 6, 7, 8, 9, 5, 6, 7], cfg, 8) == ([8, 9, 5], 2)
    assert lookup_match([4, 2, 7, 8, 9, 5, 6, 7], cfg, 2) == ([8, 9], 1)
    assert lookup_match([1, 2, 3], cfg, 8) == ([], 0)
    assert lookup([5, 6, 7, 8, 9, 5, 6, 7], cfg, 8) == [8, 9, 5]


def _offer(source: LookupSource, context: list[int], room: int, cost: list[float], against: float):
    """find then offer, as the drafter does each step: None where nothing matched or it did not pay."""
    found = source.find(context, room)
    return None if found is None else source.offer(found, cost, against)


def test_offer_beats_the_drafter_or_stays_out():
    source = LookupSource(depth=4)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]  # the last 3 tokens occurred before, followed by 8 9 1 5
    source.accept[3] = [0.9] * 4
    offer = _offer(source, context, room=4, cost=[1.0] * 5, against=1.2)
    assert offer is not None and offer.tokens == [8, 9, 1, 5] and offer.ngram == 3
    assert offer.value == pytest.approx(chain_value([0.9] * 4, 4, [1.0] * 5)) and offer.against == 1.2
    assert _offer(source, context, room=2, cost=[1.0] * 5, against=1.2).tokens == [8, 9]
    source.accept[3] = [0.9, 0.5, 0.2, 0.2]  # past two tokens the continuation is rarely right
    assert _offer(source, context, room=4, cost=[1.0] * 5, against=1.0).tokens == [8, 9, 1, 5]
    assert _offer(source, context, room=4, cost=STEEP, against=1.0).tokens == [8, 9]  # not worth verifying on CPU
    assert _offer(source, context, room=4, cost=[1.0] * 5, against=offer.value) is None
    source.accept[3] = [0.05] * 4
    assert _offer(source, context, room=4, cost=STEEP, against=1.0) is None
    assert source.find([1, 2, 3], room=4) is None  # no match at all


def test_every_continuation_is_scored_against_what_the_target_commits():
    """Offered or not, each step's continuation is scored position by position as the target
    commits tokens, up to its first miss, into the estimates of its match length only."""
    source = LookupSource(depth=3, smoothing=0.5)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]  # continuation 8 9 1 after a 3-gram match
    assert _offer(source, context, room=3, cost=STEEP, against=100.0) is None  # not drafted: too dear
    source.committed(context + [8])
    assert source.accept[3] == [0.75, None, None]  # from the prior of 0.5
    source.committed(context + [8, 0])  # the second token missed: the third says nothing
    # the unseen second position starts from the first's estimate
    assert source.accept[3] == [0.75, 0.5 * 0.75, None] and source.pending == []
    assert source.accept[1] == [None] * 3 and source.accept[2] == [None] * 3
    context += [8, 9, 1]
    offer = _offer(source, context, room=3, cost=[1.0] * 4, against=1.0)
    assert offer is not None and offer.ngram == 3 and offer.tokens == [5, 6, 7]
    _offer(source, context + [5], room=3, cost=[1.0] * 4, against=1.0)  # the next step's continuation: 6 7 8
    source.committed(context + [5, 6, 7, 8])  # both right all the way
    assert source.accept[3] == pytest.approx([0.9375, 0.84375, 0.921875]) and source.pending == []


def test_a_branch_is_scored_once_where_its_prefix_was_right():
    """Where the continuation left the drafted tree, its token there is scored into the branch
    estimate of its match length, once the target got that far, and only if the tokens before it
    were right; the estimate is the rule of succession, (hits + 1) / (tries + 2)."""
    source = LookupSource(depth=3)
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]  # continuation 8 9 1 after a 3-gram match
    assert source.find(context, room=3).branch == 0.5
    source.branched(1)  # the tree held 8, and other tokens where this says 9
    source.committed(context + [8])
    assert source.branch[3] == [0, 0]  # not that far yet
    source.committed(context + [8, 4])
    assert source.branch[3] == [0, 1]
    source.find(context + [8, 4], room=3)  # a new continuation, not a branch of any tree
    source.committed(context + [8, 4, 0, 0, 0])
    assert source.branch[3] == [0, 1]
    tail = [7, 8, 9, 2, 7, 8]  # after 7 8: 9 2 7, a 2-gram match
    assert source.find(tail, room=3).tokens == [9, 2, 7]
    source.branched(1)
    source.committed(tail + [3, 2, 7])  # the first token missed: the branch at 1 was never reachable
    assert source.branch[2] == [0, 0]
    found = source.find(context + [8, 4, 0, 0, 0] + context, room=3)
    assert found.ngram == 3 and found.branch == pytest.approx(1 / 3)


def test_lookup_runs_only_beside_the_gate(tiny_targets):
    """Without the gate nothing chooses between sources: the drafter drafts every step, and the
    run's config says lookup was off."""
    with pytest.raises(MethodConfigError, match="lookup must be"):
        DFlashConfig(lookup="yes")
    target = tiny_targets["qwen3"]
    prompt_ids = [11, 42, 7, 93, 11, 42, 7, 93, 11, 42]
    drafter = DFlashEngineDrafter(vocab_drafter(target, [11, 42, 7, 93], feature_layers=(1,)),
                                  DFlashConfig(gate=False, lookup=True))
    run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=12)
    assert run.output_ids == hf_greedy(target, prompt_ids, 12)
    assert run.config["lookup"] is False and all("lookup" not in s.extras for s in run.steps)
    assert DFlashConfig().lookup and DFlashConfig().gate  # both on by default


def test_longest_match_sets_the_estimates_kept(tiny_targets):
    with pytest.raises(MethodConfigError, match="lookup_max_ngram must be"):
        DFlashConfig(lookup_max_ngram=0)
    drafter = DFlashEngineDrafter(vocab_drafter(tiny_targets["qwen3"], [5, 9]), DFlashConfig(lookup_max_ngram=5), STEEP)
    drafter.begin([1, 2, 3], None, None)
    assert sorted(drafter.lookups.accept) == [1, 2, 3, 4, 5] and drafter.lookups.cfg.max_ngram == 5


def _looping(target: TargetModel, period: list[int]) -> TargetModel:
    """A copy of a tiny target fitted to repeat `period` over and over: a real model whose greedy
    text repeats itself, where the random ones almost never do."""
    model = copy.deepcopy(target.model).train()
    ids = torch.tensor([period * 8])
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        opt.zero_grad()
        model(ids, labels=ids).loss.backward()
        opt.step()
    return TargetModel(model.eval(), target.tokenizer)


def _doubting(cls: type) -> type:
    """The drafter class with prompt lookup's estimates starting low, so its own drafter runs
    first and lookup takes over only once its scored continuations have shown it pays."""

    def begin(self, prompt_ids, sampling, generator) -> None:
        cls.begin(self, prompt_ids, sampling, generator)
        self.lookups.accept = {n: [0.05] * len(rates) for n, rates in self.lookups.accept.items()}

    return type(f"Doubting{cls.__name__}", (cls,), {"begin": begin})


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("method", ["dflash", "adaflash"])
def test_lookup_drafts_stay_greedy_and_skip_the_drafter(tiny_targets, arch, method, monkeypatch):
    """A drafter that is never right, beside prompt lookup, on a target whose text repeats itself:
    the output is exactly greedy; lookup, scored while the drafter's gate runs, takes over and gets
    tokens accepted (the drafter's cache catching up on the features of what they committed when it
    runs again); and the drafter runs only on the steps its own gate drafted or looked."""
    _cpu_like_costs(monkeypatch)
    period = [11, 42, 7, 93, 25, 60]
    target = _looping(tiny_targets[arch], period)
    prompt_ids = period * 2 + period[:2]
    reference = hf_greedy(target, prompt_ids, 40)
    assert lookup_match(prompt_ids + reference, PromptLookupConfig(), 8)[0]  # it does repeat itself
    model = _useless(target, prompt_ids, 40)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    cfg = {"dflash": DFlashConfig(lookup=True), "adaflash": AdaFlashConfig(lookup=True, rule="fixed", fixed_len=7)}
    drafter = _doubting({"dflash": DFlashEngineDrafter, "adaflash": AdaFlashDrafter}[method])(model, cfg[method], STEEP)
    run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=40)
    assert run.output_ids == reference
    states = [s.extras["gate"]["state"] for s in run.steps[1:]]
    first = states.index("lookup")
    assert first > 0 and set(states[:first]) <= {"shadow", "off", "on", "probe"}
    looked_up = [s for s in run.steps[1:] if s.extras["gate"]["state"] == "lookup"]
    assert sum(len(s.accepted) for s in looked_up) >= len(looked_up)
    assert all(s.tokens == s.extras["lookup"]["tokens"] for s in looked_up)
    assert len(forwards) == sum(state in ("on", "probe", "shadow") for state in states)


def test_drafter_catches_up_after_lookup_steps(tiny_targets, monkeypatch):
    """Lookup and the drafter taking turns: each drafter block first takes in the features of every
    position the lookup step before it committed (a cache out of step with the target raises),
    and the output stays exactly greedy."""
    import functools

    import specflash.drafters.dflash as dflash_module

    # a free verifier and a free drafter: drafting always pays, so the drafter's gate stays on
    monkeypatch.setattr(dflash_module, "DraftGate", functools.partial(DraftGate, draft_cost=0.0))
    target = _looping(tiny_targets["qwen3"], [11, 42, 7, 93, 25, 60])
    prompt_ids = [11, 42, 7, 93, 25, 60, 11, 42]
    reference = hf_greedy(target, prompt_ids, 60)
    offer, calls = LookupSource.offer, []

    def every_other_step(self, *args):
        calls.append(1)
        return offer(self, *args) if len(calls) % 2 else None

    monkeypatch.setattr(LookupSource, "offer", every_other_step)
    model = vocab_drafter(target, sorted(set(reference)), feature_layers=(1,))
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(lookup=True), [1.0] * 9),
                   max_new_tokens=60)
    assert run.output_ids == reference
    decode = run.steps[1:]
    states = [s.extras["gate"]["state"] for s in decode]
    turns = [(a, b) for a, b in zip(decode, decode[1:])
             if a.extras["gate"]["state"] == "lookup" and len(a.accepted) and b.extras["gate"]["state"] == "on"]
    assert len(turns) >= 2
    assert len(forwards) == sum(state in ("on", "probe", "shadow") for state in states)


def test_lookup_leaves_the_gate_its_plain_timing_steps(tiny_targets, monkeypatch):
    """A gate timing its own steps measures every width against a plain one-token step, taken every
    4 * probe_every steps at least; lookup, which could draft every step here, yields to it. The
    clock ticks a fixed 1 ms per read, so every width times alike: with the real clock, a loaded
    machine could time wide steps dear enough that lookup stopped paying (a flaky test)."""
    import itertools
    import time

    ticks = itertools.count(0.0, 0.001)
    monkeypatch.setattr(time, "perf_counter", lambda: next(ticks))
    target = _looping(tiny_targets["llama"], [11, 42, 7, 93, 25, 60])
    prompt_ids = [11, 42, 7, 93, 25, 60, 11, 42]
    model = vocab_drafter(target, [11, 42, 7, 93, 25, 60], feature_layers=(1,))
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(probe_every=1), [1.0] * 9),
                   max_new_tokens=80)
    assert run.output_ids == hf_greedy(target, prompt_ids, 80)
    decode = run.steps[1:]
    plain = [i for i, s in enumerate(decode) if s.verified == 1]
    assert sum("lookup" in s.extras for s in decode) > len(decode) // 2 and len(decode) > 10
    assert plain and plain[0] <= 1 and all(b - a <= 4 * 1 + 2 for a, b in zip(plain, plain[1:]))
    assert len(decode) - 1 - plain[-1] <= 4 * 1 + 2


def test_match_length_table_counts_by_the_longest_match():
    """scripts/lookup_match_lengths.py: at each answer position the longest match proposes, and its
    run of tokens matching the answer is counted under that match length (worked by hand)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "lookup_match_lengths.py"
    spec = importlib.util.spec_from_file_location("lookup_match_lengths", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # tail 1 2 -> proposes 3 4 1 2 (2 right); then 1 2 3 -> 4 1 2 3 (1 right); then 1 2 3 4 -> 1 2 3 4 (0)
    stats = module.match_stats([1, 2, 3, 4, 1, 2], [3, 4, 9], max_ngram=6)
    assert dict(stats) == {2: [1, 1, 2], 3: [1, 1, 1], 4: [1, 0, 0]}
