"""Records -> the Compare panel: several methods on one prompt, side by side, honestly labelled.

Speed numbers mean nothing without the machine they came from, so every figure's title names
the device of the runs (RunRecord.device) and CPU runs say they are not representative.
`speedup` is decode tokens/s over plain decoding's (ar) in the same comparison, measured back
to back on the same machine; `identical to ar` checks the output token for token. Pure.
"""

from __future__ import annotations

from typing import Any, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specflash.trace import RunRecord

COLUMNS = ["method", "device", "new tokens", "tokens/s", "mean acceptance length", "draft acceptance rate",
           "speedup vs ar", "verified per committed", "identical to ar"]


def device_label(runs: Sequence[RunRecord]) -> str:
    """'measured on cpu (CPU: not representative)' or the list of devices when they differ."""
    devices = sorted({r.device for r in runs})
    label = "measured on " + ", ".join(devices) if devices else "no runs"
    if devices and all(d.startswith("cpu") for d in devices):
        label += " (CPU: not representative of GPU speed)"
    return label


def _baseline(runs: Sequence[RunRecord]) -> RunRecord | None:
    return next((r for r in runs if r.method == "ar"), None)


def speedup(run: RunRecord, base: RunRecord | None) -> float | None:
    if base is None or not base.metrics.get("tokens_per_s"):
        return None
    return run.metrics["tokens_per_s"] / base.metrics["tokens_per_s"]


PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")


def method_colours(runs: Sequence[RunRecord]) -> dict[str, str]:
    """One colour per method, the same in every chart of the panel (and so in its legend)."""
    names = list(dict.fromkeys(r.method for r in runs))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _sampled(run: RunRecord) -> bool:
    return float(run.sampling.get("temperature", 0.0)) > 0


def identical_label(run: RunRecord, base: RunRecord | None) -> str:
    """Whether the output equals ar's, token for token; above T = 0 that is not the claim (the
    methods match the target in distribution, which the tests check), so it says so instead."""
    if base is None:
        return ""
    if _sampled(run) or _sampled(base):
        return "sampled: equal in distribution, not token for token"
    return "yes" if run.output_ids == base.output_ids else "no"


def _measured(run: RunRecord, value: float, digits: int) -> float | str:
    """A per-step figure, or "n/a" for a run with no decode step (one token, all from the prefill)."""
    return round(value, digits) if run.metrics.get("decode_steps") else "n/a"


def compare_rows(runs: Sequence[RunRecord]) -> list[list[Any]]:
    """One table row per run, in COLUMNS order."""
    base = _baseline(runs)
    rows = []
    for run in runs:
        m = run.metrics
        s = speedup(run, base)
        rows.append([
            run.method, run.device, m["new_tokens"], _measured(run, m["tokens_per_s"], 1),
            _measured(run, m["mean_acceptance_length"], 2), _measured(run, m["draft_acceptance_rate"], 2),
            "n/a" if s is None else round(s, 2), _measured(run, m["verified_per_committed"], 2),
            identical_label(run, base),
        ])
    return rows


def compare_figure(runs: Sequence[RunRecord]) -> go.Figure:
    """Four bar charts: tokens/s, mean acceptance length, speedup vs ar, verified per committed."""
    base = _baseline(runs)
    names = [r.method for r in runs]
    panels = (
        ("tokens/s (decode)", [r.metrics["tokens_per_s"] for r in runs]),
        ("mean acceptance length", [r.metrics["mean_acceptance_length"] for r in runs]),
        ("speedup vs ar", [speedup(r, base) or 0.0 for r in runs]),
        ("verified per committed", [r.metrics["verified_per_committed"] for r in runs]),
    )
    colours = method_colours(runs)
    fig = make_subplots(rows=2, cols=2, subplot_titles=[title for title, _ in panels])
    for i, (title, values) in enumerate(panels):
        fig.add_bar(x=names, y=values, name=title, showlegend=False, text=[f"{v:.2f}" for v in values],
                    marker_color=[colours[n] for n in names], textposition="auto", row=i // 2 + 1, col=i % 2 + 1)
    fig.add_hline(y=1.0, line_dash="dash", line_color="#555", annotation_text="ar = 1.0", row=2, col=1)
    fig.update_layout(title=f"Methods compared: {device_label(runs)}", height=560, margin=dict(l=40, r=20, t=80, b=40))
    return fig


def acceptance_figure(runs: Sequence[RunRecord]) -> go.Figure:
    """Per-position acceptance rate and the acceptance-length histogram, one trace per method."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("per-position acceptance rate", "tokens committed per step"))
    colours = method_colours(runs)
    for run in runs:
        colour = colours[run.method]
        rates = run.metrics.get("per_position_acceptance", [])
        if rates:
            fig.add_scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers", name=run.method,
                            legendgroup=run.method, line_color=colour, row=1, col=1)
        hist = run.metrics.get("acceptance_histogram", {})
        fig.add_bar(x=[int(k) for k in hist], y=list(hist.values()), name=run.method, legendgroup=run.method,
                    marker_color=colour, showlegend=not rates, row=1, col=2)
    fig.update_layout(title=f"Acceptance: {device_label(runs)}", barmode="group", height=400,
                      margin=dict(l=40, r=20, t=80, b=40))
    fig.update_xaxes(title_text="draft position", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="tokens committed", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    return fig
