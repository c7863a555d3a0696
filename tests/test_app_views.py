"""The app's pure views on recorded traces: real runs of every method on a tiny preset, plus
hand-built StepRecords carrying PTD / DeLS / AdaFlash extras (those methods may not exist yet)."""

from __future__ import annotations

import re

import pytest

import specflash
from app import views, views_compare, views_heads, views_tree
from app.methods import all_knobs, available_methods, method_knobs, options_for
from specflash.errors import SpecFlashError
from specflash.models.presets import default_drafter
from specflash.trace import RunRecord, StepRecord

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"
SPAN = re.compile(r'<span class="tok tok-(\w+)" data-step="(\d+)" title="([^"]*)"')


@pytest.fixture(scope="module")
def target(tiny_root):
    return specflash.load(PRESET, device="cpu", cache_dir=tiny_root)


@pytest.fixture(scope="module")
def runs(target, tiny_root) -> dict[str, RunRecord]:
    """One greedy run per method this checkout has (methods needing missing files are left out).
    `draft` drafts with the target itself, so its trace has accepted tokens and bonuses."""
    out = {}
    for method in available_methods():
        drafter = PRESET if method == "draft" else default_drafter(PRESET, method, tiny_root)
        try:
            out[method] = specflash.generate(
                target, PROMPT, method, max_new_tokens=24, drafter=drafter, cache_dir=tiny_root,
            )
        except SpecFlashError:
            continue
    assert {"ar", "pld", "draft"} <= set(out)
    return out


@pytest.fixture(scope="module")
def texts(target, runs) -> dict[int, str]:
    ids = {t for run in runs.values() for s in run.steps for t in (*s.tokens, *s.committed, s.correction)}
    return {t: target.tokenizer.decode([t]) for t in ids}


def expected_origins(run: RunRecord) -> list[tuple[str, int]]:
    """(origin, step) of every committed token, straight from the records."""
    out = []
    for s in run.steps:
        for i, _ in enumerate(s.committed):
            kind = "accepted" if i < len(s.accepted) else s.correction_kind
            out.append((kind, s.step))
    return out


@pytest.mark.parametrize("method", ["ar", "pld", "draft"])
def test_output_spans_carry_each_tokens_origin_step_and_probabilities(runs, texts, method):
    run = runs[method]
    spans = SPAN.findall(views.output_html(run.steps, texts))
    assert [(kind, int(step)) for kind, step, _ in spans] == expected_origins(run)
    assert len(spans) == len(run.output_ids)
    assert all("p=" in title and "q=" in title for _, _, title in spans)
    if method == "ar":
        assert {kind for kind, _, _ in spans} == {"target"}


def test_draft_run_shows_accepted_tokens_with_their_q(runs, texts):
    run = runs["draft"]
    step = next(s for s in run.steps if s.accepted and len(s.committed) > 1)
    token = views.step_tokens(step)[0]
    assert token.origin == "accepted" and token.q == pytest.approx(step.q[step.accepted[0]])
    assert f"q={step.q[step.accepted[0]]:.3f}" in views.token_span(token, texts)


def test_views_read_a_run_back_from_json_the_same(runs, texts):
    for run in runs.values():
        again = RunRecord.from_json(run.to_json())
        assert views.output_html(again.steps, texts) == views.output_html(run.steps, texts)
        assert views.stats_markdown(again) == views.stats_markdown(run)


def test_missing_token_text_shows_the_id():
    step = StepRecord(0, "prefill", 3, [], [], None, [], [], 42, "target", 0.5, [42], 3, 0.0, 0.1)
    assert "⟨42⟩" in views.output_html([step], {})


def chain_step(**kw) -> StepRecord:
    base = dict(step=3, phase="decode", context_len=10, tokens=[5, 6, 7, 8], parents=[-1, 0, 1, 2],
                q=[0.9, 0.8, 0.7, 0.6], p=[0.95, 0.85, 0.1, 0.5], accepted=[0, 1], correction=9,
                correction_kind="resample", correction_p=0.4, committed=[5, 6, 9], verified=5,
                draft_time=0.01, verify_time=0.02)
    return StepRecord(**(base | kw))


def test_step_inspector_says_why_the_draft_gate_drafted_nothing():
    off = {"state": "off", "width": 0, "value": 1.0, "reason": "drafting does not pay: best drafted width is worth 0.61"}
    skipped = chain_step(tokens=[], parents=[], q=None, p=[], accepted=[], correction_kind="target",
                         committed=[9], verified=1, extras={"gate": off})
    probe = chain_step(extras={"gate": {**off, "state": "probe", "width": 7, "reason": "drafting off for 8 steps: probing"}})
    assert views.stop_summary(skipped, {9: "X"}).startswith("Draft gate off: drafting does not pay")
    assert "Draft gate probe: drafting off for 8 steps" in views.stop_summary(probe, {})
    assert views.gate_summary([skipped, skipped, probe]) == "on 0, off 2, probe 1 steps"
    assert views.gate_summary([chain_step()]) is None


def test_step_inspector_marks_where_verification_stopped():
    step = chain_step()
    assert views.node_status(step) == ["accepted", "accepted", "rejected", "unverified"]
    table = views.step_table_html(step, {5: "a", 6: "b", 7: "c", 8: "d", 9: "X"})
    assert table.count('class="node-accepted"') == 2 and 'class="node-rejected"' in table
    assert "stopped after 2 accepted token(s) of 4" in table and "&#x27;X&#x27; (resample, p=0.400)" in table
    fig = views.step_figure(step, {})
    assert list(fig.data[0].y) == step.p and list(fig.data[1].y) == step.q
    assert fig.data[0].marker.color[2] == views.STATUS_COLOURS["rejected"]


def test_step_inspector_bonus_and_point_mass_draft():
    step = chain_step(q=None, accepted=[0, 1, 2, 3], correction_kind="bonus", committed=[5, 6, 7, 8, 9])
    assert "All 4 drafted tokens" in views.step_table_html(step, {})
    assert len(views.step_figure(step, {}).data) == 1  # no q bars for point masses


def ptd_step() -> StepRecord:
    ptd = {"draft_before": {"tokens": [1, 2, 3], "parents": [-1, 0, 0]},
           "draft_after": {"tokens": [2, 4, 5, 6], "parents": [-1, 0, 0, 1]},
           "added": [2, 3], "pruned": [0, 99], "inherited": [1], "guess_size": 4, "lookahead_size": 4}
    return chain_step(tokens=[5, 6, 7, 8], parents=[-1, 0, 0, 1], accepted=[0, 1], correction_kind="resample",
                      extras={"ptd": ptd})


def _traces(fig, name):
    return [t for t in fig.data if t.name == name]


def test_tree_layout_puts_depth_on_x_and_parents_over_children():
    x, y, root_y = views_tree.tree_layout([-1, 0, 0, 1])
    assert x == [1.0, 2.0, 2.0, 3.0]
    assert min(y[1], y[2]) <= y[0] <= max(y[1], y[2]) and y[3] == y[1]
    assert root_y == y[0]


def test_ptd_figure_highlights_the_accepted_path_and_colours_the_update():
    step = ptd_step()
    fig = views_tree.ptd_figure(step, {5: "a"})
    accepted = _traces(fig, "accepted")[0]
    assert sorted(accepted.customdata) == [0, 1] and accepted.marker.color == views_tree.NODE_COLOURS["accepted"]
    assert sorted(_traces(fig, "verified")[0].customdata) == [2, 3]
    path = _traces(fig, "accepted path")[0]
    assert len(path.x) == 3 and path.line.width == 4  # root + two accepted nodes
    cats = {t.name: (t.xaxis, sorted(t.customdata)) for t in fig.data if t.name in ("pruned", "added", "inherited")}
    assert cats == {"pruned": ("x2", [0]), "added": ("x3", [2, 3]), "inherited": ("x3", [1])}
    kept = [(t.xaxis, sorted(t.customdata)) for t in _traces(fig, "kept")]
    assert kept == [("x2", [1, 2]), ("x3", [0])]
    assert "guess size 4, lookahead size 4" in fig.layout.title.text


def test_ptd_figure_of_a_real_ptd_run_matches_its_extras(runs, texts):
    if "ptd" not in runs:
        pytest.skip("specflash/drafters/ptd.py is not in this checkout")
    step = next(s for s in runs["ptd"].steps if s.extras.get("ptd", {}).get("added"))
    ptd = step.extras["ptd"]
    fig = views_tree.ptd_figure(step, texts)
    added = [i for t in _traces(fig, "added") for i in t.customdata]
    assert sorted(added) == sorted(ptd["added"])
    pruned = [i for t in _traces(fig, "pruned") for i in t.customdata]
    assert sorted(pruned) == sorted(ptd["pruned"])
    n_nodes = sum(len(t.customdata) for t in fig.data if t.name in views_tree.NODE_COLOURS)
    assert n_nodes == len(step.tokens) + len(ptd["draft_before"]["tokens"]) + len(ptd["draft_after"]["tokens"])


def test_ptd_empty_state_for_other_methods(runs):
    assert not views_tree.has_ptd(runs["ar"].steps)
    assert views_tree.has_ptd([ptd_step()])
    assert "no PTD tree" in views_tree.NO_PTD


def dels_step() -> StepRecord:
    dels = {"long": [2.0, 1.5, 0.5, 1.0], "short": [0.5, -0.2, 1.2, 0.1], "prior": [0.1, 0.1, 0.1, 0.1],
            "flipped": [False, False, True, False]}
    return chain_step(extras={"dels": dels})


def test_dels_figure_stacks_components_and_stars_flipped_tokens():
    fig = views_heads.dels_figure([chain_step(step=1), dels_step()], {})
    long, short, prior = (fig.data[i] for i in range(3))
    assert list(long.y) == [2.0, 1.5, 0.5, 1.0] and list(short.y) == [0.5, -0.2, 1.2, 0.1]
    assert fig.layout.barmode == "relative" and prior.name == "prior"
    assert list(fig.data[3].text) == ["✓", "✓", "✗", "·"]
    flipped = _traces(fig, "short expert flipped the argmax")[0]
    assert list(flipped.x) == [long.x[2]] and long.x[2].startswith("s3·2")


def test_adaflash_predicted_vs_accepted_and_the_cut():
    ada = {"score": 0.7, "verify_len": 3, "cut_tokens": [11, 12], "rule": "threshold"}
    steps = [chain_step(step=1), chain_step(step=2, extras={"adaflash": ada})]
    fig = views_heads.adaflash_figure(steps)
    assert list(fig.data[0].x) == [2] and list(fig.data[0].y) == [2] and list(fig.data[1].y) == [3]
    assert "threshold" in fig.layout.title.text
    html = views_heads.adaflash_cut_html(steps[1], {11: "k", 12: "l"})
    before, after = html.split("✂")
    assert before.count("draft-accepted") == 2 and after.count('class="draft-cut"') == 2 and "&#x27;l&#x27;" in after
    assert not views_heads.has_extras(steps[:1], "adaflash")


def test_compare_rows_and_figures_are_labelled_with_the_device(runs):
    chosen = [runs[m] for m in ("ar", "pld", "draft")]
    rows = views_compare.compare_rows(chosen)
    assert [r[0] for r in rows] == ["ar", "pld", "draft"]
    assert rows[0][6] == 1.0 and all(r[8] == "yes" for r in rows)  # greedy: every method equals ar
    for fig in (views_compare.compare_figure(chosen), views_compare.acceptance_figure(chosen)):
        assert "measured on cpu" in fig.layout.title.text
    hist = views_compare.acceptance_figure(chosen).data
    assert any(t.type == "bar" and t.name == "pld" for t in hist)
    colours = {}
    for trace in hist:  # the histogram's bars take the colour their legend entry shows
        colour = trace.marker.color if trace.type == "bar" else trace.line.color
        assert colours.setdefault(trace.name, colour) == colour
    assert len(set(colours.values())) == len(colours)
    lines = [shape for shape in views_compare.compare_figure(chosen).layout.shapes if shape.y0 == shape.y1 == 1.0]
    assert len(lines) == 1 and lines[0].yref == "y3"  # the 1.0 line sits on the speedup chart


def test_compare_says_what_identical_means_and_has_no_rate_for_one_token(runs):
    sampled = RunRecord.from_dict({**runs["pld"].to_dict(), "sampling": {**runs["pld"].sampling, "temperature": 0.7}})
    rows = views_compare.compare_rows([runs["ar"], sampled])
    assert rows[1][8] == "sampled: equal in distribution, not token for token"
    one = RunRecord.from_dict({**runs["ar"].to_dict(), "steps": runs["ar"].to_dict()["steps"][:1]})
    one.metrics = {**runs["ar"].metrics, "decode_steps": 0, "tokens_per_s": 0.0, "mean_acceptance_length": 0.0}
    row = views_compare.compare_rows([one])[0]
    assert row[3] == row[4] == "n/a"
    assert "| mean_acceptance_length | n/a (no decode step) |" in views.stats_markdown(one)


def test_options_come_from_the_method_configs():
    knobs = all_knobs(["ar", "draft", "pld"])
    assert [k.name for k in method_knobs("pld")] == ["k", "max_ngram", "min_ngram"]
    assert method_knobs("ar") == []
    if "dflash" in available_methods():  # an `int | None` knob: blank means the method's choice
        (knob,) = [k for k in method_knobs("dflash") if k.default is None][:1]
        assert knob.kind is int and "blank" in knob.label
        assert options_for("dflash", [knob], [" 3 "]) == {knob.name: 3}
        assert options_for("dflash", [knob], [""]) == {knob.name: None}
    values = [4.0, 6.0, 3.0, 1.0]
    assert options_for("pld", knobs, values) == {"k": 6, "max_ngram": 3, "min_ngram": 1}
    assert options_for("draft", knobs, [None, 6, 3, 1]) == {"k": 4}
    assert options_for("ar", knobs, values) == {}


def test_adaflash_without_a_head_and_with_hindsight():
    ada = {"score": None, "verify_len": 2, "cut_tokens": [11, 12], "rule": "cost", "cut_would_accept": 1}
    steps = [chain_step(step=2, extras={"adaflash": ada})]
    fig = views_heads.adaflash_figure(steps)
    assert not _traces(fig, "length-head score r")  # no head, no score line
    assert list(_traces(fig, "cut tokens greedy would accept (hindsight)")[0].y) == [1]
    html = views_heads.adaflash_cut_html(steps[0], {11: "k", 12: "l"})
    assert "score" not in html and "would have accepted 1" in html
