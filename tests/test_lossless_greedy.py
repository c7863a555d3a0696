"""Temperature 0: every method's output equals transformers' greedy decoding, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.config import DraftModelConfig, PromptLookupConfig
from specflash.drafters.base import Draft, Drafter, Lookahead
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.tree import DraftTree

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "What is 12 * 7?",
]


class OracleTreeDrafter(Drafter):
    """Proposes random trees that hide the true greedy continuation (sometimes corrupted) among
    distractor branches, plus random unverified lookahead tokens, so the tree mask, positions,
    walk and KV compaction all get exercised."""

    name = "oracle-tree"

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, seed: int) -> None:
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.rng = random.Random(seed)

    def propose(self, context: list[int], max_len: int) -> Draft:
        done = len(context) - self.prompt_len
        truth = self.reference[done : done + min(max_len, self.rng.randint(0, 5))]
        if truth and self.rng.random() < 0.3:
            truth[self.rng.randrange(len(truth))] = self.rng.randrange(self.vocab)
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for token in truth:
            for _ in range(self.rng.randint(0, 2)):  # distractor siblings before the true child
                tokens.append(self.rng.randrange(self.vocab))
                parents.append(parent)
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
        if max_len > 0:
            for _ in range(self.rng.randint(0, 3)):  # distractor leaves anywhere shallow
                anchor = self.rng.randrange(-1, len(tokens)) if tokens else -1
                depth = 1 if anchor == -1 else DraftTree(tuple(tokens), tuple(parents)).depths()[anchor] + 1
                if depth <= max_len:
                    tokens.append(self.rng.randrange(self.vocab))
                    parents.append(anchor)
        n = len(tokens) + 1
        extra = self.rng.randint(0, 3)
        allow = torch.rand(extra, n + extra, generator=torch.Generator().manual_seed(len(context))) < 0.5
        allow[:, n:] = torch.eye(extra, dtype=torch.bool)  # lookahead rows see themselves, not each other
        lookahead = Lookahead([self.rng.randrange(self.vocab) for _ in range(extra)],
                              [self.rng.randint(1, 4) for _ in range(extra)], allow)
        return Draft(DraftTree(tuple(tokens), tuple(parents)), lookahead=lookahead if extra else None)


def _drafters(name, target, others, ref, ids):
    if name == "ar":
        return Drafter()
    if name == "pld":
        return PromptLookupDrafter(PromptLookupConfig(k=5, max_ngram=3))
    if name == "draft-self":  # mostly right: the target drafting for itself
        return DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size)
    if name == "draft-random":  # mostly wrong: an unrelated random model
        return DraftModelDrafter(others["random-drafter"].model, DraftModelConfig(k=3), target.vocab_size)
    if name == "tree":
        return OracleTreeDrafter(ref, len(ids), target.vocab_size, seed=len(ids))
    raise AssertionError(name)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS + ("mistral",))
@pytest.mark.parametrize("method", ["ar", "pld", "draft-self", "draft-random", "tree"])
def test_greedy_equals_transformers(tiny_targets, arch, method):
    target = tiny_targets[arch]
    for prompt, n in zip(PROMPTS, (24, 40, 17)):
        ids = target.tokenizer(prompt).input_ids
        ref = hf_greedy(target, ids, n)
        drafter = _drafters(method, target, tiny_targets, ref, ids)
        run = generate(target, ids, method="ar", max_new_tokens=n, drafter=drafter)
        assert run.output_ids == ref, f"{arch}/{method} diverged on {prompt!r}"
        assert sum(len(s.committed) for s in run.steps) == len(run.output_ids)


def test_drafts_are_actually_accepted(tiny_targets):
    """The lossless tests above mean something only if drafts are kept: the self-drafter
    should be accepted nearly always, the random one rarely."""
    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[1]).input_ids
    good = generate(target, ids, max_new_tokens=40,
                    drafter=DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size))
    bad = generate(target, ids, max_new_tokens=40,
                   drafter=DraftModelDrafter(tiny_targets["random-drafter"].model, DraftModelConfig(k=4), target.vocab_size))
    assert good.metrics["draft_acceptance_rate"] > 0.9
    assert good.metrics["mean_acceptance_length"] > 3.5
    assert bad.metrics["draft_acceptance_rate"] < 0.3


def test_eos_stops_and_nothing_follows(tiny_targets):
    """Drafted tokens after an EOS are cut: the output ends at the first EOS, like generate()."""
    target = tiny_targets["llama"]
    ids = target.tokenizer(PROMPTS[1]).input_ids
    ref = hf_greedy(target, ids, 60)
    eos = target.eos_ids
    assert any(t in eos for t in ref), "fixture prompt should reach EOS within 60 tokens"
    run = generate(target, ids, max_new_tokens=60,
                   drafter=DraftModelDrafter(target.model, DraftModelConfig(k=6), target.vocab_size))
    assert run.output_ids == ref
    assert run.output_ids[-1] in eos and run.finish_reason == "eos"


def test_to_context_limit(tiny_targets):
    """max_new_tokens=None runs to the context limit and says so."""
    target = tiny_targets["qwen2"]
    ids = target.tokenizer(PROMPTS[1]).input_ids * 20
    limit = target.context_length
    run = generate(target, ids[: limit - 9], max_new_tokens=None, stop_on_eos=False,
                   drafter=PromptLookupDrafter(PromptLookupConfig(k=8)))
    assert len(run.output_ids) == 9
    assert run.finish_reason == "context"
    assert max(s.context_len + len(s.tokens) for s in run.steps) <= limit


def test_stream_yields_the_same_steps(tiny_targets):
    from specflash.api import stream

    target = tiny_targets["qwen3"]
    ids = target.tokenizer(PROMPTS[2]).input_ids
    steps = list(stream(target, ids, method="pld", max_new_tokens=20))
    run = generate(target, ids, method="pld", max_new_tokens=20)
    assert [s.committed for s in steps] == [s.committed for s in run.steps]
    assert steps[0].phase == "prefill" and all(s.phase == "decode" for s in steps[1:])
    assert torch.equal(torch.tensor(run.output_ids), torch.tensor(sum((s.committed for s in steps), [])))
