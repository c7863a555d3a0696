"""Reduced draft vocabularies (d2t): the checkpoint map, q = 0 outside it, lossless decoding."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.errors import CheckpointError, DrafterMismatchError
from specflash.models.dflash_io import D2T_FILE, load_drafter, new_drafter, save_drafter
from specflash.training.dflash_objective import draft_labels, leading_correct, slot_logits
from test_dflash import PROMPTS, make_spec


def vocab_drafter(target, ids, seed=0, std=0.2, **shape):
    model = new_drafter(make_spec(target, **shape), target, torch.tensor(ids))
    model.init_weights(torch.Generator().manual_seed(seed), std=std)
    return model.eval()


def spread_ids(target, n):
    """n distinct ids spread over the target's vocabulary, sorted."""
    return sorted({int(i) for i in torch.linspace(3, target.vocab_size - 1, n).round()})


def test_d2t_round_trip_uses_eagle3_offsets(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    ids = spread_ids(target, 40)
    save_drafter(vocab_drafter(target, ids), tmp_path)
    d2t = load_file(str(tmp_path / D2T_FILE))["d2t"]
    assert [i + int(d2t[i]) for i in range(len(d2t))] == ids  # target id = draft id + d2t[draft id]
    assert json.loads((tmp_path / "config.json").read_text())["draft_vocab_size"] == len(ids)
    assert "d2t" not in load_file(str(tmp_path / "model.safetensors"))  # z-lab weights stay as they are
    assert load_drafter(tmp_path, target).draft_ids.tolist() == ids


def test_full_vocabulary_drafter_writes_no_map(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    save_drafter(new_drafter(make_spec(target), target), tmp_path)
    assert not (tmp_path / D2T_FILE).exists()
    assert load_drafter(tmp_path, target).draft_ids is None


def test_logits_outside_the_draft_vocabulary_are_minus_infinity(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = spread_ids(target, 25)
    model = vocab_drafter(target, ids)
    hidden = torch.randn(3, target.hidden_size)
    probs = torch.softmax(model.logits(hidden), dim=-1)
    outside = torch.ones(target.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert probs[:, outside].abs().max() == 0
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    full = target.model.get_output_embeddings()(hidden)  # the target's own head on those rows
    assert torch.allclose(model.logits(hidden)[:, ids], full[:, ids], atol=1e-5)


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_greedy_with_a_draft_vocabulary_equals_transformers(tiny_targets, arch):
    target = tiny_targets[arch]
    ids = spread_ids(target, 60)
    drafter = DFlashEngineDrafter(vocab_drafter(target, ids, feature_layers=(1, 0)), DFlashConfig(gate=False))
    drafted = 0
    for prompt in PROMPTS:
        prompt_ids = target.tokenizer(prompt)["input_ids"]
        run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=24, stop_on_eos=False)
        assert run.output_ids == hf_greedy(target, prompt_ids, 24)
        for step in run.steps:
            assert set(step.tokens) <= set(ids)
            drafted += len(step.tokens)
    assert drafted > 0


def test_d2t_errors(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    ids = spread_ids(target, 10)
    save_drafter(vocab_drafter(target, ids), tmp_path)
    save_file({"d2t": torch.tensor([target.vocab_size] * 3)}, str(tmp_path / D2T_FILE))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "draft_vocab_size": 3}))
    with pytest.raises(DrafterMismatchError, match="outside the target's"):
        load_drafter(tmp_path, target)
    save_file({"d2t": torch.tensor([5, 0, 0])}, str(tmp_path / D2T_FILE))  # ids 5, 1, 2: not increasing
    with pytest.raises(CheckpointError, match="increasing"):
        load_drafter(tmp_path, target)
    save_file({"d2t": torch.tensor([1, 1])}, str(tmp_path / D2T_FILE))
    with pytest.raises(CheckpointError, match="draft_vocab_size 3"):
        load_drafter(tmp_path, target)
    (tmp_path / D2T_FILE).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_drafter(tmp_path, target)


def test_draft_labels_map_inside_and_flag_outside():
    draft_ids = torch.tensor([2, 5, 9, 11])
    labels = torch.tensor([[5, 3, 11], [2, 12, 9]])
    index, inside = draft_labels(draft_ids, labels)
    assert inside.tolist() == [[True, False, True], [True, False, True]]
    assert index[inside].tolist() == [1, 3, 0, 2]


def test_zlab_view_is_what_a_full_vocabulary_loader_reads(tiny_targets, tmp_path):
    from specflash.training.evaluate import zlab_view

    target = tiny_targets["llama"]
    model = vocab_drafter(target, spread_ids(target, 30))
    save_drafter(model, tmp_path / "ours")
    view = load_drafter(zlab_view(tmp_path / "ours", tmp_path / "zlab"), target)
    assert view.draft_ids is None and "draft_vocab_size" not in json.loads((tmp_path / "zlab" / "config.json").read_text())
    hidden = torch.randn(2, target.hidden_size)
    assert view.logits(hidden).shape[-1] == target.vocab_size
    assert torch.isfinite(view.logits(hidden)).all()
    for name, tensor in view.state_dict().items():
        assert torch.equal(tensor, load_drafter(tmp_path / "ours", target).state_dict()[name])


def test_frequent_tokens_and_their_coverage_on_other_shards(tmp_path):
    from specflash.training.data import Sample, write_shard
    from specflash.training.draft_vocab import coverage, frequent_tokens

    def shard(name, answers):
        path = tmp_path / name
        write_shard(path, [Sample([1, 2] + a, 2, "code", "test", f"{name}-{i}") for i, a in enumerate(answers)], "generate")
        return path

    chosen = shard("a.safetensors", [[7, 7, 7, 3], [3, 9, 7]])  # counts: 7 x4, 3 x2, 9 x1 (prompt ids 1, 2 ignored)
    other = shard("b.safetensors", [[7, 3, 5, 5], [9]])
    assert frequent_tokens([chosen], 2, 16).tolist() == [3, 7]
    assert coverage([chosen], [other], [1, 2, 3], 16) == {1: 1 / 5, 2: 2 / 5, 3: 3 / 5}


def test_draft_probs_are_the_full_softmax_restricted_to_the_draft_vocabulary(tiny_targets):
    from specflash.drafters.dflash import argmax_chain

    target = tiny_targets["qwen3"]
    ids = spread_ids(target, 25)
    model = vocab_drafter(target, ids)
    hidden = torch.randn(3, target.hidden_size)
    probs, columns = model.draft_probs(hidden)
    full = torch.softmax(model.logits(hidden).float(), dim=-1)  # [3, V], 0 outside the vocabulary
    assert columns.tolist() == ids and probs.shape == (3, len(ids))
    assert torch.allclose(probs, full[:, ids], atol=1e-6) and torch.allclose(probs.sum(-1), torch.ones(3))
    tokens, q = argmax_chain(probs, columns)  # back in target ids
    assert tokens == full.argmax(-1).tolist() and set(tokens) <= set(ids)
    assert q == pytest.approx(full.max(-1).values.tolist(), abs=1e-6)
    whole = new_drafter(make_spec(target), target).eval()
    probs, columns = whole.draft_probs(hidden)
    assert columns is None and probs.shape == (3, target.vocab_size)
    assert argmax_chain(probs, columns)[0] == whole.logits(hidden).argmax(-1).tolist()


def test_acceptance_over_draft_columns_equals_the_full_vocabulary_rule(tiny_targets):
    """Training code scores acceptance over the draft vocabulary's columns (slot_logits): the same
    runs as the argmax of the -inf-filled full logits the engine's rule amounts to, labels outside
    the vocabulary included, without building [N, L, V] logits."""
    target = tiny_targets["qwen3"]
    ids = spread_ids(target, 25)
    model = vocab_drafter(target, ids, std=0.5)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 5, target.hidden_size, generator=g)
    full = model.logits(hidden[:, 1:])
    labels = full.argmax(-1)  # leading runs of every length, then misses, some labels outside the vocabulary
    flip = torch.rand(labels.shape, generator=g) < 0.3
    labels = torch.where(flip, torch.randint(0, target.vocab_size, labels.shape, generator=g), labels)
    valid = torch.rand(labels.shape, generator=g) < 0.9
    logits, columns, reachable = slot_logits(model, hidden, labels, valid)
    got = leading_correct(logits, columns, reachable)
    assert torch.equal(got, leading_correct(full, labels, valid))
    assert got.max() > 0 and (~reachable & valid).any()
