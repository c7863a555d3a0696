"""What the app opens on: the prompt and method that won most clearly in a committed benchmark.

A first run on plain decoding shows no speculation at all, and a first run on a method that
loses here shows mostly rejections; neither tells a visitor what the tool is for. So the app
reads the benchmark JSON this repository ships for the preset (`python -m specflash bench`,
docs/bench-*.json) and preselects the (method, held-out prompt) with the highest measured
speedup over ar, saying where that figure came from. Wins where the draft gate's prompt lookup
drafted most steps are passed over while another win exists: they come from a prompt the target
repeats itself on (the 135M model loops), and show copying, not the method's drafter. Without a
benchmark for the preset it opens on the first held-out prompt and prompt lookup, and says that
nothing was measured.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from specflash.drafters import METHODS
from specflash.models.presets import REPO_ROOT, weights_fingerprint
from specflash.prompts import heldout_prompts

DOCS = Path(__file__).resolve().parents[1] / "docs"
FALLBACK_METHOD = "pld"
LOOKUP_DRIVEN = 0.5  # above this share of steps drafted by the gate's prompt lookup, a win is lookup's


@dataclass(frozen=True)
class FirstRun:
    prompt: str
    method: str
    note: str  # one sentence: why this prompt and method, and where the figure comes from


def _per_prompt_speedups(samples: Iterable[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(method, prompt id) -> median ar wall time over median method wall time, on that prompt."""
    walls: dict[tuple[str, str], list[float]] = {}
    for s in samples:
        walls.setdefault((s["method"], s["prompt_id"]), []).append(float(s["wall"]))
    medians = {key: statistics.median(values) for key, values in walls.items()}
    return {(method, pid): medians[("ar", pid)] / wall for (method, pid), wall in medians.items()
            if method != "ar" and ("ar", pid) in medians and wall > 0}


def _lookup_shares(samples: Iterable[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """(method, prompt id) -> share of its decode steps that the gate's prompt lookup drafted."""
    counts: dict[tuple[str, str], list[int]] = {}
    for s in samples:
        metrics = s.get("metrics", {})
        pair = counts.setdefault((s["method"], s["prompt_id"]), [0, 0])
        pair[0] += metrics.get("lookup_steps", 0)
        pair[1] += metrics.get("decode_steps", 0)
    return {key: looked / steps for key, (looked, steps) in counts.items() if steps}


def bench_for(preset: str, device: str, docs: Path = DOCS) -> tuple[Path, dict[str, Any]] | None:
    """The committed benchmark of this preset on this kind of device, if the repository has one:
    of several (docs/ also keeps narrower A/B runs and runs of drafters shipped before), one that
    measured the weights shipped now (`measures_shipped_weights`), then the one over the most
    prompts (the figures least swayed by a few easy or hard ones), then the one that compares the
    most methods, then the newest (by date, then by the time its run started)."""
    found = []
    for path in sorted(docs.glob("bench-*.json")):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        samples = data.get("samples") or [{}]
        per_prompt = all("prompt_id" in s and "wall" in s for s in samples)  # not a batched benchmark
        if data.get("model") == preset and str(data.get("device", "")).startswith(device) and per_prompt:
            rank = (measures_shipped_weights(data), len({s["prompt_id"] for s in samples}),
                    len({s["method"] for s in samples}), data.get("date", ""), data.get("started", ""))
            found.append((rank, path, data))
    if not found:
        return None
    _, path, data = max(found, key=lambda item: item[0])  # the first in name order on a tie
    return path, data


def measures_shipped_weights(data: dict[str, Any]) -> bool:
    """Whether a benchmark recorded the weights it ran (specflash.bench.measured_weights) and
    every one of them is, byte for byte, what the repository holds at that path now."""
    recorded = {(part["path"], part["weights"])  # each folder digested once, however many methods ran it
                for parts in data.get("weights", {}).values() for part in parts.values()}
    return bool(recorded) and all(weights_fingerprint(REPO_ROOT / path) == digest for path, digest in recorded)


def first_run(preset: str, device: str, methods: list[str], docs: Path = DOCS) -> FirstRun:
    """The preselected prompt and method for this preset and device (see the module docstring)."""
    prompts = {p.id: p for p in heldout_prompts()}
    fallback = FALLBACK_METHOD if FALLBACK_METHOD in methods else methods[0]
    found = bench_for(preset, device, docs)
    if found:
        path, data = found
        lookup = _lookup_shares(data["samples"])
        ranked = sorted(((lookup.get(key, 0.0) <= LOOKUP_DRIVEN, s, key)
                         for key, s in _per_prompt_speedups(data["samples"]).items()
                         if key[0] in methods and key[0] in METHODS and key[1] in prompts), reverse=True)
        if ranked:
            _, speed, (method, pid) = ranked[0]
            return FirstRun(prompts[pid].text, method, (
                f"Preselected: **{method}** on a held-out {prompts[pid].domain} prompt, the clearest win measured "
                f"for {preset} on {device}: {speed:.2f}x plain decoding (median wall time over "
                f"{data.get('repeats', 1)} repeats, `{path.relative_to(path.parents[1]).as_posix()}`, made by "
                f"`python -m specflash bench`). Pick any prompt or method to see others."))
    first = heldout_prompts()[0]
    return FirstRun(first.text, fallback, (
        f"Preselected: **{fallback}** on a held-out {first.domain} prompt; no benchmark of {preset} on {device} "
        "ships with this build, so nothing here says which method wins on it."))
