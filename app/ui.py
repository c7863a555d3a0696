"""The Gradio layout and its event wiring, nothing else: handlers.py does the work, views draw.

Every event has an api_name so gradio_client tests (and scripts) call the same endpoints the
buttons do. Decoding events share one queue slot ("engine"): models are shared between sessions
and CPU hosts have few cores, so runs go one at a time while sliders stay responsive.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gradio as gr

from specflash.models.presets import DEFAULT_PRESET, PRESETS
from specflash.prompts import heldout_prompts

from specflash.drafters import METHODS

from . import handlers, handlers_compare, views, views_adaflash, views_dels, views_lattice, views_tree
from .first_run import FirstRun, first_run
from .handlers import MAX_NEW_TOKENS, RunInputs, Session
from .handlers_compare import MAX_REPEATS
from .methods import Knob, all_knobs, available_methods, method_note, missing_drafter, unavailable_methods
from .runner import Runner, devices
from .views_compare import COLUMNS

INTRO = (
    "# SpecFlash: watch speculative decoding\n"
    "Lossless speculative decoding on a Hugging Face causal LM, step by step: which tokens the "
    "drafter proposed, which the target accepted, and what it cost."
)


def prompt_choices() -> list[tuple[str, str]]:
    """(label, text) of every held-out prompt, for the prompt picker."""
    return [(f"{p.domain} · {p.text[:70]}", p.text) for p in heldout_prompts()]


def knob_component(knob: Knob) -> gr.components.Component:
    if knob.choices:
        return gr.Dropdown(list(knob.choices), value=knob.default, label=knob.label)
    if knob.default is None:  # a Number cannot be blank in the browser (it shows and sends 0)
        return gr.Textbox(value="", label=knob.label, placeholder="blank")
    if knob.kind is bool:
        return gr.Checkbox(value=knob.default, label=knob.label)
    if knob.kind in (int, float):
        return gr.Number(value=knob.default, label=knob.label, precision=0 if knob.kind is int else None)
    return gr.Textbox(value=knob.default, label=knob.label)


def method_controls(methods: list[str], default: str) -> tuple[list[gr.Group], list[str], list[Any]]:
    """One group of knob inputs per method that has knobs, shown only while it is chosen, all in
    a closed accordion: the defaults are sensible, and a dozen boxes would push Generate off screen."""
    groups, owners, components = [], [], []
    with gr.Accordion("method knobs (defaults are the method's own)", open=False, elem_id="knobs"):
        for method in methods:
            knobs = all_knobs([method])
            if not knobs:
                continue
            with gr.Group(visible=method == default) as group:
                components += [knob_component(k) for k in knobs]
            groups.append(group)
            owners.append(method)
        gr.Markdown("Methods without knobs: " + ", ".join(m for m in methods if m not in owners) + ".")
    return groups, owners, components


def run_panel(default_model: str, methods: list[str], first: FirstRun) -> dict[str, Any]:
    """The Run tab: controls on the left, the coloured output and stats on the right."""
    c: dict[str, Any] = {}
    with gr.Row():
        with gr.Column(scale=2):
            c["first_note"] = gr.Markdown(first.note, elem_id="first-note")
            c["example"] = gr.Dropdown(prompt_choices(), value=first.prompt, label="held-out prompt (or type your own)")
            c["prompt"] = gr.Textbox(value=first.prompt, label="prompt", lines=3, elem_id="prompt")
            with gr.Row():
                c["method"] = gr.Dropdown(methods, value=first.method, label="method", elem_id="method")
                c["model"] = gr.Dropdown(list(PRESETS), value=default_model, label="model preset",
                                         allow_custom_value=True, elem_id="model")
                c["device"] = gr.Dropdown(devices(), value=devices()[-1], label="device")
            c["method_note"] = gr.Markdown(method_note(first.method), elem_id="method-note")
            c["drafter"] = gr.Textbox(label="drafter (a folder or preset; blank: the preset's own)", elem_id="drafter",
                                      visible=METHODS[first.method].drafter_role is not None)
            with gr.Row():
                c["temperature"] = gr.Number(value=0.0, label="temperature (0 = greedy)", step=0.1,
                                             elem_id="temperature")
                c["top_p"] = gr.Number(value=1.0, label="top-p (0 < p <= 1)", step=0.05, elem_id="top-p")
                c["seed"] = gr.Number(value=0, precision=0, label="seed")
                c["max_tokens"] = gr.Number(value=64, precision=0, label=f"max new tokens (up to {MAX_NEW_TOKENS})",
                                            elem_id="max-tokens")
            c["groups"], c["owners"], c["knobs"] = method_controls(methods, first.method)
            missing = unavailable_methods()
            if missing:
                gr.Markdown(f"*Not in this build yet: {', '.join(missing)}.*")
            with gr.Row():
                c["run"] = gr.Button("Generate", variant="primary", elem_id="run")
                c["stop"] = gr.Button("Stop", variant="stop", elem_id="stop")
        with gr.Column(scale=3):
            c["output"] = gr.HTML("<p style='color:#666'>Press Generate: the output appears here, every token "
                                  "coloured by where it came from (accepted draft, the target's correction, ...).</p>",
                                  elem_id="output")
            c["token_step"] = gr.Textbox(visible="hidden", elem_id="token-step")
            c["stats"] = gr.Markdown(elem_id="stats")
            c["text"] = gr.Textbox(label="output text", lines=3, interactive=False, elem_id="output-text")
    return c


def inspector_panels() -> dict[str, Any]:
    """Step inspector, PTD, DeLS and AdaFlash tabs (the Run tab's run feeds them all)."""
    c: dict[str, Any] = {}
    with gr.Tab("Step inspector", id="steps"):
        c["step_slider"] = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="step-slider")
        c["step_html"] = gr.HTML(handlers.NO_RUN_STEPS, elem_id="step-table")
        c["step_fig"] = gr.Plot(elem_id="step-plot", show_label=False)
    with gr.Tab("PTD tree", id="ptd"):
        c["ptd_slider"] = gr.Slider(0, 1, value=0, step=1, label="replay step", elem_id="ptd-slider")
        c["ptd_note"] = gr.Markdown(views_tree.NO_PTD, elem_id="ptd-note")
        c["ptd_bigger"] = gr.Button("Run ptd again with larger trees (preset = paper)", elem_id="ptd-bigger", size="sm")
        c["ptd_fig"] = gr.Plot(elem_id="ptd-plot", show_label=False, visible=False)
        c["ptd_anim"] = gr.Plot(elem_id="ptd-anim", show_label=False, visible=False)
    with gr.Tab("DeLS", id="dels"):
        c["dels_note"] = gr.Markdown(views_dels.dels_note(None), elem_id="dels-note")
        c["dels_summary"] = gr.HTML(elem_id="dels-summary", visible=False)
        c["dels_slider"] = gr.Slider(0, 1, value=0, step=1, label="step (why each drafted token won)",
                                     elem_id="dels-slider", visible=False)
        c["dels_fig"] = gr.Plot(elem_id="dels-plot", show_label=False, visible=False)
        c["dels_step"] = gr.HTML(elem_id="dels-step")
    with gr.Tab("AdaFlash", id="adaflash"):
        c["ada_note"] = gr.Markdown(views_adaflash.adaflash_note(None), elem_id="ada-note")
        c["ada_fig"] = gr.Plot(elem_id="ada-plot", show_label=False, visible=False)
        c["ada_slider"] = gr.Slider(0, 1, value=0, step=1, label="step (cut on the draft)", elem_id="ada-slider",
                                    visible=False)
        c["ada_cut"] = gr.HTML(elem_id="ada-cut")
    with gr.Tab("DFlash 2 lattice", id="lattice"):
        c["lattice_run"] = gr.Markdown(elem_id="lattice-run")
        c["lattice_slider"] = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="lattice-slider", visible=False)
        c["lattice_note"] = gr.HTML(views_lattice.NO_LATTICE, elem_id="lattice-note")
        c["lattice_fig"] = gr.Plot(elem_id="lattice-plot", show_label=False, visible=False)
    return c


def compare_panel(methods: list[str], preset: str, cache_dir: Path | None) -> dict[str, Any]:
    """The Compare tab; methods the preset cannot run as it stands start unticked, with the reason."""
    c: dict[str, Any] = {}
    missing = {m: why for m in methods if (why := missing_drafter(preset, m, cache_dir))}
    gr.Markdown("Runs each chosen method on the Run tab's prompt, model, sampling and seed, several times, "
                "interleaved; ar always runs as the baseline. Figures are medians with their range.")
    c["methods"] = gr.CheckboxGroup(methods, value=[m for m in methods if m not in missing], label="methods",
                                    elem_id="compare-methods")
    if missing:
        gr.Markdown("Unticked: " + "; ".join(f"**{m}**: {why}" for m, why in missing.items()) + ".",
                    elem_id="compare-unticked")
    with gr.Row():
        c["repeats"] = gr.Number(value=3, precision=0, label=f"repeats (up to {MAX_REPEATS})", elem_id="repeats")
        c["button"] = gr.Button("Compare", variant="primary", elem_id="compare")
    c["note"] = gr.Markdown(elem_id="compare-note")
    c["table"] = gr.Dataframe(headers=COLUMNS, interactive=False, elem_id="compare-table")
    c["fig"] = gr.Plot(elem_id="compare-plot", show_label=False)
    c["outputs"] = gr.HTML(elem_id="compare-outputs")
    c["accept"] = gr.Plot(elem_id="accept-plot", show_label=False)
    c["cost"] = gr.Plot(elem_id="cost-plot", show_label=False)
    return c


def io_panel() -> dict[str, Any]:
    c: dict[str, Any] = {}
    gr.Markdown("Export the current run as JSON, or import one (from this app or `specflash generate --json`) "
                "to explore it here: every panel reads it, and the Run tab's controls take its settings.")
    with gr.Row():
        c["file"] = gr.File(label="download this run (.json)", interactive=False, elem_id="export-file")
        c["upload"] = gr.File(label="import a run (.json)", file_types=[".json"], type="filepath", elem_id="import-file")
    c["paste"] = gr.Textbox(label="or paste a run's JSON", lines=3, max_lines=12, elem_id="import-text")
    c["import"] = gr.Button("Import pasted JSON", elem_id="import")
    c["json"] = gr.Code(language="json", label="this run's JSON", max_lines=30, elem_id="export-json")
    return c


def wire(c: dict[str, Any], runner: Runner, knobs: list[Knob], methods: list[str], session: gr.State,
         tabs: gr.Tabs) -> None:
    """All events: run/stop, method knobs, sliders, compare, import."""
    run_inputs = [c[k] for k in ("prompt", "method", "model", "device", "drafter", "temperature", "top_p", "seed",
                                 "max_tokens")]
    settings = [c[k] for k in ("prompt", "method", "model", "temperature", "top_p", "seed", "max_tokens")] + c["knobs"]
    run_outputs = [c[k] for k in ("output", "text", "stats")] + [session] + [c[k] for k in (
        "step_slider", "step_fig", "step_html", "ptd_slider", "ptd_fig", "ptd_anim", "ptd_note", "dels_note", "dels_summary",
        "dels_slider", "dels_fig", "dels_step", "ada_fig", "ada_note", "ada_slider", "ada_cut", "lattice_run", "lattice_slider", "lattice_fig", "lattice_note",
        "json", "file")] + settings
    n = len(run_inputs)

    def on_run(*values: Any):
        yield from handlers.run(runner, knobs, RunInputs(*values[:n]), list(values[n:]))

    def on_compare(*values: Any):
        prompt, model, device, drafter, temperature, top_p, seed, max_tokens, chosen, repeats, state = values[:11]
        inputs = RunInputs(prompt, "ar", model, device, drafter, temperature, top_p, seed, max_tokens)
        yield from handlers_compare.compare(runner, knobs, inputs, chosen, repeats, list(values[11:]), state)

    def on_method(method: str):
        info = METHODS.get(method)
        return [method_note(method) if info else "", gr.update(visible=bool(info and info.drafter_role))] + [
            gr.update(visible=owner == method) for owner in c["owners"]]

    c["example"].change(lambda text: text or gr.skip(), c["example"], c["prompt"], api_visibility="private")
    c["method"].change(on_method, c["method"], [c["method_note"], c["drafter"]] + c["groups"], api_visibility="private")
    run_event = c["run"].click(on_run, run_inputs + c["knobs"], run_outputs, api_name="run", concurrency_id="engine")
    c["stop"].click(lambda state: handlers.stopped(state, knobs), session, run_outputs, cancels=[run_event],
                    api_name="stop")
    c["token_step"].change(handlers.open_step, [session, c["token_step"]], [c["step_slider"], tabs],
                           api_name="open_step")
    c["step_slider"].change(handlers.step_panel, [session, c["step_slider"]], [c["step_fig"], c["step_html"]], api_name="step")
    preset = next((i for i, k in enumerate(knobs) if (k.method, k.name) == ("ptd", "preset")), None)
    if preset is not None:  # the PTD tab's shortcut: the paper preset's trees, on the same prompt
        c["ptd_bigger"].click(lambda: ("ptd", "paper"), None, [c["method"], c["knobs"][preset]],
                              api_visibility="private").then(
            on_run, run_inputs + c["knobs"], run_outputs, concurrency_id="engine", api_visibility="private")
    c["ptd_slider"].change(handlers.ptd_panel, [session, c["ptd_slider"]], [c["ptd_fig"], c["ptd_anim"], c["ptd_note"]], api_name="ptd_step")
    c["dels_slider"].change(handlers.dels_panel, [session, c["dels_slider"]], [c["dels_fig"], c["dels_step"]],
                            api_name="dels_step")
    c["lattice_slider"].change(handlers.lattice_panel, [session, c["lattice_slider"]],
                               [c["lattice_fig"], c["lattice_note"]], api_name="lattice_step")
    c["ada_slider"].change(handlers.adaflash_cut, [session, c["ada_slider"]], c["ada_cut"], api_name="adaflash_step")
    compare_inputs = ([c["prompt"]] + run_inputs[2:] + [c["methods"], c["repeats"], session] + c["knobs"])
    c["button"].click(on_compare, compare_inputs,
                      [c["table"], c["fig"], c["accept"], c["note"], c["cost"], c["outputs"], session],
                      api_name="compare", concurrency_id="engine")
    def on_row(state: Session, evt: gr.SelectData):
        return handlers_compare.load_row(runner, knobs, state, evt)

    c["table"].select(on_row, session, run_outputs, api_visibility="private")
    c["import"].click(lambda text: handlers.import_json(runner, knobs, methods, text), c["paste"], run_outputs,
                      api_name="import_json")
    c["upload"].upload(lambda path: handlers.import_file(runner, knobs, methods, path), c["upload"], run_outputs,
                       api_name="import_file")


def build_demo(default_model: str = DEFAULT_PRESET, cache_dir: Path | None = None) -> gr.Blocks:
    """The whole app; `default_model` is the preset the model picker starts on (tests use tiny-*)."""
    methods = available_methods()
    knobs = all_knobs(methods)
    runner = Runner(cache_dir)
    first = first_run(default_model, devices()[-1], methods)
    with gr.Blocks(title="SpecFlash", analytics_enabled=False) as demo:
        session = gr.State(Session())
        gr.Markdown(INTRO)
        with gr.Tabs() as tabs:
            with gr.Tab("Run", id="run"):
                c = run_panel(default_model, methods, first)
            c.update(inspector_panels())
            with gr.Tab("Compare", id="compare"):
                c.update(compare_panel(methods, default_model, cache_dir))
            with gr.Tab("Export / import", id="io"):
                c.update(io_panel())
        wire(c, runner, knobs, methods, session, tabs)
        demo.load(None, js=views.TOKEN_CLICK_JS)
    demo.queue(default_concurrency_limit=1)
    return demo
