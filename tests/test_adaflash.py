"""AdaFlash cut rules: each is lossless, each cuts where it says, and the cost-aware cut
trades verified tokens for committed ones as the cost curve dictates."""

from __future__ import annotations

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from test_dflash import random_drafter
from specflash.api import generate
from specflash.drafters.adaflash import RULES, AdaFlashConfig, AdaFlashDrafter, cut_length
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.errors import MethodConfigError
from specflash.verify_cost import best_cut, monotone

STEEP = [1.0 + 0.5 * i for i in range(16)]  # each extra verified token costs half a forward
FLAT = [1.0] * 16


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_lossless(tiny_targets, arch, rule):
    target = tiny_targets[arch]
    cfg = AdaFlashConfig(rule=rule, threshold=0.3 if rule == "confidence" else 2.0, fixed_len=2)
    drafter = AdaFlashDrafter(random_drafter(target, block=8, feature_layers=(0, 1)), cfg, STEEP[:8])
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 30)
    for step in run.steps[1:]:
        if step.tokens:
            ada = step.extras["adaflash"]
            assert ada["verify_len"] == len(step.tokens) + 1 and ada["rule"] == rule
            assert len(step.tokens) + len(ada["cut_tokens"]) == min(7, 30 - len(sum((s.committed for s in run.steps[:step.step]), [])) - 1)


def test_cut_rules_on_hand_built_drafts():
    # three drafted positions with max probabilities 0.9, 0.4, 0.8
    probs = torch.tensor([[0.9, 0.1, 0.0], [0.4, 0.3, 0.3], [0.8, 0.1, 0.1]])
    assert cut_length("confidence", probs, AdaFlashConfig(rule="confidence", threshold=0.5), None, 1) == 1
    assert cut_length("entropy", probs, AdaFlashConfig(rule="entropy", threshold=1.0), None, 1) == 1
    assert cut_length("entropy", probs, AdaFlashConfig(rule="entropy", threshold=2.0), None, 1) == 3
    assert cut_length("fixed", probs, AdaFlashConfig(rule="fixed", fixed_len=2), None, 1) == 2
    assert cut_length("heuristic", probs, AdaFlashConfig(rule="heuristic"), None, 5) == 5


def test_cost_aware_cut():
    sure = [0.99] * 7
    assert best_cut(sure, FLAT) == 7  # free verification: verify everything
    assert best_cut([0.1] * 7, STEEP) == 0  # hopeless drafts on a steep curve: verify none
    # 0.9 then hopeless: one token is worth c(2) = 1.5 (E = 1.9), the rest are not
    assert best_cut([0.9, 0.05, 0.05], STEEP) == 1
    assert monotone([1.0, 0.9, 1.4, 1.2]) == [1.0, 1.0, 1.4, 1.4]


def test_cost_rule_verifies_less_than_dflash(tiny_targets):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, block=8, feature_layers=(1,))
    ids = target.tokenizer("def add(a, b):").input_ids
    full = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig()), max_new_tokens=30)
    cut = generate(target, ids, drafter=AdaFlashDrafter(model, AdaFlashConfig(), STEEP[:8]), max_new_tokens=30)
    assert cut.output_ids == full.output_ids
    assert cut.metrics["verified_per_committed"] < full.metrics["verified_per_committed"]


def test_heuristic_window_follows_acceptance(tiny_targets):
    target = tiny_targets["llama"]
    drafter = AdaFlashDrafter(random_drafter(target, block=8), AdaFlashConfig(rule="heuristic", fixed_len=3))
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    window = 3
    for step in run.steps[1:]:
        if step.tokens:
            assert len(step.tokens) == min(window, len(step.tokens) + len(step.extras["adaflash"]["cut_tokens"]))
            window = window + 2 if len(step.accepted) == len(step.tokens) else max(1, window - 1)


def test_bad_config():
    with pytest.raises(MethodConfigError, match="cut rule"):
        AdaFlashConfig(rule="magic")
    with pytest.raises(MethodConfigError):
        AdaFlashConfig(rate=0)
