"""A run's JSON back into a RunRecord, with messages a person can act on, and the Run tab's
settings that reproduce it.

People paste JSON from this app, from `specflash generate --json`, or something else entirely;
a wrong shape must say which part is wrong ("steps[3] is not an object"), not surface Python's
"argument after ** must be a mapping". Importing also puts the run's prompt, method, model,
sampling and knobs back into the controls, so the Run tab says what the panels show. No gradio.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from specflash.trace import RunRecord, StepRecord

from .methods import Knob

SHAPE = "a SpecFlash run JSON is an object with method, model, sampling, prompt_ids, steps and output_ids"


class RunJSONError(ValueError):
    """The text is not a SpecFlash run; the message says what is wrong with it."""


def _required(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def parse_run(text: str) -> RunRecord:
    """The RunRecord in `text`, or a RunJSONError naming the first thing that does not fit."""
    if not text or not text.strip():
        raise RunJSONError("nothing to import: paste a run's JSON or upload a .json file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RunJSONError(f"not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); {SHAPE}") from None
    if not isinstance(data, dict):
        raise RunJSONError(f"this JSON is not an object (it is a {type(data).__name__}); {SHAPE}")
    missing = [k for k in _required(RunRecord) if k not in data]
    if missing:
        raise RunJSONError(f"not a SpecFlash run JSON: it has no {', '.join(missing)}; {SHAPE}")
    if not isinstance(data["steps"], list):
        raise RunJSONError("not a SpecFlash run JSON: steps must be a list of step objects")
    step_fields = {f.name for f in dataclasses.fields(StepRecord)}
    for i, step in enumerate(data["steps"]):
        if not isinstance(step, dict):
            raise RunJSONError(f"not a SpecFlash run JSON: steps[{i}] is not an object (it is {json.dumps(step)[:40]})")
        absent = [k for k in _required(StepRecord) if k not in step]
        unknown = sorted(set(step) - step_fields)
        if absent or unknown:
            said = ([f"lacks {', '.join(absent)}"] if absent else []) + ([f"has unknown {', '.join(unknown)}"] if unknown else [])
            raise RunJSONError(f"not a SpecFlash run JSON: steps[{i}] {' and '.join(said)}")
    try:
        return RunRecord.from_dict(data)
    except (TypeError, ValueError, AttributeError) as exc:
        raise RunJSONError(f"not a SpecFlash run JSON: {exc}") from None


@dataclasses.dataclass(frozen=True)
class Settings:
    """Run tab values that reproduce a run; None leaves a control as it is."""

    prompt: str | None
    method: str | None
    model: str
    temperature: float
    top_p: float
    seed: int
    max_new_tokens: int | None
    knobs: list[Any]  # one per Knob, None where the run says nothing about it


def run_settings(run: RunRecord, knobs: list[Knob], methods: list[str]) -> Settings:
    """The controls' values for this run (a knob of another method is left alone)."""
    s = run.sampling
    values = []
    for knob in knobs:
        if knob.method != run.method or knob.name not in run.config:
            values.append(None)
        else:
            value = run.config[knob.name]
            values.append("" if value is None else value)
    return Settings(
        prompt=run.prompt, method=run.method if run.method in methods else None, model=run.model,
        temperature=float(s.get("temperature", 0.0)), top_p=float(s.get("top_p", 1.0)), seed=int(s.get("seed", 0)),
        max_new_tokens=len(run.output_ids) if run.finish_reason == "length" else None, knobs=values,
    )
