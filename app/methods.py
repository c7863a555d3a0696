"""Which methods this build can run, and their knobs, read from the engine's own config classes.

The app never keeps its own list of knobs: each method's `CONFIG` dataclass (its fields, types
and defaults) is the source, so a method that lands in specflash/drafters (adaflash, dels, ...)
shows its knobs here without an app change. Methods registered in METHODS whose module is not
in this checkout yet are reported as unavailable rather than offered and failing. No gradio here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specflash.drafters import METHODS
from specflash.errors import SpecFlashError
from specflash.models.presets import PRESETS, default_drafter

# Friendlier labels for knobs we know; any other field shows under its own name.
LABELS = {
    "k": "k (draft length)",
    "max_ngram": "max n-gram",
    "min_ngram": "min n-gram",
    "block_size": "block size",
    "max_draft": "max draft length",
    "alpha": "α",
    "beta": "β",
    "lookup": "prompt lookup beside the drafter",
    "graft_lookup": "graft prompt lookup onto the tree",
    "datastore": "graft the target's earlier answers (datastore) onto the tree",
    "datastore_folder": "datastore: folder of harvests",
    "datastore_min_ngram": "datastore: shortest match (tokens)",
}


@dataclass(frozen=True)
class Knob:
    """One method knob: `method.name`, its default and the Python type values are cast to."""

    method: str
    name: str
    default: Any
    kind: type
    choices: tuple[Any, ...] | None = None  # a fixed set of values (the config field's metadata says)

    @property
    def label(self) -> str:
        label = LABELS.get(self.name, self.name.replace("_", " "))
        return label + " (blank: the method's choice)" if self.default is None else label


def method_available(name: str) -> bool:
    """True when the method's module exists in this checkout (it may still need a drafter)."""
    return importlib.util.find_spec(f"specflash.drafters.{METHODS[name].module}") is not None


def available_methods() -> list[str]:
    return [name for name in METHODS if method_available(name)]


def unavailable_methods() -> list[str]:
    return [name for name in METHODS if not method_available(name)]


_PLAIN = (bool, int, float, str)


def _kind(f: dataclasses.Field) -> type | None:
    """The plain type of a field with a default: from the default, or from the annotation when
    the default is None ("int | None" means: blank for the method's own choice, or an int)."""
    if isinstance(f.default, _PLAIN):
        return type(f.default)
    if f.default is None:
        annotation = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        return next((t for t in _PLAIN if annotation.split("|")[0].strip() == t.__name__), None)
    return None


def method_knobs(name: str) -> list[Knob]:
    """The knobs of one method, in field order; fields that are not plain values are left out."""
    config_cls = METHODS[name].load().CONFIG
    knobs = []
    for f in dataclasses.fields(config_cls):
        kind = _kind(f)
        if kind is not None:
            choices = f.metadata.get("choices")
            knobs.append(Knob(name, f.name, f.default, kind, tuple(choices) if choices else None))
    return knobs


def missing_drafter(preset: str, method: str, cache_dir: Path | None) -> str | None:
    """Why the preset cannot run this method as it stands (None when it can): a method that
    drafts with a model needs the preset to name one, or the user to give one on the Run tab."""
    role = METHODS[method].drafter_role
    if role is None:
        return None
    try:
        if default_drafter(preset, method, cache_dir) is not None:
            return None
    except SpecFlashError as exc:
        return " ".join(str(exc).split())
    where = f"the {preset} preset has no {role} drafter" if preset in PRESETS else f"{preset} is not a preset"
    return f"{where}; give one in the Run tab's drafter field"


def method_note(name: str) -> str:
    """One line on what the method does and what it needs, from the engine's registry."""
    info = METHODS[name]
    needs = ("It drafts with a drafter model: the preset's own, or the folder or preset in the drafter field."
             if info.drafter_role else "It needs nothing but the target.")
    return f"**{name}**: {info.summary}. {needs}"


def all_knobs(methods: list[str]) -> list[Knob]:
    """Every knob of every listed method, in a fixed order (the order of the UI's inputs)."""
    return [knob for name in methods for knob in method_knobs(name)]


def options_for(method: str, knobs: list[Knob], values: list[Any]) -> dict[str, Any]:
    """The `options` dict for specflash.stream: this method's knob values, cast to their types.

    A value equal to the default is still passed, so the RunRecord's config says what ran.
    A blank value falls back to the default (None: the method picks).
    """
    options = {}
    for knob, value in zip(knobs, values):
        if knob.method != method:
            continue
        if isinstance(value, str) and knob.kind is not str:
            value = value.strip()
        if value is None or value == "":
            value = knob.default
        options[knob.name] = value if value is None else _cast(knob.kind, value)
    return options


def _cast(kind: type, value: Any) -> Any:
    """Numbers typed into a text box become numbers; anything unreadable is passed on as it is,
    for the engine's config to reject with its own message."""
    if isinstance(value, str) and kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            return value
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
