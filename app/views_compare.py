"""Records -> the Compare panel: several methods on one prompt, repeated, side by side, honestly labelled.

Speed on a shared machine is noisy, and a single run per method once showed 4 tok/s on one tab
and 9.7 on another. So Compare runs every method `repeats` times, interleaved (ar, m1, m2, ar,
m1, m2, ...) so drifts in machine load hit every method alike, and shows medians with their
range. A speedup is paired: the method's decode tokens/s over ar's in the same repeat, then the
median over repeats. Times are the engine's own (prefill, then each step's draft and verify).

A CPU verifies k tokens at several times the cost of one, so speculation can lose there even
with good acceptance. Beside the measured speedup the panel shows a projection: the same steps
(same acceptance, same measured draft times) on a device where verifying a block costs one
plain step, as on a GPU at batch 1. It is labelled a projection everywhere it appears. Pure.
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specflash.trace import RunRecord

COLUMNS = ["method", "device", "new tokens", "tokens/s median (range)", "speedup vs ar median (range)",
           "projected speedup if verify = 1 step", "mean acceptance length", "draft acceptance rate",
           "verified per committed", "prefill ms", "wall ms (prefill + decode)", "identical to ar", "sampling"]
SPEEDUP, IDENTICAL = COLUMNS.index("speedup vs ar median (range)"), COLUMNS.index("identical to ar")
Groups = Mapping[str, Sequence[RunRecord]]  # method -> its runs, one per repeat, in repeat order


def device_label(runs: Sequence[RunRecord]) -> str:
    """'measured on cpu (CPU: not representative)' or the list of devices when they differ."""
    devices = sorted({r.device for r in runs})
    label = "measured on " + ", ".join(devices) if devices else "no runs"
    if devices and all(d.startswith("cpu") for d in devices):
        label += " (CPU: not representative of GPU speed)"
    return label


def sampling_label(run: RunRecord) -> str:
    """T, top-p and seed of a run, as every figure and row states them."""
    s = run.sampling
    temperature = float(s.get("temperature", 0.0))
    head = "T=0 (greedy)" if temperature == 0 else f"T={temperature:g}"
    return f"{head}, top-p {float(s.get('top_p', 1.0)):g}, seed {s.get('seed', 0)}"


def all_runs(groups: Groups) -> list[RunRecord]:
    return [run for runs in groups.values() for run in runs]


def figure_subtitle(groups: Groups) -> str:
    """Device, sampling and repeats: what every Compare figure is a measurement of."""
    runs = all_runs(groups)
    repeats = max((len(r) for r in groups.values()), default=0)
    sampling = sampling_label(runs[0]) if runs else ""
    return f"{device_label(runs)} · {sampling} · median of {repeats} interleaved repeat(s)"


def _decoded(run: RunRecord) -> bool:
    return bool(run.metrics.get("decode_steps"))


def median_range(values: Sequence[float]) -> tuple[float, float, float] | None:
    """(median, min, max), or None for no values."""
    if not values:
        return None
    return statistics.median(values), min(values), max(values)


def paired_speedups(runs: Sequence[RunRecord], base: Sequence[RunRecord]) -> list[float]:
    """Per repeat, the run's decode tokens/s over ar's in the same repeat."""
    return [r.metrics["tokens_per_s"] / b.metrics["tokens_per_s"] for r, b in zip(runs, base)
            if _decoded(r) and _decoded(b) and b.metrics["tokens_per_s"] > 0]


def plain_step_time(base: Sequence[RunRecord]) -> float | None:
    """Median time of one plain decode step, from ar's runs."""
    times = [b.metrics["decode_time"] / b.metrics["decode_steps"] for b in base if _decoded(b)]
    return statistics.median(times) if times else None


def projected_speedup(run: RunRecord, step_time: float | None) -> float | None:
    """The run's steps as they would go if each verification cost one plain step: committed
    tokens over (steps x one plain step + the run's own draft time), against one token per step."""
    m = run.metrics
    if not step_time or not _decoded(run):
        return None
    committed = m["mean_acceptance_length"] * m["decode_steps"]
    return committed * step_time / (m["decode_steps"] * step_time + m["draft_time"])


def identical_label(runs: Sequence[RunRecord], base: Sequence[RunRecord]) -> str:
    """Whether every repeat's output equals ar's, token for token; above T = 0 that is not the
    claim (the methods match the target in distribution, which the tests check), so it says so."""
    if not base or not runs:
        return ""
    if any(float(r.sampling.get("temperature", 0.0)) > 0 for r in (*runs, *base)):
        return "sampled: equal in distribution, not token for token"
    return "yes" if all(r.output_ids == base[0].output_ids for r in runs) else "no"


def _spread(stats: tuple[float, float, float] | None, digits: int, unit: str = "") -> str:
    if stats is None:
        return "n/a"
    med, lo, hi = stats
    if lo == hi:
        return f"{med:.{digits}f}{unit}"
    return f"{med:.{digits}f}{unit} ({lo:.{digits}f}-{hi:.{digits}f})"


def _median_metric(runs: Sequence[RunRecord], key: str, digits: int) -> float | str:
    values = [r.metrics[key] for r in runs if _decoded(r)]
    return round(statistics.median(values), digits) if values else "n/a"


def _ms(values: Sequence[float]) -> float:
    return round(1000 * statistics.median(values), 1)


def compare_rows(groups: Groups) -> list[list[Any]]:
    """One table row per method, in COLUMNS order (ar's speedup is 1 by definition)."""
    base = groups.get("ar", [])
    step_time = plain_step_time(base)
    rows = []
    for method, runs in groups.items():
        speed = median_range([r.metrics["tokens_per_s"] for r in runs if _decoded(r)])
        projections = [p for p in (projected_speedup(r, step_time) for r in runs) if p is not None]
        rows.append([
            method, runs[0].device, runs[0].metrics["new_tokens"], _spread(speed, 1),
            _spread(median_range(paired_speedups(runs, base)), 2, "x"),
            f"{statistics.median(projections):.2f}x (projection)" if projections else "n/a",
            _median_metric(runs, "mean_acceptance_length", 2), _median_metric(runs, "draft_acceptance_rate", 2),
            _median_metric(runs, "verified_per_committed", 2),
            _ms([r.prefill_time for r in runs]), _ms([r.prefill_time + r.metrics["decode_time"] for r in runs]),
            identical_label(runs, base), sampling_label(runs[0]),
        ])
    return rows


PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#ff9da6", "#9d755d", "#bab0ac")


def method_colours(methods: Sequence[str]) -> dict[str, str]:
    """One colour per method, the same in every chart of the panel (and so in its legend)."""
    names = list(dict.fromkeys(methods))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _bar(fig: go.Figure, names: list[str], stats: list[tuple[float, float, float] | None], colours: dict[str, str],
         row: int, col: int, **kw: Any) -> None:
    """Median bars with min-max whiskers; a method without a value gets no bar."""
    med = [s[0] if s else None for s in stats]
    fig.add_bar(
        x=names, y=med, marker_color=[colours[n] for n in names], showlegend=False, row=row, col=col,
        text=[f"{m:.2f}" if m is not None else "n/a" for m in med], textposition="inside",
        error_y=dict(type="data", symmetric=False, array=[(s[2] - s[0]) if s else 0 for s in stats],
                     arrayminus=[(s[0] - s[1]) if s else 0 for s in stats], color="#333", thickness=1),
        **kw,
    )


def compare_figure(groups: Groups) -> go.Figure:
    """tokens/s, mean acceptance length, speedup (measured and projected), verified per committed."""
    base = groups.get("ar", [])
    names = list(groups)
    colours = method_colours(names)
    step_time = plain_step_time(base)
    fig = make_subplots(rows=2, cols=2, subplot_titles=(
        "decode tokens/s (median, whiskers: range)", "mean acceptance length (tokens per target forward)",
        "speedup vs ar: measured (solid) and projected if verify = 1 step (hatched)", "verified per committed token"))
    _bar(fig, names, [median_range([r.metrics["tokens_per_s"] for r in groups[n] if _decoded(r)]) for n in names],
         colours, 1, 1)
    _bar(fig, names, [median_range([r.metrics["mean_acceptance_length"] for r in groups[n] if _decoded(r)])
                      for n in names], colours, 1, 2)
    _bar(fig, names, [median_range(paired_speedups(groups[n], base)) for n in names], colours, 2, 1,
         offsetgroup="measured", name="measured")
    projected = [median_range([p for p in (projected_speedup(r, step_time) for r in groups[n]) if p is not None])
                 for n in names]
    _bar(fig, names, projected, colours, 2, 1, offsetgroup="projected", name="projected",
         marker_pattern_shape="/", opacity=0.55)
    _bar(fig, names, [median_range([r.metrics["verified_per_committed"] for r in groups[n] if _decoded(r)])
                      for n in names], colours, 2, 2)
    fig.add_hline(y=1.0, line_dash="dash", line_color="#555", annotation_text="ar = 1.0", row=2, col=1)
    fig.update_layout(title=f"Methods compared: {figure_subtitle(groups)}", height=620, barmode="group",
                      margin=dict(l=40, r=20, t=90, b=40), title_font_size=14)
    return fig


def acceptance_figure(groups: Groups) -> go.Figure:
    """Per-position acceptance rate and the acceptance-length histogram of each method's first run."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("per-position acceptance rate", "tokens committed per step"))
    colours = method_colours(list(groups))
    for method, runs in groups.items():
        run, colour = runs[0], colours[method]
        rates = run.metrics.get("per_position_acceptance", [])
        if rates:
            fig.add_scatter(x=list(range(1, len(rates) + 1)), y=rates, mode="lines+markers", name=method,
                            legendgroup=method, line_color=colour, row=1, col=1)
        hist = run.metrics.get("acceptance_histogram", {})
        fig.add_bar(x=[int(k) for k in hist], y=list(hist.values()), name=method, legendgroup=method,
                    marker_color=colour, showlegend=not rates, row=1, col=2)
    fig.update_layout(title=f"Acceptance (first repeat): {figure_subtitle(groups)}", barmode="group", height=400,
                      margin=dict(l=40, r=20, t=80, b=40), title_font_size=14)
    fig.update_xaxes(title_text="draft position", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="tokens committed", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    return fig


def verify_cost_figure(curve: Sequence[float], device: str) -> go.Figure:
    """This device's measured c(l): a target forward over l tokens in units of a one-token forward,
    between the two limits (free: 1, sequential: l)."""
    lengths = list(range(1, len(curve) + 1))
    fig = go.Figure()
    fig.add_scatter(x=lengths, y=list(curve), mode="lines+markers", name=f"measured on {device}", line_color="#d62728")
    fig.add_scatter(x=lengths, y=[1.0] * len(lengths), mode="lines", name="verification free (GPU-like)",
                    line=dict(color="#2ca02c", dash="dash"))
    fig.add_scatter(x=lengths, y=lengths, mode="lines", name="as costly as l plain steps",
                    line=dict(color="#999", dash="dot"))
    fig.update_layout(title=f"Verify cost on this device: a forward over l tokens, in plain steps ({device})",
                      xaxis_title="tokens verified in one forward (l)", yaxis_title="cost / one-token forward",
                      height=340, margin=dict(l=50, r=20, t=60, b=40), title_font_size=14,
                      legend=dict(orientation="h", y=-0.25))
    return fig


def verify_cost_note(curve: Sequence[float], groups: Groups) -> str:
    """Why a method loses to ar here, when one does: what verifying its tokens costs on this device."""
    base = groups.get("ar", [])
    losing = [m for m, runs in groups.items() if m != "ar"
              and (s := median_range(paired_speedups(runs, base))) is not None and s[0] < 1.0]
    if not curve:
        return ""
    longest = len(curve)
    cost = f"verifying {longest} tokens in one forward costs {curve[-1]:.1f} plain steps on this device"
    if not losing:
        return f"Here {cost}; every method above paid for it."
    return (f"{', '.join(losing)} ran slower than ar here: {cost} (the chart below), so a step must commit more "
            f"than that many tokens to win. The projected column shows the same acceptance where verifying costs one "
            f"step, as on a GPU at batch 1.")
