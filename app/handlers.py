"""Event handlers: UI values in, engine via the runner, views out, in the order ui.py wires them.

Kept apart from the layout so ui.py stays wiring only and each handler reads top to bottom:
check input, run (streaming one yield per target forward), render every panel from the records.
A run's records and token texts live in the per-session `Session` (a gr.State), so sliders
re-render from the stored trace without recomputing, and an imported run feeds the same panels.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

from specflash.config import SamplingConfig
from specflash.trace import RunRecord

from . import views, views_compare, views_heads, views_tree
from .methods import Knob, options_for
from .runner import Runner, engine_errors, step_ids


PANEL_OUTPUTS = 14  # RUN_OUTPUTS after (output HTML, text, stats, session)


@dataclass
class Session:
    """One browser session's current run and the text of every token id it shows."""

    run: RunRecord | None = None
    texts: dict[int, str] = field(default_factory=dict)
    text: str = ""  # the output decoded as a whole (per-token texts can split characters)


@dataclass(frozen=True)
class RunInputs:
    """What the Run panel's controls say, in the order of ui.py's RUN_INPUTS."""

    prompt: str
    method: str
    preset: str
    device: str
    temperature: float
    top_p: float
    seed: float
    max_new_tokens: float

    def sampling(self) -> SamplingConfig:
        with engine_errors():
            return SamplingConfig(temperature=float(self.temperature), top_p=float(self.top_p), seed=int(self.seed or 0))


def _first_drafted(run: RunRecord, key: str | None = None) -> int:
    """The step a slider opens on: the first with a draft (and extras[key] when given), else the
    first with extras[key], else 0."""
    keyed = [s for s in run.steps if key is None or s.extras.get(key)]
    return next((s.step for s in keyed if s.tokens), keyed[0].step if keyed else 0)


def _slider(run: RunRecord, value: int) -> dict:
    return gr.update(maximum=max(views.last_step(run), 1), value=min(value, views.last_step(run)))


def step_panel(session: Session, index: int) -> tuple[Any, str]:
    """Step inspector outputs for one step: (figure, table HTML)."""
    if session.run is None or not session.run.steps:
        return None, "<p>No run yet: generate or import one.</p>"
    step = session.run.steps[min(int(index), len(session.run.steps) - 1)]
    return views.step_figure(step, session.texts), views.step_table_html(step, session.texts)


def ptd_panel(session: Session, index: int) -> tuple[dict, str]:
    """PTD outputs: (plot update, note); the plot is hidden for runs without a PTD tree."""
    run = session.run
    if run is None or not views_tree.has_ptd(run.steps):
        return gr.update(value=None, visible=False), views_tree.NO_PTD
    step = run.steps[min(int(index), len(run.steps) - 1)]
    return gr.update(value=views_tree.ptd_figure(step, session.texts), visible=True), ""


def adaflash_cut(session: Session, index: int) -> str:
    run = session.run
    if run is None or not views_heads.has_extras(run.steps, "adaflash"):
        return ""
    return views_heads.adaflash_cut_html(run.steps[min(int(index), len(run.steps) - 1)], session.texts)


def head_panels(session: Session) -> tuple[dict, str, dict, str]:
    """(DeLS plot, DeLS note, AdaFlash plot, AdaFlash note) for the whole run."""
    run = session.run
    steps = run.steps if run else []
    dels = views_heads.has_extras(steps, "dels")
    ada = views_heads.has_extras(steps, "adaflash")
    return (
        gr.update(value=views_heads.dels_figure(steps, session.texts) if dels else None, visible=dels),
        "" if dels else views_heads.NO_DELS,
        gr.update(value=views_heads.adaflash_figure(steps) if ada else None, visible=ada),
        "" if ada else views_heads.NO_ADAFLASH,
    )


def export_file(run: RunRecord) -> str:
    """The run's JSON written to a fresh temporary file, for the download component."""
    folder = Path(tempfile.mkdtemp(prefix="specflash-run-"))
    path = folder / f"specflash-{run.method}-{run.model.replace('/', '_')}.json"
    path.write_text(run.to_json(indent=1), encoding="utf-8")
    return str(path)


def render_all(session: Session) -> tuple:
    """Every output of ui.py's RUN_OUTPUTS from the session's run."""
    run = session.run
    if run is None:
        return (gr.skip(),) * (4 + PANEL_OUTPUTS)
    first, ptd_first, ada_first = _first_drafted(run), _first_drafted(run, "ptd"), _first_drafted(run, "adaflash")
    return (
        views.output_html(run.steps, session.texts), session.text, views.stats_markdown(run), session,
        _slider(run, first), *step_panel(session, first),
        _slider(run, ptd_first), *ptd_panel(session, ptd_first),
        *head_panels(session),
        _slider(run, ada_first), adaflash_cut(session, ada_first),
        run.to_json(indent=1), export_file(run),
    )


def streaming(session: Session) -> tuple:
    """RUN_OUTPUTS mid-run: the coloured text, live stats and the session; panels untouched."""
    run = session.run
    return (views.output_html(run.steps, session.texts), session.text, views.stats_markdown(run), session) + (gr.skip(),) * PANEL_OUTPUTS


def loading_note(runner: Runner, inputs: RunInputs) -> str | None:
    """What to say while a model loads for the first time (None when it is loaded)."""
    if runner.has(inputs.preset, inputs.device):
        return None
    return f"Loading **{inputs.preset}** on {inputs.device} (first use only; later runs reuse it)…"


def run(runner: Runner, knobs: list[Knob], inputs: RunInputs, knob_values: list[Any]) -> Iterator[tuple]:
    """Generate with the chosen method, one yield per target forward, then render every panel."""
    options = options_for(inputs.method, knobs, knob_values)
    sampling = inputs.sampling()
    session = Session()
    note = loading_note(runner, inputs)
    if note:
        yield (gr.skip(), gr.skip(), note, gr.skip()) + (gr.skip(),) * PANEL_OUTPUTS
    target = runner.target(inputs.preset, inputs.device)
    stream = runner.stream(inputs.preset, inputs.device, inputs.prompt, inputs.method, sampling,
                           int(inputs.max_new_tokens), options)
    for step, partial in stream:
        session.texts = runner.token_texts(target.tokenizer, step_ids(step), session.texts)
        session.run = partial
        session.text = target.tokenizer.decode(partial.output_ids, skip_special_tokens=True)
        yield streaming(session)
    yield render_all(session)


def stopped(session: Session) -> tuple:
    """After Stop: the partial run, marked stopped, in every panel."""
    if session is not None and session.run is not None and session.run.finish_reason == "running":
        session.run.finish_reason = "stopped"
    return render_all(session or Session())


def import_json(runner: Runner, text: str) -> tuple:
    """A RunRecord from JSON text (exported here or by `specflash generate --json`) into every panel."""
    if not text or not text.strip():
        raise gr.Error("nothing to import: paste a run's JSON or upload a .json file", print_exception=False)
    try:
        record = RunRecord.from_json(text)
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise gr.Error(f"not a SpecFlash run JSON ({type(exc).__name__}: {exc})", print_exception=False) from None
    return render_all(Session(record, *runner.texts_for_run(record)))


def import_file(runner: Runner, path: str | None) -> tuple:
    if not path:
        return render_all(Session())
    return import_json(runner, Path(path).read_text(encoding="utf-8"))


def compare(runner: Runner, knobs: list[Knob], inputs: RunInputs, methods: list[str],
            knob_values: list[Any]) -> Iterator[tuple]:
    """Each chosen method (and ar, the baseline) on the same prompt, seed and sampling; one yield
    per method: (table rows, summary figure, acceptance figure, status). A method that cannot
    run here (a missing drafter, say) is listed with the engine's message; the others still run."""
    chosen = ["ar"] + [m for m in (methods or []) if m != "ar"]
    sampling = inputs.sampling()
    runs: list[RunRecord] = []
    skipped: list[str] = []
    for i, method in enumerate(chosen):
        note = loading_note(runner, inputs) or ""
        yield gr.skip(), gr.skip(), gr.skip(), f"{note} running {method} ({i + 1}/{len(chosen)})…"
        try:
            runs.append(runner.generate(inputs.preset, inputs.device, inputs.prompt, method, sampling,
                                        int(inputs.max_new_tokens), options_for(method, knobs, knob_values)))
        except gr.Error as exc:
            if method == "ar":
                raise
            skipped.append(f"- **{method}** did not run: {exc.message}")
        done = "Done" if i == len(chosen) - 1 else "So far"
        status = "\n".join([f"{done}: {len(runs)} of {len(chosen)} methods ran, {views_compare.device_label(runs)}", *skipped])
        yield (views_compare.compare_rows(runs), views_compare.compare_figure(runs),
               views_compare.acceptance_figure(runs), status)
