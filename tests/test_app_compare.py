"""The Compare tab's numbers, the app's first-run choice and the run-JSON import, on hand-made
records whose expected figures are worked out here from their definitions."""

from __future__ import annotations

import json

import pytest

from app import views_compare
from app.first_run import bench_for, first_run, measures_shipped_weights
from app.methods import all_knobs
from app.run_json import RunJSONError, parse_run, run_settings
from specflash.models.presets import REPO_ROOT, weights_fingerprint
from specflash.prompts import heldout_prompts
from specflash.trace import RunRecord, StepRecord


def record(method: str, tokens_per_s: float, *, steps: int = 10, accepted: float = 1.0, draft_time: float = 0.0,
           decode_time: float = 1.0, output: tuple[int, ...] = (1, 2, 3), temperature: float = 0.0) -> RunRecord:
    run = RunRecord(method=method, config={}, sampling={"temperature": temperature, "top_p": 1.0, "seed": 0},
                    model="m", device="cpu", prompt_ids=[5], steps=[], output_ids=list(output),
                    finish_reason="length", prefill_time=0.02)
    run.metrics = {"new_tokens": len(output), "decode_steps": steps, "mean_acceptance_length": accepted,
                   "draft_acceptance_rate": 0.5, "tokens_per_s": tokens_per_s, "verified_per_committed": 2.0,
                   "decode_time": decode_time, "draft_time": draft_time, "per_position_acceptance": [0.5],
                   "acceptance_histogram": {"1": 5, "2": 5}}
    return run


def test_speedups_are_paired_per_repeat_and_reported_as_median_and_range():
    groups = {"ar": [record("ar", 10), record("ar", 20)], "pld": [record("pld", 15), record("pld", 20)]}
    rows = views_compare.compare_rows(groups)
    # repeat 1: 15/10 = 1.5, repeat 2: 20/20 = 1.0 -> median 1.25, range 1.00-1.50
    assert rows[1][views_compare.SPEEDUP] == "1.25x (1.00-1.50)"
    assert rows[0][views_compare.SPEEDUP] == "1.00x"
    assert rows[1][views_compare.COLUMNS.index("tokens/s median (range)")] == "17.5 (15.0-20.0)"


def test_the_projection_costs_each_step_one_plain_step_plus_the_measured_draft():
    ar = record("ar", 10, steps=10, decode_time=1.0)  # one plain step: 0.1 s
    fast = record("dflash", 8, steps=10, accepted=3.0, draft_time=0.1)
    assert views_compare.projected_speedup(fast, views_compare.plain_step_time([ar])) == pytest.approx(
        30 * 0.1 / (10 * 0.1 + 0.1))
    assert views_compare.projected_speedup(ar, 0.1) == pytest.approx(1.0)
    row = views_compare.compare_rows({"ar": [ar], "dflash": [fast]})[1]
    assert row[views_compare.COLUMNS.index("projected speedup if verify = 1 step")] == "2.73x (projection)"


def test_identical_means_every_repeat_and_says_what_sampling_means():
    base = [record("ar", 10)]
    assert views_compare.identical_label([record("pld", 9), record("pld", 9, output=(1, 2))], base) == "no"
    assert views_compare.identical_label([record("pld", 9)], base) == "yes"
    sampled = [record("pld", 9, temperature=0.7)]
    assert views_compare.identical_label(sampled, base) == "sampled: equal in distribution, not token for token"
    assert views_compare.sampling_label(sampled[0]) == "T=0.7, top-p 1, seed 0"


def test_figures_state_device_sampling_and_repeats_and_keep_one_colour_per_method():
    groups = {"ar": [record("ar", 10)] * 3, "pld": [record("pld", 12)] * 3, "ptd": [record("ptd", 8)] * 3}
    fig = views_compare.compare_figure(groups)
    assert "measured on cpu" in fig.layout.title.text and "T=0 (greedy)" in fig.layout.title.text
    assert "median of 3 interleaved repeat(s)" in fig.layout.title.text
    lines = [s for s in fig.layout.shapes if s.y0 == s.y1 == 1.0]
    assert len(lines) == 1 and lines[0].yref == "y3"  # the 1.0 line sits on the speedup chart
    colours = views_compare.method_colours(list(groups))
    for trace in fig.data:
        assert list(trace.marker.color) == [colours[m] for m in trace.x]
    hist = views_compare.acceptance_figure(groups).data
    for trace in hist:
        assert (trace.marker.color if trace.type == "bar" else trace.line.color) == colours[trace.name]


def test_the_verify_cost_note_names_the_methods_that_lost():
    groups = {"ar": [record("ar", 10)], "pld": [record("pld", 12)], "ptd": [record("ptd", 8)]}
    note = views_compare.verify_cost_note([1.0, 1.2, 1.5, 2.0], groups)
    assert note.startswith("ptd ran slower than ar here") and "4 tokens in one forward costs 2.0 plain steps" in note
    fig = views_compare.verify_cost_figure([1.0, 1.2, 1.5, 2.0], "cpu")
    assert list(fig.data[0].y) == [1.0, 1.2, 1.5, 2.0] and list(fig.data[2].y) == [1, 2, 3, 4]


def _bench(path, model, device, samples):
    path.write_text(json.dumps({"model": model, "device": device, "repeats": 2, "samples": samples}))


def test_the_first_run_is_the_clearest_measured_win(tmp_path):
    code, rewrite = heldout_prompts("code")[0], heldout_prompts("rewrite")[0]
    samples = []
    for pid, walls in ((code.id, {"ar": 2.0, "pld": 1.9, "dflash": 1.0}), (rewrite.id, {"ar": 2.0, "pld": 1.25})):
        for method, wall in walls.items():
            samples += [{"method": method, "prompt_id": pid, "wall": wall}, {"method": method, "prompt_id": pid, "wall": wall}]
    _bench(tmp_path / "bench-x-cpu.json", "preset-x", "cpu: 2 threads", samples)
    _bench(tmp_path / "bench-batch-x-cpu.json", "preset-x", "cpu", [{"method": "ar", "rows": 4}])  # not per prompt
    narrow = [{"method": m, "prompt_id": rewrite.id, "wall": w} for m, w in (("ar", 2.0), ("pld", 0.5))]
    _bench(tmp_path / "bench-ab-x-cpu.json", "preset-x", "cpu: 2 threads", narrow)  # an A/B of fewer methods
    first = first_run("preset-x", "cpu", ["ar", "pld", "dflash"], docs=tmp_path)
    assert (first.prompt, first.method) == (code.text, "dflash") and "2.00x plain decoding" in first.note
    assert first_run("preset-x", "cpu", ["ar", "pld"], docs=tmp_path).prompt == rewrite.text  # 2.0 / 1.25 = 1.6
    fallback = first_run("other", "cpu", ["ar", "pld"], docs=tmp_path)
    assert fallback.method == "pld" and "nothing here says which method wins" in fallback.note


def test_a_win_prompt_lookup_drafted_gives_way_to_one_the_drafter_made(tmp_path):
    code, rewrite = heldout_prompts("code")[0], heldout_prompts("rewrite")[0]

    def sample(method, pid, wall, looked):
        return {"method": method, "prompt_id": pid, "wall": wall, "metrics": {"decode_steps": 10, "lookup_steps": looked}}

    samples = [sample("ar", pid, 2.0, 0) for pid in (code.id, rewrite.id)]
    samples += [sample("dflash", rewrite.id, 0.8, 7), sample("dflash", code.id, 1.0, 1)]
    _bench(tmp_path / "bench-x-cpu.json", "preset-x", "cpu: 2 threads", samples)
    first = first_run("preset-x", "cpu", ["ar", "dflash"], docs=tmp_path)
    assert (first.prompt, first.method) == (code.text, "dflash") and "2.00x" in first.note
    _bench(tmp_path / "bench-x-cpu.json", "preset-x", "cpu: 2 threads", samples[:3])  # no other win: it is kept
    assert first_run("preset-x", "cpu", ["ar", "dflash"], docs=tmp_path).prompt == rewrite.text


def test_parse_run_round_trips_and_names_what_is_wrong():
    run = record("pld", 10)
    run.steps = [StepRecord(step=0, phase="prefill", context_len=1, tokens=[], parents=[], q=None, p=[], accepted=[],
                            correction=1, correction_kind="target", correction_p=1.0, committed=[1], verified=1,
                            draft_time=0.0, verify_time=0.01, extras={})]
    assert parse_run(run.to_json()) == run
    bad = json.loads(run.to_json())
    bad["steps"][0].pop("committed")
    bad["steps"][0]["colour"] = "red"
    with pytest.raises(RunJSONError, match=r"steps\[0\] lacks committed and has unknown colour"):
        parse_run(json.dumps(bad))
    with pytest.raises(RunJSONError, match="not JSON"):
        parse_run("{oops")
    with pytest.raises(RunJSONError, match="nothing to import"):
        parse_run("  ")


def test_run_settings_restore_only_the_runs_own_knobs():
    knobs = all_knobs(["pld", "ptd"])
    run = record("pld", 10, temperature=0.5)
    run.config, run.prompt = {"k": 2, "max_ngram": 3, "min_ngram": 1}, "hello"
    settings = run_settings(run, knobs, ["ar", "pld", "ptd"])
    assert (settings.prompt, settings.method, settings.temperature, settings.max_new_tokens) == ("hello", "pld", 0.5, 3)
    assert [v for k, v in zip(knobs, settings.knobs) if k.method == "pld"] == [2, 3, 1]
    assert all(v is None for k, v in zip(knobs, settings.knobs) if k.method == "ptd")


def test_figures_of_the_shipped_weights_come_before_wider_older_ones(tmp_path):
    code = heldout_prompts("code")[0]
    drafter = "assets/drafters/smollm2-135m-dflash"
    shipped = {"dflash": {"drafter": {"path": drafter, "weights": weights_fingerprint(REPO_ROOT / drafter)}}}
    replaced = {"dflash": {"drafter": {"path": drafter, "weights": "0" * 16}}}

    def samples(methods, wall):
        return [{"method": m, "prompt_id": code.id, "wall": 2.0 if m == "ar" else wall} for m in methods]

    wide = samples(("ar", "pld", "dflash"), 1.0)
    (tmp_path / "bench-a-cpu.json").write_text(json.dumps(
        {"model": "preset-x", "device": "cpu", "weights": replaced, "samples": wide}))
    (tmp_path / "bench-b-cpu.json").write_text(json.dumps({"model": "preset-x", "device": "cpu", "samples": wide}))
    (tmp_path / "bench-c-cpu.json").write_text(json.dumps(
        {"model": "preset-x", "device": "cpu", "weights": shipped, "samples": samples(("ar", "dflash"), 1.6)}))
    assert measures_shipped_weights({"weights": shipped}) and not measures_shipped_weights({"weights": replaced})
    assert not measures_shipped_weights({})
    assert bench_for("preset-x", "cpu", tmp_path)[0].name == "bench-c-cpu.json"
    assert "1.25x" in first_run("preset-x", "cpu", ["ar", "dflash"], docs=tmp_path).note
    (tmp_path / "bench-c-cpu.json").unlink()
    older, newer = ({"model": "preset-x", "device": "cpu", "date": d, "samples": wide}
                    for d in ("2026-12-01", "2026-12-05"))
    (tmp_path / "bench-a-cpu.json").write_text(json.dumps(newer))
    (tmp_path / "bench-b-cpu.json").write_text(json.dumps(older))
    assert bench_for("preset-x", "cpu", tmp_path)[0].name == "bench-a-cpu.json"
    # two runs of one day: the later start wins, and a run that recorded none counts as earlier
    (tmp_path / "bench-b-cpu.json").write_text(json.dumps({**newer, "started": "2026-12-05T09:00:00Z"}))
    assert bench_for("preset-x", "cpu", tmp_path)[0].name == "bench-b-cpu.json"
    (tmp_path / "bench-a-cpu.json").write_text(json.dumps({**newer, "started": "2026-12-05T10:00:00Z"}))
    assert bench_for("preset-x", "cpu", tmp_path)[0].name == "bench-a-cpu.json"
    # a run over more prompts comes before one over more methods
    more = heldout_prompts("code")[1]
    broad = [{"method": m, "prompt_id": p.id, "wall": 1.0} for m in ("ar", "dflash") for p in (code, more)]
    (tmp_path / "bench-b-cpu.json").write_text(json.dumps({**older, "samples": broad}))
    assert bench_for("preset-x", "cpu", tmp_path)[0].name == "bench-b-cpu.json"
