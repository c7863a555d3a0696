"""The app launched in-process and driven through gradio_client, like a script or a Space user:
every method this checkout runs on a tiny preset gives exactly specflash.generate's output, and
bad input comes back as the engine's own message."""

from __future__ import annotations

import json
import socket

import pytest

gradio_client = pytest.importorskip("gradio_client")

import specflash
from app import handlers
from app.methods import all_knobs, available_methods, method_available
from app.ui import build_demo
from specflash.config import SamplingConfig
from specflash.errors import SpecFlashError
from specflash.models.presets import default_drafter

PRESET = "tiny-qwen3"
PROMPT = "What is 12 * 7? The answer is 84. What is 12 * 7?"
MAX_NEW = 16
KNOBS = all_knobs(available_methods())
# /run, /import_json and /stop return the Run outputs in this order (the session state is not sent)
OUT = {name: i for i, name in enumerate((
    "html", "text", "stats", "step_slider", "step_fig", "step_html", "ptd_slider", "ptd_fig", "ptd_anim", "ptd_note",
    "dels_note", "dels_summary", "dels_slider", "dels_fig", "dels_step", "ada_fig", "ada_note", "ada_slider", "ada_cut",
    "lattice_run", "lattice_slider", "lattice_fig", "lattice_note", "json", "file",
    "set_prompt", "set_method", "set_model", "set_temperature", "set_top_p", "set_seed", "set_max_tokens"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def client(tiny_root):
    demo = build_demo(default_model=PRESET, cache_dir=tiny_root)
    _, url, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True)
    try:
        yield gradio_client.Client(url, verbose=False)
    finally:
        demo.close()


@pytest.fixture(scope="module")
def target(tiny_root):
    return specflash.load(PRESET, device="cpu", cache_dir=tiny_root)


def run_args(prompt=PROMPT, method="ar", temperature=0.0, top_p=1.0, seed=0, knobs=None, model=PRESET, drafter="",
             max_new=MAX_NEW):
    """Positional inputs of /run: the Run panel's controls, then every knob (defaults unless given)."""
    knobs = knobs or {}
    values = [knobs.get(k.name, k.default) if k.method == method else k.default for k in KNOBS]
    values = ["" if v is None else v for v in values]  # blank text boxes, as the browser sends them
    return [prompt, method, model, "cpu", drafter, temperature, top_p, seed, max_new, *values]


def compare_args(methods, repeats=1, **kw):
    """Positional inputs of /compare: the Run panel's prompt and settings (no method), the methods,
    the repeats, then every knob."""
    args = run_args(**kw)
    return [args[0], *args[2:9], methods, repeats, *args[9:]]


def reference(target, tiny_root, method, temperature=0.0, top_p=1.0, seed=0):
    return specflash.generate(
        target, PROMPT, method, max_new_tokens=MAX_NEW, sampling=SamplingConfig(temperature=temperature, top_p=top_p, seed=seed),
        drafter=default_drafter(PRESET, method, tiny_root), cache_dir=tiny_root,
    )


def final_outputs(client, args):
    """The last yield of the streaming /run endpoint, and how many yields there were."""
    job = client.submit(*args, api_name="/run")
    outputs = job.result()
    return outputs, len(job.outputs())


@pytest.mark.parametrize("method", ["ar", "pld", "draft", "dflash", "ptd"])
def test_run_matches_generate(client, target, tiny_root, method):
    if not method_available(method):
        pytest.skip(f"method {method!r} is registered but specflash/drafters has no module for it in this checkout")
    try:
        expected = reference(target, tiny_root, method)
    except SpecFlashError as exc:
        pytest.skip(f"{method!r} cannot run on {PRESET}: {exc}")
    outputs, yields = final_outputs(client, run_args(method=method))
    html, text, stats = outputs[OUT["html"]], outputs[OUT["text"]], outputs[OUT["stats"]]
    record = json.loads(outputs[OUT["json"]])
    assert record["output_ids"] == expected.output_ids
    assert [s["committed"] for s in record["steps"]] == [s.committed for s in expected.steps]
    assert text == target.tokenizer.decode(expected.output_ids, skip_special_tokens=True)
    assert html.count('class="tok tok-') == len(expected.output_ids)
    assert f"| method | {method} |" in stats and "| device | cpu |" in stats
    assert yields >= len(expected.steps)  # streamed: one yield per target forward at least


def test_sampled_run_matches_generate_with_the_same_seed(client, target, tiny_root):
    expected = reference(target, tiny_root, "pld", temperature=0.8, top_p=0.9, seed=7)
    outputs, _ = final_outputs(client, run_args(method="pld", temperature=0.8, top_p=0.9, seed=7))
    assert json.loads(outputs[OUT["json"]])["output_ids"] == expected.output_ids


def test_knobs_reach_the_engine(client):
    outputs, _ = final_outputs(client, run_args(method="pld", knobs={"k": 2}))
    assert json.loads(outputs[OUT["json"]])["config"]["k"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (run_args(prompt="   "), "the prompt is empty"),
        (run_args(method="pld", knobs={"k": 0}), "k (draft length) must be an integer >= 1"),
        (run_args(method="pld", knobs={"max_ngram": 1, "min_ngram": 3}), "max_ngram (1) must be >= min_ngram (3)"),
        (run_args(model="qwen3-4b"), "not in the local Hugging Face cache"),
        (run_args(model="no-such-model-here"), "no-such-model-here"),
    ],
)
def test_bad_input_returns_the_engines_message(client, args, message):
    with pytest.raises(gradio_client.exceptions.AppError) as info:
        client.predict(*args, api_name="/run")
    assert message in str(info.value)
    assert "Traceback" not in str(info.value)


def test_import_feeds_every_panel(client, target, tiny_root):
    run = reference(target, tiny_root, "pld")
    outputs = client.predict(run.to_json(), api_name="/import_json")
    assert outputs[OUT["text"]] == target.tokenizer.decode(run.output_ids, skip_special_tokens=True)
    assert json.loads(outputs[OUT["json"]])["output_ids"] == run.output_ids
    assert "no PTD tree" in outputs[OUT["ptd_note"]] and "no DeLS" in outputs[OUT["dels_note"]]
    assert outputs[OUT["step_slider"]]["maximum"] == len(run.steps) - 1
    with pytest.raises(gradio_client.exceptions.AppError, match="not JSON .* a SpecFlash run JSON is an object"):
        client.predict("{not json", api_name="/import_json")


def test_compare_runs_ar_as_the_baseline_with_repeats(client):
    table, _, _, note, cost, outputs = client.predict(*compare_args(["pld"], repeats=2), api_name="/compare")
    rows, columns = table["data"], table["headers"]
    assert [r[0] for r in rows] == ["ar", "pld"]
    speedup, identical = columns.index("speedup vs ar median (range)"), columns.index("identical to ar")
    assert rows[0][speedup] == "1.00x" and rows[1][identical] == "yes"
    assert all(r[columns.index("sampling")] == "T=0 (greedy), top-p 1, seed 0" for r in rows)
    assert "measured on cpu" in note and "median of 2 interleaved repeat(s)" in note
    assert outputs.count('class="compare-output"') == 2
    assert outputs.count('class="sf-legend"') == 1  # one colour legend above the columns


def test_the_token_limit_is_said_when_it_is_not_what_was_typed(client, monkeypatch):
    monkeypatch.setattr(handlers, "MAX_NEW_TOKENS", 20)  # the server runs in this process
    outputs, _ = final_outputs(client, run_args(max_new=100000))
    assert "asked 100000, used 20" in outputs[OUT["stats"]]
    assert len(json.loads(outputs[OUT["json"]])["output_ids"]) <= 20
    with pytest.raises(gradio_client.exceptions.AppError, match="max new tokens must be at least 1"):
        client.predict(*run_args(max_new=0), api_name="/run")


def test_import_restores_the_run_tab(client, target, tiny_root):
    run = specflash.generate(target, "Count to five.", "pld", max_new_tokens=MAX_NEW, options={"k": 3},
                             sampling=SamplingConfig(temperature=0.7, top_p=0.9, seed=5), cache_dir=tiny_root)
    outputs = client.predict(run.to_json(), api_name="/import_json")
    assert outputs[OUT["set_prompt"]] == "Count to five."
    assert outputs[OUT["set_method"]] == "pld"
    assert (outputs[OUT["set_temperature"]], outputs[OUT["set_top_p"]], outputs[OUT["set_seed"]]) == (0.7, 0.9, 5)
    k = next(i for i, knob in enumerate(KNOBS) if (knob.method, knob.name) == ("pld", "k"))
    assert outputs[len(OUT) + k] == 3


@pytest.mark.parametrize(("text", "message"), [
    ("[1, 2]", "this JSON is not an object (it is a list)"),
    ('{"method": "ar"}', "it has no config, sampling"),
    ('{"method": "ar", "config": {}, "sampling": {}, "model": "m", "device": "cpu", "prompt_ids": [], '
     '"steps": [3], "output_ids": [], "finish_reason": "eos", "prefill_time": 0}', "steps[0] is not an object (it is 3)"),
])
def test_a_wrongly_shaped_json_gets_a_plain_message(client, text, message):
    with pytest.raises(gradio_client.exceptions.AppError) as info:
        client.predict(text, api_name="/import_json")
    assert message in str(info.value) and "mapping" not in str(info.value)
