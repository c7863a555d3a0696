"""The PTD tree panel (app/views_tree.py): one vocabulary with the step inspector, labels and
legends that fit, the grow -> verify -> prune animation, and the hint for larger trees; on
hand-built StepRecords with a known extras["ptd"] and on a real PTD run of a tiny model."""

from __future__ import annotations

import pytest

import specflash
from app import views, views_tree
from specflash.trace import StepRecord

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"
DRAFT_WORDS = ("kept", "added", "pruned")


def make_step(**kw) -> StepRecord:
    """Guess tree 0 -> 1 -> 3 and 0 -> 2, 4 under the root; nodes 0 and 1 accepted, so 2 and 3
    are rejected (their parents are on the accepted path) and 5 (under the rejected 3) unverified.
    Draft tree 10 -> {11 -> 13, 12} is updated into 11 -> {13, 14}, 15: 10 and 12 pruned (12 is out
    of range in `pruned` too: ignored), 14 and 15 added, 11 and 13 kept."""
    ptd = {"draft_before": {"tokens": [10, 11, 13, 12], "parents": [-1, 0, 1, 0]},
           "draft_after": {"tokens": [11, 13, 14, 15], "parents": [-1, 0, 0, -1]},
           "added": [2, 3], "pruned": [0, 3, 99], "inherited": [0, 1], "guess_size": 6, "lookahead_size": 4}
    base = dict(step=4, phase="decode", context_len=12, tokens=[5, 6, 7, 8, 9, 4], parents=[-1, 0, -1, 1, 1, 3],
                q=None, p=[0.9, 0.8, 0.1, 0.2, 0.3, 0.4], accepted=[0, 1], correction=11,
                correction_kind="resample", correction_p=0.5, committed=[5, 6, 11], verified=7,
                draft_time=0.01, verify_time=0.02, extras={"ptd": ptd})
    return StepRecord(**(base | kw))


TEXTS = {5: "Hello", 6: " world", 7: "\n", 8: "  ", 9: "<b>", 10: " a", 11: " b", 12: " c", 13: " d", 14: " e",
         15: " supercalifragilistic", 4: " Fibonacci"}


def named(traces, name: str, axis: str | None = None) -> list:
    return [t for t in traces if t.name == name and (axis is None or t.xaxis == axis)]


def nodes_of(traces, name: str, axis: str) -> list[int]:
    return sorted(i for t in named(traces, name, axis) for i in t.customdata)


def test_guess_tree_uses_the_step_inspectors_words_and_colours():
    step = make_step()
    fig = views_tree.ptd_figure(step, TEXTS)
    status = views.node_status(step)
    for word, colour in views.STATUS_COLOURS.items():
        assert nodes_of(fig.data, word, "x") == [i for i, s in enumerate(status) if s == word]
        assert all(t.marker.color == colour for t in named(fig.data, word, "x"))
    assert nodes_of(fig.data, "unverified", "x") == [5]
    assert not named(fig.data, "verified")  # the old word for a rejected node is gone


def test_draft_tree_words_differ_from_the_guess_tree_and_match_the_extras():
    fig = views_tree.ptd_figure(make_step(), TEXTS)
    assert (nodes_of(fig.data, "kept", "x2"), nodes_of(fig.data, "pruned", "x2")) == ([1, 2], [0, 3])
    assert (nodes_of(fig.data, "kept", "x3"), nodes_of(fig.data, "added", "x3")) == ([0, 1], [2, 3])
    draft_colours = {views_tree.STYLES[w].colour for w in DRAFT_WORDS}
    assert len(draft_colours) == 3 and not draft_colours & set(views.STATUS_COLOURS.values())
    assert not {t.name for t in fig.data if t.xaxis != "x"} & set(views.STATUS_COLOURS)


def test_every_subplot_says_what_it_shows_and_the_legends_sit_under_their_panel():
    fig = views_tree.ptd_figure(make_step(), TEXTS)
    titles = [a.text for a in fig.layout.annotations]
    assert len(titles) == 3 and all("<br>" in t for t in titles)  # a name, then a one-line explanation
    assert sum(t.count("draft tree") for t in titles) >= 2
    for col, axis in ((1, fig.layout.xaxis), (2, fig.layout.xaxis2), (3, fig.layout.xaxis3)):
        legend = fig.layout["legend" if col == 1 else f"legend{col}"]
        assert legend.y < 0 and legend.yanchor == "top" and legend.x == pytest.approx(axis.domain[0])
    used = {t.legend for t in fig.data if t.showlegend is not False}
    assert used == {"legend", "legend2", "legend3"}


def test_axis_ranges_leave_room_for_every_label():
    fig = views_tree.ptd_figure(make_step(), TEXTS)
    for col in (1, 2, 3):
        suffix = "" if col == 1 else str(col)
        xr, yr = fig.layout["xaxis" + suffix].range, fig.layout["yaxis" + suffix].range
        nodes = [t for t in fig.data if t.xaxis == "x" + suffix and t.mode == "markers+text"]
        xs = [x for t in nodes for x in t.x]
        ys = [y for t in nodes for y in t.y]
        assert xr[0] <= -0.5 and min(ys) - yr[0] >= 0.5 and yr[1] - max(ys) >= 0.5  # root and its label above
        deepest = [len(label) for t in nodes for x, label in zip(t.x, t.text) if x == max(xs)]
        room = (views_tree.CHAR_PX * max(deepest) + 1) / views_tree.LEVEL_PX
        assert xr[1] >= max(xs) + room
    root = [t for t in fig.data if t.xaxis == "x3" and t.text and t.text[0].startswith("root")][0]
    assert root.text[0] == "root: b" and root.textposition == "top center"  # this step's last committed token


def test_node_labels_show_whitespace_escape_html_and_stay_short():
    assert views_tree.node_label(TEXTS, 7) == "↵" and views_tree.node_label(TEXTS, 8) == "␣␣"
    assert views_tree.node_label(TEXTS, 9) == "&lt;b&gt;"
    long = views_tree.node_label(TEXTS, 15)
    assert len(long) == views_tree.MAX_LABEL and long.endswith("…")
    assert views_tree.node_label({}, 77) == "⟨77⟩"


def test_animation_goes_drafted_verified_pruned_updated():
    step = make_step()
    fig = views_tree.ptd_animation(step, TEXTS)
    assert [f.name for f in fig.frames] == list(views_tree.STAGES) == ["drafted", "verified", "pruned", "updated"]
    shapes = [[(t.name, t.xaxis) for t in f.data] for f in fig.frames]
    assert all(s == shapes[0] for s in shapes) and len(fig.data) == len(fig.frames[0].data)
    drafted, verified, pruned, updated = (f.data for f in fig.frames)
    assert nodes_of(drafted, "drafted", "x") == list(range(6)) and not nodes_of(drafted, "accepted", "x")
    for word in views.STATUS_COLOURS:
        expected = [i for i, s in enumerate(views.node_status(step)) if s == word]
        assert nodes_of(verified, word, "x") == nodes_of(updated, word, "x") == expected
    assert nodes_of(verified, "drafted", "x2") == list(range(4))  # the draft tree has no verdict yet
    assert (nodes_of(pruned, "pruned", "x2"), nodes_of(pruned, "kept", "x2")) == ([0, 3], [1, 2])
    assert [len(t.x) for t in named(verified, "accepted path")] == [3]  # root + the two accepted nodes


def test_the_last_frame_is_exactly_draft_after():
    step = make_step()
    after = step.extras["ptd"]["draft_after"]
    last = views_tree.ptd_animation(step, TEXTS).frames[-1].data
    nodes = nodes_of(last, "kept", "x2") + nodes_of(last, "added", "x2")
    assert sorted(nodes) == list(range(len(after["tokens"]))) and not nodes_of(last, "pruned", "x2")
    x, y, _ = views_tree.tree_layout(after["parents"])
    for t in named(last, "kept", "x2") + named(last, "added", "x2"):
        for i, px, py, label in zip(t.customdata, t.x, t.y, t.text):
            assert (px, py, label) == (x[i], y[i], views_tree.node_label(TEXTS, after["tokens"][i]))


def test_play_and_the_slider_carry_the_frames_inline_for_gradio():
    """gr.Plot renders with Plotly.react(data, layout, config): fig.frames never reach the page."""
    fig = views_tree.ptd_animation(make_step(), TEXTS)
    play = fig.layout.updatemenus[0].buttons[0]
    assert play.method == "animate" and [f["name"] for f in play.args[0]] == list(views_tree.STAGES)
    steps = fig.layout.sliders[0].steps
    assert [s.args[0][0]["name"] for s in steps] == list(views_tree.STAGES)
    assert [f["layout"]["sliders[0].active"] for f in play.args[0]] == [0, 1, 2, 3]
    captions = [f["layout"]["annotations"][-1]["text"] for f in play.args[0]]
    assert [c.split(" ")[0] for c in captions] == ["1", "2", "3", "4"] and len(set(captions)) == 4
    assert all(len(f["layout"]["annotations"]) == 3 for f in play.args[0])  # both subplot titles kept


def test_root_token_is_the_last_token_committed_before_the_step():
    steps = [make_step(step=0, committed=[1, 2]), make_step(step=1, committed=[]), make_step(step=2)]
    assert views_tree.root_token(steps, 2) == 2 and views_tree.root_token(steps, 0) is None


def test_tree_size_note_names_the_knob_only_for_small_trees():
    small = views_tree.tree_size_note([make_step()])
    assert "`preset` to `paper`" in small and "lookahead_budget" in small
    big = {"tokens": list(range(views_tree.SMALL_TREE)), "parents": [-1] * views_tree.SMALL_TREE}
    step = make_step(extras={"ptd": {**make_step().extras["ptd"], "draft_after": big}})
    assert views_tree.tree_size_note([step]) == "" and views_tree.tree_size_note([]) == ""


@pytest.fixture(scope="module")
def real_run(tiny_root):
    target = specflash.load(PRESET, device="cpu", cache_dir=tiny_root)
    return specflash.generate(target, PROMPT, "ptd", max_new_tokens=16, cache_dir=tiny_root,
                              options={"preset": "paper"})


def test_a_real_paper_preset_run_animates_into_each_steps_draft_after(real_run):
    steps = [s for s in real_run.steps if views_tree.ptd_extras(s)]
    assert steps and views_tree.tree_size_note(real_run.steps) == ""
    for step in steps:
        ptd = step.extras["ptd"]
        last = views_tree.ptd_animation(step, {}).frames[-1].data
        shown = sorted(nodes_of(last, "kept", "x2") + nodes_of(last, "added", "x2"))
        assert shown == list(range(len(ptd["draft_after"]["tokens"])))
        assert nodes_of(last, "added", "x2") == sorted(ptd["added"])
        static = views_tree.ptd_figure(step, {})
        assert nodes_of(static.data, "pruned", "x2") == sorted(ptd["pruned"])
