"""Averaging two drafters of one line: the tensors are the weighted mean, the draft vocabulary
must agree, and a length head only one of them holds is dropped with its config keys."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specflash.errors import CheckpointError
from specflash.models.dflash_io import load_drafter
from specflash.training import average
from test_train_dflash2 import setup  # noqa: F401  (a tiny target and a saved DFlash drafter)


def _perturbed(src, dst, delta):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: (v.float() + delta).to(v.dtype) for k, v in weights.items()}, str(dst / "model.safetensors"))
    return dst


def test_the_average_is_the_weighted_mean_and_loads(setup, tmp_path):  # noqa: F811
    tmp, target, _ = setup
    start = tmp / "dflash"
    moved = _perturbed(start, tmp_path / "moved", 0.5)
    assert average.main([str(start), str(moved), "--out", str(tmp_path / "avg"), "--weight", "0.25"]) == 0
    a, b = load_file(str(start / "model.safetensors")), load_file(str(moved / "model.safetensors"))
    got = load_file(str(tmp_path / "avg" / "model.safetensors"))
    assert set(got) == set(a)
    for k in a:
        assert torch.allclose(got[k].float(), 0.25 * a[k].float() + 0.75 * b[k].float(), atol=2e-3)
    note = json.loads((tmp_path / "avg" / "config.json").read_text())["specflash_training"]
    assert note["averaged"] == ["dflash", "moved"] and note["weight_of_first"] == 0.25
    assert torch.equal(load_drafter(tmp_path / "avg", target).draft_ids, load_drafter(start, target).draft_ids)


def test_a_length_head_one_drafter_holds_is_dropped(setup, tmp_path):  # noqa: F811
    tmp, target, _ = setup
    start = tmp / "dflash"
    headed = _perturbed(start, tmp_path / "headed", 0.0)
    weights = load_file(str(headed / "model.safetensors"))
    save_file({**weights, "thresh_head_two_model.down.weight": torch.zeros(4, 4)}, str(headed / "model.safetensors"))
    config = json.loads((headed / "config.json").read_text())
    config.setdefault("dflash_config", {})["use_thresh_head_two_model"] = True
    (headed / "config.json").write_text(json.dumps(config))
    note = average.average(start, headed, tmp_path / "avg")
    assert note["dropped"] == ["thresh_head_two_model.down.weight"]
    assert "use_thresh_head_two_model" not in json.loads((tmp_path / "avg" / "config.json").read_text())["dflash_config"]


def test_drafters_of_other_vocabularies_or_shapes_are_refused(setup, tmp_path, capsys):  # noqa: F811
    tmp, _, _ = setup
    start = tmp / "dflash"
    other = _perturbed(start, tmp_path / "other", 0.0)
    d2t = load_file(str(other / "d2t.safetensors"))["d2t"]
    save_file({"d2t": d2t.flip(0).contiguous()}, str(other / "d2t.safetensors"))
    with pytest.raises(CheckpointError, match="different draft vocabularies"):
        average.average(start, other, tmp_path / "avg")
    wide = _perturbed(start, tmp_path / "wide", 0.0)
    weights = load_file(str(wide / "model.safetensors"))
    name = next(iter(weights))
    save_file({**weights, name: torch.zeros(*weights[name].shape[:-1], weights[name].shape[-1] + 1)},
              str(wide / "model.safetensors"))
    assert average.main([str(start), str(wide), "--out", str(tmp_path / "avg2")]) == 2
    assert "not one drafter's shape" in capsys.readouterr().err
