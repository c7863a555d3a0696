"""Records -> the DFlash 2 lattice panel: why the candidate selector gets more drafts accepted.

DFlash 2 keeps each block slot's top-K candidates (ranked by the drafter's unary score) and walks
a path through them with transition scores; `extras["dflash2"]` (drafters/dflash2.py) holds one
step's lattice. This view lays that walk next to the path independent per-slot argmaxes (rank 0
everywhere, what DFlash would draft from the same logits) and the target's own tokens.

What the trace shows of the target, and so what the view claims: the target verified the walked
path only. Its token is known at every accepted slot and at the first rejected one (the
correction); past that, it was never computed. The argmax path's agreement is therefore exact
when it leaves the target's tokens inside that known prefix (or the whole block was accepted),
and only a lower bound when it matches all of them. At temperature 0 agreement is acceptance
(greedy verification accepts exactly the matching prefix); in a sampled run it counts matches
with the target's sampled tokens, which is not what verifying the argmax path would accept.
Pure: plotly figures and HTML.
"""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specflash.trace import StepRecord

from .views import STATUS_COLOURS, draft_tree, leaf_count, lookup_note, lookup_share, node_status, token_text

NO_LATTICE = (
    "<p>This tab draws DFlash 2's candidate lattice for every step: the top-K candidates of each block "
    "slot ranked by the drafter's unary score, the selector's transition scores, the path the selector "
    "walked, the path independent per-slot argmaxes would have taken, and the tokens the target produced. "
    "This run has no lattice: run method <code>dflash2</code> with a DFlash 2 drafter (or import such a "
    "run) to fill it.</p>"
)
SHOWN_RANKS = 8  # candidate ranks drawn per slot by default; deeper ones used by a path are added
COLOURS = {"walked": "#111111", "argmax": "#7a5cc9", "target": "#f07f0a", "anchor": "#d9d9d9"}


def step_lattice(step: StepRecord) -> dict[str, Any] | None:
    """The step's DFlash 2 lattice, or None (prefill, a step the draft gate skipped, another method)."""
    lattice = step.extras.get("dflash2") if step.extras else None
    return lattice if lattice and lattice.get("candidates") else None


def has_lattice(steps: Sequence[StepRecord]) -> bool:
    return any(step_lattice(s) for s in steps)


def lattice_ids(step: StepRecord) -> list[int]:
    """Every token id the lattice view shows for a step beyond its draft and committed tokens (the
    anchor and all candidates), so the app decodes their texts along with the others."""
    lattice = step_lattice(step)
    if lattice is None:
        return []
    return [lattice["anchor"], *(token for row in lattice["candidates"] for token in row)]


def target_tokens(step: StepRecord) -> list[int]:
    """The target's token per drafted slot, as far as verification shows it: the accepted draft
    tokens, then the correction at the first rejected slot. A bonus (whole draft accepted) falls
    after the last slot, outside the lattice. Later slots were never computed by the target."""
    lattice = step_lattice(step)
    slots = len(lattice["candidates"]) if lattice else 0
    return ([step.tokens[i] for i in step.accepted] + [step.correction])[:slots]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@dataclass(frozen=True)
class Comparison:
    """One step's two paths against the target. `walked` and `argmax` count leading slots that
    agree with the target's tokens; `argmax_bound` says the argmax path matched every token the
    trace knows (`known` of `slots`), so its true run is `argmax` or more. `parts` is the first
    slot (0-based) where the paths differ, None when they are the same path."""

    slots: int
    known: int
    walked: int
    argmax: int
    argmax_bound: bool
    parts: int | None
    sampled: bool

    @property
    def mattered(self) -> bool:
        """The paths differ at or before the walked path's first rejection, so the choice counted."""
        return self.parts is not None and self.parts <= self.walked

    @property
    def winner(self) -> str:
        """Which path agreed with the target further: "walked", "argmax" or "tie" (an argmax lower
        bound above the walked run is still further)."""
        if self.argmax > self.walked:
            return "argmax"
        return "walked" if self.walked > self.argmax else "tie"


def compare(step: StepRecord) -> Comparison | None:
    """The step's walked and argmax paths against the target's known tokens (None: no lattice)."""
    lattice = step_lattice(step)
    if lattice is None:
        return None
    target = target_tokens(step)
    walked, argmax = lattice["path_tokens"], lattice["argmax_tokens"]
    slots = len(lattice["candidates"])
    agree = common_prefix(argmax, target)
    parts = common_prefix(walked, argmax)
    return Comparison(slots=slots, known=len(target), walked=common_prefix(walked, target), argmax=agree,
                      argmax_bound=agree == len(target) < slots, parts=parts if parts < slots else None,
                      sampled=bool(lattice.get("sampled")))


# ---- the figure ----------------------------------------------------------------------------------


def cell_label(texts: Mapping[int, str], token: int, width: int = 8) -> str:
    """A token as a grid cell shows it: spaces and newlines made visible; a partial UTF-8 byte
    (decoded alone as U+FFFD), a control character or an empty text by its id, since many ids
    would otherwise look alike; long texts cut to `width` characters."""
    text = token_text(texts, token).replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    if not text or "\ufffd" in text or not text.isprintable():
        return f"⟨{token}⟩"
    return html.escape(text if len(text) <= width else text[: width - 1] + "…")


def softmax(values: Sequence[float | None]) -> list[float]:
    """Softmax over one slot's K scores; None (a non-finite score in the trace) weighs nothing."""
    finite = [v for v in values if v is not None]
    if not finite:
        return [0.0] * len(values)
    top = max(finite)
    weights = [0.0 if v is None else math.exp(v - top) for v in values]
    total = sum(weights)
    return [w / total for w in weights]


@dataclass(frozen=True)
class Grid:
    """Which rows the figure draws: ranks 0..shown-1, then a "more" row summarising the ranks not
    drawn (when any), then an "outside" row for target tokens not among the K (when any)."""

    shown: int
    top_k: int
    outside: bool

    @property
    def more_row(self) -> int | None:
        return self.shown if self.shown < self.top_k else None

    @property
    def outside_row(self) -> int | None:
        return self.shown + (self.more_row is not None) if self.outside else None

    def row_of(self, rank: int | None) -> int:
        """The row a candidate rank lands on (None: a token outside the top-K)."""
        if rank is None:
            return self.outside_row
        return rank if rank < self.shown else self.more_row

    def labels(self) -> list[str]:
        rows = [f"rank {r}" for r in range(self.shown)]
        if self.more_row is not None:
            rows.append(f"ranks {self.shown}–{self.top_k - 1}")
        if self.outside:
            rows.append("not in top-K")
        return rows


def target_ranks(lattice: Mapping[str, Any], target: Sequence[int]) -> list[int | None]:
    """The rank of the target's token among each known slot's candidates (None: not among them)."""
    return [row.index(token) if token in row else None for row, token in zip(lattice["candidates"], target)]


def grid_for(lattice: Mapping[str, Any], target: Sequence[int], depth: int) -> Grid:
    """Ranks 0..depth-1, widened to every rank the walked path or the target's tokens use."""
    ranks = target_ranks(lattice, target)
    used = [*lattice["path"], *(r for r in ranks if r is not None)]
    shown = min(lattice["top_k"], max(depth, max(used, default=0) + 1))
    return Grid(shown=shown, top_k=lattice["top_k"], outside=any(r is None for r in ranks))


def _panel_cells(lattice: Mapping[str, Any], grid: Grid, texts: Mapping[int, str],
                 scores_key: str) -> tuple[list[list[float | None]], list[list[str]], list[list[list[str]]]]:
    """(z, cell text, hover data) of one panel, rows by grid row, columns by slot. z is the softmax
    over the slot's K of the panel's scores (unary, or the edge scores from the walked predecessor);
    the "more" row holds the mass of the ranks not drawn."""
    n_rows = len(grid.labels())
    z: list[list[float | None]] = [[None] * len(lattice["candidates"]) for _ in range(n_rows)]
    text = [[""] * len(lattice["candidates"]) for _ in range(n_rows)]
    hover = [[[""] for _ in lattice["candidates"]] for _ in range(n_rows)]
    for slot, (row, unary, edges) in enumerate(zip(lattice["candidates"], lattice["unary"], lattice["scores"])):
        probs = softmax(unary if scores_key == "unary" else edges)
        for rank, token in enumerate(row[: grid.shown]):
            z[rank][slot] = probs[rank]
            text[rank][slot] = cell_label(texts, token) + _transition_line(unary[rank], edges[rank], scores_key)
            hover[rank][slot] = [_cell_hover(texts, token, rank, unary[rank], edges[rank], probs[rank], scores_key)]
        if grid.more_row is not None:
            rest = sum(probs[grid.shown :])
            z[grid.more_row][slot] = rest
            text[grid.more_row][slot] = f"+{len(row) - grid.shown} · {rest:.0%}"
            hover[grid.more_row][slot] = [f"{len(row) - grid.shown} lower-ranked candidates hold {rest:.1%}"]
    return z, text, hover


def _transition_line(unary: float | None, edge: float | None, scores_key: str) -> str:
    """The lower panel's second line: the transition term S - U the selector added to the unary."""
    if scores_key == "unary" or unary is None or edge is None:
        return ""
    return f"<br><span style='font-size:10px'>{edge - unary:+.2f}</span>"


def _score(value: float | None) -> str:
    return "-inf" if value is None else f"{value:.2f}"


def _cell_hover(texts: Mapping[int, str], token: int, rank: int, unary: float | None, edge: float | None,
                prob: float, scores_key: str) -> str:
    transition = "n/a" if unary is None or edge is None else f"{edge - unary:+.2f}"
    share = "unary share" if scores_key == "unary" else "selector share"
    return (f"{html.escape(repr(token_text(texts, token)))} (id {token}), rank {rank}<br>unary U={_score(unary)}, "
            f"edge S={_score(edge)}, transition S−U={transition}<br>{share} {prob:.1%}")


@dataclass(frozen=True)
class Panel:
    """One of the two grids: which lattice list shades it ("unary" or "scores"), the pixel height
    of a candidate row, and how far from a row's centre (in rows) the paths run, clear of the text."""

    row: int
    key: str
    row_px: int
    edge: float

    @property
    def refs(self) -> tuple[str, str]:
        return ("x", "y") if self.row == 1 else (f"x{self.row}", f"y{self.row}")


PANELS = (Panel(1, "unary", 30, 0.36), Panel(2, "scores", 46, 0.41))  # the lower one has two text lines


def _add_panel(fig: go.Figure, panel: Panel, lattice: Mapping[str, Any], grid: Grid, texts: Mapping[int, str]) -> None:
    z, text, hover = _panel_cells(lattice, grid, texts, panel.key)
    fig.add_heatmap(
        x=list(range(1, len(lattice["candidates"]) + 1)), y=list(range(len(z))), z=z, text=text, customdata=hover,
        texttemplate="%{text}", textfont=dict(size=12), coloraxis="coloraxis", xgap=2, ygap=2,
        hovertemplate="slot %{x}<br>%{customdata[0]}<extra></extra>", showlegend=False, row=panel.row, col=1,
    )


def _path_xy(ranks: Sequence[int], grid: Grid, offset: float) -> tuple[list[float], list[float]]:
    """A path drawn along one edge of each chosen cell (offset from the row centre, so the token
    text stays readable): from the anchor cell, across each slot's cell, diagonally between slots."""
    xs, ys = [0.4], [offset]
    for slot, rank in enumerate(ranks, start=1):
        y = grid.row_of(rank) + offset
        xs += [slot - 0.4, slot + 0.4]
        ys += [y, y]
    return xs, ys


def _add_paths(fig: go.Figure, panel: Panel, lattice: Mapping[str, Any], grid: Grid, status: Sequence[str]) -> None:
    """The argmax path along the top of each rank-0 cell (dashed), the walked path along the
    bottom of its chosen cells (solid) with one marker per slot coloured by what verification said."""
    legend = panel.row == 1
    ax, ay = _path_xy([0] * len(lattice["path"]), grid, -panel.edge)
    fig.add_scatter(x=ax, y=ay, mode="lines", line=dict(color=COLOURS["argmax"], width=3, dash="dash"),
                    name="independent argmaxes (rank 0)", legendgroup="argmax", showlegend=legend,
                    hoverinfo="skip", row=panel.row, col=1)
    wx, wy = _path_xy(lattice["path"], grid, panel.edge)
    fig.add_scatter(x=wx, y=wy, mode="lines", line=dict(color=COLOURS["walked"], width=3),
                    name="the selector's walk", legendgroup="walked", showlegend=legend,
                    hoverinfo="skip", row=panel.row, col=1)
    for state in STATUS_COLOURS:
        idx = [i for i, s in enumerate(status) if s == state]
        if idx:
            fig.add_scatter(x=[i + 1 for i in idx], y=[grid.row_of(lattice["path"][i]) + panel.edge for i in idx],
                            mode="markers", hoverinfo="skip",
                            marker=dict(color=STATUS_COLOURS[state], size=9, line=dict(color="white", width=1)),
                            name=f"walked token {state}", legendgroup=state, showlegend=legend, row=panel.row, col=1)


def _add_target(fig: go.Figure, panel: Panel, lattice: Mapping[str, Any], grid: Grid, target: Sequence[int],
                texts: Mapping[int, str]) -> None:
    """An orange frame around the target's token in every slot the trace knows it; a token not
    among the K is written into the "not in top-K" row."""
    ranks = target_ranks(lattice, target)
    xref, yref = panel.refs
    for slot, rank in enumerate(ranks, start=1):
        y = grid.row_of(rank)
        fig.add_shape(type="rect", x0=slot - 0.47, x1=slot + 0.47, y0=y - 0.47, y1=y + 0.47, xref=xref, yref=yref,
                      line=dict(color=COLOURS["target"], width=3), layer="above")
    outside = [(slot, token) for slot, (rank, token) in enumerate(zip(ranks, target), start=1) if rank is None]
    if outside:
        fig.add_scatter(x=[s for s, _ in outside], y=[grid.outside_row] * len(outside), mode="text",
                        text=[cell_label(texts, t) for _, t in outside], hoverinfo="skip", showlegend=False,
                        textfont=dict(color=COLOURS["target"], size=13), row=panel.row, col=1)
    if panel.row == 1:
        fig.add_scatter(x=[None], y=[None], mode="markers", name="the target's token (known slots)", row=1, col=1,
                        marker=dict(symbol="square-open", size=14, color=COLOURS["target"], line=dict(width=3)))


def _add_anchor(fig: go.Figure, panel: Panel, lattice: Mapping[str, Any], texts: Mapping[int, str]) -> None:
    """The last verified token, where both paths start (slot 0 of the block)."""
    xref, yref = panel.refs
    fig.add_shape(type="rect", x0=-0.47, x1=0.47, y0=-0.47, y1=0.47, xref=xref, yref=yref, layer="below",
                  fillcolor=COLOURS["anchor"], line=dict(width=0))
    fig.add_scatter(x=[0], y=[0], mode="text", text=[cell_label(texts, lattice["anchor"])], hoverinfo="skip",
                    showlegend=False, row=panel.row, col=1)


def _divergence(fig: go.Figure, comparison: Comparison) -> None:
    """A dotted line before the slot where the two paths part."""
    if comparison.parts is not None:
        fig.add_vline(x=comparison.parts + 0.5, line=dict(color=COLOURS["argmax"], width=2, dash="dot"))
        fig.add_scatter(x=[None], y=[None], mode="lines", name="where the paths part",
                        line=dict(color=COLOURS["argmax"], width=2, dash="dot"), row=1, col=1)


def walked_status(step: StepRecord, slots: int) -> list[str]:
    """Per walked slot: accepted, rejected (verified and refused) or unverified (below a refusal,
    or, in a tree step, past the part of the walk the tree held: its nodes went to other paths)."""
    lattice = step_lattice(step)
    walk = list((lattice or {}).get("path_tokens", step.tokens))[:slots]
    nodes = draft_tree(step).follow(walk)
    status = node_status(step)
    return [status[nodes[i]] if i < len(nodes) else "unverified" for i in range(slots)]


def no_lattice_reason(step: StepRecord) -> str:
    """Why a step has no lattice, in a sentence."""
    if step.phase == "prefill":
        why = "it is the prefill (the prompt's forward, no draft)"
    elif not step.tokens:
        why = "nothing was drafted (the draft gate skipped it, or no token was left to draft)"
    else:
        why = lookup_note(step) or "its draft came without a DFlash 2 lattice"
    return f"Step {step.step} has no lattice: {why}."


def _empty_figure(step: StepRecord) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=no_lattice_reason(step), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper",
                       font=dict(size=14))
    fig.update_layout(height=160, xaxis=dict(visible=False), yaxis=dict(visible=False), plot_bgcolor="white")
    return fig


def lattice_figure(step: StepRecord, texts: Mapping[int, str], depth: int = SHOWN_RANKS) -> go.Figure:
    """Two aligned grids over the step's drafted slots (x) and candidate ranks (y, by unary
    score): above, shaded by each candidate's share of the unary scores (what independent argmaxes
    read); below, by its share of the edge scores from the walked predecessor (what the selector
    read). Both carry the argmax path, the walked path and the target's token per known slot."""
    lattice = step_lattice(step)
    if lattice is None:
        return _empty_figure(step)
    comparison = compare(step)
    target = target_tokens(step)
    grid = grid_for(lattice, target, depth)
    n_rows = len(grid.labels())
    heights = [panel.row_px * n_rows for panel in PANELS]
    choice = "it draws each slot from softmax(S / T)" if comparison.sampled else "it takes each slot's darkest"
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=heights, vertical_spacing=80 / sum(heights),
                        subplot_titles=(
        "what independent argmaxes read: unary scores U (shade: share of the slot's K); they take rank 0",
        f"what the selector read: edge scores S = U + transition from the walked predecessor; {choice}"
        "<br><sup>shade: share of the slot's K · number: the transition S − U</sup>",
    ))
    status = walked_status(step, comparison.slots)
    for panel in PANELS:
        _add_panel(fig, panel, lattice, grid, texts)
        _add_anchor(fig, panel, lattice, texts)
        _add_paths(fig, panel, lattice, grid, status)
        _add_target(fig, panel, lattice, grid, target, texts)
    _divergence(fig, comparison)
    slots = comparison.slots
    fig.update_layout(
        title=dict(text=_figure_title(step, comparison), x=0.01, font=dict(size=15)),
        height=sum(heights) + 80 + 190, margin=dict(l=90, r=30, t=110, b=40),  # 80: between panels; 190: titles, legend
        coloraxis=dict(colorscale="Blues", cmin=0, cmax=1, colorbar=dict(title="share", tickformat=".0%", len=0.8)),
        legend=dict(orientation="h", y=-0.04, x=0, yanchor="top"), plot_bgcolor="white",
    )
    fig.update_xaxes(tickvals=list(range(slots + 1)), ticktext=["anchor"] + [f"slot {s}" for s in range(1, slots + 1)],
                     range=[-0.55, slots + 0.55], showgrid=False, zeroline=False)
    fig.update_yaxes(tickvals=list(range(n_rows)), ticktext=grid.labels(), autorange="reversed", showgrid=False,
                     zeroline=False)
    return fig


def _figure_title(step: StepRecord, c: Comparison) -> str:
    argmax = f"≥{c.argmax}" if c.argmax_bound else f"{c.argmax}"
    mode = "sampled walk" if c.sampled else "greedy walk"
    return (f"step {step.step} ({mode}): the walked path agreed with the target for {c.walked} of {c.slots} slots, "
            f"independent argmaxes would have agreed for {argmax}")


# ---- the text ------------------------------------------------------------------------------------


def _quote(texts: Mapping[int, str], token: int) -> str:
    """A token in running text, labelled as in the grid (whitespace visible, bytes by id)."""
    return f"<code>{cell_label(texts, token, width=24)}</code>"


def _walked_sentence(step: StepRecord, c: Comparison, texts: Mapping[int, str]) -> str:
    if c.walked == c.slots:
        bonus = ""
        if step.correction_kind == "bonus":
            bonus = f", and the target added {_quote(texts, step.correction)} after the block"
        return f"The selector's path agreed with the target for all {c.slots} slots{bonus}."
    lattice = step_lattice(step)
    drafted = lattice["path_tokens"][c.walked]
    took = target_tokens(step)[c.walked]  # the correction, or in a tree step a token another path drafted
    outside = "" if took in lattice["candidates"][c.walked] else (
        f", which is not among that slot's {len(lattice['candidates'][c.walked])} candidates")
    agreed = (f"agreed with the target for {c.walked} slot(s); at slot {c.walked + 1}"
              if c.walked else "missed at slot 1:")
    after = (" The target never saw the slots after that, so its tokens there are unknown." if c.walked + 1 >= c.known
             else " Another path of the step's tree went on from there (the Step inspector shows it).")
    return (f"The selector's path {agreed} it drafted {_quote(texts, drafted)} and the target produced "
            f"{_quote(texts, took)}{outside}.{after}")


def _slots(n: int) -> str:
    return "slot 1" if n == 1 else f"slots 1–{n}"


def _argmax_sentence(c: Comparison) -> str:
    if c.argmax_bound:
        return (f"The independent-argmax path would have agreed for at least {c.argmax} slot(s): it matches every "
                f"target token the trace knows ({_slots(c.known)}); the target's token at slot {c.known + 1} after "
                f"the argmax prefix was never computed.")
    return f"The independent-argmax path would have agreed for exactly {c.argmax} slot(s)."


def _verdict_sentence(c: Comparison) -> str:
    if c.parts is None:
        return "Both paths are the same this step: the selector kept every slot's top unary candidate."
    where = f"The paths part at slot {c.parts + 1}"
    if not c.mattered:
        return f"{where}, after the walked path's first rejection: no difference to this step."
    said = {"walked": "the selector's path went further", "argmax": "the argmax path would have gone further",
            "tie": "both paths stop at the same slot"}[c.winner]
    return f"{where}, inside what the target verified: {said}."


CELL = "border:1px solid #ddd;padding:2px 8px;text-align:center"
STATUS_TINTS = {"accepted": "#d7f0dc", "rejected": "#f8d7d6", "unverified": "#f0f0f0"}  # light STATUS_COLOURS


def _slot_table(step: StepRecord, texts: Mapping[int, str]) -> str:
    """Slots as columns, rows: walked token (rank), argmax token, the target's token or "?"."""
    lattice = step_lattice(step)
    target = target_tokens(step)
    status = walked_status(step, len(lattice["candidates"]))
    head = "".join(f'<th style="{CELL}">{s}</th>' for s in range(1, len(status) + 1))
    walked = "".join(
        f'<td class="walked-{st}" title="{st}" style="{CELL};background:{STATUS_TINTS[st]}">'
        f"{_quote(texts, t)} <small>rank {r}</small></td>"
        for t, r, st in zip(lattice["path_tokens"], lattice["path"], status))
    argmax = "".join(f'<td style="{CELL}">{_quote(texts, t)}</td>' for t in lattice["argmax_tokens"])
    known = "".join(f'<td style="{CELL}">{_quote(texts, t)}</td>' for t in target)
    unknown = f'<td style="{CELL};color:#999" title="never computed by the target">?</td>' * (len(status) - len(target))
    return (f'<table class="lattice-slots" style="border-collapse:collapse"><tr><th>slot</th>{head}</tr>'
            f"<tr><th>walked</th>{walked}</tr><tr><th>argmax</th>{argmax}</tr>"
            f"<tr><th>target</th>{known}{unknown}</tr></table>")


def lattice_summary_html(step: StepRecord, texts: Mapping[int, str]) -> str:
    """The step in sentences (how far each path agreed with the target, what is and is not known)
    and a slot-by-slot table of the walked, argmax and target tokens."""
    c = compare(step)
    if c is None:
        return f"<p>{no_lattice_reason(step)}</p>"
    lattice = step_lattice(step)
    gate = step.extras.get("gate")
    gated = f", draft gate {html.escape(str(gate['state']))}" if gate else ""
    caveat = ("<li>Sampled run: slots are drawn, so agreement counts matches with the target's sampled tokens, "
              "not what verifying the argmax path would have accepted.</li>") if c.sampled else ""
    return (
        f'<div class="lattice-summary"><p>Step {step.step}: {c.slots} slots drafted from the anchor '
        f"{_quote(texts, lattice['anchor'])} (block {lattice['block_size']}, top-{lattice['top_k']} candidates per "
        f"slot{gated}).</p>"
        f"<ul><li>{_walked_sentence(step, c, texts)}</li><li>{_argmax_sentence(c)}</li>"
        f"<li>{_verdict_sentence(c)}</li>{caveat}</ul>{_slot_table(step, texts)}</div>"
    )


def lattice_run_summary(steps: Sequence[StepRecord]) -> str:
    """Markdown over every step with a lattice: the mean agreed run of each path (the argmax one
    a lower bound wherever any step's is), how often the paths differ, and which went further."""
    found = [c for c in map(compare, steps) if c is not None]
    if not found:
        return ""
    n = len(found)
    sampled = any(c.sampled for c in found)
    walked = sum(c.walked for c in found) / n
    argmax = sum(c.argmax for c in found) / n
    bound = sum(c.argmax_bound for c in found)
    differ = sum(c.parts is not None for c in found)
    mattered = [c for c in found if c.mattered]
    wins = {w: sum(c.winner == w for c in mattered) for w in ("walked", "argmax", "tie")}
    argmax_text = (f"exactly **{argmax:.2f}**" if not bound else
                   f"at least **{argmax:.2f}** (exact on {n - bound} steps; on {bound} it matched every target token "
                   f"the trace knows, so only a lower bound is known there)")
    trees = [s for s in steps if step_lattice(s) and leaf_count(s.parents) > 1]  # greedy runs only
    if trees:  # the walk is one path of a tree: what verifying it alone would have accepted, at T = 0
        accepted = sum(len(s.accepted) for s in steps if step_lattice(s)) / n
        head = (f"Draft tokens agreeing with the target per step, what verifying each path alone would have "
                f"accepted: the selector's walked path **{walked:.2f}**; the independent-argmax path {argmax_text}. "
                f"{len(trees)} of the steps verified a tree of the lattice's most probable paths instead (the walk "
                f"among them where the tree held it), accepting **{accepted:.2f}** draft tokens per step.")
    elif sampled:
        head = (f"Draft tokens agreeing with the target per step: the selector's walked path **{walked:.2f}** (its "
                f"accepted tokens); the independent-argmax path {argmax_text}. Sampled run: the argmax figure counts "
                f"matches with the target's sampled tokens, not what verifying that path would have accepted.")
    else:
        head = (f"Accepted draft tokens per step: the selector's walked path **{walked:.2f}**; the independent-argmax "
                f"path would have had {argmax_text}.")
    return (
        f"**DFlash 2 lattice, {n} drafted steps.** {head}\n\n"
        f"The two paths differ in {differ} of {n} steps. Of the {len(mattered)} where "
        f"they differ at or before the walked path's first rejection, the walked path went further in "
        f"{wins['walked']}, the argmax path in {wins['argmax']}, and they tied in {wins['tie']}; in the other "
        f"{differ - len(mattered)} they part only after it, where the target had already stopped."
        + lookup_share(steps, "lattice")
    )
