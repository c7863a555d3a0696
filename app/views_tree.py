"""Records -> the PTD panel: the verified guess tree and the draft tree's progressive update.

PTD verifies a guess tree (the StepRecord's tokens/parents) while the target grows its own draft
tree of lookahead tokens; `extras["ptd"]` records that tree before and after the step's update.
Reading of the index lists (the contract says "added/pruned/inherited" without a tree): `added`
and `inherited` index nodes of `draft_after`, `pruned` indexes nodes of `draft_before`; a node
of `draft_after` in neither list was kept. Indices out of range are ignored, not fatal, so a
trace from a newer engine still draws. Pure: plotly figures, no gradio.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specflash.trace import StepRecord

from .views import token_text

NODE_COLOURS = {
    "accepted": "#2e9e44",
    "verified": "#d9534f",
    "kept": "#6c8ebf",
    "added": "#f0a30a",
    "pruned": "#bbbbbb",
    "inherited": "#9b59b6",
}
NO_PTD = "This run has no PTD tree (it was decoded with another method): run `ptd` or import a PTD run."


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


def guess_categories(step: StepRecord) -> list[str]:
    """Guess-tree nodes: accepted (on the accepted path) or verified-but-not-accepted."""
    accepted = set(step.accepted)
    return ["accepted" if i in accepted else "verified" for i in range(len(step.tokens))]


def _valid(indices: Sequence[int], n: int) -> set[int]:
    return {i for i in indices if isinstance(i, int) and 0 <= i < n}


def draft_categories(ptd: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """(categories of draft_before nodes: pruned/kept, of draft_after nodes: added/inherited/kept)."""
    n_before = len(ptd["draft_before"]["tokens"])
    n_after = len(ptd["draft_after"]["tokens"])
    pruned = _valid(ptd.get("pruned", []), n_before)
    added = _valid(ptd.get("added", []), n_after)
    inherited = _valid(ptd.get("inherited", []), n_after)
    before = ["pruned" if i in pruned else "kept" for i in range(n_before)]
    after = ["added" if i in added else "inherited" if i in inherited else "kept" for i in range(n_after)]
    return before, after


def _add_tree(fig: go.Figure, col: int, tokens: Sequence[int], parents: Sequence[int], cats: Sequence[str],
              texts: Mapping[int, str], shown: set[str]) -> None:
    """Edges, a root marker and one node trace per category into subplot `col`."""
    x, y, root_y = tree_layout(parents)
    ex: list[float | None] = []
    ey: list[float | None] = []
    for i, parent in enumerate(parents):
        px, py = (0.0, root_y) if parent < 0 else (x[parent], y[parent])
        ex += [px, x[i], None]
        ey += [py, y[i], None]
    fig.add_scatter(x=ex, y=ey, mode="lines", line=dict(color="#999", width=1), hoverinfo="skip",
                    showlegend=False, row=1, col=col)
    fig.add_scatter(x=[0.0], y=[root_y], mode="markers+text", text=["root"], textposition="middle left",
                    marker=dict(color="black", size=10), hoverinfo="skip", showlegend=False, row=1, col=col)
    for cat in NODE_COLOURS:
        idx = [i for i, c in enumerate(cats) if c == cat]
        if not idx:
            continue
        labels = [token_text(texts, tokens[i]) for i in idx]
        fig.add_scatter(
            x=[x[i] for i in idx], y=[y[i] for i in idx], mode="markers+text", name=cat, legendgroup=cat,
            showlegend=cat not in shown, text=labels, textposition="top center", customdata=idx,
            marker=dict(color=NODE_COLOURS[cat], size=14, line=dict(color="white", width=1)),
            hovertemplate="node %{customdata}: %{text}<extra>" + cat + "</extra>", row=1, col=col,
        )
        shown.add(cat)


def _accepted_path(fig: go.Figure, step: StepRecord) -> None:
    """A thick green line along the accepted root-to-leaf path of the guess tree."""
    x, y, root_y = tree_layout(step.parents)
    px, py = [0.0], [root_y]
    for node in step.accepted:
        px.append(x[node])
        py.append(y[node])
    fig.add_scatter(x=px, y=py, mode="lines", line=dict(color=NODE_COLOURS["accepted"], width=4),
                    name="accepted path", hoverinfo="skip", row=1, col=1)


def ptd_figure(step: StepRecord, texts: Mapping[int, str]) -> go.Figure:
    """Three trees side by side: the guess tree verified this step (accepted path highlighted),
    the draft tree before this step's update (pruned marked) and after it (added/inherited)."""
    ptd = ptd_extras(step) or {"draft_before": {"tokens": [], "parents": []}, "draft_after": {"tokens": [], "parents": []}}
    before_cats, after_cats = draft_categories(ptd)
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        f"guess tree ({len(step.tokens)} nodes verified)",
        f"draft tree before ({len(before_cats)} nodes)",
        f"draft tree after ({len(after_cats)} nodes)",
    ))
    shown: set[str] = set()
    if step.accepted:
        _accepted_path(fig, step)
    _add_tree(fig, 1, step.tokens, step.parents, guess_categories(step), texts, shown)
    for col, key, cats in ((2, "draft_before", before_cats), (3, "draft_after", after_cats)):
        _add_tree(fig, col, ptd[key]["tokens"], ptd[key]["parents"], cats, texts, shown)
    sizes = f"guess size {ptd.get('guess_size', '?')}, lookahead size {ptd.get('lookahead_size', '?')}"
    fig.update_layout(title=f"PTD step {step.step}: {sizes}", height=420, margin=dict(l=30, r=20, t=80, b=30),
                      legend=dict(orientation="h", y=1.12, x=1, xanchor="right"))
    fig.update_xaxes(title_text="depth", dtick=1)
    fig.update_yaxes(showticklabels=False)
    return fig
