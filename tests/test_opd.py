"""AdaFlash training: the distillation objective, resumable OPD/SFT rounds, the length head trainer
and the per-domain evaluation, on tiny models."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from conftest import hf_greedy
from test_dflash import random_drafter
from specflash.api import generate
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.models.dflash import loss_weights
from specflash.models.dflash_io import load_drafter, save_drafter
from specflash.models.length_head import LengthHead, load_length_head
from specflash.models.presets import REPO_ROOT
from specflash.training import evaluate, length_head, opd
from specflash.training.dflash_features import sequence_features
from specflash.training.dflash_objective import make_sequence
from specflash.training.opd_objective import BlockTerms, DistillConfig, block_terms, combine


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_head_logits_rebuild_the_targets_logits(tiny_targets, arch):
    target = tiny_targets[arch]
    ids = target.tokenizer("def add(a, b): return a + b").input_ids
    target.capture_layers((target.num_layers - 1,))
    out = target.forward(ids, target.new_cache(), 0)
    assert torch.allclose(target.head_logits(out.features), out.logits, atol=1e-4)


def _greedy_sequence(target, text: str, new: int):
    ids = target.tokenizer(text).input_ids
    full = ids + hf_greedy(target, ids, new)
    layers = (1, target.num_layers - 1)
    target.capture_layers(layers)
    feats = sequence_features(target, full).clone()  # out of inference mode, for autograd
    h = target.hidden_size
    return make_sequence(full, len(ids), None), feats[:, :h], feats[:, h:]


def test_opd_at_alpha_one_is_sft_on_greedy_data(tiny_targets):
    target = tiny_targets["qwen3"]
    model = random_drafter(target, block=4, feature_layers=(1,))
    seq, feats, last = _greedy_sequence(target, "The quick brown fox", 12)
    anchors = torch.arange(seq.first_anchor, len(seq.next_ids) - 1)
    w = loss_weights(4, 2.0)
    sft = combine([block_terms(model, seq, feats, last, anchors, w, target.head_logits, DistillConfig("sft"))],
                  DistillConfig("sft"))[0]
    cfg = DistillConfig("opd", alpha=1.0)
    hard = combine([block_terms(model, seq, feats, last, anchors, w, target.head_logits, cfg)], cfg)[0]
    assert torch.allclose(sft, hard, atol=1e-5)  # the target's argmax is the greedy data token
    soft_cfg = DistillConfig("opd", alpha=0.0, clip=1e9)
    terms = block_terms(model, seq, feats, last, anchors, w, target.head_logits, soft_cfg)
    assert (terms.rkl[terms.weight > 0] >= -1e-5).all()  # a KL divergence
    loss, stats = combine([terms], soft_cfg)
    loss.backward()
    assert stats["clip_ratio"] == 0.0 and any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_combine_clips_after_dividing_by_the_weight():
    w = torch.tensor([[1.0, 0.5, 0.0]])
    terms = BlockTerms(ce=torch.tensor([[2.0, 4.0, 9.0]]), rkl=torch.tensor([[0.3, 6.0, 9.0]]), weight=w,
                       accepted=torch.tensor([1]))
    cfg = DistillConfig("opd", alpha=0.5, clip=1.0)
    loss, stats = combine([terms], cfg)
    n = 1.5
    ce = (2.0 * 1.0 + 4.0 * 0.5) / n
    rkl = 1.0 * min(0.3 / n, 1.0) + 0.5 * min(6.0 / n, 1.0)  # the second slot is clipped
    assert loss.item() == pytest.approx(0.5 * ce + 0.5 * rkl)
    assert stats["clip_ratio"] == pytest.approx(0.5) and stats["tau"] == 2.0


def test_the_recipe_records_no_absolute_path(tmp_path):
    """config.json ships in assets/: a drafter inside the project is recorded relative to its root,
    one outside by its folder name."""
    for drafter, recorded in ((REPO_ROOT / "assets" / "drafters" / "d", "assets/drafters/d"), (tmp_path / "d", "d")):
        args = opd.parse_args(["--drafter", str(drafter)])
        recipe = opd.recipe(args, opd.Progress(round=1, step=8, seconds=90.0))["specflash_opd"]
        assert recipe["drafter"] == recorded and recipe["steps"] == 8
        assert not [v for v in recipe.values() if isinstance(v, str) and Path(v).is_absolute()]


def _opd_args(tmp_path, model_dir, drafter_dir, objective="opd", rounds=1):
    return ["--model", str(model_dir), "--drafter", str(drafter_dir), "--objective", objective, "--name", "t",
            "--out", str(tmp_path / f"run-{objective}"), "--data-dir", str(tmp_path / "data"),
            "--feature-cache", str(tmp_path / "features"), "--rounds", str(rounds), "--prompts-per-round", "4",
            "--max-new-tokens", "10", "--gen-batch", "2", "--anchors", "4", "--seqs-per-step", "2", "--passes", "1"]


@pytest.fixture(scope="module")
def opd_run(tiny_dirs, tiny_targets, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("opd")
    target = tiny_targets["qwen3"]
    save_drafter(random_drafter(target, block=4, feature_layers=(1,)), tmp / "drafter", dtype=torch.float32)
    assert opd.main(_opd_args(tmp, tiny_dirs["qwen3"], tmp / "drafter")) == 0
    return tmp


def test_opd_rounds_resume_and_share_data(opd_run, tiny_dirs, tiny_targets):
    tmp, target = opd_run, tiny_targets["qwen3"]
    logged = [json.loads(line) for line in (tmp / "run-opd" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1]  # 4 answers, 2 per step, 1 pass
    round0 = next((tmp / "data").glob("*/round-000"))
    made = {p.name: p.stat().st_mtime_ns for p in round0.iterdir()}
    assert opd.main(_opd_args(tmp, tiny_dirs["qwen3"], tmp / "drafter", rounds=2)) == 0  # resume: one more round
    logged = [json.loads(line) for line in (tmp / "run-opd" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [0, 1, 2, 3] and logged[-1]["round"] == 1
    assert {p.name: p.stat().st_mtime_ns for p in round0.iterdir()} == made  # round 0 was not answered again
    samples = opd.read_shard(round0 / "shard-00000.safetensors")
    prompt = samples[0].token_ids[: samples[0].prompt_len]
    assert samples[0].token_ids[samples[0].prompt_len :] == hf_greedy(target, prompt, 10)[: len(samples[0].token_ids) - len(prompt)]
    assert opd.main(_opd_args(tmp, tiny_dirs["qwen3"], tmp / "drafter", objective="sft")) == 0
    assert len(list((tmp / "data").iterdir())) == 1  # SFT trained on the same answers
    trained = load_drafter(tmp / "run-opd" / "export", target)
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, drafter=DFlashEngineDrafter(trained, DFlashConfig(gate=False)), max_new_tokens=16, stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 16)


def test_length_head_fit_learns_a_signal():
    torch.manual_seed(0)
    hidden = torch.randn(512, 4, 8)
    accepted = torch.where(hidden[:, -1, 0] > 0, 3, 0)
    blocks = length_head.Blocks(hidden.half(), accepted)
    head = LengthHead(8, bottleneck=16)
    before = length_head.score(head, blocks, 4)
    log = length_head.fit(head, blocks, epochs=40, lr=1e-2, batch=64, seed=0, block_size=4)
    after = length_head.score(head, blocks, 4)
    constant = float(((accepted + 1) / 4).var(unbiased=False))  # the best constant predictor's MSE
    assert log.train[-1] < log.train[0] and after["mse"] < 0.25 * constant < before["mse"]
    assert after["mean_abs_len_error"] < 0.5 and log.best_epoch == 40 and log.stop == []


def test_length_head_keeps_the_epoch_best_on_the_stopping_set():
    """Labels that are noise on the training blocks and a signal-free stopping set: the head fits
    the noise epoch by epoch, the stopping set's MSE rises, and the head keeps an early epoch,
    exactly the weights it had then."""
    torch.manual_seed(0)
    fit_on = length_head.Blocks(torch.randn(64, 4, 8).half(), torch.randint(0, 4, (64,)))
    stop_on = length_head.Blocks(torch.randn(256, 4, 8).half(), torch.randint(0, 4, (256,)))
    head = LengthHead(8, bottleneck=64)
    log = length_head.fit(head, fit_on, epochs=60, lr=3e-2, batch=16, seed=0, block_size=4, stop_on=stop_on)
    assert len(log.stop) == 60 and log.best_epoch == 1 + log.stop.index(min(log.stop)) < 60
    assert log.stop[-1] > min(log.stop) and log.train[-1] < log.train[log.best_epoch - 1]
    assert length_head.score(head, stop_on, 4)["mse"] == pytest.approx(min(log.stop))


def test_length_head_training_writes_a_loadable_head(opd_run, tiny_dirs, tiny_targets):
    tmp, target = opd_run, tiny_targets["qwen3"]
    data = ",".join(str(p) for p in sorted((tmp / "data").glob("*/round-*")))
    out = tmp / "with-head"
    assert length_head.main(["--model", str(tiny_dirs["qwen3"]), "--drafter", str(tmp / "run-opd" / "export"),
                             "--data", data, "--export", str(out), "--anchors", "4", "--epochs", "3",
                             "--feature-cache", str(tmp / "features")]) == 0
    assert isinstance(load_length_head(out, target.hidden_size), LengthHead)
    report = json.loads((out / "length_head_report.json").read_text())
    assert report["heldout"]["blocks"] > 0 and len(report["epoch_losses"]) == 3
    assert len(report["stop_mse"]) == 3 and 1 <= report["best_epoch"] <= 3
    assert report["heldout_previous"] is None  # the drafter it started from had no head
    ids = target.tokenizer("def add(a, b):").input_ids
    run = generate(target, ids, method="adaflash", drafter=str(out), options={"rule": "head"}, max_new_tokens=12,
                   stop_on_eos=False)
    assert run.output_ids == hf_greedy(target, ids, 12)
    assert all(s.extras["adaflash"]["score"] is not None for s in run.steps[1:] if "adaflash" in s.extras)
    again = tmp / "refit"  # a refit of a folder with a head scores that head on its own held-out blocks
    assert length_head.main(["--model", str(tiny_dirs["qwen3"]), "--drafter", str(out), "--data", data,
                             "--export", str(again), "--anchors", "4", "--epochs", "3", "--seed", "1",
                             "--feature-cache", str(tmp / "features")]) == 0
    refit = json.loads((again / "length_head_report.json").read_text())
    assert refit["heldout_previous"]["blocks"] == refit["heldout"]["blocks"] > 0
    assert refit["heldout_previous"]["mse"] != refit["heldout"]["mse"]


def test_acceptance_by_domain(opd_run, tiny_targets):
    target = tiny_targets["qwen3"]
    result = evaluate.acceptance_by_domain(target, str(opd_run / "drafter"), ("math", "code"), per_domain=2,
                                           max_new_tokens=8)
    values = list(result["domains"].values())
    assert all(v >= 1.0 for v in values) and result["mean"] == pytest.approx(statistics.fmean(values))
    assert result["std"] == pytest.approx(statistics.pstdev(values)) and len(result["outputs"]) == 4
    ar = evaluate.acceptance_by_domain(target, None, ("math", "code"), per_domain=2, max_new_tokens=8, method="ar")
    assert ar["outputs"] == result["outputs"] and ar["mean"] == 1.0
    from specflash.prompts import dev_prompts, heldout_prompts

    dev = evaluate.acceptance_by_domain(target, str(opd_run / "drafter"), ("math", "code"), per_domain=2,
                                        max_new_tokens=8, prompt_set="dev")
    assert set(dev["outputs"]) == {q.id for d in ("math", "code") for q in dev_prompts(d)[:2]}
    assert set(result["outputs"]) == {q.id for d in ("math", "code") for q in heldout_prompts(d)[:2]}
    assert set(dev["outputs"]).isdisjoint(result["outputs"])


def test_acceptance_by_domain_caps_the_drafted_depth(opd_run, tiny_targets):
    """`max_draft` caps the tokens drafted per step, so drafters of different block sizes compare at
    the same depth; the outputs stay the target's."""
    target = tiny_targets["qwen3"]
    drafter = str(opd_run / "drafter")
    full = evaluate.acceptance_by_domain(target, drafter, ("math", "code"), per_domain=2, max_new_tokens=8)
    two = evaluate.acceptance_by_domain(target, drafter, ("math", "code"), per_domain=2, max_new_tokens=8, max_draft=2)
    assert two["outputs"] == full["outputs"]
    assert all(v > 2 for v in full["drafted_per_step"].values())  # the tiny drafter's block drafts up to 7
    assert all(0 < v <= 2 for v in two["drafted_per_step"].values())


def test_scripts_fail_with_one_line_and_status_2(tiny_dirs, tmp_path, capsys):
    args = _opd_args(tmp_path, tiny_dirs["qwen3"], tmp_path / "no-such-drafter")
    assert opd.main(args) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    assert evaluate.main(["--model", str(tiny_dirs["qwen3"]), "--drafters", str(tmp_path / "missing"),
                          "--per-domain", "1", "--max-new-tokens", "2"]) == 2
    assert "not found" in capsys.readouterr().err


def test_opd_with_a_draft_vocabulary_runs_over_its_support(tiny_targets):
    """q is 0 outside a draft vocabulary: the reverse KL sums over the vocabulary (finite, >= 0),
    a label outside it carries no weight, and an all-inside vocabulary gives the full-vocab KL."""
    from specflash.models.dflash_io import new_drafter
    from test_dflash import make_spec

    target = tiny_targets["qwen3"]
    seq, feats, last = _greedy_sequence(target, "The quick brown fox", 12)
    anchors = torch.arange(seq.first_anchor, len(seq.next_ids) - 1)
    w, cfg = loss_weights(4, 2.0), DistillConfig("opd", alpha=0.5, clip=1e9)
    some = sorted(set(seq.next_ids.tolist()))[:3] + [target.vocab_size - 1]
    for ids in (torch.tensor(sorted(set(some))), torch.arange(target.vocab_size)):
        model = new_drafter(make_spec(target, block=4, feature_layers=(1,)), target, ids)
        model.init_weights(torch.Generator().manual_seed(0), std=0.2)
        terms = block_terms(model, seq, feats, last, anchors, w, target.head_logits, cfg)
        assert torch.isfinite(terms.rkl).all() and torch.isfinite(terms.ce).all()
        assert (terms.rkl[terms.weight > 0] >= -1e-5).all()
        inside = torch.isin(seq.next_ids, ids)
        assert bool((terms.weight > 0).any()) and (len(ids) == target.vocab_size or not inside.all())
    full = random_drafter(target, block=4, feature_layers=(1,), std=0.2)
    full.load_state_dict(model.state_dict())
    ref = block_terms(full, seq, feats, last, anchors, w, target.head_logits, cfg)
    assert torch.allclose(ref.rkl, terms.rkl, atol=1e-4) and torch.allclose(ref.ce, terms.ce, atol=1e-4)
