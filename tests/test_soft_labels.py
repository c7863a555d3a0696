"""Soft labels for DFlash training: the teacher read from the target's last layer is the target's
own next-token distribution, the soft term is the cross-entropy against it at the slots' label
positions (over the drafter's softmax columns), and the trainer mixes it in by `--soft-labels`."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hf_greedy
from specflash.models.dflash import loss_weights
from specflash.models.dflash_io import new_drafter
from specflash.training import dflash
from specflash.training.dflash_objective import Teacher, block_forward, make_sequence, sequence_loss
from test_dflash import make_spec
from test_train_dflash2 import setup  # noqa: F401  (the tiny harvest fixture)

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def _run(target, ids: list[int], layers: tuple[int, ...]):
    target.capture_layers(layers)
    return target.forward(ids, target.new_cache(), 0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_last_layer_through_norm_and_head_is_the_targets_distribution(tiny_targets, arch):
    target = tiny_targets[arch]
    ids = target.tokenizer(PROMPT).input_ids
    out = _run(target, ids, (target.num_layers - 1,))
    logits = target.head_logits(out.features)
    assert torch.allclose(logits.float(), out.logits, atol=1e-4)
    columns = torch.tensor([5, 0, 17, 3])
    assert torch.allclose(target.head_logits(out.features, columns), logits[:, columns], atol=1e-5)


def _case(target, draft_ids=None):
    """A random drafter fed by layer 0, a greedy sequence, its anchors, and the target's logits."""
    ids = target.tokenizer(PROMPT).input_ids
    ids = ids + hf_greedy(target, ids, 12)
    model = new_drafter(make_spec(target, block=4, feature_layers=(0,)), target, draft_ids)
    model.init_weights(torch.Generator().manual_seed(1), std=0.2)
    out = _run(target, ids, (0, target.num_layers - 1))
    features, width = out.features.clone(), target.hidden_size  # out of inference mode, for autograd
    seq = make_sequence(ids, 6, None)
    anchors = torch.tensor([6, 9, len(ids) - 3])  # the last block runs past the sequence's end
    return model, seq, features[:, :width], features[:, width:], anchors, out.logits


def _reference_soft(model, seq, feats, anchors, target_logits, weights, columns=None) -> torch.Tensor:
    """sum over valid slots of weight * -sum_v p log q, p from the target's real forward logits."""
    with torch.no_grad():
        hidden = block_forward(model, seq, feats, anchors)[:, 1:]
        logits = model.logits(hidden) if columns is None else model.draft_logits(hidden)
        log_q = logits.float().log_softmax(-1)
        total = torch.zeros(())
        for n, a in enumerate(anchors.tolist()):
            for k in range(model.spec.block_size - 1):
                if a + k >= len(seq.next_ids):
                    continue
                row = target_logits[a + k] if columns is None else target_logits[a + k, columns]
                total += weights[k] * -(row.softmax(-1) * log_q[n, k]).sum()
    return total


def test_soft_term_is_cross_entropy_against_the_target_and_mixes_by_weight(tiny_targets):
    target = tiny_targets["qwen3"]
    model, seq, feats, last, anchors, target_logits = _case(target)
    weights = loss_weights(4, 2.0)
    hard = sequence_loss(model, seq, feats, anchors, weights)
    soft = sequence_loss(model, seq, feats, anchors, weights, teacher=Teacher(last, target.head_logits, 1.0))
    reference = _reference_soft(model, seq, feats, anchors, target_logits, weights)
    assert float(soft.loss.detach()) == pytest.approx(float(reference), rel=1e-4)
    assert soft.weight == pytest.approx(hard.weight)  # full vocabulary: every valid slot is reachable
    half = sequence_loss(model, seq, feats, anchors, weights, teacher=Teacher(last, target.head_logits, 0.5))
    assert float(half.loss.detach()) == pytest.approx(0.5 * float(hard.loss.detach()) + 0.5 * float(reference), rel=1e-4)
    off = sequence_loss(model, seq, feats, anchors, weights, teacher=Teacher(last, target.head_logits, 0.0))
    assert float(off.loss.detach()) == pytest.approx(float(hard.loss.detach()))
    assert (soft.slot1_correct, soft.accepted) == (hard.slot1_correct, hard.accepted)  # scored on the labels


def test_with_a_draft_vocabulary_the_teacher_is_renormalised_over_it(tiny_targets):
    target = tiny_targets["llama"]
    draft_ids = torch.arange(0, target.vocab_size, 3)
    model, seq, feats, last, anchors, target_logits = _case(target, draft_ids)
    weights = loss_weights(4, 2.0)
    soft = sequence_loss(model, seq, feats, anchors, weights, teacher=Teacher(last, target.head_logits, 1.0))
    reference = _reference_soft(model, seq, feats, anchors, target_logits, weights, columns=draft_ids)
    assert float(soft.loss.detach()) == pytest.approx(float(reference), rel=1e-4)


def test_trainer_with_soft_labels_learns_and_records_the_weight(setup, tmp_path):  # noqa: F811
    tmp, target, model_dir = setup
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "0", "--out", str(tmp_path),
            "--steps", "12", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", "--log-every", "1",
            "--lr", "3e-3", "--soft-labels", "1"]
    assert dflash.main(argv) == 0
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    first, last = sum(r["loss"] for r in log[:4]) / 4, sum(r["loss"] for r in log[-4:]) / 4
    assert last < first
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["specflash_training"]["soft_labels"] == 1.0
