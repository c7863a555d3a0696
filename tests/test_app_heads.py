"""The DeLS and AdaFlash tabs' views on hand-built StepRecords whose extras are known, so every
expected number below is worked out by hand from the records, not by the code under test."""

from __future__ import annotations

import dataclasses

import pytest

from app import views_adaflash, views_dels
from specflash.drafters.adaflash import RULES
from specflash.trace import RunRecord, StepRecord


def chain(step: int, tokens: list[int], accepted: int, extras: dict, q: list[float] | None = None) -> StepRecord:
    """A chain draft whose first `accepted` tokens were accepted (then a rejection, if any left)."""
    n = len(tokens)
    return StepRecord(step=step, phase="decode", context_len=10, tokens=tokens, parents=list(range(-1, n - 1)),
                      q=q, p=[0.5] * n, accepted=list(range(accepted)), correction=99,
                      correction_kind="bonus" if accepted == n else "resample", correction_p=0.5,
                      committed=tokens[:accepted] + [99], verified=n + 1, draft_time=0.0, verify_time=0.0,
                      extras=extras)


def alt(token: int, long: float, short: float, prior: float) -> dict:
    return {"token": token, "long": long, "short": short, "prior": prior}


def dels_extras(flipped: list[bool], alternatives: list[list[dict]] | None = None) -> dict:
    """A DeLS record whose drafted-token contributions are each position's first alternative."""
    n = len(flipped)
    alternatives = alternatives or [[alt(0, 1.0, 0.0, 0.0)] for _ in range(n)]
    record = {key: [a[0][key] for a in alternatives] for key in ("long", "short", "prior")}
    return {"dels": {**record, "flipped": flipped, "alternatives": alternatives}}


def run_of(method: str, steps: list[StepRecord], config: dict | None = None) -> RunRecord:
    return RunRecord(method=method, config=config or {}, sampling={"temperature": 0.0}, model="m", device="cpu",
                     prompt_ids=[1], steps=steps, output_ids=[], finish_reason="length", prefill_time=0.0)


# ---- DeLS -------------------------------------------------------------------------------------

def test_flip_rates_by_position_count_only_checked_tokens():
    # statuses: A = acc acc rej unv, B = rej unv unv, C = acc acc (bonus)
    steps = [chain(1, [1, 2, 3, 4], 2, dels_extras([False, True, True, False])),
             chain(2, [1, 2, 3], 0, dels_extras([True, False, True])),
             chain(3, [1, 2], 2, dels_extras([False, False])),
             chain(4, [], 0, {})]  # the gate drafted nothing: no record, no row
    by_position = {r.position: r for r in views_dels.position_rates(steps)}
    # (drafted, flips, flipped accepted, flipped checked, unflipped accepted, unflipped checked)
    expected = {0: (3, 1, 0, 1, 2, 2),   # B0 flipped and rejected; A0, C0 unflipped and accepted
                1: (3, 1, 1, 1, 1, 1),   # A1 flipped, accepted; B1 unflipped but never checked: left out
                2: (2, 2, 0, 1, 0, 0),   # A2 flipped, rejected; B2 flipped, never checked
                3: (1, 0, 0, 0, 0, 0),   # A3 never checked
                None: (9, 4, 1, 3, 3, 3)}
    assert {k: (r.drafted, r.flips, r.flipped_accepted, r.flipped_verified, r.kept_accepted, r.kept_verified)
            for k, r in by_position.items()} == expected
    summary = views_dels.dels_summary_html(steps)
    assert "flipped 4/9 (44%) of the drafted tokens" in summary
    assert "accepted 1/3 (33%) of the flipped ones and 3/3 (100%) of the others" in summary
    assert "<td>3</td><td>1</td>" in summary and "<td>all</td><td>9</td>" in summary


def test_step_figure_compares_drafted_and_runner_up_source_by_source():
    alternatives = [
        [alt(10, 30.0, 3.0, 1.0), alt(11, 31.0, -0.5, 2.0), alt(12, 29.0, 0.0, 0.0)],  # flipped: long liked 11
        [alt(20, 28.0, 1.0, 2.0), alt(21, 26.0, 2.5, 2.0), alt(22, 25.0, 0.0, 0.0)],  # not flipped
        [alt(30, 27.0, 4.0, 1.0), alt(31, 26.0, 1.0, 1.0), alt(32, 28.0, -9.0, 0.0)],  # flipped: long liked 32
    ]
    step = chain(5, [10, 20, 30], 1, dels_extras([True, False, True], alternatives))
    texts = {10: "cat", 11: "dog", 20: " sat", 21: " ran", 30: " on", 31: " in", 32: " by", 99: "X"}
    fig = views_dels.dels_step_figure(step, texts)
    bars = {t.name.split(" (")[0]: t for t in fig.data if t.type == "bar"}
    assert list(bars) == ["long expert", "short expert", "prior"]
    for index, key in enumerate(("long", "short", "prior")):
        trace = bars[["long expert", "short expert", "prior"][index]]
        assert [list(pair) for pair in trace.customdata] == [[a[0][key], a[1][key]] for a in alternatives]
        assert list(trace.x) == pytest.approx([a[0][key] - a[1][key] for a in alternatives])
    (margin,) = [t for t in fig.data if t.name == "fused margin (sum)"]
    assert list(margin.x) == pytest.approx([34.0 - 32.5, 31.0 - 30.5, 32.0 - 28.0])
    labels = list(bars["long expert"].y)
    assert ["⚑ flip" in label for label in labels] == [True, False, True]
    assert "✓ accepted" in labels[0] and "not checked" in labels[2]
    assert "✗ rejected, target took &#x27;X&#x27;" in labels[1]
    assert "dog" in labels[0] and "cat" in labels[0]
    assert [(s.y0, s.y1) for s in fig.layout.shapes] == [(-0.5, 0.5), (1.5, 2.5)]  # the flipped rows shaded
    table = views_dels.dels_step_html(step, texts)
    assert table.count('<tr class="dels-') == 3 and table.count("dels-flip") == 2
    assert "ranked <code>&#x27;dog&#x27;</code> above it" in table and "ranked <code>&#x27; by&#x27;</code>" in table
    assert "<td><b>34.00</b></td>" in table and "<td><b>32.50</b></td>" in table


def test_tree_step_shows_its_fused_chain_wherever_the_tree_holds_it():
    """A tree step: the fused chain 10 20 30, drafted as a tree 10 -> 20, 10 -> 21 -> 40 (its third
    position gave way to a sibling of its second). The target took 10 21 then 50: the chain's 20 was
    refused (the target took 21 there) and its 30, in no node, was never checked."""
    extras = dels_extras([False, False, False])
    extras["dels"]["chain"] = [10, 20, 30]
    step = StepRecord(step=6, phase="decode", context_len=10, tokens=[10, 20, 21, 40], parents=[-1, 0, 0, 2],
                      q=None, p=[0.5] * 4, accepted=[0, 2], correction=50, correction_kind="resample",
                      correction_p=0.5, committed=[10, 21, 50], verified=5, draft_time=0.0, verify_time=0.0,
                      extras=extras)
    positions = views_dels.step_positions(step)
    assert [(p.drafted.token, p.status) for p in positions] == [(10, "accepted"), (20, "rejected"), (30, "unverified")]
    labels = list(views_dels.dels_step_figure(step, {21: " ran", 50: "Z"}).data[0].y)
    assert "target took &#x27; ran&#x27;" in labels[1]
    summary = views_dels.dels_step_html(step, {})
    assert "3 drafted (the fused chain; the step verified a tree of 4 nodes on 2 branches)" in summary
    quoted = list(views_dels.dels_step_figure(step, {10: "'s"}).data[0].y)[0]
    assert "&#34;&#x27;s&#34;" in quoted and "&quot;" not in quoted  # plotly shows &quot; as is


def test_flip_whose_long_pick_was_not_recorded_and_records_without_alternatives():
    outside = [[alt(10, 30.0, 3.0, 1.0), alt(11, 29.0, 0.0, 0.0)]]  # long's own pick is none of these
    step = chain(2, [10], 0, dels_extras([True], outside))
    assert "outside the recorded top 3" in views_dels.dels_step_html(step, {})
    bare = chain(3, [10, 20], 2, {"dels": {"long": [1.0, 2.0], "short": [0.1, 0.2], "prior": [0.0, 0.0],
                                           "flipped": [False, True]}})
    (position, _) = views_dels.step_positions(bare)
    assert position.runner_up is None and position.drafted.fused == pytest.approx(1.1)
    fig = views_dels.dels_step_figure(bare, {})
    assert list(fig.data[0].x) == [None, None] and "no runner-up recorded" in fig.data[0].y[0]
    assert "not recorded" in views_dels.dels_step_html(bare, {})
    undrafted = chain(4, [], 0, {})
    assert "no DeLS record" in views_dels.dels_step_html(undrafted, {})
    assert "no DeLS draft this step" in views_dels.dels_step_figure(undrafted, {}).layout.title.text


def test_dels_note_says_what_the_tab_shows_and_which_method_fills_it():
    for note in (views_dels.dels_note(None), views_dels.dels_note(run_of("dflash", [chain(1, [1], 1, {})]))):
        assert "method `dels`" in note and "runner-up" in note and "flip" in note
    assert "No run yet" in views_dels.dels_note(None)
    assert "(method `dflash`) has no DeLS record" in views_dels.dels_note(run_of("dflash", []))
    live = run_of("dels", [chain(1, [1], 1, dels_extras([False]))], {"alpha": 0.3, "beta": 0.2})
    assert "0.3·short − 0.2·log prior" in views_dels.dels_note(live)


# ---- AdaFlash ---------------------------------------------------------------------------------

def ada(rule: str, score: float | None, cut: list[int], would: int | None = None) -> dict:
    record = {"rule": rule, "score": score, "verify_len": 0, "cut_tokens": cut, "cut_q": [0.1] * len(cut)}
    if would is not None:
        record["cut_would_accept"] = would
    return {"dflash": {"block_size": 8}, "adaflash": record}


def test_rule_meanings_follow_the_rule_and_its_settings():
    meanings = {rule: views_adaflash.rule_meaning(rule, {}) for rule in RULES}
    assert len(set(meanings.values())) == len(RULES)
    assert "draft probability is below 0.5" in meanings["confidence"]
    assert "always verify 5 drafted tokens" in views_adaflash.rule_meaning("fixed", {"fixed_len": 5})
    assert "drafter's own token probabilities" in meanings["cost"]
    assert "length head's predicted run" in views_adaflash.rule_meaning("cost", {"estimate": "head"})
    assert views_adaflash.rule_meaning("threshold", {}) == "a cut rule this app does not describe"
    step = chain(2, [1, 2], 1, ada("fixed", None, [3]))
    title = views_adaflash.adaflash_figure([step], {"fixed_len": 2}).layout.title.text
    assert "rule <b>fixed</b>: always verify 2 drafted tokens" in title


@pytest.mark.parametrize(("rule", "config", "scored"), [
    ("cost", {}, False), ("fixed", {}, False), ("head", {}, True), ("cost", {"estimate": "head"}, True)])
def test_score_axis_only_where_the_rule_reads_the_score(rule, config, scored):
    steps = [chain(2, [1, 2, 3], 1, ada(rule, 0.25, [4, 5]), q=[0.9, 0.5, 0.4])]
    fig = views_adaflash.adaflash_figure(steps, config)
    on_y2 = [t for t in fig.data if t.yaxis == "y2"]
    score_axis = fig.to_dict()["layout"].get("yaxis2")
    assert bool(on_y2) == scored and (score_axis is not None and score_axis["range"] == [0, 1]) == scored
    if scored:
        assert list(on_y2[0].y) == [0.25]
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y >= 1  # above the plot, on nothing
    assert ("score r" in views_adaflash.adaflash_cut_html(steps[0], {}, config)) == scored


def test_predicted_run_is_the_rules_own_estimate():
    step = chain(2, [1, 2, 3], 1, ada("cost", 0.5, [4]), q=[0.9, 0.5, 0.4])
    # the cost rule reads chained confidences: 0.9 + 0.9*0.5 + 0.9*0.5*0.4
    assert views_adaflash.predicted_run(step, "cost", {}) == pytest.approx(0.9 + 0.45 + 0.18)
    assert views_adaflash.predicted_run(step, "cost", {"rate": 2.0}) == pytest.approx(1 + 1 + 0.8)
    # score rules: the head's run r * L * rate - 1 = 0.5 * 8 - 1, capped at the 3 tokens verified
    assert views_adaflash.predicted_run(step, "head", {}) == pytest.approx(3.0)
    assert views_adaflash.predicted_run(step, "head", {"rate": 0.5}) == pytest.approx(1.0)
    assert views_adaflash.predicted_run(step, "fixed", {}) is None
    # a tree (two root children, one grandchild) sums its paths: 0.6 + 0.3 + 0.6 * 0.5; a grafted
    # prompt-lookup node (from node 2 on) is not the rule's
    tree = dataclasses.replace(step, parents=[-1, -1, 0], q=[0.6, 0.3, 0.5])
    assert views_adaflash.predicted_run(tree, "cost", {}) == pytest.approx(1.2)
    grafted = dataclasses.replace(tree, extras={**tree.extras, "graft": {"first_node": 2}}, q=[0.6, 0.3, None])
    assert views_adaflash.predicted_run(grafted, "cost", {}) == pytest.approx(0.9)


def test_cut_counts_drafted_tokens_verified_not_the_verify_length():
    # the engine records verify_len = drafted tokens kept + 1 (the target's own next token)
    step = chain(8, [7], 0, ada("cost", 0.15, [11, 12, 13, 14], would=1), q=[0.2])
    step.extras["adaflash"]["verify_len"] = 2
    cut = views_adaflash.step_cut(step, {})
    assert (cut.verified, cut.accepted, cut.cut, cut.would_accept, cut.score) == (1, 0, 4, 1, None)
    html = views_adaflash.adaflash_cut_html(step, {7: "a", 11: "k"}, {})
    assert "The target verified 1 drafted token and the cut saved 4 (never verified)" in html
    assert "the rule expected 0.20 accepted, the target accepted 0" in html and "would have accepted 1" in html
    before, after = html.split("✂")
    assert before.count("draft-rejected") == 1 and after.count('class="draft-cut"') == 4 and "&#x27;k&#x27;" in after
    fig = views_adaflash.adaflash_figure([step, chain(9, [], 0, {})], {})
    heights = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert heights == {"accepted": [0], "sent to verification, not accepted": [1],
                       "cut, though greedy would have accepted it (hindsight)": [1], "cut, never verified (saved)": [3]}
    (line,) = [t for t in fig.data if t.name == "the cut (drafted tokens sent to verification)"]
    assert list(line.x) == [8] and list(line.y) == [1]


def test_without_hindsight_the_cut_is_not_split():
    step = chain(3, [1, 2], 2, ada("confidence", None, [5, 6, 7]), q=[0.9, 0.8])
    fig = views_adaflash.adaflash_figure([step], {})
    heights = {t.name: list(t.y) for t in fig.data if t.type == "bar"}
    assert heights == {"accepted": [2], "sent to verification, not accepted": [0], "cut, never verified (saved)": [3]}
    assert not [t for t in fig.data if t.name == "predicted accepted run"]  # the confidence rule estimates nothing


def test_adaflash_note_says_what_the_tab_shows_and_sums_the_run():
    assert "No run yet" in views_adaflash.adaflash_note(None) and "method `adaflash`" in views_adaflash.adaflash_note(None)
    other = views_adaflash.adaflash_note(run_of("dels", [chain(1, [1], 1, dels_extras([False]))]))
    assert "(method `dels`) has no AdaFlash record" in other and "method `adaflash`" in other
    steps = [chain(1, [1, 2], 2, ada("cost", None, [3], would=1)), chain(2, [1], 0, ada("cost", None, [4, 5], would=0))]
    note = views_adaflash.adaflash_note(run_of("adaflash", steps))
    assert "Cut rule `cost`" in note
    assert "Over 2 drafted steps: 6 tokens drafted, 3 verified (2 accepted), 3 cut and never verified" in note
    assert "greedy verification would have accepted 1" in note and "verified no draft" not in note
    idle = [chain(3, [], 0, {"gate": {"state": "off", "width": 0, "value": 1.0, "reason": "r"}}),
            chain(4, [], 0, {"gate": {"state": "off", "width": 0, "value": 1.0, "reason": "r"}}),
            chain(5, [], 0, {"gate": {"state": "shadow", "width": 7, "value": 1.0, "reason": "r"}, "shadow": [4]})]
    note = views_adaflash.adaflash_note(run_of("adaflash", steps + idle))
    assert "3 decode steps verified no draft: the draft gate's choice (2 with drafting off, 1 shadow look " in note


def test_runner_up_tokens_are_decoded_with_the_step():
    """A runner-up the step did not draft still needs its text (else the view shows its id)."""
    from app.runner import step_ids

    step = chain(2, [5, 6], 1, dels_extras([False, True], [[alt(5, 1.0, 0.0, 0.0), alt(41, 0.5, 0.1, 0.0)],
                                                           [alt(6, 1.0, 0.0, 0.0), alt(42, 0.9, 0.2, 0.0)]]))
    assert {41, 42} <= set(step_ids(step))


def test_a_tree_step_says_its_paths_and_the_chain_the_cut_continues():
    extras = ada("cost", None, [13, 14])
    extras["adaflash"]["chain"] = [7, 8]
    tree = chain(4, [7, 11, 8], 1, extras)
    tree.parents = [-1, -1, 0]  # 7 and 11 branch at the root, 8 follows 7
    html = views_adaflash.adaflash_cut_html(tree, {7: "a", 8: "b", 11: "k"}, {})
    assert "a tree of 2 paths" in html and "argmax chain &#x27;a&#x27; &#x27;b&#x27;" in html
    assert "a tree of" not in views_adaflash.adaflash_cut_html(chain(5, [7, 8], 1, ada("cost", None, [13])), {}, {})


def test_grafted_lookup_nodes_are_counted_apart_from_the_cut():
    """Nodes 0-1 are the drafter's (a chain, its first refused), 2-4 prompt lookup's continuation
    grafted at the root (all three accepted): the cut's counts are the drafter's 2 verified and 0
    accepted, the 3 grafted nodes are reported beside them, after a ⇢ mark."""
    extras = {**ada("cost", None, [7, 8]), "graft": {"tokens": [20, 21, 22], "ngram": 2, "shared": 0, "first_node": 2}}
    extras["adaflash"]["chain"] = [5, 6]
    step = StepRecord(step=3, phase="decode", context_len=10, tokens=[5, 6, 20, 21, 22], parents=[-1, 0, -1, 2, 3],
                      q=[0.6, 0.5, None, None, None], p=[0.1] * 5, accepted=[2, 3, 4], correction=9,
                      correction_kind="bonus", correction_p=0.5, committed=[20, 21, 22, 9], verified=6,
                      draft_time=0.0, verify_time=0.0, extras=extras)
    cut = views_adaflash.step_cut(step, {})
    assert (cut.verified, cut.accepted, cut.cut, cut.grafted, cut.grafted_accepted) == (2, 0, 2, 3, 3)
    assert cut.predicted == pytest.approx(0.6 + 0.3)  # the rule's own nodes only
    html_out = views_adaflash.adaflash_cut_html(step, {}, {})
    assert "verified 2 drafted tokens" in html_out and "3 grafted nodes (3 accepted)" in html_out
    assert "a tree of" not in html_out  # the drafter's own nodes are a chain; the graft adds the branch
    assert html_out.index("cut-mark") < html_out.index("graft-mark") and html_out.count("draft-accepted") == 3
    note = views_adaflash.adaflash_note(run_of("adaflash", [step]))
    assert "4 tokens drafted, 2 verified (0 accepted)" in note and "verified 3 nodes of continuations grafted" in note
