"""Records -> the DeLS tab: per drafted position, how DeLS's three logit sources chose the token,
whether the short expert overrode the long one, and whether the target then accepted it.

DeLS (specflash/drafters/dels.py) drafts x_k = argmax(long[k] + alpha * short - beta * log_prior).
`extras["dels"]` holds, per drafted position: each source's contribution to the drafted token
(`long`, `short`, `prior`, already scaled and signed, so they add up to the fused logit);
`flipped`, true when the fused argmax differs from the long expert's own argmax (the short
expert and the prior together overrode it); and `alternatives`, the fused top 3 with the same
three contributions each, the drafted token first. A step that verified a tree records these
for its fused chain (`chain`: the root's likeliest child, then that node's, as far as the tree
expanded it), and each position takes the verdict of the node that holds it. Logits only matter
relative to each other, so the step view compares the drafted token with its runner-up, source
by source. Pure: plotly figures and HTML strings.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from specflash.trace import RunRecord, StepRecord

from .views import (STATUS_COLOURS, draft_tree, gate_idle_share, leaf_count, lookup_note, lookup_share, node_status,
                    token_text)

SOURCES = (("long", "long expert (DFlash, whole context)", "#3366cc"),
           ("short", "short expert (local head, recent tokens)", "#ff9900"),
           ("prior", "prior (minus token frequency)", "#999999"))
VERDICT_MARKS = {"accepted": "✓ accepted", "rejected": "✗ rejected", "unverified": "· not checked"}
FLIP_BAND = "rgba(230, 25, 75, 0.10)"
WHAT_IT_SHOWS = (
    "This tab shows, for each token DeLS drafted, how its three logit sources (the long-context "
    "DFlash expert, the short local expert and the frequency prior) voted for it against its "
    "runner-up, where the short expert overrode the long expert's pick (a flip), and whether the "
    "target accepted the token; plus how often flips happen and how often flipped tokens are "
    "accepted, by block position, over the whole run."
)


@dataclass(frozen=True)
class Candidate:
    """One token DeLS scored at a position, with each source's contribution to its fused logit."""

    token: int
    long: float
    short: float
    prior: float

    @property
    def fused(self) -> float:
        return self.long + self.short + self.prior


@dataclass(frozen=True)
class Position:
    """One drafted position: the drafted token, its fused runner-up (None when not recorded),
    whether the long expert was overridden, and the target's verdict on it."""

    index: int
    drafted: Candidate
    runner_up: Candidate | None
    long_favourite: Candidate | None  # a recorded rival the long expert ranks above the drafted token
    flipped: bool
    status: str  # accepted / rejected / unverified (views.node_status)


@dataclass(frozen=True)
class PositionRates:
    """Counts over a run at one block position (None = all positions together)."""

    position: int | None
    drafted: int
    flips: int
    flipped_accepted: int
    flipped_verified: int
    kept_accepted: int
    kept_verified: int


def has_dels(steps: Sequence[StepRecord]) -> bool:
    return any(s.extras.get("dels") for s in steps)


def _candidate(entry: Mapping[str, Any]) -> Candidate:
    return Candidate(int(entry["token"]), float(entry["long"]), float(entry["short"]), float(entry["prior"]))


def step_positions(step: StepRecord) -> list[Position]:
    """The step's drafted positions with their DeLS record ([] when the step has none)."""
    dels = step.extras.get("dels")
    if not dels:
        return []
    status = node_status(step)
    alternatives = dels.get("alternatives") or [[] for _ in dels["long"]]
    chain = dels.get("chain", step.tokens)[: len(dels["long"])]
    # a tree step holds the fused chain's first positions as a path; the rest gave way to siblings
    nodes = draft_tree(step).follow(list(chain))
    out = []
    for i, token in enumerate(chain):
        drafted = Candidate(token, dels["long"][i], dels["short"][i], dels["prior"][i])
        rivals = [_candidate(a) for a in alternatives[i] if a["token"] != token]
        above = [c for c in rivals if c.long > drafted.long]
        out.append(Position(i, drafted, rivals[0] if rivals else None, max(above, key=lambda c: c.long, default=None),
                            bool(dels["flipped"][i]), status[nodes[i]] if i < len(nodes) else "unverified"))
    return out


def _quoted(texts: Mapping[int, str], token: int) -> str:
    """A token's text quoted for both the HTML tables and plotly's labels (which show &quot; as is)."""
    return html.escape(repr(token_text(texts, token))).replace("&quot;", "&#34;")


def _verdict(p: Position, step: StepRecord, texts: Mapping[int, str]) -> str:
    """The target's verdict; at a rejection, also the token it put there instead (often the
    long expert's pick after a flip, which is the lesson of the view)."""
    took = step.committed[p.index] if p.index < len(step.committed) else step.correction
    instead = f", target took {_quoted(texts, took)}" if p.status == "rejected" else ""
    return VERDICT_MARKS[p.status] + instead


def _row_label(p: Position, step: StepRecord, texts: Mapping[int, str]) -> str:
    """Y tick text of a position: index, drafted vs runner-up, the target's verdict, the flip."""
    rival = f" over {_quoted(texts, p.runner_up.token)}" if p.runner_up else " (no runner-up recorded)"
    verdict = f'<span style="color:{STATUS_COLOURS[p.status]}">{_verdict(p, step, texts)}</span>'
    flip = ' <b style="color:#e6194b">⚑ flip</b>' if p.flipped else ""
    return f"<b>{p.index}</b> {_quoted(texts, p.drafted.token)}{rival}<br>{verdict}{flip}"


def _advantage_trace(key: str, name: str, colour: str, positions: list[Position], labels: list[str]) -> go.Bar:
    """One source's advantage (drafted minus runner-up) per position; customdata keeps both raw
    contributions so the hover (and a reader of the figure) sees what was subtracted."""
    pairs = [(getattr(p.drafted, key), getattr(p.runner_up, key) if p.runner_up else None) for p in positions]
    return go.Bar(
        y=labels, x=[d - r if r is not None else None for d, r in pairs], orientation="h", name=name,
        marker_color=colour, customdata=[list(pair) for pair in pairs],
        hovertemplate=(f"{name}<br>drafted %{{customdata[0]:.2f}} − runner-up %{{customdata[1]:.2f}}"
                       " = %{x:+.2f}<extra></extra>"),
    )


def _step_summary(step: StepRecord, positions: list[Position]) -> str:
    """One sentence: how many tokens were drafted, flipped, accepted."""
    if not positions:
        why = lookup_note(step) or "prefill, or the draft gate skipped drafting"
        return f"step {step.step}: no DeLS draft this step ({why})"
    flips = [p.index for p in positions if p.flipped]
    flipped = f"flipped at position{'s' if len(flips) > 1 else ''} {', '.join(map(str, flips))}" if flips else "no flip"
    leaves = leaf_count(step.parents)
    tree = (f" (the fused chain; the step verified a tree of {len(step.tokens)} nodes on {leaves} branches)"
            if leaves > 1 else "")
    return (f"step {step.step}: {len(positions)} drafted{tree}, short expert {flipped}; "
            f"target accepted {sum(p.status == 'accepted' for p in positions)}")


def dels_step_figure(step: StepRecord, texts: Mapping[int, str]) -> go.Figure:
    """Per drafted position, how much each source favoured the drafted token over its runner-up
    (right of 0: for the drafted token); the fused margin is their sum. Flipped rows are shaded
    and each row carries the target's verdict, so a reader sees whether overriding paid off."""
    positions = step_positions(step)
    labels = [_row_label(p, step, texts) for p in positions]
    fig = go.Figure([_advantage_trace(key, name, colour, positions, labels) for key, name, colour in SOURCES])
    fig.add_scatter(
        y=labels, x=[p.drafted.fused - p.runner_up.fused if p.runner_up else None for p in positions], mode="markers",
        name="fused margin (sum)", marker=dict(symbol="diamond", size=11, color="black"),
        hovertemplate="fused: drafted wins by %{x:.2f}<extra></extra>",
    )
    for p in positions:
        if p.flipped:
            fig.add_hrect(y0=p.index - 0.5, y1=p.index + 0.5, fillcolor=FLIP_BAND, line_width=0, layer="below")
    fig.update_layout(
        title=dict(text=f"DeLS {_step_summary(step, positions)}<br><sup>bars: how much each source favoured the "
                        "drafted token over its runner-up (logit difference; right of 0 = for the drafted token)</sup>"),
        template="plotly_white", barmode="group", height=170 + 62 * max(len(positions), 1), bargap=0.25,
        yaxis=dict(autorange="reversed", type="category", automargin=True),
        xaxis=dict(title="logit advantage of the drafted token over the runner-up", zeroline=True,
                   zerolinecolor="#444", zerolinewidth=2),
        legend=dict(orientation="h", yanchor="bottom", y=1.0, x=0),
        margin=dict(l=20, r=20, t=110, b=50),
    )
    return fig


def _contributions(c: Candidate | None, texts: Mapping[int, str]) -> str:
    if c is None:
        return '<td colspan="5" style="color:#888">not recorded</td>'
    return (f'<td><code style="white-space:pre">{_quoted(texts, c.token)}</code></td>'
            + "".join(f"<td>{getattr(c, key):.2f}</td>" for key, _, _ in SOURCES) + f"<td><b>{c.fused:.2f}</b></td>")


def _flip_note(p: Position, texts: Mapping[int, str]) -> str:
    if not p.flipped:
        return ""
    if p.long_favourite is None:
        return "long expert's own pick is outside the recorded top 3"
    return f"long expert ranked <code>{_quoted(texts, p.long_favourite.token)}</code> above it"


def _step_row(p: Position, step: StepRecord, texts: Mapping[int, str]) -> str:
    shade = f' style="background:{FLIP_BAND}"' if p.flipped else ""
    return (f'<tr class="dels-{p.status}{" dels-flip" if p.flipped else ""}"{shade}><td>{p.index}</td>'
            f'<td style="color:{STATUS_COLOURS[p.status]};font-weight:600">{_verdict(p, step, texts)}</td>'
            f"{_contributions(p.drafted, texts)}{_contributions(p.runner_up, texts)}"
            f'<td>{"⚑ " if p.flipped else ""}{_flip_note(p, texts)}</td></tr>')


def dels_step_html(step: StepRecord, texts: Mapping[int, str]) -> str:
    """The step's raw numbers: per position, each source's logit for the drafted token and the
    runner-up, the flip (and whom the long expert preferred) and the target's verdict."""
    positions = step_positions(step)
    if not positions:
        return f"<p>Step {step.step} has no DeLS record (no draft this step).</p>"
    parts = "".join(f"<th>{name.split(' (')[0]}</th>" for _, name, _ in SOURCES)
    head = (f'<tr><th rowspan="2">pos</th><th rowspan="2">target</th><th colspan="5">drafted token</th>'
            f'<th colspan="5">runner-up</th><th rowspan="2">flip</th></tr>'
            f"<tr><th>token</th>{parts}<th>fused</th><th>token</th>{parts}<th>fused</th></tr>")
    rows = "".join(_step_row(p, step, texts) for p in positions)
    return (f'<div class="dels-step"><p>DeLS {_step_summary(step, positions)}. Contributions add up to the fused logit; '
            f"a flip means the short expert and the prior together overrode the long expert's top token.</p>"
            f'<table class="dels-table" style="font-size:0.9em">{head}{rows}</table></div>')


def _rates(position: int | None, group: list[Position]) -> PositionRates:
    flipped = [p for p in group if p.flipped]
    kept = [p for p in group if not p.flipped]

    def accepted(ps: list[Position]) -> int:
        return sum(p.status == "accepted" for p in ps)

    def checked(ps: list[Position]) -> int:  # a token below a rejection was never checked
        return sum(p.status != "unverified" for p in ps)

    return PositionRates(position, len(group), len(flipped), accepted(flipped), checked(flipped),
                         accepted(kept), checked(kept))


def position_rates(steps: Sequence[StepRecord]) -> list[PositionRates]:
    """Per block position, then all positions together: drafted tokens, flips, and accepted /
    verified split by flipped or not. Verified = accepted or rejected: a token below a rejection
    was never checked by the target, so it counts in neither acceptance rate."""
    positions = [p for step in steps for p in step_positions(step)]
    by_index = sorted({p.index for p in positions})
    return [_rates(i, [p for p in positions if p.index == i]) for i in by_index] + [_rates(None, positions)]


def _rate(part: int, whole: int, colour: str) -> str:
    """`part/whole (pct)` with a small bar, or a dash when there is nothing to divide by."""
    if not whole:
        return '<td style="color:#888">–</td>'
    pct = 100 * part / whole
    bar = f'<div style="background:{colour};height:5px;width:{pct:.0f}%;min-width:1px"></div>'
    return f"<td>{part}/{whole} ({pct:.0f}%){bar}</td>"


def _rates_row(r: PositionRates) -> str:
    total = ' style="font-weight:600;border-top:2px solid #888"' if r.position is None else ""
    accepted = STATUS_COLOURS["accepted"]
    return (f'<tr{total}><td>{"all" if r.position is None else r.position}</td><td>{r.drafted}</td>'
            f'{_rate(r.flips, r.drafted, "#e6194b")}{_rate(r.flipped_accepted, r.flipped_verified, accepted)}'
            f"{_rate(r.kept_accepted, r.kept_verified, accepted)}</tr>")


def _share(part: int, whole: int, label: str) -> str:
    if not whole:
        return f"none of the {label} (none was checked)"
    return f"{part}/{whole} ({100 * part / whole:.0f}%) of the {label}"


def dels_headline(total: PositionRates) -> str:
    """The run in one sentence: how often the short expert flipped, and whether flips paid."""
    return (f"The short expert flipped {_share(total.flips, total.drafted, 'drafted tokens')}. Of the tokens the "
            f"target checked, it accepted {_share(total.flipped_accepted, total.flipped_verified, 'flipped ones')} "
            f"and {_share(total.kept_accepted, total.kept_verified, 'others')}.")


def dels_summary_html(steps: Sequence[StepRecord]) -> str:
    """The run's flip and acceptance rates by block position, with the definitions spelled out."""
    rates = position_rates(steps)
    head = ("<tr><th>block position</th><th>drafted</th><th>short expert flipped the pick</th>"
            "<th>accepted when flipped</th><th>accepted when not flipped</th></tr>")
    rows = "".join(_rates_row(r) for r in rates)
    return (
        f'<div class="dels-summary"><p><b>Over the whole run.</b> {dels_headline(rates[-1])}</p>'
        '<p style="font-size:0.9em;color:#555">Block position 0 is the first drafted token of a step. A <i>flip</i>: '
        "the short expert and the prior overrode the long expert's top token. <i>Accepted</i> counts only tokens the "
        "target checked (accepted or rejected); tokens below a rejection were never checked and are left out.</p>"
        f'<table class="dels-rates">{head}{rows}</table></div>'
    )


def dels_note(run: RunRecord | None) -> str:
    """What the tab says above its panels: with no DeLS run, what it will show and which method
    fills it; with one, the fusion weights it ran with."""
    if run is None:
        return f"**No run yet.** {WHAT_IT_SHOWS} Generate with method `dels` (or import a DeLS run) to fill it."
    if not has_dels(run.steps):
        return (f"**This run (method `{run.method}`) has no DeLS record.** {WHAT_IT_SHOWS} "
                "Generate with method `dels` (or import a DeLS run) to fill it.")
    alpha, beta = run.config.get("alpha", "α"), run.config.get("beta", "β")
    return (f"DeLS drafted each token as argmax(long + {alpha}·short − {beta}·log prior). "
            "Pick a step below to see, per drafted position, which source won it and what the target said."
            + lookup_share(run.steps, "DeLS record") + gate_idle_share(run.steps))
