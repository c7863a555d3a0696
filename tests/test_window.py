"""Sliding-window targets (gpt-oss: windowed and full layers alternate, with attention sinks;
Mistral: every layer windowed), window 8: tree attention carries the window in its mask, so tree
drafts and PTD stay lossless with prompts and outputs far past it."""

from __future__ import annotations

import pytest
import torch

from conftest import WINDOW_ARCHS, hf_greedy
from test_batch import OracleDrafter
from test_hybrid import ChainOracle
from test_dflash import random_drafter
from test_lossless_greedy import OracleTreeDrafter
from specflash.api import generate, generate_batch
from specflash.config import DraftModelConfig, PromptLookupConfig
from specflash.drafters.base import Drafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.draft_model import DraftModelDrafter
from specflash.drafters.prompt_lookup import PromptLookupDrafter
from specflash.kv import keep_rows
from specflash.models.family import FULL, SLIDING
from specflash.tree import DraftTree, additive_mask

TREE = DraftTree((10, 11, 12, 13, 14, 15), (-1, -1, 0, 1, 1, 3))  # depths 1, 1, 2, 2, 2, 3
PROMPTS = [  # 24 and 52 tokens against a window of 8
    "The quick brown fox jumps over the lazy dog.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
PTD_OPTIONS = [{}, {"preset": "paper"}]


def _last_logits(target, ids):
    return target.forward(ids, target.new_cache(), 0).logits[-1]


def test_window_mask_by_hand():
    """Window 3, prefix of 4 (positions 0-3), root at 4, chain a(5) - c(6) and a sibling b(5)."""
    tree = DraftTree((1, 2, 3), (-1, -1, 0))
    mask = additive_mask(tree.ancestor_mask(), 4, torch.float32, tree.position_ids(4), window=3)[0, 0] == 0
    # columns: prefix 0..3, root, a, b, c
    assert mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]  # root at 4 sees 2, 3, itself
    assert mask[1].tolist() == [0, 0, 0, 1, 1, 1, 0, 0]  # a at 5 sees 3, root, itself
    assert mask[3].tolist() == [0, 0, 0, 0, 1, 1, 0, 1]  # c at 6 sees root, a, itself: never b
    with pytest.raises(ValueError, match="positions"):
        additive_mask(tree.ancestor_mask(), 4, torch.float32, window=3)


def test_families_mask_per_layer_type(family_target):
    gpt, mistral = family_target("gpt_oss"), family_target("mistral_window")
    assert gpt.sliding_window == mistral.sliding_window == 8
    allow, positions = TREE.ancestor_mask(), TREE.position_ids(20)
    masks = gpt.family.tree_mask(allow, 20, positions, torch.float32)
    assert set(masks) == {FULL, SLIDING} and not torch.equal(masks[FULL], masks[SLIDING])
    assert torch.equal(masks[FULL], additive_mask(allow, 20, torch.float32))
    assert torch.is_tensor(mistral.family.tree_mask(allow, 20, positions, torch.float32))


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
def test_tree_nodes_match_sequential_paths_past_the_window(family_target, arch):
    """Every node's logits equal a plain forward of prefix + its path, 20 tokens past a window of
    8, and keeping a path leaves the cache as sequential decoding would."""
    target = family_target(arch)
    prefix = list(range(30, 58))
    cache = target.new_cache()
    start = len(prefix) - 1
    target.forward(prefix[:-1], cache, 0)
    out = target.forward([prefix[-1], *TREE.tokens], cache, start, tree=TREE)
    for node in range(len(TREE)):
        path = [TREE.tokens[i] for i in TREE.path_to(node)]
        assert torch.allclose(out.logits[node + 1], _last_logits(target, prefix + path), atol=1e-4), f"node {node}"
    path = TREE.path_to(5)
    keep_rows(cache, start, [0] + [n + 1 for n in path])
    nxt = target.forward([42], cache, len(prefix) + len(path)).logits[-1]
    assert torch.allclose(nxt, _last_logits(target, prefix + [TREE.tokens[i] for i in path] + [42]), atol=1e-4)


def test_the_window_changes_the_logits(family_target):
    """Past the window a full-attention tree mask gives other logits, so the tests above bind."""
    target = family_target("mistral_window")
    prefix = list(range(30, 58))
    cache = target.new_cache()
    target.forward(prefix[:-1], cache, 0)
    mask = additive_mask(TREE.ancestor_mask(), len(prefix) - 1, target.dtype)
    out = target.model(input_ids=torch.tensor([[prefix[-1], *TREE.tokens]]), attention_mask=mask, cache=cache,
                       position_ids=torch.tensor([TREE.position_ids(len(prefix) - 1)]))
    path = [TREE.tokens[i] for i in TREE.path_to(5)]
    assert not torch.allclose(out.logits[0, 6], _last_logits(target, prefix + path), atol=1e-2)


def _drafter(method: str, target, ids, ref) -> Drafter:
    if method == "tree":
        return OracleTreeDrafter(ref, len(ids), target.vocab_size, seed=len(ids))
    if method == "oracle":
        return ChainOracle(ref, len(ids), target.vocab_size, seed=len(ids))
    if method == "pld":
        return PromptLookupDrafter(PromptLookupConfig(k=5, max_ngram=3))
    if method == "draft-self":
        return DraftModelDrafter(target.model, DraftModelConfig(k=4), target.vocab_size)
    if method == "dflash":
        return DFlashEngineDrafter(random_drafter(target, block=8, feature_layers=(0, 1)), DFlashConfig(gate=False))
    raise AssertionError(method)


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
@pytest.mark.parametrize("method", ["tree", "oracle", "pld", "draft-self", "dflash"])
def test_greedy_equals_transformers(family_target, arch, method):
    target = family_target(arch)
    accepted = 0
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        ref = hf_greedy(target, ids, 40)
        run = generate(target, ids, max_new_tokens=40, drafter=_drafter(method, target, ids, ref))
        assert run.output_ids == ref, f"{arch}/{method} diverged on {prompt!r}"
        accepted += sum(len(s.accepted) for s in run.steps)
    assert method in ("pld", "dflash") or accepted > 10


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
@pytest.mark.parametrize("options", PTD_OPTIONS, ids=["cpu", "paper"])
def test_ptd_equals_transformers(family_target, arch, options):
    target = family_target(arch)
    for prompt in PROMPTS:
        ids = target.tokenizer(prompt).input_ids
        run = generate(target, ids, "ptd", max_new_tokens=40, options=options)
        assert run.output_ids == hf_greedy(target, ids, 40), f"{arch}/{options} diverged on {prompt!r}"


@pytest.mark.parametrize("arch", WINDOW_ARCHS)
def test_batches_past_the_window_equal_transformers(family_target, arch):
    """Rows of different lengths (one shorter than the window) keep different draft counts, so
    the cache gets holes and compactions; each row's window still counts its own positions."""
    target = family_target(arch)
    prompts = [target.tokenizer(p).input_ids for p in (*PROMPTS, "def add(a, b):")]
    refs = [hf_greedy(target, ids, 40) for ids in prompts]
    plain = generate_batch(target, prompts, max_new_tokens=40)
    assert [r.output_ids for r in plain.runs] == refs
    drafted = generate_batch(target, prompts, drafter=OracleDrafter(prompts, refs, target.vocab_size), max_new_tokens=40)
    assert [r.output_ids for r in drafted.runs] == refs
