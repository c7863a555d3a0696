"""The app's runner keeps the drafters it built, as a server does."""

from __future__ import annotations

import pytest

pytest.importorskip("gradio")

from app.runner import DRAFTERS_KEPT, Runner
from specflash.config import SamplingConfig
from specflash.models.dflash_io import save_drafter
from test_dflash import random_drafter

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"


def plain_timing_steps(run) -> int:
    return sum("timing one plain step" in s.extras.get("gate", {}).get("reason", "") for s in run.steps)


def test_a_drafter_is_built_once_per_method_knobs_and_weights(tiny_root, tmp_path):
    """The second `dflash` run reuses the first's drafter, so its draft gate starts from what the
    first measured of the device (no step spent verifying the root alone to time it) and the output
    is the same; other knobs get a drafter of their own; the least recently used is dropped past
    DRAFTERS_KEPT."""
    runner = Runner(cache_dir=tiny_root)
    target = runner.target(PRESET, "cpu")
    weights = str(tmp_path)
    save_drafter(random_drafter(target, block=4, feature_layers=(1,)), tmp_path)
    runs = [runner.generate(PRESET, "cpu", PROMPT, "dflash", SamplingConfig(), 24, {}, weights) for _ in range(2)]
    assert runs[0].output_ids == runs[1].output_ids
    assert plain_timing_steps(runs[0]) >= 1 and plain_timing_steps(runs[1]) == 0
    kept = runner.drafter(target, "dflash", {}, weights)
    assert runner.drafter(target, "dflash", {}, weights) is kept
    assert runner.drafter(target, "dflash", {"tree_width": 2}, weights) is not kept
    first = runner.drafter(target, "pld", {"k": 1}, None)
    for k in range(2, DRAFTERS_KEPT + 2):
        runner.drafter(target, "pld", {"k": k}, None)
    assert runner.drafter(target, "pld", {"k": 1}, None) is not first
