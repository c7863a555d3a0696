"""The device's verify-cost curve c(l): a target forward of l tokens, relative to one token.

Whether verifying one more drafted token pays depends on this curve: nearly flat on a GPU at
batch 1, steep on a CPU. It is measured once per (model, device) on a fixed prefix, medians over
repeats, and cached as JSON so later runs reuse it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .engine import sync_device


def measure_verify_cost(target, max_len: int, repeats: int = 5, prefix_len: int = 64) -> list[float]:
    """[c(1) = 1, c(2), ..., c(max_len)]."""
    prefix = [i % target.vocab_size for i in range(10, 10 + prefix_len)]
    medians = []
    for n in range(1, max_len + 1):
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            cache = target.new_cache()
            target.forward(prefix, cache, 0, last_only=True)
            block = [(20 + i) % target.vocab_size for i in range(n)]
            sync_device(target.device)
            t0 = time.perf_counter()
            target.forward(block, cache, prefix_len)
            sync_device(target.device)
            times.append(time.perf_counter() - t0)
        medians.append(sorted(times[1:])[len(times[1:]) // 2])
    base = medians[0]
    return [m / base for m in medians]


def monotone(curve: list[float]) -> list[float]:
    """Running maximum: verifying more tokens never costs less (timing noise can say otherwise)."""
    out, best = [], 0.0
    for c in curve:
        best = max(best, c)
        out.append(best)
    return out


def cached_verify_cost(target, max_len: int, cache_dir: Path | None) -> list[float]:
    """The curve from `cache_dir/verify-cost/` if measured before for this model and device."""
    if cache_dir is None:
        return monotone(measure_verify_cost(target, max_len))
    key = f"{Path(str(target.name)).name}-{target.device.type}-{str(target.dtype).split('.')[-1]}.json"
    path = Path(cache_dir) / "verify-cost" / key
    if path.exists():
        curve = json.loads(path.read_text())
        if len(curve) >= max_len:
            return curve[:max_len]
    curve = monotone(measure_verify_cost(target, max_len))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve))
    return curve


def best_cut(confidences: list[float], cost: list[float], draft_cost: float = 0.0) -> int:
    """How many drafted tokens m to verify: argmax over m of expected committed tokens per unit
    cost, E(m) = 1 + sum_{j<=m} prod_{i<=j} conf_i over cost(m) = c(m + 1) + draft_cost."""
    best_m, best_value, expected, survive = 0, 1.0 / (cost[0] + draft_cost), 1.0, 1.0
    for m, conf in enumerate(confidences, start=1):
        if m >= len(cost):
            break
        survive *= conf
        expected += survive
        value = expected / (cost[m] + draft_cost)
        if value > best_value:
            best_m, best_value = m, value
    return best_m
