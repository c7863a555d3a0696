"""Records -> what the Run panel and the step inspector show: token spans, stats, per-step draft.

Pure functions over StepRecords / RunRecords plus a token-text map (id -> text, decoded once by
the runner with the target's tokenizer), so they are tested without a browser and render the
same for a live run and for one imported from JSON. No gradio import: HTML strings and plotly
figures only. Styles are inline so the HTML renders anywhere (Gradio, a notebook, a file).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Mapping, Sequence

import plotly.graph_objects as go

from specflash.trace import RunRecord, StepRecord

# origin kind -> (legend label, background colour)
ORIGINS: dict[str, tuple[str, str]] = {
    "accepted": ("accepted draft token", "#b7ebc0"),
    "resample": ("correction from the target (draft rejected)", "#ffd0a1"),
    "bonus": ("bonus from the target (whole draft accepted)", "#b9d4ff"),
    "target": ("target only (prefill / no draft)", "#ececec"),
}
STATUS_COLOURS = {"accepted": "#2e9e44", "rejected": "#d9534f", "unverified": "#9e9e9e"}


@dataclass(frozen=True)
class Token:
    """One committed token and where it came from."""

    id: int
    step: int
    origin: str  # a key of ORIGINS
    p: float | None
    q: float | None


def token_text(texts: Mapping[int, str], token: int) -> str:
    """The decoded text of a token id, or ⟨id⟩ when no tokenizer was at hand."""
    return texts.get(token, f"⟨{token}⟩")


def step_tokens(step: StepRecord) -> list[Token]:
    """The tokens a step committed, in order: accepted draft nodes, then the target's own token
    (committed may be shorter than that, cut at EOS or at the token limit)."""
    out = []
    for i, token in enumerate(step.committed):
        if i < len(step.accepted):
            node = step.accepted[i]
            q = step.q[node] if step.q is not None else None
            out.append(Token(token, step.step, "accepted", step.p[node], q))
        else:
            kind = step.correction_kind if step.correction_kind in ORIGINS else "target"
            out.append(Token(token, step.step, kind, step.correction_p, None))
    return out


def run_tokens(steps: Sequence[StepRecord]) -> list[Token]:
    return [t for step in steps for t in step_tokens(step)]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def token_span(token: Token, texts: Mapping[int, str]) -> str:
    """One token as a coloured span; its title says the step, the origin, p and q."""
    label, colour = ORIGINS[token.origin]
    title = f"step {token.step} · {label} · id {token.id} · p={_fmt(token.p)} q={_fmt(token.q)}"
    text = html.escape(token_text(texts, token.id))
    return (
        f'<span class="tok tok-{token.origin}" data-step="{token.step}" title="{html.escape(title)}" '
        f'style="background:{colour};border-radius:3px;padding:0 1px;margin:0 1px 0 0">{text}</span>'
    )


def legend_html() -> str:
    chips = "".join(
        f'<span style="background:{c};border-radius:3px;padding:1px 6px;margin-right:8px">{html.escape(l)}</span>'
        for l, c in ORIGINS.values()
    )
    return f'<div class="tok-legend" style="font-size:0.85em;margin-bottom:6px">{chips}</div>'


def output_html(steps: Sequence[StepRecord], texts: Mapping[int, str]) -> str:
    """The generated text, every token coloured by origin, with the legend above it."""
    spans = "".join(token_span(t, texts) for t in run_tokens(steps))
    body = spans or '<span style="color:#888">(no tokens yet)</span>'
    return (
        f'<div class="specflash-output">{legend_html()}'
        f'<div style="white-space:pre-wrap;font-family:monospace;line-height:1.7">{body}</div></div>'
    )


def stats_markdown(run: RunRecord) -> str:
    """The headline numbers of a run (vLLM metric names), with the device they were measured on."""
    m = run.metrics
    if not m:
        return ""

    def per_step(key: str, digits: int) -> str:  # a run whose only token came from the prefill has none
        return f"{m[key]:.{digits}f}" if m["decode_steps"] else "n/a (no decode step)"

    rows = [
        ("method", run.method), ("model", run.model), ("device", run.device),
        ("new tokens", m["new_tokens"]), ("target forwards (decode)", m["decode_steps"]),
        ("mean_acceptance_length", per_step("mean_acceptance_length", 2)),
        ("draft_acceptance_rate", per_step("draft_acceptance_rate", 2)),
        ("tokens_per_s (decode)", per_step("tokens_per_s", 1)),
        ("verified_per_committed", per_step("verified_per_committed", 2)),
        ("finish", run.finish_reason),
    ]
    gate = gate_summary(run.steps)
    if gate:
        rows.append(("draft gate", gate))
    return "| metric | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def node_status(step: StepRecord) -> list[str]:
    """Per draft node: accepted, rejected (verified and refused), or unverified (below a refusal)."""
    accepted = set(step.accepted)
    on_path = {-1} | accepted
    return [
        "accepted" if i in accepted else "rejected" if parent in on_path else "unverified"
        for i, parent in enumerate(step.parents)
    ]


def stop_summary(step: StepRecord, texts: Mapping[int, str]) -> str:
    """Where verification stopped and what the target added, in one sentence."""
    correction = html.escape(repr(token_text(texts, step.correction)))
    tail = f"the target added {correction} ({step.correction_kind}, p={step.correction_p:.3f})"
    if step.phase == "prefill":
        return f"Prefill over {step.context_len} prompt tokens: {tail}."
    gate = step.extras.get("gate")
    why = f"Draft gate {gate['state']}: {html.escape(gate['reason'])}. " if gate else ""
    if not step.tokens:
        return f"{why}No draft this step: {tail}."
    n, a = len(step.tokens), step.accepted_len
    if step.correction_kind == "bonus":
        return f"{why}All {a} drafted tokens on the path were accepted (of {n} drafted): {tail}."
    return f"{why}Verification stopped after {a} accepted token(s) of {n} drafted: {tail}."


def gate_summary(steps: Sequence[StepRecord]) -> str | None:
    """How many steps the draft gate drafted, skipped and probed (None when no gate ran)."""
    states = [s.extras["gate"]["state"] for s in steps if "gate" in s.extras]
    if not states:
        return None
    return f"on {states.count('on')}, off {states.count('off')}, probe {states.count('probe')} steps"


def step_table_html(step: StepRecord, texts: Mapping[int, str]) -> str:
    """The step's draft as a table: node, parent, token, q, p, min(1, p/q), status."""
    head = "<tr><th>node</th><th>parent</th><th>token</th><th>q (draft)</th><th>p (target)</th><th>min(1,p/q)</th><th>status</th></tr>"
    rows = []
    for i, (token, parent, status) in enumerate(zip(step.tokens, step.parents, node_status(step))):
        q = step.q[i] if step.q is not None else None
        ratio = "n/a" if not q else f"{min(1.0, step.p[i] / q):.3f}"
        colour = STATUS_COLOURS[status]
        rows.append(
            f'<tr class="node-{status}"><td>{i}</td><td>{"root" if parent < 0 else parent}</td>'
            f"<td><code>{html.escape(repr(token_text(texts, token)))}</code></td><td>{_fmt(q)}</td>"
            f'<td>{_fmt(step.p[i])}</td><td>{ratio}</td><td style="color:{colour};font-weight:600">{status}</td></tr>'
        )
    table = f'<table class="step-table">{head}{"".join(rows)}</table>' if rows else ""
    return f'<div class="step-inspector"><p>{stop_summary(step, texts)}</p>{table}</div>'


def step_figure(step: StepRecord, texts: Mapping[int, str]) -> go.Figure:
    """Per draft node, the target's p and the drafter's q of its token; bars coloured by status."""
    labels = [f"{i}: {token_text(texts, t)!r}" for i, t in enumerate(step.tokens)]
    status = node_status(step)
    fig = go.Figure()
    fig.add_bar(
        x=labels, y=step.p, name="p (target)", marker_color=[STATUS_COLOURS[s] for s in status],
        customdata=status, hovertemplate="%{x}<br>p=%{y:.3f}<br>%{customdata}<extra></extra>",
    )
    if step.q is not None:
        fig.add_bar(x=labels, y=step.q, name="q (draft)", marker_color="#7a5cc9", opacity=0.6)
    title = f"step {step.step}: " + ("no draft" if not step.tokens else f"{step.accepted_len}/{len(step.tokens)} accepted")
    fig.update_layout(title=title, barmode="group", yaxis=dict(title="probability", range=[0, 1.05]), height=340,
                      margin=dict(l=40, r=20, t=50, b=40), showlegend=True)
    return fig


def last_step(run: RunRecord | None) -> int:
    """The highest step index a slider over this run can take (0 for no run)."""
    return max(len(run.steps) - 1, 0) if run else 0
