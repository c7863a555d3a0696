"""The benchmark's arithmetic: paired speedups, pooled acceptance, identical-output check; and
the PTD sweep (specflash.bench_ptd) on a tiny model."""

from __future__ import annotations

from specflash import bench_ptd
from specflash.bench import Sample, summarize_samples


def _s(method, prompt, repeat, wall, out, steps=None, mal=None, vpc=None):
    metrics = {} if steps is None else {"decode_steps": steps, "mean_acceptance_length": mal, "verified_per_committed": vpc}
    return Sample(method, "code", prompt, repeat, wall, len(out), out, metrics)


def test_summary_rows():
    samples = [
        _s("ar", "a", 0, 2.0, [1, 2, 3, 4], 4, 1.0, 1.0),
        _s("pld", "a", 0, 1.0, [1, 2, 3, 4], 2, 2.0, 2.0),
        _s("ar", "b", 0, 4.0, [5, 6], 2, 1.0, 1.0),
        _s("pld", "b", 0, 1.0, [5, 7], 1, 2.0, 1.5),
        _s("hf-pld", "a", 0, 4.0, [1, 2, 3, 4]),
    ]
    rows = {r["method"]: r for r in summarize_samples(samples, ["ar", "pld", "hf-pld"])}
    assert rows["ar"]["speedup"] == 1.0
    assert rows["pld"]["speedup"] == 3.0  # median of the paired ratios 2.0 and 4.0
    assert rows["pld"]["mean_acceptance_length"] == 2.0  # 6 tokens over 3 steps
    assert rows["pld"]["verified_per_committed"] == (2 * 2 * 2.0 + 1.5 * 2 * 1) / 6
    assert rows["pld"]["identical_to_ar"] is False
    assert rows["hf-pld"]["identical_to_ar"] is True and rows["hf-pld"]["mean_acceptance_length"] is None
    assert list(rows) == ["ar", "pld", "hf-pld"]


def test_ptd_sweep_gives_one_lossless_row_per_shape(tiny_targets, capsys):
    target = tiny_targets["qwen3"]
    prompts = {"count": target.tokenizer("1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,").input_ids}
    shapes = [(4, 0, 0, 3, 2), (8, 4, 2, 2, 2)]
    rows = bench_ptd.sweep(target, prompts, shapes, 8)
    assert len(rows) == len(shapes) and all(r.items() >= bench_ptd.options_of(s).items() for r, s in zip(rows, shapes))
    assert all(r["identical_to_ar"] and r["mean_acceptance_length"] >= 1.0 for r in rows)
    assert rows[0]["lookahead_per_forward"] == 0.0 < rows[1]["lookahead_per_forward"]
    assert capsys.readouterr().out.splitlines() == [bench_ptd.format_row(r) for r in rows]
