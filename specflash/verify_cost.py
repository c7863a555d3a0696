"""The device's verify-cost curve c(l): a target forward of l tokens, relative to one token.

Whether verifying one more drafted token pays depends on this curve: nearly flat on a GPU at
batch 1, steep on a CPU. It is measured once per (model, device) on a fixed prefix, medians over
repeats, and cached as JSON so later runs reuse it. A batch of B rows has its own curve c_B(l)
(B rows x l tokens, relative to B rows x 1 token): a batched step pays for the longest row, so
its cut is one common length for the whole batch (`best_common_cut`).
"""

from __future__ import annotations

import json
import time
from itertools import accumulate
from operator import mul
from pathlib import Path

import torch

from .engine import sync_device

METHOD = "rounds"  # names how the curve is measured and fitted, in its cache files: older ones are measured again


def measure_verify_cost(target, max_len: int, repeats: int = 5, prefix_len: int = 64, batch: int = 1) -> list[float]:
    """[c(1) = 1, c(2), ..., c(max_len)], each a forward of `batch` rows: medians over `repeats`
    rounds, each round timing every length once (after one round that warms up), so that a
    change in the machine's load weighs on all lengths alike. Timed length after length instead,
    a burst of load while 2 tokens were timed once gave c(2) = 1.45 on a machine where a quiet
    run gives 1.00 (SmolLM2-135M, 2 threads, packed kernel), and the fit carried it to c(8)."""
    prefix = [i % target.vocab_size for i in range(10, 10 + prefix_len)]
    times: list[list[float]] = [[] for _ in range(max_len)]
    for round_ in range(repeats + 1):
        for n in range(1, max_len + 1):
            cache = target.new_cache()
            _forward(target, prefix, cache, 0, batch, last_only=True)
            block = [(20 + i) % target.vocab_size for i in range(n)]
            sync_device(target.device)
            t0 = time.perf_counter()
            _forward(target, block, cache, prefix_len, batch)
            sync_device(target.device)
            if round_:
                times[n - 1].append(time.perf_counter() - t0)
    medians = [sorted(t)[len(t) // 2] for t in times]
    return [m / medians[0] for m in medians]


@torch.inference_mode()
def _forward(target, ids: list[int], cache, start: int, batch: int, last_only: bool = False) -> None:
    """The same `ids` in each of `batch` rows at positions start..: the target wrapper's own
    forward at batch 1, the model's plain causal forward (no padding to mask) above it."""
    if batch == 1:
        target.forward(ids, cache, start, last_only=last_only)
        return
    input_ids = torch.tensor([ids] * batch, device=target.device)  # [B, n]
    positions = torch.arange(start, start + len(ids), device=target.device)[None].expand(batch, -1)
    target.model(input_ids=input_ids, position_ids=positions, cache=cache, use_cache=True,
                 logits_to_keep=1 if last_only else 0)


def monotone(curve: list[float]) -> list[float]:
    """The nearest non-decreasing curve (least squares: pool adjacent violators), scaled so that
    c(1) = 1. Verifying more tokens never costs less, but timing noise can say otherwise; pooling
    averages a point timed too high with the lengths after it, where a running maximum let that
    one point raise every longer length."""
    pools: list[list[float]] = []  # [sum, count] of runs of equal fitted values
    for c in curve:
        pools.append([c, 1])
        while len(pools) > 1 and pools[-2][0] / pools[-2][1] > pools[-1][0] / pools[-1][1]:
            total, count = pools.pop()
            pools[-1][0] += total
            pools[-1][1] += count
    fitted = [total / count for total, count in pools for _ in range(int(count))]
    return [c / fitted[0] for c in fitted]


def cached_verify_cost(target, max_len: int, cache_dir: Path | None, batch: int = 1) -> list[float]:
    """The curve from `cache_dir/verify-cost/` if measured before for this model, device, batch
    size and, on a CPU, number of torch threads: the curve depends on it (SmolLM2-135M on a
    2-core machine: verifying 7 tokens cost 2.05x one with one thread, 1.84x with two), as the
    row-kernel choice the target runs on does (row_kernels.tune keys it the same way)."""
    if cache_dir is None:
        return monotone(measure_verify_cost(target, max_len, batch=batch))
    threads = f"-t{torch.get_num_threads()}" if target.device.type == "cpu" else ""
    suffix = "" if batch == 1 else f"-b{batch}"
    key = (f"{Path(str(target.name)).name}-{target.device.type}{threads}-{str(target.dtype).split('.')[-1]}"
           f"{target.kernel_tag}{suffix}-{METHOD}.json")
    path = Path(cache_dir) / "verify-cost" / key
    if path.exists():
        curve = json.loads(path.read_text())
        if len(curve) >= max_len:
            return curve[:max_len]
    curve = monotone(measure_verify_cost(target, max_len, batch=batch))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(curve))
    return curve


def best_cut(confidences: list[float], cost: list[float], draft_cost: float = 0.0) -> int:
    """How many drafted tokens m to verify: argmax over m of expected committed tokens per unit
    cost, E(m) = 1 + sum_{j<=m} prod_{i<=j} conf_i over cost(m) = c(m + 1) + draft_cost."""
    return best_node_count(list(accumulate(confidences, mul)), cost, draft_cost)


def best_node_count(path_probs: list[float], cost: list[float], draft_cost: float = 0.0) -> int:
    """How many of a draft tree's nodes to verify, taken in order (each after its parent): argmax
    over n of (1 + sum_{i<=n} P_i) / (c(n + 1) + draft_cost), P_i the chance that node i's path is
    accepted, so the sum is the expected number of accepted drafts (a chain's P_j is the product of
    its first j confidences: `best_cut`)."""
    best_n, best_value, expected = 0, 1.0 / (cost[0] + draft_cost), 1.0
    for n, p in enumerate(path_probs, start=1):
        if n >= len(cost):
            break
        expected += p
        value = expected / (cost[n] + draft_cost)
        if value > best_value:
            best_n, best_value = n, value
    return best_n


def best_common_cut(confidences_per_row: list[list[float]], cost: list[float], draft_cost: float = 0.0) -> int:
    """One cut m for a whole batch, whose forward feeds every row m + 1 positions: argmax over m
    of sum_b E_b(m) / (c_B(m + 1) + draft_cost), with E_b as in `best_cut` over row b's own
    confidences (a row with fewer drafts than m verifies all of them and gains nothing more).
    With one row this is `best_cut`."""
    deepest = max((len(conf) for conf in confidences_per_row), default=0)
    survive = [1.0] * len(confidences_per_row)
    expected = float(len(confidences_per_row))  # sum_b E_b(0): every row commits the target's token
    best_m, best_value = 0, expected / (cost[0] + draft_cost)
    for m in range(1, deepest + 1):
        if m >= len(cost):
            break
        for b, conf in enumerate(confidences_per_row):
            if m <= len(conf):
                survive[b] *= conf[m - 1]
                expected += survive[b]
        value = expected / (cost[m] + draft_cost)
        if value > best_value:
            best_m, best_value = m, value
    return best_m
