"""Records -> what the Run panel and the step inspector show: token spans, stats, per-step draft.

Pure functions over StepRecords / RunRecords plus a token-text map (id -> text, decoded once by
the runner with the target's tokenizer), so they are tested without a browser and render the
same for a live run and for one imported from JSON. No gradio import: HTML strings and plotly
figures only (and TOKEN_CLICK_JS, the page script ui.py installs). Styles travel inside the
returned HTML so it renders anywhere (Gradio, a notebook, a file).
"""

from __future__ import annotations

import html
import textwrap
from dataclasses import dataclass
from typing import Mapping, Sequence

import plotly.graph_objects as go

from specflash.drafters.lookup_graft import GRAFTS, graft_spans
from specflash.trace import RunRecord, StepRecord
from specflash.tree import DraftTree

# origin kind -> (legend label, background colour); the labels for sampling (and for callers
# that do not say the temperature); GREEDY_LABELS replaces what differs at temperature 0.
ORIGINS: dict[str, tuple[str, str]] = {
    "accepted": ("accepted draft token", "#b7ebc0"),
    "resample": ("correction from the target (draft rejected)", "#ffd0a1"),
    "bonus": ("bonus from the target (whole draft accepted)", "#b9d4ff"),
    "target": ("target only (prefill / no draft)", "#ececec"),
}
GREEDY_LABELS = {"resample": "the target's argmax (draft rejected)"}
ORIGIN_EDGES = {"accepted": "#2e9e44", "resample": "#e07b00", "bonus": "#2f6fd6", "target": "#8c8c8c"}
STATUS_COLOURS = {"accepted": "#2e9e44", "rejected": "#d9534f", "unverified": "#9e9e9e"}
Q_COLOUR = "#7a5cc9"
GREEDY_RULE = "greedy: a draft token is accepted when it is the target's argmax"
SAMPLED_RULE = "sampling: a draft token is kept with probability min(1, p/q)"
POINT_MASS_RULE = "sampling, point-mass draft: the test takes q = 1, so a draft token is kept with probability p"

# Scoped to .sf-out and shipped inside output_html, so the view is the same in Gradio, a notebook
# and a saved file. Tokens carry no margin or padding (words stay whole); the hover card and the
# newline mark are pseudo-elements, so a span's text is exactly the token's decoded text.
TOKEN_CSS = (
    ".sf-out .sf-legend{font-size:0.85em;margin-bottom:6px;line-height:2}"
    ".sf-out .sf-chip{border-radius:3px;padding:1px 6px;margin-right:8px;color:#1f2328;white-space:nowrap}"
    ".sf-out .sf-hint{color:#777;line-height:1.4}"
    ".sf-out .sf-text{white-space:pre-wrap;overflow-wrap:anywhere;tab-size:4;line-height:1.7;"
    "font-family:ui-monospace,Menlo,Consolas,monospace}"
    ".sf-out .tok{position:relative;margin:0;padding:0;border-radius:0;color:#1f2328;cursor:pointer}"
    ".sf-out .tok:hover{outline:1px solid rgba(0,0,0,0.6);z-index:20}"
    ".sf-out .tok .nl::before{content:'\\21B5';color:rgba(0,0,0,0.35)}"
    ".sf-out .tok:hover::after{content:attr(data-card);position:absolute;left:0;top:calc(100% + 4px);z-index:1000;"
    "width:max-content;max-width:32em;white-space:pre-wrap;padding:6px 10px;background:#fff;color:#1f2328;"
    "font:12px/1.5 ui-monospace,Menlo,Consolas,monospace;text-align:left;border:1px solid #d0d7de;"
    "border-top:4px solid var(--sf-edge);border-radius:6px;box-shadow:0 4px 12px rgba(0,0,0,0.18);pointer-events:none}"
    # Where anchor positioning exists, the card is fixed to the viewport (no container clips it)
    # and flips left or above the token when it would run off the right or bottom edge.
    "@supports (position-try-fallbacks: flip-inline){.sf-out .tok:hover{anchor-name:--sf-tok}"
    ".sf-out .tok:hover::after{position:fixed;position-anchor:--sf-tok;left:anchor(left);top:anchor(bottom);"
    "margin-top:4px;position-try-fallbacks:flip-inline,flip-block,flip-block flip-inline}}"
    + "".join(f".sf-out .tok-{k}{{background:{ORIGINS[k][1]};--sf-edge:{ORIGIN_EDGES[k]}}}" for k in ORIGINS)
)

# Wired by ui.py as `demo.load(None, js=TOKEN_CLICK_JS)`: one listener on the document (so it
# survives every re-render of #output) that writes a clicked token's step into the hidden
# #token-step textbox and opens the Step inspector tab. In Gradio 6 a script-set value fires the
# textbox's `change` event (not `input`), which moves the step slider; the value carries a click
# counter ("STEP:N") so clicking the same token again is still a change.
TOKEN_CLICK_JS = """() => {
  if (window.specflashTokenClick) return;
  window.specflashTokenClick = true;
  let clicks = 0;
  document.addEventListener('click', (event) => {
    const tok = event.target.closest && event.target.closest('#output .tok[data-step]');
    const box = document.querySelector('#token-step textarea, #token-step input');
    if (!tok || !box) return;
    clicks += 1;
    box.value = tok.dataset.step + ':' + clicks;
    box.dispatchEvent(new Event('input', {bubbles: true}));
    const tab = [...document.querySelectorAll('button[role=tab]')].find(b => b.textContent.trim() === 'Step inspector');
    if (tab) tab.click();
  });
}"""


@dataclass(frozen=True)
class Token:
    """One committed token and where it came from."""

    id: int
    step: int
    origin: str  # a key of ORIGINS
    p: float | None
    q: float | None
    point_mass: bool = False  # verified as a point mass (q = 1), whatever q the trace shows


def is_point_mass(step: StepRecord) -> bool:
    """Whether the step's draft was verified with point-mass proposals (q = 1 in the test): drafts
    without q, and the DFlash family's argmax blocks (extras "dflash"), whose trace q is the
    drafter's own probability, kept for reference only (drafters/dflash.py)."""
    return step.q is None or "dflash" in step.extras


def is_greedy(temperature: float | None) -> bool:
    """Temperature 0 is greedy verification (an argmax match); None, a caller that does not say,
    keeps the sampling wording every view had before the temperature was passed in."""
    return temperature is not None and temperature <= 0


def origin_label(origin: str, temperature: float | None = None) -> str:
    """The human label of a token origin; at T = 0 a correction is the target's argmax, not a resample."""
    if is_greedy(temperature) and origin in GREEDY_LABELS:
        return GREEDY_LABELS[origin]
    return ORIGINS[origin][0]


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
            out.append(Token(token, step.step, "accepted", step.p[node], q, is_point_mass(step)))
        else:
            kind = step.correction_kind if step.correction_kind in ORIGINS else "target"
            out.append(Token(token, step.step, kind, step.correction_p, None))
    return out


def run_tokens(steps: Sequence[StepRecord]) -> list[Token]:
    return [t for step in steps for t in step_tokens(step)]


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def accept_probability(p: float, q: float | None, point_mass: bool) -> float | None:
    """min(1, p/q) with the q the sampled test used: 1 for a point mass; None when q is 0."""
    used = 1.0 if point_mass else q
    return min(1.0, p / used) if used else None


def acceptance_text(token: Token, temperature: float | None = None) -> str:
    """How the target's test treated the token: an argmax match at T = 0, else min(1, p/q), with
    q = 1 for a point-mass draft (the target's own tokens were never tested)."""
    if token.origin != "accepted" or token.p is None:
        return "n/a: the target's own token"
    if is_greedy(temperature):
        return "greedy: argmax match"
    ratio = _fmt(accept_probability(token.p, token.q, token.point_mass))
    return f"min(1, p/1) = {ratio} (point-mass draft)" if token.point_mass else f"min(1, p/q) = {ratio}"


def hover_card(token: Token, texts: Mapping[int, str], temperature: float | None = None) -> str:
    """The plain-text lines of a token's hover card: step, origin, the token, p, q, acceptance."""
    q = _fmt(token.q) if token.origin == "accepted" else "n/a: not drafted"
    return "\n".join([
        f"step {token.step} · {origin_label(token.origin, temperature)}",
        f"token       {token_text(texts, token.id)!r} (id {token.id})",
        f"p (target)  {_fmt(token.p)}",
        f"q (draft)   {q}",
        f"acceptance  {acceptance_text(token, temperature)}",
    ])


def _text_html(text: str) -> str:
    """Escaped token text with an empty marker before each newline, which the CSS draws as a
    faint ↵: a newline token is otherwise invisible, and the marker adds no text of its own."""
    return html.escape(text).replace("\n", '<span class="nl"></span>\n')


def token_span(token: Token, texts: Mapping[int, str], temperature: float | None = None) -> str:
    """One token as a span of its decoded text, coloured by origin (TOKEN_CSS); its hover card
    (data-card) says the step, the origin, p and q."""
    card = html.escape(hover_card(token, texts, temperature))
    return (
        f'<span class="tok tok-{token.origin}" data-step="{token.step}" data-card="{card}">'
        f"{_text_html(token_text(texts, token.id))}</span>"
    )


def legend_html(temperature: float | None = None) -> str:
    """The origin colours with their labels (argmax wording at T = 0) and how to use the view."""
    chips = " ".join(
        f'<span class="sf-chip" style="background:{colour}">{html.escape(origin_label(kind, temperature))}</span>'
        for kind, (_, colour) in ORIGINS.items()
    )
    hint = '<div class="sf-hint">hover a token for its step, p and q; in the app, click it to open its step</div>'
    return f'<div class="sf-legend">{chips}{hint}</div>'


def output_html(steps: Sequence[StepRecord], texts: Mapping[int, str], temperature: float | None = None,
                legend: bool = True) -> str:
    """The generated text as it reads, every token coloured by origin, with the legend above it
    (unless the caller shows one legend for several outputs) and the styles inside (pass the
    run's temperature so T = 0 says argmax, not resample)."""
    spans = "".join(token_span(t, texts, temperature) for t in run_tokens(steps))
    body = spans or '<span style="color:#888">(no tokens yet)</span>'
    return (
        f'<div class="sf-out specflash-output"><style>{TOKEN_CSS}</style>{legend_html(temperature) if legend else ""}'
        f'<div class="sf-text">{body}</div></div>'
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


def draft_tree(step: StepRecord) -> DraftTree:
    """The step's draft as the engine's tree, for its path operations."""
    return DraftTree(tuple(step.tokens), tuple(step.parents))


def leaf_count(parents: Sequence[int]) -> int:
    """How many paths a draft tree (its parent list) holds: 1 for a chain, 0 for no draft."""
    return len(set(range(len(parents))) - set(parents))


def node_status(step: StepRecord) -> list[str]:
    """Per draft node: accepted, rejected (verified and refused), or unverified (below a refusal)."""
    accepted = set(step.accepted)
    on_path = {-1} | accepted
    return [
        "accepted" if i in accepted else "rejected" if parent in on_path else "unverified"
        for i, parent in enumerate(step.parents)
    ]


def _correction_kind(kind: str, temperature: float | None) -> str:
    """A correction's kind as the stop summary words it: at T = 0 the target did not resample."""
    return "the target's argmax, draft rejected" if is_greedy(temperature) and kind == "resample" else kind


def stop_summary(step: StepRecord, texts: Mapping[int, str], temperature: float | None = None) -> str:
    """Where verification stopped and what the target added, in one sentence."""
    correction = html.escape(repr(token_text(texts, step.correction)))
    kind = _correction_kind(step.correction_kind, temperature)
    tail = f"the target added {correction} ({kind}, p={step.correction_p:.3f})"
    if step.phase == "prefill":
        return f"Prefill over {step.context_len} prompt tokens: {tail}."
    gate = step.extras.get("gate")
    why = f"Draft gate {gate['state']}: {html.escape(gate['reason'])}. " if gate else ""
    if not step.tokens:
        return f"{why}No draft this step: {tail}."
    n, a = len(step.tokens), step.accepted_len
    leaves = leaf_count(step.parents)
    drafted = f"{n} drafted" if leaves == 1 else f"{n} drafted on {leaves} branches of a tree (the parent column)"
    for key, first, last in graft_spans(step.extras, len(step.tokens)):
        nodes = f"node {first} is" if first == last else f"nodes {first}-{last} are"
        where = "occurred earlier" if key == "graft" else "occurred in the target's earlier answers"
        drafted += (f"; {nodes} {_GRAFT_SOURCES[key]}'s continuation (the last {step.extras[key]['ngram']} token(s) "
                    f"{where}), grafted onto the drafter's tree")
    if step.correction_kind == "bonus":
        return f"{why}All {a} drafted tokens on the path were accepted (of {drafted}): {tail}."
    return f"{why}Verification stopped after {a} accepted token(s) of {drafted}: {tail}."


_GRAFT_SOURCES = {"graft": "prompt lookup", "datastore": "the datastore"}  # by their extras keys (GRAFTS)


def gate_summary(steps: Sequence[StepRecord]) -> str | None:
    """How many steps the draft gate drafted, skipped and probed, and prompt lookup drafted
    instead or beside the drafter (None when no gate ran)."""
    states = [s.extras["gate"]["state"] for s in steps if "gate" in s.extras]
    if not states:
        return None
    lookup = f", prompt lookup {states.count('lookup')}" if "lookup" in states else ""
    grafted = [f"{_GRAFT_SOURCES[key]} in {count}" for key in GRAFTS if (count := sum(key in s.extras for s in steps))]
    graft = f" (grafted onto the drafter's tree: {', '.join(grafted)})" if grafted else ""
    return (f"on {states.count('on')}{graft}, off {states.count('off')}, probe {states.count('probe')}, "
            f"shadow {states.count('shadow')}{lookup} steps")


def lookup_share(steps: Sequence[StepRecord], record: str) -> str:
    """A sentence for a method's panel: how many of the run's decode steps prompt lookup drafted
    instead of the drafter, which therefore have no `record` of their own ("" when none did)."""
    decode = [s for s in steps if s.phase != "prefill"]
    looked_up = sum("lookup" in s.extras for s in decode)
    if not looked_up:
        return ""
    return (f" Prompt lookup drafted {looked_up} of the run's {len(decode)} decode steps instead of the drafter (the "
            "draft gate's choice; untick *prompt lookup beside the drafter* in the method knobs to see the drafter "
            f"alone): they have no {record} and are left out here.")


def gate_idle_share(steps: Sequence[StepRecord]) -> str:
    """A sentence for a method's panel: how many decode steps the draft gate sent to the target
    with no draft, and why, so empty steps in the plot are not read as a fault ("" when none)."""
    idle = [s.extras["gate"]["state"] for s in steps
            if s.phase != "prefill" and not s.tokens and s.extras.get("gate", {}).get("state") in ("off", "shadow")]
    if not idle:
        return ""
    off, shadows = idle.count("off"), idle.count("shadow")
    parts = [f"{off} with drafting off" if off else "", f"{shadows} shadow look{'s' if shadows != 1 else ''} "
             "(drafted, scored later, not verified)" if shadows else ""]
    return (f" {len(idle)} decode step{'s' if len(idle) != 1 else ''} verified no draft: the draft gate's choice "
            f"({', '.join(p for p in parts if p)}; the Step inspector gives its reason for each).")


def lookup_note(step: StepRecord) -> str | None:
    """Why a learned method's step has no record of its own drafter: prompt lookup drafted it
    (the method's `lookup` option); None when it did not."""
    lookup = step.extras.get("lookup")
    if not lookup:
        return None
    return (f"prompt lookup drafted this step instead of the drafter: the last {lookup['ngram']} token(s) occurred "
            f"earlier in the text, and the {len(lookup['tokens'])} that followed them were worth more")


def verification_rule(step: StepRecord, temperature: float) -> str:
    """The acceptance rule this step's draft was verified by, in words."""
    return GREEDY_RULE if is_greedy(temperature) else POINT_MASS_RULE if is_point_mass(step) else SAMPLED_RULE


def _q_note(step: StepRecord, temperature: float) -> str:
    """Says what a q column means when the test did not use it (point masses at T > 0)."""
    shown = step.q is not None and is_point_mass(step) and not is_greedy(temperature)
    return " (q is the drafter's own probability, shown for reference)" if shown else ""


def step_table_html(step: StepRecord, texts: Mapping[int, str], temperature: float | None = None) -> str:
    """The step's draft as a table: node, parent, token, q, p, min(1, p/q), status; at T = 0 the
    ratio column goes (greedy verification is an argmax match) and the rule is said instead."""
    greedy, point_mass = is_greedy(temperature), is_point_mass(step)
    columns = ["node", "parent", "token", "q (draft)", "p (target)"] + ([] if greedy else ["min(1,p/q)"]) + ["status"]
    head = "<tr>" + "".join(f"<th>{c}</th>" for c in columns) + "</tr>"
    rows = []
    spans = graft_spans(step.extras, len(step.tokens))
    source = {node: _GRAFT_SOURCES[key] for key, first, last in spans for node in range(first, last + 1)}
    for i, (token, parent, status) in enumerate(zip(step.tokens, step.parents, node_status(step))):
        q = step.q[i] if step.q is not None else None
        ratio = "" if greedy else f"<td>{_fmt(accept_probability(step.p[i], q, point_mass))}</td>"
        rows.append(
            f'<tr class="node-{status}"><td>{i}</td><td>{"root" if parent < 0 else parent}</td>'
            f"<td><code>{html.escape(repr(token_text(texts, token)))}</code></td>"
            f"<td>{source.get(i) or _fmt(q)}</td>"
            f"<td>{_fmt(step.p[i])}</td>{ratio}"
            f'<td style="color:{STATUS_COLOURS[status]};font-weight:600">{status}</td></tr>'
        )
    table = f'<table class="step-table">{head}{"".join(rows)}</table>' if rows else ""
    rule = ""
    if rows and temperature is not None:
        rule = f"<p><em>{verification_rule(step, temperature)}{_q_note(step, temperature)}.</em></p>"
    return f'<div class="step-inspector"><p>{stop_summary(step, texts, temperature)}</p>{rule}{table}</div>'


def no_draft_reason(step: StepRecord, texts: Mapping[int, str] | None = None) -> str:
    """Why a step verified no draft: the prefill, the draft gate's reason, or an empty proposal."""
    if step.phase == "prefill":
        return "the prefill (the prompt forward yields the first new token)"
    gate = step.extras.get("gate")
    if gate and gate["state"] == "off":
        return f"the draft gate was off ({gate['reason']})"
    if gate and gate["state"] == "shadow":
        known = "".join(token_text(texts or {}, t) for t in step.extras.get("shadow", []))
        return (f"the draft gate was off and drew a shadow draft {gate['width']} tokens deep, starting {known!r}, "
                "not verified: it is scored against the tokens the target commits next (each later token drafted "
                "only once the ones before it matched)")
    return "the drafter proposed nothing"


def _no_draft_figure(step: StepRecord, texts: Mapping[int, str]) -> go.Figure:
    """A step without a draft has no bars to draw: say so in words on blank, axis-less paper."""
    added = html.escape(repr(token_text(texts, step.correction)))
    fig = go.Figure()
    reason = "<br>".join(html.escape(line) for line in textwrap.wrap(no_draft_reason(step, texts), 110))
    fig.add_annotation(text=f"<b>no draft this step</b>:<br>{reason}<br>the target added {added} (p={step.correction_p:.3f})",
                       x=0.5, y=0.5, xref="paper", yref="paper", showarrow=False, font=dict(size=14, color="#444"))
    fig.update_layout(title=f"step {step.step}: no draft", xaxis=dict(visible=False), yaxis=dict(visible=False),
                      height=220, margin=dict(l=20, r=20, t=50, b=20), plot_bgcolor="white", showlegend=False)
    return fig


def step_figure(step: StepRecord, texts: Mapping[int, str], temperature: float | None = None) -> go.Figure:
    """Per draft node, the target's p and the drafter's q of its token. The p bars are one trace
    per status, so every legend swatch is the colour of the bars it names; the node labels take
    their status colour too, since a rejected node's p is often too small to see as a bar."""
    if not step.tokens:
        return _no_draft_figure(step, texts)
    labels = [f"{i}: {token_text(texts, t)!r}" for i, t in enumerate(step.tokens)]
    status = node_status(step)
    fig = go.Figure()
    for kind, colour in STATUS_COLOURS.items():
        nodes = [i for i, s in enumerate(status) if s == kind]
        if nodes:
            fig.add_bar(x=[labels[i] for i in nodes], y=[step.p[i] for i in nodes], name=f"p (target), {kind}",
                        marker_color=colour, offsetgroup="p",
                        hovertemplate=f"%{{x}}<br>p=%{{y:.3f}}<br>{kind}<extra></extra>")
    if step.q is not None:
        fig.add_bar(x=labels, y=step.q, name="q (draft)", marker_color=Q_COLOUR, opacity=0.6, offsetgroup="q",
                    hovertemplate="%{x}<br>q=%{y:.3f}<extra></extra>")
    title = f"step {step.step}: {step.accepted_len}/{len(step.tokens)} accepted"
    if temperature is not None:
        title += f"<br><sup>{verification_rule(step, temperature)}</sup>"
    fig.update_layout(title=title, barmode="group", yaxis=dict(title="probability", range=[0, 1.05]), height=340,
                      xaxis=dict(categoryorder="array", categoryarray=labels, tickvals=labels,
                                 ticktext=[f'<span style="color:{STATUS_COLOURS[s]}">{html.escape(l, quote=False)}</span>'
                                           for l, s in zip(labels, status)]),
                      margin=dict(l=40, r=20, t=60, b=40), showlegend=True)
    return fig


def clicked_step(value: str | float | None, run: RunRecord | None) -> int | None:
    """The step a click in the token view asks for: the hidden #token-step box holds
    "STEP:CLICK" (TOKEN_CLICK_JS); None when there is no run or the value is not a step."""
    head = str(value or "").split(":")[0].strip()
    if run is None or not run.steps or not head.isdigit():
        return None
    return min(int(head), len(run.steps) - 1)


def last_step(run: RunRecord | None) -> int:
    """The highest step index a slider over this run can take (0 for no run)."""
    return max(len(run.steps) - 1, 0) if run else 0
