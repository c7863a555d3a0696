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

from . import handlers
from .handlers import RunInputs, Session
from .methods import Knob, all_knobs, available_methods, unavailable_methods
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
    if knob.default is None:  # a Number cannot be blank in the browser (it shows and sends 0)
        return gr.Textbox(value="", label=knob.label, placeholder="blank")
    if knob.kind is bool:
        return gr.Checkbox(value=knob.default, label=knob.label)
    if knob.kind in (int, float):
        return gr.Number(value=knob.default, label=knob.label, precision=0 if knob.kind is int else None)
    return gr.Textbox(value=knob.default, label=knob.label)


def method_controls(methods: list[str], default: str) -> tuple[list[gr.Group], list[str], list[Any]]:
    """One group of knob inputs per method that has knobs, shown only while it is chosen."""
    groups, owners, components = [], [], []
    for method in methods:
        knobs = all_knobs([method])
        if not knobs:
            continue
        with gr.Group(visible=method == default) as group:
            gr.Markdown(f"**{method} knobs**")
            components += [knob_component(k) for k in knobs]
        groups.append(group)
        owners.append(method)
    return groups, owners, components


def run_panel(default_model: str, methods: list[str]) -> dict[str, Any]:
    """The Run tab: controls on the left, the coloured output and stats on the right."""
    c: dict[str, Any] = {}
    with gr.Row():
        with gr.Column(scale=2):
            c["example"] = gr.Dropdown(prompt_choices(), value=None, label="held-out prompt (or type your own)")
            c["prompt"] = gr.Textbox(label="prompt", lines=3, elem_id="prompt")
            with gr.Row():
                c["method"] = gr.Dropdown(methods, value=methods[0], label="method", elem_id="method")
                c["model"] = gr.Dropdown(list(PRESETS), value=default_model, label="model preset",
                                         allow_custom_value=True, elem_id="model")
                c["device"] = gr.Dropdown(devices(), value=devices()[-1], label="device")
            with gr.Row():
                c["temperature"] = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="temperature (0 = greedy)")
                c["top_p"] = gr.Slider(0.05, 1.0, value=1.0, step=0.05, label="top-p")
            with gr.Row():
                c["seed"] = gr.Number(value=0, precision=0, label="seed")
                c["max_tokens"] = gr.Slider(1, 512, value=64, step=1, label="max new tokens", elem_id="max-tokens")
            c["groups"], c["owners"], c["knobs"] = method_controls(methods, methods[0])
            missing = unavailable_methods()
            if missing:
                gr.Markdown(f"*Not in this build yet: {', '.join(missing)}.*")
            with gr.Row():
                c["run"] = gr.Button("Generate", variant="primary", elem_id="run")
                c["stop"] = gr.Button("Stop", variant="stop", elem_id="stop")
        with gr.Column(scale=3):
            c["output"] = gr.HTML(elem_id="output")
            c["stats"] = gr.Markdown(elem_id="stats")
            c["text"] = gr.Textbox(label="output text", lines=3, interactive=False, elem_id="output-text")
    return c


def inspector_panels() -> dict[str, Any]:
    """Step inspector, PTD, DeLS and AdaFlash tabs (the Run tab's run feeds them all)."""
    c: dict[str, Any] = {}
    with gr.Tab("Step inspector", id="steps"):
        c["step_slider"] = gr.Slider(0, 1, value=0, step=1, label="step", elem_id="step-slider")
        c["step_html"] = gr.HTML(elem_id="step-table")
        c["step_fig"] = gr.Plot(elem_id="step-plot", show_label=False)
    with gr.Tab("PTD tree", id="ptd"):
        c["ptd_slider"] = gr.Slider(0, 1, value=0, step=1, label="replay step", elem_id="ptd-slider")
        c["ptd_note"] = gr.Markdown(elem_id="ptd-note")
        c["ptd_fig"] = gr.Plot(elem_id="ptd-plot", show_label=False, visible=False)
    with gr.Tab("DeLS", id="dels"):
        c["dels_note"] = gr.Markdown(elem_id="dels-note")
        c["dels_fig"] = gr.Plot(elem_id="dels-plot", show_label=False, visible=False)
    with gr.Tab("AdaFlash", id="adaflash"):
        c["ada_note"] = gr.Markdown(elem_id="ada-note")
        c["ada_fig"] = gr.Plot(elem_id="ada-plot", show_label=False, visible=False)
        c["ada_slider"] = gr.Slider(0, 1, value=0, step=1, label="step (cut on the draft)", elem_id="ada-slider")
        c["ada_cut"] = gr.HTML(elem_id="ada-cut")
    return c


def compare_panel(methods: list[str]) -> dict[str, Any]:
    c: dict[str, Any] = {}
    gr.Markdown("Runs each chosen method on the Run tab's prompt, model, sampling and seed; ar always runs as the baseline.")
    c["methods"] = gr.CheckboxGroup(methods, value=methods, label="methods", elem_id="compare-methods")
    c["button"] = gr.Button("Compare", variant="primary", elem_id="compare")
    c["note"] = gr.Markdown(elem_id="compare-note")
    c["table"] = gr.Dataframe(headers=COLUMNS, interactive=False, elem_id="compare-table")
    c["fig"] = gr.Plot(elem_id="compare-plot", show_label=False)
    c["accept"] = gr.Plot(elem_id="accept-plot", show_label=False)
    return c


def io_panel() -> dict[str, Any]:
    c: dict[str, Any] = {}
    gr.Markdown("Export the current run as JSON, or import one (from this app or `specflash generate --json`) "
                "to explore it here: every panel reads it.")
    with gr.Row():
        c["file"] = gr.File(label="download this run (.json)", interactive=False, elem_id="export-file")
        c["upload"] = gr.File(label="import a run (.json)", file_types=[".json"], type="filepath", elem_id="import-file")
    c["paste"] = gr.Textbox(label="or paste a run's JSON", lines=3, elem_id="import-text")
    c["import"] = gr.Button("Import pasted JSON", elem_id="import")
    c["json"] = gr.Code(language="json", label="this run's JSON", elem_id="export-json")
    return c


def wire(c: dict[str, Any], runner: Runner, knobs: list[Knob], session: gr.State) -> None:
    """All events: run/stop, method knobs, sliders, compare, import."""
    run_inputs = [c[k] for k in ("prompt", "method", "model", "device", "temperature", "top_p", "seed", "max_tokens")]
    run_outputs = [c[k] for k in ("output", "text", "stats")] + [session] + [c[k] for k in (
        "step_slider", "step_fig", "step_html", "ptd_slider", "ptd_fig", "ptd_note", "dels_fig", "dels_note",
        "ada_fig", "ada_note", "ada_slider", "ada_cut", "json", "file")]
    n = len(run_inputs)

    def on_run(*values: Any):
        yield from handlers.run(runner, knobs, RunInputs(*values[:n]), list(values[n:]))

    def on_compare(*values: Any):
        inputs = RunInputs(values[0], "ar", *values[1:n - 1])  # (prompt, model .. max tokens)
        yield from handlers.compare(runner, knobs, inputs, values[n - 1], list(values[n:]))

    def on_method(method: str):
        return [gr.update(visible=owner == method) for owner in c["owners"]]

    c["example"].change(lambda text: text or gr.skip(), c["example"], c["prompt"], api_visibility="private")
    if c["groups"]:
        c["method"].change(on_method, c["method"], c["groups"], api_visibility="private")
    run_event = c["run"].click(on_run, run_inputs + c["knobs"], run_outputs, api_name="run", concurrency_id="engine")
    c["stop"].click(handlers.stopped, session, run_outputs, cancels=[run_event], api_name="stop")
    c["step_slider"].change(handlers.step_panel, [session, c["step_slider"]], [c["step_fig"], c["step_html"]], api_name="step")
    c["ptd_slider"].change(handlers.ptd_panel, [session, c["ptd_slider"]], [c["ptd_fig"], c["ptd_note"]], api_name="ptd_step")
    c["ada_slider"].change(handlers.adaflash_cut, [session, c["ada_slider"]], c["ada_cut"], api_name="adaflash_step")
    compare_inputs = [c["prompt"]] + run_inputs[2:] + [c["methods"]] + c["knobs"]
    c["button"].click(on_compare, compare_inputs, [c["table"], c["fig"], c["accept"], c["note"]],
                      api_name="compare", concurrency_id="engine")
    c["import"].click(lambda text: handlers.import_json(runner, text), c["paste"], run_outputs, api_name="import_json")
    c["upload"].upload(lambda path: handlers.import_file(runner, path), c["upload"], run_outputs, api_name="import_file")


def build_demo(default_model: str = DEFAULT_PRESET, cache_dir: Path | None = None) -> gr.Blocks:
    """The whole app; `default_model` is the preset the model picker starts on (tests use tiny-*)."""
    methods = available_methods()
    knobs = all_knobs(methods)
    runner = Runner(cache_dir)
    with gr.Blocks(title="SpecFlash", analytics_enabled=False) as demo:
        session = gr.State(Session())
        gr.Markdown(INTRO)
        with gr.Tabs():
            with gr.Tab("Run", id="run"):
                c = run_panel(default_model, methods)
            c.update(inspector_panels())
            with gr.Tab("Compare", id="compare"):
                c.update(compare_panel(methods))
            with gr.Tab("Export / import", id="io"):
                c.update(io_panel())
        wire(c, runner, knobs, session)
    demo.queue(default_concurrency_limit=1)
    return demo
