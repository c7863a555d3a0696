"""Held-out validation in the DFlash trainer: rows of held-out acceptance in the log, scored only
on the held-out shards, without changing what the run trains."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from specflash.training import dflash
from specflash.models.dflash import loss_weights
from specflash.training.data import read_shard
from specflash.training.validation import held_out_blocks
from test_train_dflash2 import setup  # noqa: F401  (the tiny harvest fixture: two shards of 4 answers)

HELD = "shard-00001.safetensors"


def _train(setup, out, *extra):  # noqa: F811
    tmp, _, model_dir = setup
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(out),
            "--steps", "4", "--anchors", "8", "--seqs-per-step", "2", "--no-feature-cache", "--log-every", "1",
            "--lr", "3e-3", "--hold-out", HELD, *extra]
    return dflash.main(argv)


def _log(out):
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_validation_rows_are_logged_and_training_is_unchanged(setup, tmp_path):  # noqa: F811
    assert _train(setup, tmp_path / "plain") == 0
    assert _train(setup, tmp_path / "validated", "--validate-every", "3", "--validate-samples", "3") == 0
    plain, validated = (load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("plain", "validated"))
    assert all(torch.equal(plain[k], validated[k]) for k in plain)
    rows = _log(tmp_path / "validated")
    checks = [r for r in rows if "val_tau" in r]
    assert [r["step"] for r in checks] == [0, 3, 4]  # the start, every 3 steps, and the end
    assert all(1 <= r["val_tau"] <= 8 and 0 <= r["val_acc1"] <= 1 and r["val_loss"] > 0 for r in checks)
    training = [{k: v for k, v in r.items() if k != "seconds"} for r in rows if "val_tau" not in r]
    assert training == [{k: v for k, v in r.items() if k != "seconds"} for r in _log(tmp_path / "plain")]


def test_blocks_come_from_the_held_out_shards_only(setup):  # noqa: F811
    tmp, target, _ = setup
    blocks = held_out_blocks(target, [tmp / "data"], [HELD], (1,), None, samples=3, anchors=8)
    held = {tuple(s.token_ids) for s in read_shard(tmp / "data" / HELD)}
    assert len(blocks) == 3 and all(tuple(seq.tokens.tolist()) in held for seq, _, _ in blocks)
    assert all(bool((anchors >= seq.first_anchor).all()) for seq, _, anchors in blocks)


def test_validation_needs_held_out_shards_in_the_data(setup, tmp_path, capsys):  # noqa: F811
    tmp, _, model_dir = setup
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--target-layer-ids", "1", "--out", str(tmp_path),
            "--steps", "1", "--no-feature-cache", "--validate-every", "1", "--hold-out", "shard-00009.safetensors"]
    assert dflash.main(argv) == 2
    assert "none of them is in the data folders" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        dflash.parse_args(["--model", "m", "--data", "d", "--validate-every", "-1"])


def test_cli_scores_drafters_side_by_side(setup, capsys):  # noqa: F811
    """Two copies of one drafter score the same figures on the same blocks, which match the
    trainer's own function on the blocks the CLI draws."""
    from specflash.models.dflash_io import load_drafter
    from specflash.training import validation

    tmp, target, model_dir = setup
    folder = str(tmp / "dflash")
    argv = ["--model", str(model_dir), "--data", str(tmp / "data"), "--hold-out", HELD, "--drafters",
            f"{folder},{folder}", "--labels", "a,b", "--samples", "3", "--anchors", "8"]
    assert validation.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["a"] == result["b"]
    blocks = held_out_blocks(target, [tmp / "data"], [HELD], (1,), None, samples=3, anchors=8)
    model = load_drafter(folder, target).float()
    direct = validation.held_out_acceptance(model, blocks, loss_weights(8, 4.0))
    assert result["a"]["val_tau"] == pytest.approx(direct["val_tau"])
    assert result["a"]["blocks"] == sum(len(a) for _, _, a in blocks)
    assert validation.main(argv[:-6] + ["--drafters", folder, "--labels", "a,b"]) == 2


def test_per_folder_scores_each_folder_apart_and_together(setup, tmp_path, capsys):  # noqa: F811
    import shutil

    from specflash.training import validation

    tmp, _, model_dir = setup
    twin = tmp_path / "twin"
    shutil.copytree(tmp / "data", twin)
    argv = ["--model", str(model_dir), "--data", f"{tmp / 'data'},{twin}", "--hold-out", HELD, "--drafters",
            str(tmp / "dflash"), "--labels", "a", "--samples", "4", "--anchors", "8", "--per-folder"]
    assert validation.main(argv) == 0
    result = json.loads(capsys.readouterr().out)["a"]
    folders = result.pop("folders")
    assert sorted(folders) == ["data", "twin"] and folders["data"] == folders["twin"]  # the same shards, the same draw
    assert result["blocks"] == 2 * folders["data"]["blocks"]
    assert result["val_tau"] == pytest.approx(folders["data"]["val_tau"])


def test_prompt_checks_keep_the_best_weights_and_leave_training_unchanged(setup, tmp_path):  # noqa: F811
    """`--validate-prompts dev`: each check logs the dev prompts' acceptance per domain, the run's
    best-prompts/ folder holds weights that score the best mean logged, and the trained weights
    are those of a run without the checks."""
    from specflash.training.evaluate import acceptance_by_domain
    from specflash.training.prompt_validation import BEST

    _, target, _ = setup
    assert _train(setup, tmp_path / "plain") == 0
    out = tmp_path / "prompts"
    assert _train(setup, out, "--validate-every", "2", "--validate-samples", "2", "--validate-prompts", "dev",
                  "--validate-prompts-per-domain", "1") == 0
    checks = [r for r in _log(out) if "prompts_tau" in r]
    assert [r["step"] for r in checks] == [0, 2, 4]
    domains = ("math", "code", "writing", "rewrite")
    for row in checks:
        assert row["prompts_tau"] == pytest.approx(sum(row[f"prompts_tau_{d}"] for d in domains) / 4)
        assert all(row[f"prompts_tau_{d}"] >= 1 for d in domains)
    assert checks[0]["prompts_best"] is True
    best = max(r["prompts_tau"] for r in checks)
    again = acceptance_by_domain(target, str(out / BEST), domains, per_domain=1, prompt_set="dev")
    assert again["mean"] == pytest.approx(best)
    trained, plain = (load_file(str(tmp_path / d / "checkpoint" / "model.safetensors")) for d in ("prompts", "plain"))
    assert all(torch.equal(plain[k], trained[k]) for k in plain)


def test_prompt_checks_need_the_check_cadence():
    with pytest.raises(SystemExit):
        dflash.parse_args(["--model", "m", "--data", "d", "--validate-prompts", "dev"])


def test_the_best_prompt_check_is_kept_not_the_last(setup, tmp_path):  # noqa: F811
    """Two checks of different weights, in both orders: best-prompts/ holds whichever scored
    higher, so a worse later check never replaces it."""
    from specflash.models.dflash_io import load_drafter
    from specflash.training.evaluate import acceptance_by_domain
    from specflash.training.prompt_validation import BEST, PromptValidation

    tmp, target, _ = setup
    model = load_drafter(tmp / "dflash", target).float()
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    muted = {k: torch.zeros_like(v) if k.startswith("fc.") else v.clone() for k, v in trained.items()}
    for order in ((trained, muted), (muted, trained)):
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        out.mkdir()
        check = PromptValidation(model, target, out, "dev", per_domain=1)
        scores = []
        for weights in order:
            model.load_state_dict(weights)
            scores.append(check()["prompts_tau"])
        assert scores[0] != scores[1]
        kept = acceptance_by_domain(target, str(out / BEST), per_domain=1, prompt_set="dev")["mean"]
        assert kept == pytest.approx(max(scores))


def test_a_resumed_run_measures_its_best_against_its_earlier_checks(setup, tmp_path):  # noqa: F811
    from specflash.models.dflash_io import load_drafter
    from specflash.training.prompt_validation import BEST, PromptValidation

    tmp, target, _ = setup
    (tmp_path / "log.jsonl").write_text(json.dumps({"step": 250, "prompts_tau": 99.0}) + "\n")
    row = PromptValidation(load_drafter(tmp / "dflash", target).float(), target, tmp_path, "dev", 1)()
    assert row["prompts_tau"] < 99.0 and "prompts_best" not in row and not (tmp_path / BEST).exists()
