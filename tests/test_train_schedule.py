"""The drafter trainer's learning-rate schedule: warmup, cosine to 10%, and with `--minutes` a
decay that follows the clock when the clock is further along than the steps."""

from __future__ import annotations

import argparse
import math

import pytest

from specflash.training.dflash import learning_rate


def args(minutes=None):
    return argparse.Namespace(lr=1e-3, warmup=0.1, minutes=minutes)


def test_steps_alone_warm_up_then_decay_to_a_tenth():
    a = args()
    assert learning_rate(a, 0, 100) == pytest.approx(1e-4)  # 1 of 10 warmup steps
    assert learning_rate(a, 9, 100) == pytest.approx(1e-3)
    assert learning_rate(a, 10, 100) == pytest.approx(1e-3)
    assert learning_rate(a, 55, 100) == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))))
    assert learning_rate(a, 100, 100) == pytest.approx(1e-4)
    assert learning_rate(a, 100, 100, seconds=1e9) == pytest.approx(1e-4)  # no --minutes: the clock is ignored


def test_with_minutes_the_decay_follows_whichever_is_further():
    a = args(minutes=10)
    by_steps = learning_rate(a, 55, 100, seconds=60)  # steps at half, clock at a tenth
    assert by_steps == pytest.approx(learning_rate(args(), 55, 100))
    by_clock = learning_rate(a, 20, 100, seconds=300)  # steps at a ninth, clock at half
    assert by_clock == pytest.approx(1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * 0.5))))
    assert learning_rate(a, 20, 100, seconds=600) == pytest.approx(1e-4)  # the clock ran out: the low rate
    assert learning_rate(a, 5, 100, seconds=600) == pytest.approx(6e-4)  # warmup stays by steps


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "fp32")])
def test_auto_precision_uses_bf16_only_where_the_cpu_multiplies_it(monkeypatch, native, expected):
    """Emulated bf16 autocast made a CPU step 30x slower: auto must fall back to fp32 there."""
    from specflash.training import dflash, dflash2

    monkeypatch.setattr(dflash, "bf16_matrix_units", lambda: native)
    base = ["--model", "m", "--data", "d"]
    assert dflash.parse_args(base).precision == expected
    assert dflash2.parse_args([*base, "--init-from", "x"]).precision == expected
    assert dflash.parse_args([*base, "--precision", "fp32"]).precision == "fp32"  # an explicit choice stands
    assert dflash.parse_args([*base, "--precision", "bf16"]).precision == "bf16"
