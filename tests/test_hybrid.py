"""Hybrid targets (Gated DeltaNet linear attention interleaved with full attention, as in
Qwen3-Next and Qwen3.5): recurrent states are checkpointed before verification and replayed
after a rejection (row by row in a batch), so every chain method and batched decoding equal
transformers' greedy decoding; tree methods say in one line why they cannot run."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from conftest import HYBRID_ARCHS, hf_greedy
from test_adaflash import STEEP, random_head as length_head
from test_dels import random_head as local_head
from test_batch import OracleDrafter
from test_dflash import random_drafter
from specflash.api import generate, generate_batch
from specflash.config import DraftModelConfig, PromptLookupConfig
from specflash.drafters import build_drafter
from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.base import Draft, Drafter
from specflash.drafters.dels import DeLSConfig, DeLSDrafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.errors import UnsupportedModelError
from specflash.kv import checkpoint, is_recurrent, restore, rollback
from specflash.tree import DraftTree

PROMPTS = ["The quick brown fox jumps over the lazy dog. The quick brown", "def add(a, b):"]


class ChainOracle(Drafter):
    """Chains of 0-5 tokens of the true greedy continuation, often corrupted at a random place,
    so verification accepts all, some or none of a draft and the target must roll back."""

    name = "chain-oracle"

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, seed: int = 0) -> None:
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab
        self.rng = random.Random(seed)

    def propose(self, context: list[int], max_len: int) -> Draft:
        done = len(context) - self.prompt_len
        chain = self.reference[done : done + min(max_len, self.rng.randint(0, 5))]
        if chain and self.rng.random() < 0.6:
            chain[self.rng.randrange(len(chain))] = self.rng.randrange(self.vocab)
        return Draft(DraftTree.chain(chain))


def perturbed(model, scale: float, seed: int = 0):
    """A copy of `model` with noise on every weight: a drafter that agrees with it often, not always."""
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * p.std().clamp_min(1e-3))
    return twin


def _drafter(method: str, target, ids: list[int], ref: list[int]) -> Drafter:
    if method == "ar":
        return Drafter()
    if method == "pld":
        return PromptLookupDrafter(PromptLookupConfig(k=5, max_ngram=3))
    if method == "oracle":
        return ChainOracle(ref, len(ids), target.vocab_size, seed=len(ids))
    if method == "draft-self":
        return DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size)
    if method == "draft-noisy":  # a recurrent drafter that is partly accepted: its own rollback runs
        return DraftModelDrafter(perturbed(target.model, 0.02), DraftModelConfig(k=4), target.vocab_size)
    model = random_drafter(target, block=8, feature_layers=(0, 3))
    if method == "dflash":
        return DFlashEngineDrafter(model, DFlashConfig(gate=False))
    if method == "adaflash":
        return AdaFlashDrafter(model, AdaFlashConfig(gate=False, rule="head"), STEEP[:8], length_head(target.hidden_size))
    if method == "dels":
        return DeLSDrafter(model, DeLSConfig(gate=False, alpha=0.7, beta=0.3), local_head(target))
    raise AssertionError(method)


def test_tiny_hybrids_are_hybrid(family_target):
    for arch in HYBRID_ARCHS:
        target = family_target(arch)
        assert target.family.recurrent and target.sliding_window is None
        assert target.family.layer_types == ("linear_attention", "full_attention") * 2
        assert is_recurrent(target.new_cache())


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_checkpoint_restore_equals_never_fed(family_target, arch):
    """Feeding a block, restoring the checkpoint and feeding another block gives exactly what the
    second block gives on a cache that never saw the first."""
    target = family_target(arch)
    ids = target.tokenizer(PROMPTS[0]).input_ids
    fresh = target.new_cache()
    target.forward(ids, fresh, 0)
    expected = target.forward([5, 6, 7], fresh, len(ids)).logits
    cache = target.new_cache()
    target.forward(ids, cache, 0)
    saved = checkpoint(cache)
    target.forward([9, 8, 7, 6], cache, len(ids))
    with pytest.raises(ValueError, match="restore a Checkpoint"):
        rollback(cache, 4)
    restore(cache, saved)
    assert cache.get_seq_length() == len(ids)
    assert torch.equal(target.forward([5, 6, 7], cache, len(ids)).logits, expected)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
@pytest.mark.parametrize("method", ["ar", "pld", "oracle", "draft-self", "draft-noisy", "dflash", "adaflash", "dels"])
def test_greedy_equals_transformers(family_target, arch, method):
    target = family_target(arch)
    accepted = 0
    for prompt, n in zip(PROMPTS, (40, 24)):
        ids = target.tokenizer(prompt).input_ids
        ref = hf_greedy(target, ids, n)
        run = generate(target, ids, max_new_tokens=n, drafter=_drafter(method, target, ids, ref))
        assert run.output_ids == ref, f"{arch}/{method} diverged on {prompt!r}"
        accepted += sum(len(s.accepted) for s in run.steps)
    if method in ("oracle", "draft-self", "draft-noisy"):
        assert accepted > 10, "drafts should be accepted, so rollback and replay are exercised"


def test_noisy_drafter_is_partly_accepted(family_target):
    """The recurrent drafter's own rollback lands inside its drafted tokens."""
    target = family_target("qwen3_5")
    ids = target.tokenizer(PROMPTS[0]).input_ids
    run = generate(target, ids, max_new_tokens=40, stop_on_eos=False, drafter=_drafter("draft-noisy", target, ids, []))
    kept = [len(s.accepted) for s in run.steps[1:] if s.tokens]
    assert any(0 < k < 4 for k in kept) and 0 < run.metrics["draft_acceptance_rate"] < 1


def test_trees_say_why_in_one_line(family_target):
    target = family_target("qwen3_next")
    ids = target.tokenizer(PROMPTS[1]).input_ids
    with pytest.raises(UnsupportedModelError, match=r"qwen3_next has recurrent layers .*use ar, draft, pld") as err:
        build_drafter("ptd", target)
    assert "\n" not in str(err.value)

    class TwoBranches(Drafter):
        def propose(self, context, max_len):
            return Draft(DraftTree((5, 6), (-1, -1)))

    with pytest.raises(UnsupportedModelError, match="tree drafts and lookahead tokens"):
        generate(target, ids, max_new_tokens=5, drafter=TwoBranches())


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_batches_equal_transformers(family_target, arch):
    """Left padding stays out of the recurrent states, and rows that keep different numbers of
    drafted tokens each get the state after their own (plain, oracle drafts, DFlash)."""
    target = family_target(arch)
    prompts = [target.tokenizer(p).input_ids for p in (PROMPTS[0], PROMPTS[1], "What is 12 * 7? The answer")]
    refs = [hf_greedy(target, ids, 30) for ids in prompts]
    dflash = DFlashEngineDrafter(random_drafter(target, block=8, feature_layers=(0, 3)), DFlashConfig(gate=False))
    oracle = OracleDrafter(prompts, refs, target.vocab_size)
    for drafter in (None, oracle, dflash):
        batch = generate_batch(target, prompts, drafter=drafter, max_new_tokens=30)
        assert [run.output_ids for run in batch.runs] == refs
    kept = [[len(s.accepted) for s in run.steps[1:4]] for run in generate_batch(
        target, prompts, drafter=OracleDrafter(prompts, refs, target.vocab_size), max_new_tokens=30).runs]
    assert any(len({row[i] for row in kept}) > 1 for i in range(3)), "rows should keep different counts"


def test_dflash_drafts_chains_on_recurrent_targets(family_target):
    """A recurrent state keeps one path, so DFlash drafts chains on such a target even with trees
    on (its default), and the run's config says so."""
    target = family_target("qwen3_5")
    ids = target.tokenizer(PROMPTS[0]).input_ids
    model = random_drafter(target, block=5, feature_layers=(0, 3))
    run = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False, tree=True)), max_new_tokens=12)
    assert run.output_ids == hf_greedy(target, ids, 12)
    assert all(s.parents == list(range(-1, len(s.tokens) - 1)) for s in run.steps)
    assert run.config["tree"] is False
