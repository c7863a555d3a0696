"""The app's only door to the engine: load each model once, run a method, turn errors into gr.Error.

Models load lazily, once per (preset, device), and are shared by every session; so are the last
few drafters built (by method, drafter and knobs), as a server keeps its drafters: a run skips
building one (the DeLS drafter's tables, a DFlash checkpoint's load) and its draft gate starts from
what the same drafter measured of the device last time. The queue runs one decoding at a time
(see ui.py), so sharing a target and its drafters is safe. Every SpecFlashError becomes a
gr.Error carrying the engine's own message (bad prompt, bad knob, preset that needs files), so a
user never sees a stack trace. On a ZeroGPU Space the decoding generator runs under
`spaces.GPU`; it yields plain CPU-side records only (ids and floats), never tensors.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import gradio as gr
import torch

import specflash
from specflash.api import default_device, pack_run
from specflash.drafters import build_drafter
from specflash.drafters.base import Drafter
from specflash.drafters.adaflash import annotate_cuts
from specflash.config import SamplingConfig
from specflash.engine import Decoding
from specflash.errors import SpecFlashError
from specflash.models.presets import default_drafter
from specflash.models.target import TargetModel
from specflash.trace import RunRecord, StepRecord
from specflash.models.acquire import default_cache_dir
from specflash.verify_cost import cached_verify_cost

from .views_lattice import lattice_ids

try:  # a ZeroGPU Space: run decoding on the borrowed GPU
    import spaces

    gpu: Callable = spaces.GPU(duration=120)
except ImportError:  # anywhere else: the identity

    def gpu(fn: Callable) -> Callable:
        return fn


@contextmanager
def engine_errors() -> Iterator[None]:
    """Show any SpecFlashError as a gr.Error with the engine's message, without a traceback."""
    try:
        yield
    except SpecFlashError as exc:
        message = " ".join(str(exc).split())
        raise gr.Error(message, title=type(exc).__name__, print_exception=False) from None


def devices() -> list[str]:
    """Devices a user may pick here: cpu, and cuda when present."""
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


DRAFTERS_KEPT = 8  # built drafters kept, the least recently used dropped first (DeLS's: ~100 MB)


class Runner:
    """Loaded targets by (preset, device), the drafters built for them, and the calls the UI makes."""

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir
        self._targets: dict[tuple[str, str], TargetModel] = {}
        self._drafters: OrderedDict[tuple, Drafter] = OrderedDict()
        self._lock = threading.Lock()

    def has(self, preset: str, device: str) -> bool:
        """Whether this target is loaded already (else the UI says it is loading)."""
        return (preset, device) in self._targets

    def target(self, preset: str, device: str) -> TargetModel:
        """The target for a preset on a device, loaded on first use."""
        key = (preset, device)
        with self._lock:
            if key not in self._targets:
                with engine_errors():
                    self._targets[key] = specflash.load(preset, device=device, cache_dir=self.cache_dir)
            return self._targets[key]

    def verify_cost(self, preset: str, device: str, max_len: int = 8) -> list[float]:
        """This device's verify-cost curve for the preset's target (measured once, then cached)."""
        return cached_verify_cost(self.target(preset, device), max_len, self.cache_dir or default_cache_dir())

    def loaded(self, preset: str) -> TargetModel | None:
        return next((t for (name, _), t in self._targets.items() if name == preset), None)

    def decoding(self, target: TargetModel, preset: str, prompt: str, method: str, sampling: SamplingConfig,
                 max_new_tokens: int, options: dict[str, Any], drafter: str | None = None) -> Decoding:
        """A ready Decoding with `drafter`, or the preset's drafter where the method needs one."""
        with engine_errors():
            drafter = drafter or default_drafter(preset, method, self.cache_dir)
            built = self.drafter(target, method, options, drafter)
            return specflash.stream(target, prompt, method, max_new_tokens=max_new_tokens, sampling=sampling,
                                    drafter=built)

    def drafter(self, target: TargetModel, method: str, options: dict[str, Any], drafter: str | None) -> Drafter:
        """The method's drafter for `target` with these knobs and drafter weights: built once, then
        kept (the last DRAFTERS_KEPT); each run starts it afresh (Drafter.begin)."""
        key = (id(target), method, drafter, json.dumps(options, sort_keys=True, default=str))
        with self._lock:
            if key in self._drafters:
                self._drafters.move_to_end(key)
                return self._drafters[key]
        built = build_drafter(method, target, options, drafter, cache_dir=self.cache_dir)
        with self._lock:
            self._drafters[key] = built
            while len(self._drafters) > DRAFTERS_KEPT:
                self._drafters.popitem(last=False)
        return built

    def stream(self, preset: str, device: str, prompt: str, method: str, sampling: SamplingConfig,
               max_new_tokens: int, options: dict[str, Any], drafter: str | None = None,
               ) -> Iterator[tuple[StepRecord, RunRecord]]:
        """(the new step, the run so far) after every target forward."""
        target = self.target(preset, device)
        decoding = self.decoding(target, preset, prompt, method, sampling, max_new_tokens, options, drafter)
        steps: list[StepRecord] = []
        with engine_errors():
            for step in _steps(decoding):
                steps.append(step)
                yield step, pack_run(decoding, steps, method, finish_reason="running")
        # The analysis (would the cut tokens have been accepted?) runs once the timing is over.
        yield steps[-1], annotate_cuts(pack_run(decoding, steps, method))

    def generate(self, preset: str, device: str, prompt: str, method: str, sampling: SamplingConfig,
                 max_new_tokens: int, options: dict[str, Any], drafter: str | None = None) -> RunRecord:
        """A whole run at once (the Compare panel)."""
        run = None
        for _, run in self.stream(preset, device, prompt, method, sampling, max_new_tokens, options, drafter):
            pass
        assert run is not None
        return run

    def token_texts(self, tokenizer: Any, ids: list[int], known: dict[int, str] | None = None) -> dict[int, str]:
        """Text of each token id, decoded one id at a time (specials kept), reusing `known`."""
        texts = dict(known or {})
        for token in ids:
            if token not in texts:
                texts[token] = tokenizer.decode([token], skip_special_tokens=False)
        return texts

    def texts_for_run(self, run: RunRecord) -> tuple[dict[int, str], str]:
        """(token texts, output text) for an imported run, from its model's tokenizer when this
        machine has it; without one, tokens show as ⟨id⟩."""
        target = self.loaded(run.model)
        if target is None:
            try:
                target = self.target(run.model, default_device())
            except gr.Error:
                return {}, " ".join(f"⟨{t}⟩" for t in run.output_ids)
        texts = self.token_texts(target.tokenizer, [t for s in run.steps for t in step_ids(s)])
        return texts, target.tokenizer.decode(run.output_ids, skip_special_tokens=True)


def step_ids(step: StepRecord) -> list[int]:
    """Every token id a step's views may show: draft, correction, committed, and those inside
    method extras (PTD draft trees, AdaFlash cut tokens, DeLS runner-ups, a gate's shadow draft)."""
    ids = [*step.tokens, step.correction, *step.committed, *(step.extras or {}).get("shadow", [])]
    ptd = step.extras.get("ptd") if step.extras else None
    if ptd:
        ids += ptd["draft_before"]["tokens"] + ptd["draft_after"]["tokens"]
    ada = step.extras.get("adaflash") if step.extras else None
    if ada:
        ids += list(ada.get("cut_tokens", []))
    dels = step.extras.get("dels") if step.extras else None
    if dels:
        ids += [int(a["token"]) for position in dels.get("alternatives") or [] for a in position]
    return ids + lattice_ids(step)


@gpu
def _steps(decoding: Decoding) -> Iterator[StepRecord]:
    """The decoding loop, on the GPU where one is borrowed; yields CPU-side StepRecords."""
    yield from decoding
