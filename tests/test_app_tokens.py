"""The token view and the step inspector on hand-built traces: the coloured text reads as the
decoded text (no gaps, newlines and indentation kept), hover cards carry p and q, greedy runs
are worded as argmax matches, and every legend swatch is the colour of what it labels."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from app import views
from specflash.trace import RunRecord, StepRecord

# A code answer split where a tokenizer splits it: inside words, at newlines, at indentation.
TEXTS = {1: "def", 2: " fib", 3: "onacci", 4: "(n):", 5: "\n", 6: "    ", 7: "return", 8: " n", 9: "\n\n",
         10: "\tx", 11: " =", 12: " 1", 13: ":\n        "}


def step(**kw) -> StepRecord:
    base = dict(step=1, phase="decode", context_len=10, tokens=[2, 3, 4, 11], parents=[-1, 0, 1, 2],
                q=[0.9, 0.8, 0.7, 0.6], p=[0.95, 0.4, 0.1, 0.5], accepted=[0, 1], correction=5,
                correction_kind="resample", correction_p=0.6, committed=[2, 3, 5], verified=5,
                draft_time=0.01, verify_time=0.02)
    return StepRecord(**(base | kw))


def code_run() -> list[StepRecord]:
    """Prefill, a rejection, a whole-draft bonus, a step without a draft, and an EOS-like cut."""
    return [
        StepRecord(0, "prefill", 9, [], [], None, [], [], 1, "target", 0.9, [1], 9, 0.0, 0.1),
        step(step=1),
        step(step=2, tokens=[6, 7, 8], parents=[-1, 0, 1], q=[0.7, 0.9, 0.8], p=[0.9, 0.99, 0.6],
             accepted=[0, 1, 2], correction=9, correction_kind="bonus", correction_p=0.3, committed=[6, 7, 8, 9]),
        step(step=3, tokens=[], parents=[], q=None, p=[], accepted=[], correction=10, correction_kind="target",
             committed=[10]),
        step(step=4, tokens=[11, 12], parents=[-1, 0], q=None, p=[0.8, 0.7], accepted=[0, 1], correction=13,
             correction_kind="bonus", committed=[11, 12, 13]),
    ]


class Spans(HTMLParser):
    """Each .tok span of output_html: its attributes and its text (nested marker spans included)."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[dict] = []
        self.depth = 0  # span nesting inside the current .tok

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "span" and self.depth:
            self.depth += 1
        elif tag == "span" and "tok" in (attrs.get("class") or "").split():
            self.spans.append({**attrs, "text": ""})
            self.depth = 1

    def handle_endtag(self, tag):
        if tag == "span" and self.depth:
            self.depth -= 1

    def handle_data(self, data):
        if self.depth:
            self.spans[-1]["text"] += data


def spans(html: str) -> list[dict]:
    parser = Spans()
    parser.feed(html)
    return parser.spans


def css_rules(css: str) -> list[tuple[str, str]]:
    """(selector, declarations) of every innermost rule, @supports blocks included."""
    return [(sel.strip(), body) for sel, body in re.findall(r"([^{}]+)\{([^{}]*)\}", css)]


def test_the_spans_read_back_as_the_decoded_text_newlines_and_indentation_included():
    steps = code_run()
    found = spans(views.output_html(steps, TEXTS, temperature=0.0))
    decoded = "".join(TEXTS[t] for s in steps for t in s.committed)
    assert "".join(s["text"] for s in found) == decoded
    assert [s["class"] for s in found] == [f"tok tok-{t.origin}" for t in views.run_tokens(steps)]
    assert [int(s["data-step"]) for s in found] == [t.step for t in views.run_tokens(steps)]
    html = views.output_html(steps, TEXTS)
    assert html.count('<span class="nl"></span>\n') == decoded.count("\n")  # a ↵ mark before every newline
    assert ".sf-out .sf-text{white-space:pre-wrap;" in html


def test_no_token_has_horizontal_margin_or_padding():
    html = views.output_html(code_run(), TEXTS)
    assert all("style" not in s for s in spans(html))  # all token styling is in the scoped sheet
    token_rules = [(sel, body) for sel, body in css_rules(views.TOKEN_CSS)
                   if re.search(r"\.tok(-\w+|:hover)?$", sel)]  # rules on the token box itself
    assert token_rules and "margin:0;padding:0" in dict(token_rules)[".sf-out .tok"]
    for sel, body in token_rules:
        assert not re.search(r"(margin|padding)(-left|-right|-inline)?:(?!0[;}]|0$)", body), sel


def test_hover_card_carries_step_origin_p_q_and_the_acceptance_test():
    card = spans(views.output_html([step(step=7)], TEXTS, 0.8))[0]["data-card"]
    assert card.startswith("step 7 · accepted draft token\n")
    assert "p (target)  0.950" in card and "q (draft)   0.900" in card and "min(1, p/q) = 1.000" in card
    greedy = spans(views.output_html([step(step=7)], TEXTS, 0.0))
    assert "acceptance  greedy: argmax match" in greedy[0]["data-card"] and "min(1" not in greedy[0]["data-card"]
    correction = greedy[-1]["data-card"]
    assert correction.startswith("step 7 · the target's argmax (draft rejected)") and "q (draft)   n/a" in correction
    assert all("title" not in s for s in greedy)  # the styled card replaces the browser tooltip


def test_point_mass_drafts_are_tested_with_q_one():
    """DFlash-family drafts are verified as point masses; their trace q is the drafter's own."""
    dflash = step(p=[0.5, 0.4, 0.1, 0.5], extras={"dflash": {"block_size": 8}})
    card = spans(views.output_html([dflash], TEXTS, 1.0))[0]["data-card"]
    assert "min(1, p/1) = 0.500 (point-mass draft)" in card and "q (draft)   0.900" in card
    table = views.step_table_html(dflash, TEXTS, 1.0)
    assert "<td>0.500</td><td>0.500</td>" in table  # p, then min(1, p/1)
    assert views.POINT_MASS_RULE in table and "for reference" in table
    assert views.SAMPLED_RULE in views.step_table_html(step(), TEXTS, 1.0)


def test_greedy_legend_and_summary_say_argmax_not_resample():
    greedy = views.legend_html(0.0)
    assert "the target&#x27;s argmax (draft rejected)" in greedy and "correction from the target" not in greedy
    assert "correction from the target (draft rejected)" in views.legend_html(0.7)
    assert views.legend_html() == views.legend_html(0.7)  # callers that do not say T keep the sampling words
    assert "(the target's argmax, draft rejected, p=0.600)" in views.stop_summary(step(), TEXTS, 0.0)
    assert "(resample, p=0.600)" in views.stop_summary(step(), TEXTS, 0.7)


def headers(table: str) -> list[str]:
    return re.findall(r"<th>([^<]*)</th>", table)


def test_greedy_table_drops_the_ratio_column_and_states_the_rule():
    greedy = views.step_table_html(step(), TEXTS, 0.0)
    assert headers(greedy) == ["node", "parent", "token", "q (draft)", "p (target)", "status"]
    assert views.GREEDY_RULE in greedy
    sampled = views.step_table_html(step(), TEXTS, 0.7)
    assert headers(sampled) == ["node", "parent", "token", "q (draft)", "p (target)", "min(1,p/q)", "status"]
    assert "<td>0.500</td>" in sampled  # min(1, 0.4 / 0.8) for node 1
    assert all(len(re.findall(r"<td", row)) == len(headers(greedy)) for row in greedy.split("<tr")[2:])


@pytest.mark.parametrize("no_draft, why", [
    (code_run()[0], "the prefill"),
    (step(tokens=[], parents=[], q=None, p=[], accepted=[], correction_kind="target", committed=[5],
          extras={"gate": {"state": "off", "width": 0, "value": 1.0, "reason": "drafting does not pay"}}),
     "the draft gate was off (drafting does not pay)"),
    (step(tokens=[], parents=[], q=None, p=[], accepted=[], correction_kind="target", committed=[5]),
     "the drafter proposed nothing"),
    (step(tokens=[], parents=[], q=None, p=[], accepted=[], correction_kind="target", committed=[5],
          extras={"gate": {"state": "shadow", "width": 7, "value": 1.0, "reason": "first step"}, "shadow": [5]}),
     "the draft gate was off and drew a shadow draft 7 tokens deep"),
])
def test_a_step_without_a_draft_draws_no_bars_and_says_why(no_draft, why):
    fig = views.step_figure(no_draft, TEXTS, 0.0)
    assert fig.data == ()
    assert not fig.layout.xaxis.visible and not fig.layout.yaxis.visible
    (note,) = fig.layout.annotations
    assert note.text.startswith(f"<b>no draft this step</b>:<br>{why}") and "the target added" in note.text
    assert max(len(line) for line in note.text.split("<br>")) <= 120  # wrapped to fit the plot's width


def test_every_legend_swatch_is_the_colour_of_its_bars():
    s = step()
    fig = views.step_figure(s, TEXTS, 0.7)
    names = [t.name for t in fig.data]
    assert names == ["p (target), accepted", "p (target), rejected", "p (target), unverified", "q (draft)"]
    status = views.node_status(s)
    for trace in fig.data:
        assert isinstance(trace.marker.color, str)  # one colour per trace: the legend shows it
        if trace.name.startswith("p (target), "):
            kind = trace.name.split(", ")[1]
            assert trace.marker.color == views.STATUS_COLOURS[kind]
            nodes = [i for i, st in enumerate(status) if st == kind]
            assert list(trace.y) == [s.p[i] for i in nodes]
    assert fig.data[-1].marker.color == views.Q_COLOUR and list(fig.data[-1].y) == s.q
    assert {t.offsetgroup for t in fig.data[:-1]} == {"p"}  # status traces share one slot per node
    assert list(fig.layout.xaxis.categoryarray) == [f"{i}: {TEXTS[t]!r}" for i, t in enumerate(s.tokens)]


def test_greedy_figure_states_the_argmax_rule():
    assert views.GREEDY_RULE in views.step_figure(step(), TEXTS, 0.0).layout.title.text
    assert views.GREEDY_RULE not in views.step_figure(step(), TEXTS, 0.7).layout.title.text


def test_a_clicked_token_names_its_step():
    run = RunRecord("draft", {}, {"temperature": 0.0}, "m", "cpu", [1], code_run(), [1], "length", 0.0)
    assert views.clicked_step("3:12", run) == 3
    assert views.clicked_step("99:1", run) == len(run.steps) - 1
    assert views.clicked_step("", run) is None and views.clicked_step("3:1", None) is None
    assert "#output .tok[data-step]" in views.TOKEN_CLICK_JS and "#token-step" in views.TOKEN_CLICK_JS


def test_the_summary_says_when_the_draft_was_a_tree():
    chain = views.stop_summary(step(), TEXTS, 0.0)
    assert "of 4 drafted:" in chain and "branches" not in chain
    tree = views.stop_summary(step(parents=[-1, 0, -1, 2], accepted=[0]), TEXTS, 0.0)  # two paths of two
    assert "1 accepted token(s) of 4 drafted on 2 branches of a tree" in tree


def test_grafted_lookup_nodes_are_named_in_the_summary_and_the_table():
    """Nodes 2-3 continue prompt lookup's match, grafted beside the drafter's nodes 0-1."""
    grafted = step(parents=[-1, 0, 0, 2], q=[0.9, 0.8, None, None], accepted=[0, 2, 3], correction=5,
                   correction_kind="bonus", committed=[2, 4, 11, 5],
                   extras={"graft": {"tokens": [2, 4, 11], "ngram": 2, "shared": 1, "first_node": 2}})
    summary = views.stop_summary(grafted, TEXTS, 0.0)
    assert "nodes 2-3 are prompt lookup's continuation (the last 2 token(s) occurred earlier)" in summary
    cells = re.findall(r"<td>([^<]*)</td>", views.step_table_html(grafted, TEXTS, 0.0))
    assert cells.count("prompt lookup") == 2 and "0.900" in cells and "0.800" in cells
    one = step(parents=[-1, 0, 0, 1],
               extras={"graft": {"tokens": [2, 3, 11], "ngram": 1, "shared": 2, "first_node": 3}})
    assert "node 3 is prompt lookup's continuation" in views.stop_summary(one, TEXTS, 0.0)
    both = step(parents=[-1, 0, 0, 0], q=[0.9, 0.8, None, None],
                extras={"graft": {"tokens": [2, 4], "ngram": 2, "shared": 1, "first_node": 2},
                        "datastore": {"tokens": [2, 11], "ngram": 6, "shared": 1, "first_node": 3}})
    summary = views.stop_summary(both, TEXTS, 0.0)
    assert "node 2 is prompt lookup's continuation (the last 2 token(s) occurred earlier)" in summary
    assert ("node 3 is the datastore's continuation (the last 6 token(s) occurred in the target's earlier answers)"
            in summary)
    cells = re.findall(r"<td>([^<]*)</td>", views.step_table_html(both, TEXTS, 0.0))
    assert cells.count("prompt lookup") == 1 and cells.count("the datastore") == 1
