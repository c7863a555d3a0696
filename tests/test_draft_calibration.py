"""scripts/draft_calibration.py: the slots it scores are the ones verification reaches, and its
table bins them as stated."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from specflash.models.dflash import loss_weights
from specflash.models.dflash_io import load_drafter
from specflash.training.validation import held_out_acceptance, held_out_blocks
from test_train_dflash2 import setup  # noqa: F401  (tiny qwen3 target, DFlash drafter, harvest of 2 shards)

_PATH = Path(__file__).resolve().parents[1] / "scripts" / "draft_calibration.py"


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location("draft_calibration", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reached_slots_are_the_accepted_run_and_its_first_miss(calibration, setup):  # noqa: F811
    tmp, target, _ = setup
    drafter = load_drafter(tmp / "dflash", target).float().eval()
    blocks = held_out_blocks(target, [tmp / "data"], ["shard-00001.safetensors"], (1,), None, samples=4, anchors=6)
    conf, right, slot = calibration.reached_slots(calibration.drafted_slots(drafter, blocks))
    n = sum(len(a) for _, _, a in blocks)
    accepted = (held_out_acceptance(drafter, blocks, loss_weights(8, 4.0))["val_tau"] - 1) * n
    assert abs(float(right.sum()) - accepted) < 1e-6
    assert int((slot == 0).sum()) == n  # every block reaches its first slot
    assert bool(((conf > 0) & (conf <= 1)).all())


def test_the_table_bins_by_confidence_and_by_slot(calibration):
    conf = torch.tensor([0.05, 0.15, 0.95, 0.97, 0.55])
    right = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    slot = torch.tensor([0, 0, 0, 1, 1])
    t = calibration.table(conf, right, slot)
    assert t["slots_reached"] == 5
    assert [(b["from"], b["n"], b["accepted"]) for b in t["bins"]] == [(0.0, 1, 0.0), (0.1, 1, 1.0), (0.5, 1, 0.0),
                                                                        (0.9, 2, 1.0)]
    assert [(s["slot"], s["n"]) for s in t["per_slot"]] == [(1, 3), (2, 2)]
    assert [s["accepted"] for s in t["per_slot"]] == pytest.approx([2 / 3, 0.5])


def test_block_runs_are_the_accepted_runs_of_whole_blocks(calibration, setup):  # noqa: F811
    tmp, target, _ = setup
    drafter = load_drafter(tmp / "dflash", target).float().eval()
    blocks = held_out_blocks(target, [tmp / "data"], ["shard-00001.safetensors"], (1,), None, samples=4, anchors=6)
    slots = calibration.drafted_slots(drafter, blocks)
    conf, run = calibration.block_runs(slots)
    assert conf.shape == (len(run), 7) and bool(((conf > 0) & (conf <= 1)).all())
    _, right, slot = calibration.reached_slots(slots)
    assert int(run.sum()) <= int(right.sum())  # the whole blocks' runs are part of every reached slot's


def test_cut_values_by_hand(calibration):
    conf = torch.tensor([[0.9, 0.9], [0.1, 0.1]])
    run = torch.tensor([2, 0])
    curve = [1.0, 1.5, 2.0]
    v = calibration.cut_values(conf, run, curve, 0.5, [1.0])
    assert v["fixed 0"]["value"] == pytest.approx(2 / 2.0)
    assert v["fixed 1"]["value"] == pytest.approx((2 + 1) / (2 * (1.5 + 0.5)))
    assert v["fixed 2"]["value"] == pytest.approx((3 + 1) / (2 * (2.0 + 0.5)))
    # the cut verifies both drafts of the sure block (E = 1 + 0.9 + 0.81 over 2.0 beats 1.9 over 1.5)
    # and none of the hopeless one
    assert v["cut, rate 1"]["mean_width"] == pytest.approx(1.0)
    assert v["cut, rate 1"]["value"] == pytest.approx((3 + 1) / (2.0 + 0.5 + 1.0 + 0.5))

