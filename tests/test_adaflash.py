"""AdaFlash cut rules: each is lossless, each cuts where it says, and the cost-aware cut
trades verified tokens for committed ones as the cost curve dictates."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import LOSSLESS_ARCHS, hf_greedy
from test_dflash import random_drafter
from specflash.api import generate
from specflash.drafters.adaflash import (
    RULES, AdaFlashConfig, AdaFlashDrafter, acceptance_estimate, annotate_cuts, build, cut_length, path_probabilities,
)
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.errors import CheckpointError, MethodConfigError
from specflash.models.dflash_io import load_drafter, save_drafter
from specflash.trace import RunRecord, StepRecord
from specflash.tree import DraftTree
from specflash.models.length_head import LengthHead, length_labels, load_length_head, save_length_head, verify_len
from specflash.verify_cost import best_cut, best_node_count, monotone

STEEP = [1.0 + 0.5 * i for i in range(16)]  # each extra verified token costs half a forward
FLAT = [1.0] * 16


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("rule", RULES)
def test_every_rule_is_lossless(tiny_targets, arch, rule):
    target = tiny_targets[arch]
    cfg = AdaFlashConfig(gate=False, rule=rule, threshold=0.3 if rule == "confidence" else 2.0, fixed_len=2)
    model = random_drafter(target, block=8, feature_layers=(0, 1))
    drafter = AdaFlashDrafter(model, cfg, STEEP[:8], random_head(target.hidden_size, seed=1))
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 30)
    for step in run.steps[1:]:
        if step.tokens:
            ada = step.extras["adaflash"]
            assert ada["verify_len"] == len(step.tokens) + 1 and ada["rule"] == rule
            assert len(step.tokens) + len(ada["cut_tokens"]) == min(7, 30 - len(sum((s.committed for s in run.steps[:step.step]), [])) - 1)


def random_head(hidden_size: int, seed: int = 0, bias: float = 0.0) -> LengthHead:
    torch.manual_seed(seed)
    head = LengthHead(hidden_size, bottleneck=16)
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head.eval()


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
    # pooled by hand: (1.0 + 0.9) / 2 = 0.95 and (1.4 + 1.2) / 2 = 1.3, then divided by 0.95
    assert monotone([1.0, 0.9, 1.4, 1.2]) == pytest.approx([1.0, 1.0, 1.3 / 0.95, 1.3 / 0.95])
    # one length timed high under load: averaged with the lengths after it, not carried to them all
    assert monotone([1.0, 1.45, 1.0, 1.0]) == pytest.approx([1.0, 3.45 / 3, 3.45 / 3, 3.45 / 3])
    assert monotone([1.0, 1.1, 1.2]) == [1.0, 1.1, 1.2]


def test_cost_rule_verifies_less_than_dflash(tiny_targets):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, block=8, feature_layers=(1,))
    ids = target.tokenizer("def add(a, b):").input_ids
    full = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False)), max_new_tokens=30)
    cut = generate(target, ids, drafter=AdaFlashDrafter(model, AdaFlashConfig(gate=False), STEEP[:8]), max_new_tokens=30)
    assert cut.output_ids == full.output_ids
    assert cut.metrics["verified_per_committed"] < full.metrics["verified_per_committed"]


def test_a_drafting_gate_lets_the_cut_pick_the_width(tiny_targets, monkeypatch):
    """The gate says draft, at width 1: dflash verifies 1 drafted token, adaflash drafts every
    slot that fits and verifies what its cut says (here the fixed rule's 4), losslessly."""
    from specflash.drafters.gate import DraftGate, GateDecision

    monkeypatch.setattr(DraftGate, "decide", lambda self, room: GateDecision("on", min(1, room), 1.5, "width 1"))
    target = tiny_targets["qwen3"]
    model = random_drafter(target, block=8, feature_layers=(1,))
    ids = target.tokenizer("def add(a, b):").input_ids
    runs = {name: generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
            for name, drafter in (("dflash", DFlashEngineDrafter(model, DFlashConfig(lookup=False), STEEP[:8])),
                                  ("adaflash", AdaFlashDrafter(model, AdaFlashConfig(lookup=False, rule="fixed",
                                                                                     fixed_len=4), STEEP[:8])))}
    assert runs["dflash"].output_ids == runs["adaflash"].output_ids == hf_greedy(target, ids, 30)
    decode = [s for s in runs["dflash"].steps[1:] if s.tokens]
    assert decode and all(len(s.tokens) == 1 and s.extras["gate"]["width"] == 1 for s in decode)
    drafting = [s for s in runs["adaflash"].steps[1:] if "adaflash" in s.extras]
    assert len(drafting) >= 4
    for step in drafting:
        drafted = len(step.tokens) + len(step.extras["adaflash"]["cut_tokens"])
        assert step.extras["gate"]["width"] == drafted and len(step.tokens) == min(4, drafted)
        assert ("the cut picks" in step.extras["gate"]["reason"]) == (drafted > 1)  # 1: all the room left
    assert max(len(s.tokens) + len(s.extras["adaflash"]["cut_tokens"]) for s in drafting) == 7
    narrow = AdaFlashDrafter(model, AdaFlashConfig(lookup=False, rule="fixed", fixed_len=4, whole_block=False), STEEP[:8])
    run = generate(target, ids, drafter=narrow, max_new_tokens=30, stop_on_eos=False)
    assert run.output_ids == runs["dflash"].output_ids
    assert all(len(s.tokens) + len(s.extras["adaflash"]["cut_tokens"]) == 1 for s in run.steps[1:] if "adaflash" in s.extras)


def test_heuristic_window_follows_acceptance(tiny_targets):
    target = tiny_targets["llama"]
    drafter = AdaFlashDrafter(random_drafter(target, block=8), AdaFlashConfig(gate=False, rule="heuristic", fixed_len=3))
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    window = 3
    for step in run.steps[1:]:
        if step.tokens:
            assert len(step.tokens) == min(window, len(step.tokens) + len(step.extras["adaflash"]["cut_tokens"]))
            depth = max(DraftTree(tuple(step.tokens), tuple(step.parents)).depths())  # a tree's longest path
            window = window + 2 if len(step.accepted) == depth else max(1, window - 1)


def test_bad_config():
    with pytest.raises(MethodConfigError, match="cut rule"):
        AdaFlashConfig(rule="magic")
    with pytest.raises(MethodConfigError):
        AdaFlashConfig(rate=0)
    with pytest.raises(MethodConfigError, match="whole_block"):
        AdaFlashConfig(whole_block="yes")


def test_verify_len_follows_adaflash_rule():
    assert verify_len(0.5, 16, 1.0, 2) == 8
    assert verify_len(0.5, 16, 1.3, 2) == 10  # round(10.4)
    assert verify_len(0.01, 16, 1.0, 2) == 2  # never below min_len
    assert verify_len(0.99, 16, 1.3, 2) == 16  # never above the block
    assert verify_len(0.0, 8, 1.0, 0) == 1  # the target's own token is always verified
    assert length_labels(torch.tensor([0, 3, 7]), 8).tolist() == [0.125, 0.5, 1.0]


@pytest.mark.parametrize("bias,expected", [(-20.0, 0), (20.0, 7)])
def test_head_rule_cuts_where_the_head_says(tiny_targets, bias, expected):
    target = tiny_targets["qwen3"]
    drafter = AdaFlashDrafter(random_drafter(target, block=8, feature_layers=(1,)), AdaFlashConfig(gate=False, rule="head", min_len=1),
                              head=random_head(target.hidden_size, bias=bias))
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=12, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 12)
    first = run.steps[1]
    assert len(first.tokens) == expected and first.extras["adaflash"]["verify_len"] == expected + 1
    assert 0.0 <= first.extras["adaflash"]["score"] <= 1.0


@pytest.mark.parametrize("rule,estimate,reads", [("cost", "confidence", False), ("fixed", "confidence", False),
                                                 ("head", "confidence", True), ("cost", "head", True)])
def test_the_length_head_runs_only_where_the_rule_reads_it(tiny_targets, rule, estimate, reads):
    target = tiny_targets["qwen3"]
    head = random_head(target.hidden_size)
    calls = []
    head.register_forward_hook(lambda *_: calls.append(1))
    drafter = AdaFlashDrafter(random_drafter(target, block=8, feature_layers=(1,)),
                              AdaFlashConfig(gate=False, rule=rule, estimate=estimate, min_len=1), STEEP[:8], head=head)
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=12, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 12)
    drafted = [s for s in run.steps if "adaflash" in s.extras]
    assert len(calls) == (len(drafted) if reads else 0)
    assert all((s.extras["adaflash"]["score"] is not None) == reads for s in drafted)


def test_length_head_checkpoint_round_trip(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    model = random_drafter(target, block=8, feature_layers=(1,))
    save_drafter(model, tmp_path, dtype=torch.float32)
    assert load_length_head(tmp_path, target.hidden_size) is None  # a plain DFlash folder has no head
    with pytest.raises(CheckpointError, match="length head"):
        build(target, AdaFlashConfig(rule="head"), str(tmp_path))
    head = random_head(target.hidden_size, seed=3)
    save_length_head(head, tmp_path, dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dflash_config"]["use_thresh_head_two_model"] is True
    assert "thresh_head_two_model.res.0.weight" in load_file(str(tmp_path / "model.safetensors"))
    loaded = load_length_head(tmp_path, target.hidden_size)
    hidden = torch.randn(2, 8, target.hidden_size)
    assert torch.allclose(loaded(hidden), head(hidden))
    load_drafter(tmp_path, target)  # the plain DFlash loader still accepts the folder
    with pytest.raises(CheckpointError, match="hidden size"):
        load_length_head(tmp_path, target.hidden_size * 2)


def _step(index, drafted, accepted, committed, cut):
    return StepRecord(step=index, phase="decode", context_len=10 + index, tokens=drafted, parents=list(range(-1, len(drafted) - 1)),
                      q=None, p=[1.0] * len(drafted), accepted=list(range(accepted)), correction=committed[-1],
                      correction_kind="bonus", correction_p=1.0, committed=committed, verified=len(drafted) + 1,
                      draft_time=0.0, verify_time=0.0, extras={"adaflash": {"cut_tokens": cut}})


def test_annotate_cuts_on_hand_built_runs():
    prefill = StepRecord(step=0, phase="prefill", context_len=3, tokens=[], parents=[], q=None, p=[], accepted=[],
                         correction=5, correction_kind="target", correction_p=1.0, committed=[5], verified=3,
                         draft_time=0.0, verify_time=0.0)
    steps = [
        prefill,
        _step(1, [6], 1, [6, 7], [8, 9, 4]),  # all verified kept; cut 8, 9 match the output, 4 does not
        _step(2, [1, 2], 1, [8, 9], [3]),  # the chain broke inside the verified part
        _step(3, [], 0, [10], [10]),  # nothing verified; the cut token is the target's own next token
        _step(4, [11], 1, [11, 12], [12, 13]),  # runs past the end of the output: cannot tell
    ]
    run = RunRecord(method="adaflash", config={}, sampling={"temperature": 0.0}, model="m", device="cpu",
                    prompt_ids=[1, 2, 3], steps=steps, output_ids=[5, 6, 7, 8, 9, 10, 11, 12], finish_reason="length",
                    prefill_time=0.0)
    would = [s.extras["adaflash"]["cut_would_accept"] for s in annotate_cuts(run).steps[1:]]
    assert would == [0, 0, 1, None]  # step 1: the cut 8 stands where the output has 7
    run.output_ids = [5, 6, 8, 9, 4, 8, 9, 10, 11, 12]
    for s in steps[1:]:
        s.committed = {1: [6, 8], 2: [9, 4], 3: [8], 4: [9, 10]}[s.step]
    steps[1].extras["adaflash"]["cut_tokens"] = [8, 9, 7]
    would = [s.extras["adaflash"]["cut_would_accept"] for s in annotate_cuts(run).steps[1:]]
    assert would[0] == 2  # 8 (the target's own token) and 9 follow 6 in the output, 7 does not
    run.sampling = {"temperature": 0.7}
    assert all(s.extras["adaflash"]["cut_would_accept"] is None for s in annotate_cuts(run).steps[1:])


def test_annotate_cuts_reads_a_tree_steps_chain():
    """A tree step verified the chain's first tokens among other paths: its cut tokens follow the
    chain, so they count only where the accepted path is that chain."""
    prefill = StepRecord(step=0, phase="prefill", context_len=3, tokens=[], parents=[], q=None, p=[], accepted=[],
                         correction=5, correction_kind="target", correction_p=1.0, committed=[5], verified=3,
                         draft_time=0.0, verify_time=0.0)

    def tree_step(index, accepted, committed):  # nodes 6 and 7 branch at the root; the chain is [6, 8]
        return StepRecord(step=index, phase="decode", context_len=10, tokens=[6, 7, 8], parents=[-1, -1, 0], q=None,
                          p=[1.0] * 3, accepted=accepted, correction=committed[-1], correction_kind="bonus",
                          correction_p=1.0, committed=committed, verified=4, draft_time=0.0, verify_time=0.0,
                          extras={"adaflash": {"cut_tokens": [9, 4], "chain": [6, 8]}})

    run = RunRecord(method="adaflash", config={}, sampling={"temperature": 0.0}, model="m", device="cpu",
                    prompt_ids=[1, 2, 3], steps=[prefill, tree_step(1, [0, 2], [6, 8, 9])],
                    output_ids=[5, 6, 8, 9, 3], finish_reason="length", prefill_time=0.0)
    assert annotate_cuts(run).steps[1].extras["adaflash"]["cut_would_accept"] == 1  # 9 follows, 4 does not
    run.steps[1] = tree_step(1, [1], [7, 2])  # the other branch was kept: the chain broke
    run.output_ids = [5, 7, 2, 9, 4]
    assert annotate_cuts(run).steps[1].extras["adaflash"]["cut_would_accept"] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_drafts_take_the_cuts_width_and_stay_greedy(tiny_targets, arch):
    """With trees on (the default) the cut's width is the tree's node count: the same rows
    verified as the chain would feed, the output still greedy, and some drafts branch."""
    target = tiny_targets[arch]
    cfg = AdaFlashConfig(gate=False, rule="fixed", fixed_len=4)
    drafter = AdaFlashDrafter(random_drafter(target, block=8, feature_layers=(0, 1)), cfg, STEEP[:8])
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 30)
    drafted = [s for s in run.steps[1:] if s.tokens]
    assert all(s.extras["adaflash"]["verify_len"] == len(s.tokens) + 1 for s in drafted)
    assert any(s.parents != list(range(-1, len(s.tokens) - 1)) for s in drafted)
    assert all(s.extras["adaflash"]["chain"][0] == s.tokens[0] for s in drafted if "chain" in s.extras["adaflash"])
    assert run.config["tree"] is True


def test_cost_rule_on_a_tree_prices_each_node_by_its_path():
    """Worked by hand: a root 0.6 with a sibling 0.3, under the root a child 0.5. Paths: 0.6, 0.3,
    0.6 * 0.5 = 0.3 (0.6, 0.6 and 0.6 at rate 2, capped at 1 per slot)."""
    tree = DraftTree((5, 6, 7), (-1, -1, 0))
    assert path_probabilities(tree, [0.6, 0.3, 0.5]) == pytest.approx([0.6, 0.3, 0.3])
    assert path_probabilities(tree, [0.6, 0.3, 0.5], rate=2.0) == pytest.approx([1.0, 0.6, 1.0])
    cost = [1.0, 1.2, 1.6, 2.0]
    assert best_node_count([0.6, 0.3, 0.3], cost) == 1  # 1.6 / 1.2 = 1.33 beats 1.9 / 1.6 and 2.2 / 2.0
    assert best_node_count([0.9, 0.8, 0.7], cost) == 3  # 3.4 / 2.0 = 1.7 beats 2.7 / 1.6 and 1.9 / 1.2
    assert best_node_count([0.6, 0.3, 0.3], [1.0, 1.2, 1.4, 1.6]) == 3  # 2.2 / 1.6 = 1.375 beats 1.36 and 1.33
    assert best_node_count([0.6, 0.3, 0.3], [1.0] * 3) == 2  # the curve ends at 3 rows
    assert best_cut([0.9, 0.5], cost) == best_node_count([0.9, 0.45], cost)  # a chain is the special case


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tree_cut_keeps_the_best_nodes_that_pay_and_stays_greedy(tiny_targets, arch):
    """The cost rule on trees (the default) verifies a best-first prefix of the block's tree, as
    many nodes as best_node_count says on the drafter's own confidences: on a flat curve all k,
    on a steep one fewer; the output stays greedy either way."""
    target = tiny_targets[arch]
    model = random_drafter(target, block=8, feature_layers=(0, 1))
    ids = target.tokenizer("The quick brown fox jumps over the lazy dog. The quick brown").input_ids
    sizes = {}
    for name, cost in (("flat", FLAT[:8]), ("steep", STEEP[:8])):
        drafter = AdaFlashDrafter(model, AdaFlashConfig(gate=False, rule="cost"), cost)
        run = generate(target, ids, drafter=drafter, max_new_tokens=30, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, ids, 30)
        drafted = [s for s in run.steps[1:] if s.tokens]
        for s in drafted:
            tree = DraftTree(tuple(s.tokens), tuple(s.parents))
            assert best_node_count(path_probabilities(tree, s.q), cost) == len(s.tokens)
            assert s.extras["adaflash"]["verify_len"] == len(s.tokens) + 1
            chain = s.extras["adaflash"]["chain"]  # the argmax chain's part the tree holds: a path from node 0
            assert len(tree.follow(chain)) == len(chain) >= 1 and chain[0] == s.tokens[0]
        sizes[name] = [len(s.tokens) for s in run.steps[1:]]
    assert max(sizes["flat"]) == 7 and sum(sizes["steep"]) < sum(sizes["flat"])


def test_cost_rule_can_read_the_heads_estimate():
    probs = torch.full((7, 3), 1 / 3)  # the draft's own confidences say nothing
    cfg = AdaFlashConfig(rule="cost", estimate="head")
    assert acceptance_estimate(probs, cfg, 3.5 / 8, 8) == [1.0, 1.0, 0.5, 0.0, 0.0, 0.0, 0.0]  # A = 2.5
    assert cut_length("cost", probs, cfg, FLAT[:8], 1, score=3.5 / 8, block_size=8) == 3
    assert cut_length("cost", probs, cfg, STEEP[:8], 1, score=3.5 / 8, block_size=8) == 2  # half a token is not worth c(4)
    assert cut_length("cost", probs, AdaFlashConfig(rule="cost"), FLAT[:8], 1) == 7  # flat cost: verify everything
    with pytest.raises(MethodConfigError, match="estimate"):
        AdaFlashConfig(estimate="oracle")


def test_cli_json_carries_the_hindsight_on_cut_tokens(tiny_dirs, tiny_targets, tmp_path, capsys):
    from specflash.cli import main

    target = tiny_targets["qwen3"]
    save_drafter(random_drafter(target, block=8, feature_layers=(1,)), tmp_path, dtype=torch.float32)
    assert main(["generate", "--model", str(tiny_dirs["qwen3"]), "--method", "adaflash", "--drafter", str(tmp_path),
                 "--prompt", "def add(a, b):", "--raw", "--max-new-tokens", "12", "--json", "-o", "rule=fixed",
                 "-o", "fixed_len=1", "-o", "gate=false"]) == 0  # random drafter: the gate would stop it
    record = json.loads(capsys.readouterr().out)
    ada = [s["extras"]["adaflash"] for s in record["steps"] if "adaflash" in s["extras"]]
    assert ada and all("cut_would_accept" in a for a in ada)
    assert record["output_ids"] == hf_greedy(target, target.tokenizer("def add(a, b):").input_ids, 12)[: len(record["output_ids"])]
