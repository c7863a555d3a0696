"""Records -> the PTD panel: the verified guess tree and the draft tree's progressive update.

PTD verifies a guess tree (the StepRecord's tokens/parents) while the target grows its own draft
tree of lookahead tokens; `extras["ptd"]` records that tree before and after the step's update.
Reading of the index lists (the contract says "added/pruned/inherited" without a tree): `added`
indexes nodes of `draft_after`, `pruned` nodes of `draft_before`; every other node survived the
update (kept). Indices out of range are ignored, not fatal, so a trace from a newer engine still
draws.

One vocabulary across panels: guess-tree nodes take the step inspector's words and colours
(`views.node_status`, `views.STATUS_COLOURS`: accepted / rejected / unverified), because they are
the same verified draft. The draft tree is never verified, so its nodes get other words and other
colours: kept (the trace's `inherited`), added, pruned. Pure: plotly figures, no gradio.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specflash.drafters.ptd import PRESETS
from specflash.trace import StepRecord

from .views import STATUS_COLOURS, leaf_count, node_status, token_text

STATUS_MEANING = {
    "accepted": "verified and accepted: committed",
    "rejected": "verified and refused by the target",
    "unverified": "below a refused node: never checked",
}
DRAFT_MEANING = {
    "kept": "in the draft tree before and after this step",
    "added": "new this step: the target's predictions grown onto the tree",
    "pruned": "dropped this step: its position was committed, it went too deep or over budget",
}
DRAFTED = "drafted"  # a node shown before its step's outcome: hollow, no verdict yet


@dataclass(frozen=True)
class Style:
    """How one node category draws: colour, what it means (hover), hollow (no verdict yet),
    faded (on its way out)."""

    colour: str
    meaning: str
    hollow: bool = False
    faded: bool = False


STYLES = {
    **{name: Style(STATUS_COLOURS[name], meaning) for name, meaning in STATUS_MEANING.items()},
    "kept": Style("#3b75af", DRAFT_MEANING["kept"]),
    "added": Style("#f0a30a", DRAFT_MEANING["added"]),
    "pruned": Style("#a07cc5", DRAFT_MEANING["pruned"], faded=True),
    DRAFTED: Style("#555555", "drafted, outcome not shown yet", hollow=True),
}
ROOT_MEANING = "root: the last committed token; every tree continues it"
NO_PTD = "This run has no PTD tree (it was decoded with another method): run `ptd` or import a PTD run."
SMALL_TREE = 8  # draft-tree nodes below which growing and pruning are hard to see
MAX_LABEL = 10  # characters of a token label on the plot; hover shows the whole token
LEVEL_PX = 70  # the width of a depth level the ranges plan for (three trees across about 1400 px)
CHAR_PX = 7  # about the width of a label character at plotly's default 12 px font
LEAF_PX = 24  # vertical room per leaf, so labels of neighbouring leaves do not collide
EMPTY_PTD = {"draft_before": {"tokens": [], "parents": []}, "draft_after": {"tokens": [], "parents": []}}
STAGES = ("drafted", "verified", "pruned", "updated")
STAGE_CAPTIONS = {
    "drafted": "1 · drafted: the n-gram pool guessed a tree after the root (left); the target's own draft "
               "tree (right) is fed in the same forward",
    "verified": "2 · verified: the target accepts the green path, refuses red, never reaches grey; "
                "the draft tree is never verified",
    "pruned": "3 · pruned: draft nodes whose position was committed, that went too deep or over budget fade out",
    "updated": "4 · updated: re-rooted on the last committed token, grown by the target's predictions (orange); "
               "fed next step",
}


def tree_layout(parents: Sequence[int]) -> tuple[list[float], list[float], float]:
    """(x, y of every node, y of the root): x = depth (root at 0), y = leaf order of a
    depth-first walk, each parent centred over its children."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    x = [0.0] * len(parents)
    y = [0.0] * len(parents)
    next_leaf = [0.0]

    def place(node: int, depth: int) -> float:
        kids = children.get(node, [])
        if not kids:
            pos, next_leaf[0] = next_leaf[0], next_leaf[0] + 1
        else:
            pos = sum(place(k, depth + 1) for k in kids) / len(kids)
        if node >= 0:
            x[node], y[node] = float(depth), -pos
        return pos

    root_y = -place(-1, 0) if parents else 0.0
    return x, y, root_y


def ptd_extras(step: StepRecord) -> dict[str, Any] | None:
    return step.extras.get("ptd") if step.extras else None


def has_ptd(steps: Sequence[StepRecord]) -> bool:
    return any(ptd_extras(s) for s in steps)


def root_token(steps: Sequence[StepRecord], index: int) -> int | None:
    """The last token committed before steps[index]: the root its guess tree and fed draft tree
    continue (a StepRecord does not carry it), or None at the start."""
    return next((s.committed[-1] for s in reversed(steps[:index]) if s.committed), None)


def _valid(indices: Sequence[int], n: int) -> set[int]:
    return {i for i in indices if isinstance(i, int) and 0 <= i < n}


def draft_categories(ptd: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(categories of draft_before nodes: pruned/kept, of draft_after nodes: added/kept)."""
    n_before = len(ptd["draft_before"]["tokens"])
    n_after = len(ptd["draft_after"]["tokens"])
    pruned = _valid(ptd.get("pruned", []), n_before)
    added = _valid(ptd.get("added", []), n_after)
    before = ["pruned" if i in pruned else "kept" for i in range(n_before)]
    after = ["added" if i in added else "kept" for i in range(n_after)]
    return before, after


def node_label(texts: Mapping[int, str], token: int) -> str:
    """A token as plot text: whitespace made visible (a newline or a run of spaces would draw as
    nothing), cut to MAX_LABEL characters, escaped (plotly reads text as HTML)."""
    text = token_text(texts, token)
    if not text.strip():
        text = text.replace("\n", "↵").replace("\t", "⇥").replace(" ", "␣")
    if len(text) > MAX_LABEL:
        text = text[: MAX_LABEL - 1] + "…"
    return html.escape(text, quote=False)


@dataclass(frozen=True)
class Placed:
    """One tree laid out for drawing: node coordinates, the root's, and each node's label."""

    tokens: list[int]
    parents: list[int]
    x: list[float]
    y: list[float]
    root_y: float
    labels: list[str]  # short, for the plot
    hovers: list[str]  # the whole token, quoted, for the hover box
    root_label: str

    @property
    def leaves(self) -> int:
        return leaf_count(self.parents) or 1  # the root alone still takes a column


def place_tree(tokens: Sequence[int], parents: Sequence[int], texts: Mapping[int, str], root: int | None) -> Placed:
    """Lay out a tree; the root reads "root" plus its token when the caller knows it."""
    x, y, root_y = tree_layout(parents)
    root_label = "root" if root is None else f"root: {node_label(texts, root).strip()}"
    labels = [node_label(texts, t) for t in tokens]
    hovers = [html.escape(repr(token_text(texts, t)), quote=False) for t in tokens]
    return Placed(list(tokens), list(parents), x, y, root_y, labels, hovers, root_label)


def axis_ranges(trees: Sequence[Placed]) -> tuple[list[float], list[float]]:
    """x and y ranges that show every node and its label at LEVEL_PX per depth level: labels sit
    right of their node, so the right edge makes room for the longest label at the deepest level;
    the root's label is centred above it, so the left edge makes room for half of it."""
    xs = [0.0] + [v for t in trees for v in t.x]
    ys = [v for t in trees for v in t.y + [t.root_y]]
    deepest = max(xs)
    chars = max([len(t.labels[i]) for t in trees for i, v in enumerate(t.x) if v == deepest], default=0)
    root_chars = max(len(t.root_label) for t in trees)
    left = max(0.5, (CHAR_PX * root_chars / 2 + 8) / LEVEL_PX)
    right = max(0.5, (CHAR_PX * chars + 24) / LEVEL_PX)
    return [-left, deepest + right], [min(ys) - 0.6, max(ys) + 0.8]


def column_widths(ranges: Sequence[tuple[list[float], list[float]]]) -> list[float]:
    """Subplot widths in proportion to their x spans, so a depth level is as wide in every panel
    and a deep guess tree gets the room a shallow draft tree does not need."""
    spans = [xr[1] - xr[0] for xr, _ in ranges]
    return [s / sum(spans) for s in spans]


def _suffix(col: int) -> str:
    """Plotly's name suffix for subplot `col`: x, x2, x3 (and legend, legend2, ...)."""
    return "" if col == 1 else str(col)


def _axes(col: int) -> dict[str, str]:
    return {"xaxis": f"x{_suffix(col)}", "yaxis": f"y{_suffix(col)}"}


def _legend(col: int) -> str:
    return f"legend{_suffix(col)}"


def edge_trace(tree: Placed, nodes: Sequence[int], col: int, faded: bool = False) -> go.Scatter:
    """Lines from each of `nodes` to its parent (the root for -1)."""
    ex: list[float | None] = []
    ey: list[float | None] = []
    for i in nodes:
        parent = tree.parents[i]
        px, py = (0.0, tree.root_y) if parent < 0 else (tree.x[parent], tree.y[parent])
        ex += [px, tree.x[i], None]
        ey += [py, tree.y[i], None]
    line = dict(color="#ccc" if faded else "#999", width=1, dash="dot" if faded else "solid")
    return go.Scatter(x=ex, y=ey, mode="lines", line=line, hoverinfo="skip", showlegend=False, **_axes(col))


def root_trace(tree: Placed, col: int) -> go.Scatter:
    """The root in black, its label centred above it (a label to its left would need room there)."""
    return go.Scatter(x=[0.0], y=[tree.root_y], mode="markers+text", text=[tree.root_label], textposition="top center",
                      marker=dict(color="black", size=11), hovertext=[ROOT_MEANING], hoverinfo="text",
                      showlegend=False, cliponaxis=False, **_axes(col))


def node_trace(tree: Placed, nodes: Sequence[int], name: str, col: int, legend: bool = True) -> go.Scatter:
    """One category's nodes with their token labels, drawn in STYLES[name]; customdata holds the
    node indices. An empty `nodes` still gives a trace, so animation frames keep their shape."""
    style = STYLES[name]
    marker = dict(size=13, color="white" if style.hollow else style.colour, symbol="x" if style.faded else "circle",
                  line=dict(color=style.colour if style.hollow else "white", width=2),
                  opacity=0.4 if style.faded else 1.0)
    return go.Scatter(
        x=[tree.x[i] for i in nodes], y=[tree.y[i] for i in nodes], mode="markers+text", name=name,
        text=[tree.labels[i] for i in nodes], textposition="middle right", customdata=list(nodes),
        hovertext=[tree.hovers[i] for i in nodes],
        textfont=dict(color="#aaa" if style.faded else "#222"), marker=marker, legend=_legend(col),
        legendgroup=name, showlegend=legend, cliponaxis=False,
        hovertemplate=f"node %{{customdata}}: %{{hovertext}}<extra>{name}: {style.meaning}</extra>", **_axes(col),
    )


def guess_traces(step: StepRecord, tree: Placed, col: int, judged: bool = True) -> list[go.Scatter]:
    """The guess tree: edges, the thick accepted path, the root, one trace per status; before
    verification (`judged` False) every node is a hollow "drafted" one. Same traces either way."""
    status = node_status(step) if judged else [DRAFTED] * len(step.tokens)
    on_path = list(step.accepted) if judged else []
    path = [(0.0, tree.root_y)] + [(tree.x[i], tree.y[i]) for i in on_path] if on_path else []
    path_trace = go.Scatter(x=[p[0] for p in path], y=[p[1] for p in path], mode="lines", name="accepted path",
                            line=dict(color=STATUS_COLOURS["accepted"], width=5), hoverinfo="skip", showlegend=False,
                            **_axes(col))
    everyone = range(len(tree.tokens))
    nodes = [node_trace(tree, [i for i in everyone if status[i] == name], name, col,
                        legend=name != DRAFTED or not judged) for name in (DRAFTED, *STATUS_MEANING)]
    return [edge_trace(tree, everyone, col), path_trace, root_trace(tree, col), *nodes]


def draft_traces(tree: Placed, cats: Sequence[str], col: int, names: Sequence[str]) -> list[go.Scatter]:
    """A draft tree: edges (dotted into pruned nodes), the root, one trace per category of
    `names` (an absent category is an empty trace); "drafted" nodes stay out of this legend."""
    firm = [i for i, c in enumerate(cats) if c != "pruned"]
    gone = [i for i, c in enumerate(cats) if c == "pruned"]
    nodes = [node_trace(tree, [i for i, c in enumerate(cats) if c == name], name, col, legend=name != DRAFTED)
             for name in names]
    return [edge_trace(tree, firm, col), edge_trace(tree, gone, col, faded=True), root_trace(tree, col), *nodes]


def _legend_under(x: float, y: float) -> dict[str, Any]:
    """A horizontal legend from paper x under a subplot, so each panel's words sit under that
    panel and no legend covers a subplot title."""
    return dict(orientation="h", x=x, xanchor="left", y=y, yanchor="top", font=dict(size=12),
                itemclick=False, itemdoubleclick=False)


def _height(trees: Sequence[Placed]) -> int:
    """Plot-area height: LEAF_PX per leaf of the tallest tree, at least 300 px."""
    return max(300, LEAF_PX * max(t.leaves for t in trees))


def _finish(fig: go.Figure, title: str, ranges: Sequence[tuple[list[float], list[float]]], plot_px: int,
            top: int, bottom: int, below_px: int) -> None:
    """Axes at their ranges, a legend per panel `below_px` under the plot area (clear of the
    depth axis), margins that leave room for titles above and controls below."""
    for col, (xr, yr) in enumerate(ranges, start=1):
        fig.update_xaxes(range=xr, dtick=1, title_text="depth", title_standoff=4, zeroline=False, row=1, col=col)
        fig.update_yaxes(range=yr, showticklabels=False, showgrid=False, zeroline=False, row=1, col=col)
    starts = [fig.layout[f"xaxis{_suffix(col)}"].domain[0] for col in range(1, len(ranges) + 1)]
    legends = {_legend(col): _legend_under(x, -below_px / plot_px) for col, x in enumerate(starts, start=1)}
    fig.update_layout(title=dict(text=title, x=0.01, y=1, yref="container", yanchor="top", pad=dict(t=12),
                                 font=dict(size=15)), height=plot_px + top + bottom,
                      margin=dict(l=20, r=20, t=top, b=bottom), plot_bgcolor="#fafafa", **legends)


def _title(name: str, count: str, explanation: str) -> str:
    return f"<b>{name}</b> ({count})<br><span style='font-size:12px;color:#555'>{explanation}</span>"


def step_summary(step: StepRecord, ptd: Mapping[str, Any]) -> str:
    """One line for the figure title: what verification and the update did."""
    before, after = draft_categories(ptd)
    return (f"PTD step {step.step}: {step.accepted_len} of {len(step.tokens)} guess nodes accepted, "
            f"{len(step.committed)} token(s) committed; draft tree {len(before)} → {len(after)} nodes "
            f"(+{after.count('added')} added, −{before.count('pruned')} pruned)")


@dataclass(frozen=True)
class StepTrees:
    """One step's three trees, laid out, and the draft trees' categories."""

    guess: Placed
    before: Placed
    after: Placed
    before_cats: list[str]
    after_cats: list[str]


def step_trees(step: StepRecord, texts: Mapping[int, str], root: int | None) -> StepTrees:
    """The guess tree and the draft tree before its update hang under `root` (the last token
    committed before this step); the updated draft tree hangs under this step's last committed."""
    ptd = ptd_extras(step) or EMPTY_PTD
    before_cats, after_cats = draft_categories(ptd)
    new_root = step.committed[-1] if step.committed else None
    return StepTrees(
        place_tree(step.tokens, step.parents, texts, root),
        place_tree(ptd["draft_before"]["tokens"], ptd["draft_before"]["parents"], texts, root),
        place_tree(ptd["draft_after"]["tokens"], ptd["draft_after"]["parents"], texts, new_root),
        before_cats, after_cats,
    )


def ptd_figure(step: StepRecord, texts: Mapping[int, str], root: int | None = None) -> go.Figure:
    """Three trees side by side: the guess tree verified this step (accepted path highlighted),
    the draft tree fed this step (pruned nodes marked) and the draft tree after its update (added
    nodes marked). `root`: the last token committed before this step, when the caller knows it."""
    trees = step_trees(step, texts, root)
    ranges = [axis_ranges([trees.guess]), axis_ranges([trees.before]), axis_ranges([trees.after])]
    gap = 0.04
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=gap, column_widths=column_widths(ranges), subplot_titles=(
        _title("guess tree verified", f"{len(step.tokens)} nodes", "n-gram guesses; the target accepts one path"),
        _title("draft tree fed", f"{len(trees.before_cats)} nodes", "the target's own lookahead; never verified"),
        _title("draft tree after the update", f"{len(trees.after_cats)} nodes", "grown and pruned; fed next step"),
    ))
    fig.add_traces(guess_traces(step, trees.guess, 1))
    fig.add_traces(draft_traces(trees.before, trees.before_cats, 2, ("kept", "pruned")))
    fig.add_traces(draft_traces(trees.after, trees.after_cats, 3, ("kept", "added")))
    summary = step_summary(step, ptd_extras(step) or EMPTY_PTD)
    _finish(fig, summary, ranges, _height([trees.guess, trees.before, trees.after]), 110, 80, 46)
    return fig


def stage_traces(step: StepRecord, trees: StepTrees, stage: str) -> list[go.Scatter]:
    """Every trace of one animation stage, the same list shape at every stage (frames update
    traces by index). The draft panel shows the tree as fed, without verdicts, until the pruning
    stage, then the updated tree."""
    n_before = len(trees.before_cats)
    draft, cats = {
        "drafted": (trees.before, [DRAFTED] * n_before),
        "verified": (trees.before, [DRAFTED] * n_before),
        "pruned": (trees.before, trees.before_cats),
        "updated": (trees.after, trees.after_cats),
    }[stage]
    return (guess_traces(step, trees.guess, 1, judged=stage != "drafted")
            + draft_traces(draft, cats, 2, ("kept", "added", "pruned", DRAFTED)))


def _caption(text: str) -> dict[str, Any]:
    """The stage's one-line explanation, boxed between the figure title and the subplot titles."""
    return dict(text=text, x=0, y=1.0, xref="paper", yref="paper", xanchor="left", yanchor="bottom", yshift=54,
                showarrow=False, font=dict(size=13, color="#333"), align="left", bgcolor="#fff6d9",
                bordercolor="#e6c65c", borderpad=5)


def animation_frames(step: StepRecord, trees: StepTrees, titles: Sequence[Any]) -> list[go.Frame]:
    """The stages of one step as plotly frames, in STAGES order; each frame's layout keeps the
    subplot `titles` (a frame's annotations replace the figure's) and adds its stage caption."""
    return [go.Frame(name=stage, data=stage_traces(step, trees, stage),
                     layout=dict(annotations=[*titles, _caption(STAGE_CAPTIONS[stage])]))
            for stage in STAGES]


def _controls(frames: Sequence[go.Frame], y: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(updatemenus with Play/Pause, a stage slider) at paper height `y`. Gradio's gr.Plot hands
    plotly only data, layout and config (Plotly.react), dropping fig.frames, so the controls carry
    the frames inline (plotly animates frame objects as well as frame names): they work in the app
    and in a page alike."""
    inline = [f.to_plotly_json() for f in frames]
    for k, frame in enumerate(inline):
        frame["layout"]["sliders[0].active"] = k  # the slider follows Play (plotly.js reads the path)
    # no transition: plotly tweens scatter text from the corner when a trace gains points
    play = dict(frame=dict(duration=2000, redraw=True), transition=dict(duration=0), mode="immediate")
    stop = dict(frame=dict(duration=0, redraw=False), transition=dict(duration=0), mode="immediate")
    buttons = [dict(label="▶ Play", method="animate", args=[inline, play]),
               dict(label="❚❚ Pause", method="animate", args=[[None], stop])]
    menu = dict(type="buttons", direction="left", x=0, y=y, xanchor="left", yanchor="top", showactive=False,
                buttons=buttons, pad=dict(t=0, r=8))
    jump = dict(frame=dict(duration=0, redraw=True), transition=dict(duration=0), mode="immediate")
    steps = [dict(label=f"{i} {f['name']}", method="animate", args=[[f], jump]) for i, f in enumerate(inline, start=1)]
    slider = dict(active=0, steps=steps, x=0.18, len=0.82, y=y, yanchor="top", currentvalue=dict(visible=False),
                  pad=dict(t=0, b=0))
    return [menu], [slider]


def ptd_animation(step: StepRecord, texts: Mapping[int, str], root: int | None = None) -> go.Figure:
    """One step of PTD as an animation: the guess tree as drafted, its verification (accepted
    path green, rejected red, the rest grey), then the draft tree's update (pruned nodes fade
    out, then the updated tree with its added nodes). Play, or click a stage on the slider."""
    trees = step_trees(step, texts, root)
    ranges = [axis_ranges([trees.guess]), axis_ranges([trees.before, trees.after])]
    gap = 0.05
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=gap, column_widths=column_widths(ranges), subplot_titles=(
        _title("guess tree", f"{len(step.tokens)} nodes", "n-gram guesses the target verifies"),
        _title("draft tree", f"{len(trees.before_cats)} → {len(trees.after_cats)} nodes",
               "the target's own lookahead; grown, pruned, never verified"),
    ))
    fig.frames = animation_frames(step, trees, fig.layout.annotations)
    fig.add_traces(fig.frames[0].data)
    plot_px = _height([trees.guess, trees.before, trees.after])
    _finish(fig, step_summary(step, ptd_extras(step) or EMPTY_PTD), ranges, plot_px, 140, 150, 46)
    menus, sliders = _controls(fig.frames, -86 / plot_px)
    fig.update_layout(annotations=fig.frames[0].layout.annotations, updatemenus=menus, sliders=sliders)
    return fig


def tree_size_note(steps: Sequence[StepRecord]) -> str:
    """A hint (markdown) when this run's draft trees are too small to show growing and pruning,
    naming the knob that makes them larger; empty when they are large enough."""
    sizes = [len(p[k]["tokens"]) for s in steps if (p := ptd_extras(s)) for k in ("draft_before", "draft_after")]
    if not sizes or max(sizes) >= SMALL_TREE:
        return ""
    paper = PRESETS["paper"]
    return (f"The draft trees of this run have at most {max(sizes)} nodes, so growing and pruning are hard to see. "
            f"For larger trees set the **ptd** knob `preset` to `paper` (up to {paper['lookahead_budget']} "
            f"draft-tree and {paper['guess_budget']} guess-tree nodes per step, depth {paper['max_depth']}) and run "
            "again; or raise `lookahead_budget`, `window` and `max_depth` alone. The cpu preset is small because "
            "each fed token costs time on a CPU.")
