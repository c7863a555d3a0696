"""Paired comparisons of a benchmark's methods: the estimate is the benchmark's own statistic,
the interval comes from resampling prompts with all their repeats, and bad requests say why."""

from __future__ import annotations

import json
import random

import pytest

from specflash.bench_compare import ALL, CompareError, compare, compare_all, parse_pairs
from specflash.cli import main


def sample(method, prompt, repeat, wall, tau=None, steps=10, domain="math"):
    metrics = {} if tau is None else {"decode_steps": steps, "mean_acceptance_length": tau}
    return {"method": method, "domain": domain, "prompt_id": prompt, "repeat": repeat, "wall": wall,
            "metrics": metrics}


def test_a_method_twice_as_fast_everywhere_is_exactly_that():
    samples = [s for p in range(6) for r in range(2)
               for s in (sample("a", f"p{p}", r, 1.0 + p, tau=3.0), sample("b", f"p{p}", r, 2.0 * (1.0 + p), tau=2.0))]
    result = compare(samples, "a", "b")
    assert (result.prompts, result.pairs) == (6, 12)
    assert (result.speed.estimate, result.speed.low, result.speed.high) == (2.0, 2.0, 2.0)
    assert (result.tau_difference.estimate, result.tau_difference.low, result.tau_difference.high) == (1.0, 1.0, 1.0)
    assert compare(samples, "b", "a").speed.estimate == 0.5


def test_the_acceptance_difference_pools_steps_like_the_benchmark():
    # a commits 30 + 60 tokens over 10 + 30 steps: 2.25 a step, not the mean of 3.0 and 2.0; b 2.0
    samples = [sample("a", "p0", 0, 1.0, tau=3.0, steps=10), sample("b", "p0", 0, 1.0, tau=2.0, steps=10),
               sample("a", "p1", 0, 1.0, tau=2.0, steps=30), sample("b", "p1", 0, 1.0, tau=2.0, steps=30)]
    assert compare(samples, "a", "b", resamples=10).tau_difference.estimate == pytest.approx(2.25 - 2.0)


def test_noise_gives_an_interval_around_one_and_a_real_gain_one_above_it():
    rng = random.Random(0)
    tie, gain = [], []
    for p in range(30):
        base = rng.uniform(0.5, 2.0)  # prompts differ far more than the methods do
        for r in range(3):
            tie += [sample("a", f"p{p}", r, base * rng.uniform(0.9, 1.1)),
                    sample("b", f"p{p}", r, base * rng.uniform(0.9, 1.1))]
            gain += [sample("a", f"p{p}", r, base * rng.uniform(0.9, 1.1)),
                     sample("b", f"p{p}", r, 1.3 * base * rng.uniform(0.9, 1.1))]
    tied = compare(tie, "a", "b")
    assert tied.speed.low < 1.0 < tied.speed.high and tied.tau_difference is None
    gained = compare(gain, "a", "b")
    assert 1.0 < gained.speed.low < gained.speed.estimate < gained.speed.high
    assert gained.speed.low <= 1.3 <= gained.speed.high


def test_repeats_of_a_prompt_move_together():
    """Ten repeats of each of two prompts are two observations, not twenty: a bootstrap over
    samples would call the gap certain, over prompts it cannot."""
    samples = []
    for r in range(10):
        samples += [sample("a", "fast", r, 1.0), sample("b", "fast", r, 2.0)]
        samples += [sample("a", "slow", r, 2.0), sample("b", "slow", r, 1.0)]
    result = compare(samples, "a", "b")
    assert result.prompts == 2 and result.pairs == 20
    assert (result.speed.low, result.speed.high) == (0.5, 2.0)


def test_the_same_seed_gives_the_same_interval_and_domains_are_their_own():
    rng = random.Random(1)
    samples = [sample(m, f"{d}{p}", 0, rng.uniform(0.5, 1.5), tau=rng.uniform(1, 3), domain=d)
               for d in ("math", "code") for p in range(8) for m in ("a", "b")]
    assert compare(samples, "a", "b", seed=3) == compare(samples, "a", "b", seed=3)
    results = compare_all(samples, [("a", "b")])
    assert [r.domain for r in results] == [ALL, "math", "code"]
    assert [r.prompts for r in results] == [16, 8, 8]
    math_only = compare([s for s in samples if s["domain"] == "math"], "a", "b")
    assert results[1].speed == math_only.speed and results[1].tau_difference == math_only.tau_difference


def test_requests_it_cannot_answer_say_why():
    samples = [sample("a", "p0", 0, 1.0), sample("b", "p1", 0, 1.0)]
    with pytest.raises(CompareError, match="no samples of c"):
        compare(samples, "a", "c")
    with pytest.raises(CompareError, match="share no"):
        compare(samples, "a", "b")
    with pytest.raises(CompareError, match="itself"):
        compare(samples, "a", "a")
    with pytest.raises(CompareError, match="A:B"):
        parse_pairs("adaflash")
    assert parse_pairs("adaflash:dflash, dflash/m12:dflash") == [("adaflash", "dflash"), ("dflash:m12", "dflash")]


def test_the_command_prints_the_table_and_writes_json(tmp_path, capsys):
    samples = [s for p in range(4)
               for s in (sample("a", f"p{p}", 0, 1.0, tau=2.5), sample("b", f"p{p}", 0, 1.5, tau=2.0))]
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"device": "cpu", "prompt_set": "dev", "repeats": 1, "samples": samples}))
    out = tmp_path / "compare.json"
    assert main(["compare", str(bench), "--pairs", "a:b", "--resamples", "50", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "a vs b" in printed and "1.500" in printed and "+0.50" in printed
    written = json.loads(out.read_text())["comparisons"][0]
    assert written["speed"]["estimate"] == 1.5 and written["domain"] == ALL
    assert main(["compare", str(bench), "--pairs", "a:zz"]) == 2
    assert "no samples of zz" in capsys.readouterr().err
    assert main(["compare", str(tmp_path / "missing.json"), "--pairs", "a:b"]) == 2
    assert "cannot read the benchmark" in capsys.readouterr().err
