"""Training DeLS's local head against a drafter: the examples hold what an accepted draft holds,
the offline acceptance is what the method's own fusion drafts, and a run lowers the fused loss."""

from __future__ import annotations

import json

import torch

from specflash.drafters.dels import fuse_block
from specflash.models.dflash import loss_weights
from specflash.models.dflash_io import load_drafter
from specflash.models.local_head import load_local_head, save_local_head
from specflash.training import local_head_fusion as fusion
from specflash.training.dflash_objective import block_forward, block_labels
from specflash.training.validation import held_out_acceptance, held_out_blocks
from test_dels import random_head
from test_train_dflash2 import setup  # noqa: F401  (tiny qwen3 target, DFlash drafter, harvest of 2 shards)

HELD = "shard-00001.safetensors"


def _blocks(setup, samples=4):  # noqa: F811
    tmp, target, _ = setup
    drafter = load_drafter(tmp / "dflash", target).float().eval()
    return drafter, held_out_blocks(target, [tmp / "data"], [HELD], (1,), None, samples=samples, anchors=6)


def test_examples_hold_the_accepted_draft_and_where_the_label_ranks(setup):  # noqa: F811
    _, target, _ = setup
    drafter, blocks = _blocks(setup)
    head = random_head(target)
    for block in blocks:
        seq, _, anchors = block
        ex = fusion.block_examples(drafter, block, head.log_prior, beta=0.3, candidates=8)
        labels, valid = block_labels(seq.next_ids, anchors, 8)
        assert torch.equal(ex.blocks[:, 0], seq.tokens[anchors]) and torch.equal(ex.blocks[:, 1:], labels)
        assert torch.equal(ex.valid, valid) and ex.candidates.shape == (len(anchors), 7, 8)
        assert bool((ex.base[..., :-1] >= ex.base[..., 1:]).all())  # ranked, best first
        assert bool(torch.isin(ex.candidates, drafter.draft_ids).all())
        found = ex.label_index >= 0
        picked = ex.candidates.gather(-1, ex.label_index.clamp(min=0)[..., None])[..., 0]
        assert torch.equal(picked[found], labels[found])
        assert not bool((ex.candidates[~found] == labels[~found][:, None]).any())


def test_offline_acceptance_is_what_the_methods_fusion_drafts(setup):  # noqa: F811
    _, target, _ = setup
    drafter, blocks = _blocks(setup)
    head = random_head(target, hidden=16, std=0.5)
    alpha, beta, candidates = 0.8, 0.3, 8
    for block in blocks:
        seq, feats, anchors = block
        ex = fusion.block_examples(drafter, block, head.log_prior, beta, candidates)
        scores = fusion.fused_scores(head, ex, alpha)
        offline = (scores.argmax(-1) == ex.label_index) & ex.valid
        first = ex.candidates[:, 0].gather(-1, scores[:, 0].argmax(-1, keepdim=True))[:, 0]
        hidden = block_forward(drafter, seq, feats.float(), anchors)[:, 1:]
        for n in range(len(anchors)):
            drafted = fuse_block(drafter.draft_logits(hidden[n]), head, int(ex.blocks[n, 0]), alpha, beta,
                                 drafter.draft_ids, candidates)["tokens"]
            assert drafted[0] == int(first[n])  # the first slot reads the same root either way
            run = 0
            while run < 7 and ex.valid[n, run] and drafted[run] == int(ex.blocks[n, run + 1]):
                run += 1
            assert int(offline[n].long().cumprod(0).sum()) == run


def test_without_fusion_the_figure_is_the_drafters_validation_tau(setup):  # noqa: F811
    _, target, _ = setup
    drafter, blocks = _blocks(setup, samples=6)
    ex = fusion.build_examples(drafter, blocks, random_head(target).log_prior, beta=0.0, candidates=4)
    tau = held_out_acceptance(drafter, blocks, loss_weights(8, 4.0))["val_tau"]
    assert abs(fusion.fused_acceptance(random_head(target), ex, alpha=0.0) - tau) < 1e-9


def test_a_run_lowers_the_fused_loss_and_exports_a_head(setup, tmp_path):  # noqa: F811
    tmp, target, model_dir = setup
    start = tmp_path / "start"
    save_local_head(random_head(target, hidden=16, std=0.1), start, dtype=torch.float32)
    before = (start / "model.safetensors").read_bytes()
    argv = ["--model", str(model_dir), "--drafter", str(tmp / "dflash"), "--init-from", str(start),
            "--data", str(tmp / "data" / "shard-00000.safetensors"), "--eval-data", str(tmp / "data"),
            "--hold-out", HELD, "--candidates", "8", "--sequences", "4", "--anchors", "6", "--steps", "60",
            "--batch", "16", "--lr", "3e-2", "--eval-samples", "4", "--grid-alphas", "0.5,1", "--grid-betas", "0",
            "--feature-cache", str(tmp_path / "features"), "--export", str(tmp_path / "head"), "--log-every", "0"]
    assert fusion.main(argv) == 0
    config = json.loads((tmp_path / "head" / "config.json").read_text())["training"]
    assert config["final_loss"] < config["first_loss"]
    assert config["shards"] == ["data/shard-00000.safetensors"] and config["sequences"] == 4
    held = config["held_out"]
    assert [(r["alpha"], r["beta"]) for r in held["grid"]] == [(0.5, 0.0), (1.0, 0.0)]
    assert all(1 <= r["tau"] <= 8 for r in held["grid"]) and held["best"]["tau"] == max(r["tau"] for r in held["grid"])
    assert (start / "model.safetensors").read_bytes() == before
    trained = load_local_head(tmp_path / "head", target)
    assert not torch.equal(trained.proj.weight, load_local_head(start, target).proj.weight)


def test_held_out_shards_are_never_trained_on(setup, tmp_path, capsys):  # noqa: F811
    tmp, target, model_dir = setup
    save_local_head(random_head(target), tmp_path / "start", dtype=torch.float32)
    argv = ["--model", str(model_dir), "--drafter", str(tmp / "dflash"), "--init-from", str(tmp_path / "start"),
            "--data", str(tmp / "data" / HELD), "--hold-out", HELD, "--steps", "1"]
    assert fusion.main(argv) == 2
    assert "is a --hold-out shard" in capsys.readouterr().err
    assert fusion.training_shards([tmp / "data"], [HELD]) == [tmp / "data" / "shard-00000.safetensors"]
