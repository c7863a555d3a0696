"""Event handlers: UI values in, engine via the runner, views out, in the order ui.py wires them.

Kept apart from the layout so ui.py stays wiring only and each handler reads top to bottom:
check input, run (streaming one yield per target forward), render every panel from the records.
A run's records and token texts live in the per-session `Session` (a gr.State), so sliders
re-render from the stored trace without recomputing, and an imported run feeds the same panels.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import gradio as gr

from specflash.config import SamplingConfig
from specflash.drafters import METHODS
from specflash.trace import RunRecord

from . import views, views_adaflash, views_compare, views_dels, views_lattice, views_tree
from .methods import Knob, options_for
from .run_json import RunJSONError, Settings, parse_run, run_settings
from .runner import Runner, engine_errors, step_ids


PANEL_OUTPUTS = 22  # RUN_OUTPUTS after (output HTML, text, stats, session)
SETTINGS_OUTPUTS = 7  # then prompt, method, model, temperature, top-p, seed, max new tokens; then every knob


@dataclass
class Session:
    """One browser session's current run, the text of every token id it shows, and the runs of
    its last comparison (a row click loads one of them into every panel)."""

    run: RunRecord | None = None
    texts: dict[int, str] = field(default_factory=dict)
    text: str = ""  # the output decoded as a whole (per-token texts can split characters)
    notes: list[str] = field(default_factory=list)  # what the run used that the controls did not say
    compared: dict[str, list[RunRecord]] = field(default_factory=dict)


MAX_NEW_TOKENS = 512  # per run in the app: a shared CPU Space must not be held for minutes


@dataclass(frozen=True)
class RunInputs:
    """What the Run panel's controls say, in the order of ui.py's RUN_INPUTS."""

    prompt: str
    method: str
    preset: str
    device: str
    drafter: str
    temperature: float | None
    top_p: float | None
    seed: float | None
    max_new_tokens: float | None

    def sampling(self) -> SamplingConfig:
        """The sampling config; a blank box means the default, a bad value the engine's message."""
        temperature = 0.0 if self.temperature is None else float(self.temperature)
        top_p = 1.0 if self.top_p is None else float(self.top_p)
        with engine_errors():
            return SamplingConfig(temperature=temperature, top_p=top_p, seed=int(self.seed or 0))

    def token_limit(self) -> tuple[int, str | None]:
        """(max new tokens to use, a note when that is not what was typed)."""
        if self.max_new_tokens is None:
            return 64, "max new tokens was blank: used 64"
        asked = int(self.max_new_tokens)
        if asked < 1:
            raise gr.Error(f"max new tokens must be at least 1, got {asked}", print_exception=False)
        if asked > MAX_NEW_TOKENS:
            return MAX_NEW_TOKENS, (f"max new tokens: asked {asked}, used {MAX_NEW_TOKENS} (this app's limit per run; "
                                    "`specflash generate` and the Python API have none)")
        return asked, None

    def drafter_path(self) -> str | None:
        """The drafter field, for methods that draft with a model; blank means the preset's own."""
        info = METHODS.get(self.method)
        return ((self.drafter or "").strip() or None) if info and info.drafter_role else None


def _first_drafted(run: RunRecord, key: str | None = None) -> int:
    """The step a slider opens on: the first with a draft (and extras[key] when given), else the
    first with extras[key], else 0."""
    keyed = [s for s in run.steps if key is None or s.extras.get(key)]
    return next((s.step for s in keyed if s.tokens), keyed[0].step if keyed else 0)


def temperature(run: RunRecord) -> float:
    return float(run.sampling.get("temperature", 0.0))


def _slider(run: RunRecord, value: int, visible: bool = True) -> dict:
    return gr.update(maximum=max(views.last_step(run), 1), value=min(value, views.last_step(run)), visible=visible)


NO_RUN_STEPS = ("<p>No run yet. Generate one on the Run tab (or import one): this tab then shows, step by step, "
                "what the drafter proposed, the target's probability of each token, and where verification "
                "stopped.</p>")


def step_panel(session: Session, index: int) -> tuple[Any, str]:
    """Step inspector outputs for one step: (figure, table HTML)."""
    if session.run is None or not session.run.steps:
        return None, NO_RUN_STEPS
    step = session.run.steps[min(int(index), len(session.run.steps) - 1)]
    t = temperature(session.run)
    return views.step_figure(step, session.texts, t), views.step_table_html(step, session.texts, t)


def ptd_panel(session: Session, index: int) -> tuple[dict, dict, str]:
    """PTD outputs: (static plot, animation, note); plots hidden for runs without a PTD tree."""
    run = session.run
    if run is None or not views_tree.has_ptd(run.steps):
        hidden = gr.update(value=None, visible=False)
        return hidden, hidden, views_tree.NO_PTD
    i = min(int(index), len(run.steps) - 1)
    step, root = run.steps[i], views_tree.root_token(run.steps, i)
    return (gr.update(value=views_tree.ptd_figure(step, session.texts, root), visible=True),
            gr.update(value=views_tree.ptd_animation(step, session.texts, root), visible=True),
            views_tree.tree_size_note(run.steps))


def open_step(session: Session, value: str) -> tuple[Any, Any]:
    """A token clicked in the Run tab: move the step slider to its step (its .change redraws the
    inspector) and open the Step inspector tab."""
    step = views.clicked_step(value, session.run if session else None)
    if step is None:
        return gr.skip(), gr.skip()
    return _slider(session.run, step), gr.Tabs(selected="steps")


def adaflash_cut(session: Session, index: int) -> str:
    run = session.run
    if run is None or not views_adaflash.has_adaflash(run.steps):
        return ""
    return views_adaflash.adaflash_cut_html(run.steps[min(int(index), len(run.steps) - 1)], session.texts, run.config)


def lattice_panel(session: Session, index: int) -> tuple[dict, str]:
    """DFlash 2 lattice outputs for one step: (plot update, step HTML); hidden for runs without a lattice."""
    run = session.run
    if run is None or not views_lattice.has_lattice(run.steps):
        return gr.update(value=None, visible=False), views_lattice.NO_LATTICE
    step = run.steps[min(int(index), len(run.steps) - 1)]
    return (gr.update(value=views_lattice.lattice_figure(step, session.texts), visible=True),
            views_lattice.lattice_summary_html(step, session.texts))


def dels_panel(session: Session, index: int) -> tuple[dict, str]:
    """DeLS step outputs: (plot update, table HTML); hidden for runs without a DeLS record."""
    run = session.run
    if run is None or not views_dels.has_dels(run.steps):
        return gr.update(value=None, visible=False), ""
    step = run.steps[min(int(index), len(run.steps) - 1)]
    return (gr.update(value=views_dels.dels_step_figure(step, session.texts), visible=True),
            views_dels.dels_step_html(step, session.texts))


def dels_run_panels(session: Session) -> tuple[str, dict]:
    """(DeLS note, DeLS whole-run summary)."""
    run = session.run
    dels = run is not None and views_dels.has_dels(run.steps)
    return views_dels.dels_note(run), gr.update(value=views_dels.dels_summary_html(run.steps) if dels else "",
                                                visible=dels)


def ada_run_panels(session: Session) -> tuple[dict, str]:
    """(AdaFlash figure, AdaFlash note)."""
    run = session.run
    ada = run is not None and views_adaflash.has_adaflash(run.steps)
    return (gr.update(value=views_adaflash.adaflash_figure(run.steps, run.config) if ada else None, visible=ada),
            views_adaflash.adaflash_note(run))


def export_file(run: RunRecord) -> str:
    """The run's JSON written to a fresh temporary file, for the download component."""
    folder = Path(tempfile.mkdtemp(prefix="specflash-run-"))
    path = folder / f"specflash-{run.method}-{run.model.replace('/', '_')}.json"
    path.write_text(run.to_json(indent=1), encoding="utf-8")
    return str(path)


def stats(session: Session) -> str:
    """The run's numbers, its sampling settings, and any note on what was used."""
    run = session.run
    lines = [views.stats_markdown(run), f"*Sampling: {views_compare.sampling_label(run)}.*"]
    return "\n\n".join(lines + [f"*{note}*" for note in session.notes])


def render_all(session: Session) -> tuple:
    """Every output of ui.py's RUN_OUTPUTS (before the settings) from the session's run."""
    run = session.run
    if run is None:
        return (gr.skip(),) * (4 + PANEL_OUTPUTS)
    first, ptd_first = _first_drafted(run), _first_drafted(run, "ptd")
    dels_first, ada_first = _first_drafted(run, "dels"), _first_drafted(run, "adaflash")
    lattice_first = _first_drafted(run, "dflash2")
    return (
        views.output_html(run.steps, session.texts, temperature(run)), session.text, stats(session), session,
        _slider(run, first), *step_panel(session, first),
        _slider(run, ptd_first), *ptd_panel(session, ptd_first),
        *dels_run_panels(session), _slider(run, dels_first, views_dels.has_dels(run.steps)),
        *dels_panel(session, dels_first),
        *ada_run_panels(session), _slider(run, ada_first, views_adaflash.has_adaflash(run.steps)),
        adaflash_cut(session, ada_first),
        views_lattice.lattice_run_summary(run.steps),
        _slider(run, lattice_first, views_lattice.has_lattice(run.steps)), *lattice_panel(session, lattice_first),
        run.to_json(indent=1), export_file(run),
    )


def streaming(session: Session) -> tuple:
    """RUN_OUTPUTS mid-run: the coloured text, live stats and the session; panels untouched. The
    stats say "running" until the panels are drawn too, even after the last token."""
    run = session.run
    live = Session(dataclasses.replace(run, finish_reason="running"), session.texts, session.text, session.notes)
    return (views.output_html(run.steps, session.texts, temperature(run)), session.text, stats(live), session) + (
        gr.skip(),) * PANEL_OUTPUTS


def keep_settings(knobs: list[Knob]) -> tuple:
    """The settings outputs left as they are (a run never rewrites the controls that made it)."""
    return (gr.skip(),) * (SETTINGS_OUTPUTS + len(knobs))


def restored_settings(settings: Settings) -> tuple:
    """The settings outputs set to reproduce an imported run (None: left as it is)."""
    values = (settings.prompt, settings.method, settings.model, settings.temperature, settings.top_p, settings.seed,
              settings.max_new_tokens, *settings.knobs)
    return tuple(gr.skip() if v is None else v for v in values)


def loading_note(runner: Runner, inputs: RunInputs) -> str | None:
    """What to say while a model loads for the first time (None when it is loaded)."""
    if runner.has(inputs.preset, inputs.device):
        return None
    return f"Loading **{inputs.preset}** on {inputs.device} (first use only; later runs reuse it)…"


def run(runner: Runner, knobs: list[Knob], inputs: RunInputs, knob_values: list[Any]) -> Iterator[tuple]:
    """Generate with the chosen method, one yield per target forward, then render every panel."""
    options = options_for(inputs.method, knobs, knob_values)
    sampling = inputs.sampling()
    limit, note = inputs.token_limit()
    session = Session(notes=[note] if note else [])
    keep = keep_settings(knobs)
    loading = loading_note(runner, inputs)
    if loading:
        yield (gr.skip(), gr.skip(), loading, gr.skip()) + (gr.skip(),) * PANEL_OUTPUTS + keep
    target = runner.target(inputs.preset, inputs.device)
    stream = runner.stream(inputs.preset, inputs.device, inputs.prompt, inputs.method, sampling, limit, options,
                           inputs.drafter_path())
    for step, partial in stream:
        session.texts = runner.token_texts(target.tokenizer, step_ids(step), session.texts)
        session.run = partial
        session.text = target.tokenizer.decode(partial.output_ids, skip_special_tokens=True)
        yield streaming(session) + keep
    yield render_all(session) + keep


def stopped(session: Session, knobs: list[Knob]) -> tuple:
    """After Stop: the partial run, marked stopped, in every panel."""
    if session is not None and session.run is not None and session.run.finish_reason == "running":
        session.run.finish_reason = "stopped"
    return render_all(session or Session()) + keep_settings(knobs)


def import_json(runner: Runner, knobs: list[Knob], methods: list[str], text: str) -> tuple:
    """A RunRecord from JSON text (exported here or by `specflash generate --json`) into every
    panel, and its prompt, method and settings into the Run tab's controls."""
    try:
        record = parse_run(text)
    except RunJSONError as exc:
        raise gr.Error(str(exc), print_exception=False) from None
    settings = run_settings(record, knobs, methods)
    notes = [] if record.prompt else ["This run's JSON has no prompt text (it was made from token ids or by an "
                                      "older version), so the prompt box was left as it was."]
    session = Session(record, *runner.texts_for_run(record), notes=notes)
    return render_all(session) + restored_settings(settings)


def import_file(runner: Runner, knobs: list[Knob], methods: list[str], path: str | None) -> tuple:
    if not path:
        return render_all(Session()) + keep_settings(knobs)
    return import_json(runner, knobs, methods, Path(path).read_text(encoding="utf-8"))
