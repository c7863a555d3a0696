"""The Compare tab's handlers: every chosen method on one prompt, repeated and interleaved, and a
table row that loads its run into every panel.

Repeats go round-robin (ar, m1, m2, ar, m1, m2, ...) rather than method by method, so a burst
of load on a shared machine lands on every method alike; the views take medians. The session
keeps every run so that clicking a row shows that method's first run in the Run tab's panels.
"""

from __future__ import annotations

import html
from typing import Any, Iterator, Mapping, Sequence

import gradio as gr

from specflash.trace import RunRecord

from . import views, views_compare
from .handlers import RunInputs, Session, keep_settings, render_all, temperature
from .methods import Knob, options_for
from .runner import Runner, step_ids

MAX_REPEATS = 10


def repeats_used(value: float | None) -> tuple[int, str | None]:
    """(repeats to run, a note when that is not what was typed)."""
    asked = 1 if value is None else int(value)
    if asked < 1:
        raise gr.Error(f"repeats must be at least 1, got {asked}", print_exception=False)
    if asked > MAX_REPEATS:
        return MAX_REPEATS, f"repeats: asked {asked}, used {MAX_REPEATS} (this app's limit)"
    return asked, None


def outputs_side_by_side(groups: Mapping[str, Sequence[RunRecord]], texts: dict[int, str]) -> str:
    """Each method's first run as coloured text, in columns, so the outputs can be read together,
    under one colour legend (every run of a Compare shares its sampling settings)."""
    columns = "".join(
        f'<div class="compare-output" style="flex:1 1 300px;min-width:260px;border:1px solid #ddd;border-radius:6px;'
        f'padding:6px"><b>{html.escape(method)}</b>'
        f'{views.output_html(runs[0].steps, texts, temperature(runs[0]), legend=False)}</div>'
        for method, runs in groups.items()
    )
    first = next(iter(groups.values()), None)
    legend = f'<div class="sf-out">{views.legend_html(temperature(first[0]))}</div>' if first else ""
    return f'{legend}<div style="display:flex;flex-wrap:wrap;gap:8px">{columns}</div>'


def _status(groups: dict[str, list[RunRecord]], chosen: list[str], repeat: int, repeats: int,
            skipped: list[str], notes: list[str], done: bool) -> str:
    head = "Done" if done else f"Repeat {repeat + 1} of {repeats}"
    lines = [f"{head}: {len(groups)} of {len(chosen)} methods ran, {views_compare.figure_subtitle(groups)}. "
             "Click a row to load that method's run into the Run tab and its panels.", *skipped, *notes]
    return "\n".join(lines)


def compare(runner: Runner, knobs: list[Knob], inputs: RunInputs, methods: list[str], repeats: float | None,
            knob_values: list[Any], session: Session) -> Iterator[tuple]:
    """Each chosen method (and ar, the baseline) on the same prompt, seed and sampling, `repeats`
    times, interleaved; yields (table, summary figure, acceptance figure, status, cost figure,
    outputs HTML, session) after each run. A method that cannot run here (no drafter, say) is
    listed with the engine's message; the others still run."""
    chosen = ["ar"] + [m for m in (methods or []) if m != "ar"]
    sampling = inputs.sampling()
    limit, limit_note = inputs.token_limit()
    count, repeat_note = repeats_used(repeats)
    notes = [f"*{n}*" for n in (limit_note, repeat_note) if n]
    groups: dict[str, list[RunRecord]] = {}
    failed: dict[str, str] = {}
    skip = (gr.skip(),) * 7
    for r in range(count):
        for method in chosen:
            if method in failed:
                continue
            loading = runner.has(inputs.preset, inputs.device) or runner.loaded(inputs.preset) is not None
            yield skip[:3] + (f"{'' if loading else 'Loading the model… '}running {method}, repeat {r + 1} of {count}…",) + skip[4:]
            try:
                run = runner.generate(inputs.preset, inputs.device, inputs.prompt, method, sampling, limit,
                                      options_for(method, knobs, knob_values))
            except gr.Error as exc:
                if method == "ar":
                    raise
                failed[method] = exc.message
                continue
            groups.setdefault(method, []).append(run)
    target = runner.target(inputs.preset, inputs.device)
    texts = dict(session.texts)
    for runs in groups.values():
        texts = runner.token_texts(target.tokenizer, [t for s in runs[0].steps for t in step_ids(s)], texts)
    curve = runner.verify_cost(inputs.preset, inputs.device)
    skipped = [f"- **{m}** did not run: {message}" for m, message in failed.items()]
    cost_note = views_compare.verify_cost_note(curve, groups)
    session = Session(session.run, texts, session.text, session.notes, groups)
    yield (views_compare.compare_rows(groups), views_compare.compare_figure(groups),
           views_compare.acceptance_figure(groups),
           _status(groups, chosen, count - 1, count, skipped, notes + ([cost_note] if cost_note else []), True),
           views_compare.verify_cost_figure(curve, inputs.device), outputs_side_by_side(groups, texts), session)


def load_row(runner: Runner, knobs: list[Knob], session: Session, evt: gr.SelectData) -> tuple:
    """The clicked row's method: its first run into the Run tab's output and every panel."""
    row = evt.index[0] if isinstance(evt.index, (list, tuple)) else evt.index
    methods = list(session.compared)
    if not methods or row is None or not 0 <= int(row) < len(methods):
        return render_all(session) + keep_settings(knobs)
    run = session.compared[methods[int(row)]][0]
    target = runner.loaded(run.model)
    text = target.tokenizer.decode(run.output_ids, skip_special_tokens=True) if target else ""
    loaded = Session(run, session.texts, text, [f"Loaded from Compare: {run.method}, repeat 1."], session.compared)
    return render_all(loaded) + keep_settings(knobs)
