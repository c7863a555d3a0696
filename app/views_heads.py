"""Records -> the DeLS and AdaFlash panels: what the extra heads decided, token by token.

DeLS mixes a long-context expert, a short (local) expert and a prior into the drafter's logits;
`extras["dels"]` holds each one's logit of the chosen token per drafted position and whether
the short expert flipped the argmax. AdaFlash's length head scores each draft and cuts it to a
verify length; `extras["adaflash"]` holds the score, the length, the cut tokens and the rule.
These views lay those next to what the target then accepted. Pure: plotly figures and HTML.
"""

from __future__ import annotations

import html
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

from specflash.trace import StepRecord

from .views import ORIGINS, node_status, token_text

NO_DELS = "This run has no DeLS record (it was decoded with another method): run `dels` or import a DeLS run."
NO_ADAFLASH = "This run has no AdaFlash record (it was decoded with another method): run `adaflash` or import one."
PARTS = (("long", "long expert", "#3366cc"), ("short", "short expert", "#ff9900"), ("prior", "prior", "#999999"))


def _extras(step: StepRecord, key: str) -> Any:
    return step.extras.get(key) if step.extras else None


def has_extras(steps: Sequence[StepRecord], key: str) -> bool:
    return any(_extras(s, key) for s in steps)


def dels_rows(steps: Sequence[StepRecord], texts: Mapping[int, str]) -> list[dict[str, Any]]:
    """One row per drafted token that has a DeLS record: label, parts, flipped, status."""
    rows = []
    for step in steps:
        dels = _extras(step, "dels")
        if not dels:
            continue
        status = node_status(step)
        for i, token in enumerate(step.tokens[: len(dels["long"])]):
            rows.append({
                "label": f"s{step.step}·{i} {token_text(texts, token)!r}",
                "step": step.step, "position": i,
                **{key: dels[key][i] for key, _, _ in PARTS},
                "flipped": bool(dels["flipped"][i]),
                "status": status[i],
            })
    return rows


def dels_figure(steps: Sequence[StepRecord], texts: Mapping[int, str]) -> go.Figure:
    """Stacked bars of the long / short / prior logit of each drafted token, with accepted or
    rejected marked under each bar and the tokens whose argmax the short expert flipped starred."""
    rows = dels_rows(steps, texts)
    labels = [r["label"] for r in rows]
    fig = go.Figure()
    for key, name, colour in PARTS:
        fig.add_bar(x=labels, y=[r[key] for r in rows], name=name, marker_color=colour)
    totals = [sum(r[k] for k, _, _ in PARTS) for r in rows]
    top = max([abs(t) for t in totals] + [1.0])
    fig.add_scatter(
        x=labels, y=[-0.08 * top] * len(rows), mode="text", name="verdict", showlegend=False,
        text=["✓" if r["status"] == "accepted" else "✗" if r["status"] == "rejected" else "·" for r in rows],
        textfont=dict(color=[{"accepted": "#2e9e44", "rejected": "#d9534f"}.get(r["status"], "#999") for r in rows], size=16),
    )
    flipped = [i for i, r in enumerate(rows) if r["flipped"]]
    fig.add_scatter(
        x=[labels[i] for i in flipped], y=[totals[i] + 0.08 * top for i in flipped], mode="markers", name="short expert flipped the argmax",
        marker=dict(symbol="star", size=14, color="#e6194b"),
    )
    fig.update_layout(title="DeLS: logit of the chosen token by component (✓ accepted, ✗ rejected)", barmode="relative",
                      height=420, yaxis_title="logit contribution", margin=dict(l=40, r=20, t=50, b=100))
    return fig


def adaflash_rows(steps: Sequence[StepRecord]) -> list[dict[str, Any]]:
    """Per step with an AdaFlash record: score, predicted verify length, accepted length, rule."""
    rows = []
    for step in steps:
        ada = _extras(step, "adaflash")
        if ada:
            rows.append({"step": step.step, "score": ada["score"], "verify_len": ada["verify_len"],
                         "accepted_len": step.accepted_len, "cut": len(ada.get("cut_tokens", [])), "rule": ada.get("rule", ""),
                         "cut_would_accept": ada.get("cut_would_accept")})
    return rows


def adaflash_figure(steps: Sequence[StepRecord]) -> go.Figure:
    """Predicted verify length against the accepted length per step, the head's score alongside."""
    rows = adaflash_rows(steps)
    x = [r["step"] for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=[r["accepted_len"] for r in rows], name="accepted length", marker_color="#2e9e44")
    fig.add_scatter(x=x, y=[r["verify_len"] for r in rows], mode="lines+markers", name="predicted verify length",
                    line=dict(color="#3366cc"))
    if any(r["score"] is not None for r in rows):
        fig.add_scatter(x=x, y=[r["score"] for r in rows], mode="lines", name="length-head score r", yaxis="y2",
                        line=dict(color="#999", dash="dot"))
    if any(r["cut_would_accept"] is not None for r in rows):
        fig.add_bar(x=x, y=[r["cut_would_accept"] for r in rows], name="cut tokens greedy would accept (hindsight)",
                    marker_color="#f0ad4e")
    rules = sorted({r["rule"] for r in rows if r["rule"]})
    fig.update_layout(
        title="AdaFlash: predicted vs accepted length" + (f" (rule: {', '.join(rules)})" if rules else ""),
        xaxis_title="step", yaxis_title="tokens", height=380, margin=dict(l=40, r=40, t=50, b=40),
        yaxis2=dict(title="score", overlaying="y", side="right", showgrid=False),
    )
    return fig


def _chip(text: str, colour: str, css_class: str, extra: str = "") -> str:
    return (f'<span class="{css_class}" style="background:{colour};border-radius:3px;padding:1px 3px;'
            f'margin:0 2px;{extra}">{html.escape(text)}</span>')


def adaflash_cut_html(step: StepRecord, texts: Mapping[int, str]) -> str:
    """The step's draft as verified, a ✂ where the length head cut it, then the tokens it cut."""
    ada = _extras(step, "adaflash")
    if not ada:
        return f"<p>Step {step.step} has no AdaFlash record.</p>"
    colours = {"accepted": ORIGINS["accepted"][1], "rejected": ORIGINS["resample"][1], "unverified": "#eee"}
    kept = "".join(_chip(repr(token_text(texts, t)), colours[s], f"draft-{s}") for t, s in zip(step.tokens, node_status(step)))
    cut = "".join(_chip(repr(token_text(texts, t)), "#f4f4f4", "draft-cut", "text-decoration:line-through;color:#888")
                  for t in ada.get("cut_tokens", []))
    score = f'score r = {ada["score"]:.3f}, ' if ada.get("score") is not None else ""
    would = ada.get("cut_would_accept")
    hindsight = "" if would is None else f" Of the cut tokens, greedy verification would have accepted {would}."
    return (
        f'<div class="adaflash-cut"><p>Step {step.step}: {score}verify length '
        f'{ada["verify_len"]}, rule <code>{html.escape(str(ada.get("rule", "")))}</code>, accepted {step.accepted_len}.'
        f'{hindsight}</p>'
        f'<div style="font-family:monospace">{kept}<span class="cut-mark" style="font-size:1.3em;color:#d9534f">✂</span>{cut}</div></div>'
    )
