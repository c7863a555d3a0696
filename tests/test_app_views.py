"""The app's pure views on recorded traces: real runs of every method on a tiny preset, plus
hand-built StepRecords carrying PTD extras (the DeLS and AdaFlash views: test_app_heads.py)."""

from __future__ import annotations

import re

import pytest

import specflash
from app import views, views_adaflash, views_dels, views_lattice, views_tree
from app.methods import all_knobs, available_methods, method_knobs, options_for
from specflash.errors import SpecFlashError
from specflash.models.presets import default_drafter
from specflash.trace import RunRecord, StepRecord

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"
SPAN = re.compile(r'<span class="tok tok-(\w+)" data-step="(\d+)" data-card="([^"]*)"')


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
    assert all("p (target)" in card and "q (draft)" in card for _, _, card in spans)
    if method == "ar":
        assert {kind for kind, _, _ in spans} == {"target"}


def test_draft_run_shows_accepted_tokens_with_their_q(runs, texts):
    run = runs["draft"]
    step = next(s for s in run.steps if s.accepted and len(s.committed) > 1)
    token = views.step_tokens(step)[0]
    assert token.origin == "accepted" and token.q == pytest.approx(step.q[step.accepted[0]])
    assert f"q (draft)   {step.q[step.accepted[0]]:.3f}" in views.token_span(token, texts)


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
    shadow = chain_step(tokens=[], parents=[], q=None, p=[], accepted=[], correction_kind="target", committed=[9],
                        verified=1, extras={"gate": {**off, "state": "shadow", "width": 3, "reason": "a shadow draft"},
                                            "shadow": [1]})
    assert views.gate_summary([skipped, skipped, probe, shadow]) == "on 0, off 2, probe 1, shadow 1 steps"
    assert "shadow draft 3 tokens deep, starting ' the'" in views.no_draft_reason(shadow, {1: " the"})
    assert views.gate_summary([chain_step()]) is None


def test_a_prompt_lookup_step_says_so_in_every_view():
    lookup = {"state": "lookup", "width": 4, "value": 1.8, "reason": "the last 3 token(s) occurred earlier: drafting "
              "the 4 that followed is worth 1.80x plain decoding, the drafter's best 1.10x"}
    step = chain_step(q=None, extras={"gate": lookup, "lookup": {"tokens": [5, 6, 7, 8], "ngram": 3, "value": 1.8,
                                                               "against": 1.1}})
    assert views.stop_summary(step, {}).startswith("Draft gate lookup: the last 3 token(s) occurred earlier")
    assert views.gate_summary([step, chain_step(extras={"gate": {**lookup, "state": "on"}})]) == (
        "on 1, off 0, probe 0, shadow 0, prompt lookup 1 steps")
    grafted = chain_step(extras={"gate": {**lookup, "state": "on"}, "graft": {"tokens": [5], "ngram": 1, "shared": 0,
                                                                              "first_node": 4}})
    assert views.gate_summary([step, grafted, chain_step(extras={"gate": {**lookup, "state": "on"}})]) == (
        "on 2 (grafted onto the drafter's tree: prompt lookup in 1), off 0, probe 0, shadow 0, prompt lookup 1 steps")
    both = chain_step(extras={"gate": {**lookup, "state": "on"}, "graft": grafted.extras["graft"],
                              "datastore": {"tokens": [9], "ngram": 5, "shared": 0, "first_node": 5}})
    assert views.gate_summary([grafted, both]).startswith(
        "on 2 (grafted onto the drafter's tree: prompt lookup in 2, the datastore in 1)")
    note = "prompt lookup drafted this step instead of the drafter: the last 3 token(s) occurred earlier"
    assert views.lookup_note(step).startswith(note) and views.lookup_note(chain_step()) is None
    assert note in views_lattice.no_lattice_reason(step)
    assert note in views_adaflash.adaflash_cut_html(step, {}, {})
    assert note in views_dels._step_summary(step, [])
    share = views.lookup_share([step, chain_step()], "cut")
    assert share == (" Prompt lookup drafted 1 of the run's 2 decode steps instead of the drafter (the draft gate's "
                     "choice; untick *prompt lookup beside the drafter* in the method knobs to see the drafter alone): "
                     "they have no cut and are left out here.")
    assert views.lookup_share([chain_step()], "cut") == ""


def test_step_inspector_marks_where_verification_stopped():
    step = chain_step()
    assert views.node_status(step) == ["accepted", "accepted", "rejected", "unverified"]
    table = views.step_table_html(step, {5: "a", 6: "b", 7: "c", 8: "d", 9: "X"})
    assert table.count('class="node-accepted"') == 2 and 'class="node-rejected"' in table
    assert "stopped after 2 accepted token(s) of 4" in table and "&#x27;X&#x27; (resample, p=0.400)" in table
    fig = views.step_figure(step, {})
    bars = {t.name: (list(t.y), t.marker.color) for t in fig.data}
    assert bars["p (target), rejected"] == ([step.p[2]], views.STATUS_COLOURS["rejected"])
    assert bars["p (target), accepted"][0] == step.p[:2] and bars["q (draft)"][0] == step.q


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
    assert sorted(accepted.customdata) == [0, 1] and accepted.marker.color == views.STATUS_COLOURS["accepted"]
    assert sorted(_traces(fig, "rejected")[0].customdata) == [2, 3]  # the step inspector's word, not "verified"
    path = _traces(fig, "accepted path")[0]
    assert len(path.x) == 3 and path.line.width >= 4  # root + two accepted nodes
    cats = {t.name: (t.xaxis, sorted(t.customdata)) for t in fig.data if t.name in ("pruned", "added")}
    assert cats == {"pruned": ("x2", [0]), "added": ("x3", [2, 3])}
    kept = [(t.xaxis, sorted(t.customdata)) for t in _traces(fig, "kept")]
    assert kept == [("x2", [1, 2]), ("x3", [0, 1])]  # every surviving node is "kept", inherited or not
    assert "2 of 4 guess nodes accepted" in fig.layout.title.text and "+2 added, −1 pruned" in fig.layout.title.text


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
    n_nodes = sum(len(t.customdata) for t in fig.data if t.name in views_tree.STYLES)
    assert n_nodes == len(step.tokens) + len(ptd["draft_before"]["tokens"]) + len(ptd["draft_after"]["tokens"])


def test_ptd_empty_state_for_other_methods(runs):
    assert not views_tree.has_ptd(runs["ar"].steps)
    assert views_tree.has_ptd([ptd_step()])
    assert "no PTD tree" in views_tree.NO_PTD


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


def test_step_chart_labels_show_quotes_as_quotes_and_escape_markup():
    """Plotly renders &quot; in tick text literally: quotes stay plain, markup is escaped."""
    fig = views.step_figure(chain_step(), {5: "'m", 6: "<b>", 7: "x", 8: "y"})
    ticks = " ".join(fig.layout.xaxis.ticktext)
    assert "0: \"'m\"" in ticks and "1: '&lt;b&gt;'" in ticks and "&quot;" not in ticks and "&#x27;" not in ticks
