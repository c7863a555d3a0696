"""Matrix-multiply kernels for the few-row forwards of decoding on a CPU, chosen by measurement.

Why: every decoding step is a forward of 1 row (plain decoding) or a handful (verifying a
draft), and a small target streams all of its weights from memory on each one. PyTorch computes
a linear layer as x @ W^T: one row goes to a matrix-vector kernel, a few rows to a general GEMM
that repacks the (large) weight matrix on every call. On this project's 2-core CPU, SmolLM2-135M
paid 1.6x a one-token forward for two tokens and 2x for three, while the same products computed
the other way round, W @ x^T (the weight as the left operand, which the GEMM streams without
repacking), cost 0.8x and 0.95x: cheaper than the one-token forward itself, whose matrix-vector
kernel left one core idle. Which way wins depends on the machine, the thread count and the row
count, so it is measured for the loaded model and cached, per row count; the choice applies to
every method alike, plain decoding included (a single row is then padded to two),
so speed-ups stay measured against the fastest plain decoding this runtime has.

The GEMM also favours some row counts over others: with two threads here, 4 rows took less time
than 3, 8 less than 7, and 16 rows 87 ms against 147 ms for 15. So a row count may be padded with
zero rows up to a larger one that measured clearly faster; the plan maps each row count to the
rows it computes (1 is always padded to at least 2: a GEMM needs two rows).

Only the kernel changes: each output row is the same dot products, summed in another order, so
logits differ from the stock path by float rounding (about 1e-4 on SmolLM2), as they already
do between a one-row and a many-row forward. Installed on CPU float32 models only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

MAX_ROWS = 16  # above this a forward is a prefill or a batch, where the stock GEMM is right
METHOD = "alternating"  # names how `measure` times, in its cache files: older ones are measured again
KERNELS = "v3"  # names the weight-left kernel's code (v2: row-major output, v3: padded rows) in timing caches


RowPlan = Mapping[int, int]  # row count -> the rows its products compute as W @ x^T (>= it); absent: stock
STOCK: RowPlan = MappingProxyType({})


class RowKernelLinear(torch.nn.Linear):
    """nn.Linear that follows a row plan (shared by all layers of one model)."""

    row_plan: RowPlan = STOCK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_plan)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: RowPlan) -> torch.Tensor:
    """F.linear, computed as W @ x^T over zero-padded rows where `plan` says so."""
    rows = x.numel() // x.shape[-1]
    if rows not in plan:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = max(plan[rows], 2)  # a GEMM needs two rows
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[-1])])
    # row-major again: elementwise ops keep their input's layout, so a transposed result would
    # reach the next product (the MLP's down projection) as a [K, rows] operand, which took 3x as
    # long there (SmolLM2-135M, 2 threads: verifying 2 tokens cost 1.37x one, 1.12x with this copy)
    out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def install(model: torch.nn.Module, plan: RowPlan) -> int:
    """Route the model's plain nn.Linear layers through RowKernelLinear with this plan; returns
    how many layers it covers. The weights are not copied."""
    layers = [m for m in model.modules() if type(m) in (torch.nn.Linear, RowKernelLinear)]
    frozen = MappingProxyType(dict(plan))
    for layer in layers:
        layer.__class__ = RowKernelLinear
        layer.row_plan = frozen
    return len(layers)


def tag(plan: RowPlan) -> str:
    """Names a plan in file names, "-wl1.2.3p4-<KERNELS>" (n, or n padded to m as "npm"; "" when stock)."""
    if not plan:
        return ""
    rows = ".".join(str(n) if plan[n] == n else f"{n}p{plan[n]}" for n in sorted(plan))
    return f"-wl{rows}-{KERNELS}"


def applies(model: torch.nn.Module) -> bool:
    """CPU float32 weights: where the measured difference was found and the cost is only rounding."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


@torch.inference_mode()
def measure(model: torch.nn.Module, vocab_size: int, max_rows: int = MAX_ROWS, repeats: int = 9,
            prefix_len: int = 64) -> dict[str, list[float]]:
    """Seconds of a forward of n = 1..max_rows tokens on top of a `prefix_len` cache, each way
    (medians over `repeats`, after one warm-up), as {"stock": [...], "weight_left": [...]}.

    The two ways alternate forward by forward at each row count, so a change in the machine's
    load while measuring weighs on both alike. Timed one way for every row count and then the
    other, under a background job on the 2-core CPU, the stock kernel looked faster at 5 and 7
    rows; in decoding, steps verifying 5 and 7 tokens then took 94 and 113 ms, against 77 and 96
    ms with the other kernel (SmolLM2-135M, 2 threads). Medians of 9 because a quiet machine
    still moves some row counts by 5-10% between passes."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prefix = torch.tensor([[(10 + i) % vocab_size for i in range(prefix_len)]], device=device)
    ways = {"stock": STOCK, "weight_left": {n: n for n in range(1, max_rows + 1)}}
    cache = DynamicCache()
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)
    result: dict[str, list[float]] = {name: [] for name in ways}
    for n in range(1, max_rows + 1):
        block = torch.tensor([[(20 + i) % vocab_size for i in range(n)]], device=device)
        positions = torch.arange(prefix_len, prefix_len + n, device=device)[None]
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(repeats + 1):
            for name, rows in ways.items():
                install(model, rows)
                t0 = time.perf_counter()
                model(input_ids=block, position_ids=positions, cache=cache, use_cache=True)
                times[name].append(time.perf_counter() - t0)
                cache.crop(-n)
        for name, seconds in times.items():
            kept = sorted(seconds[1:])
            result[name].append(kept[len(kept) // 2])
    return result


def choose(timings: dict[str, list[float]], margin: float = 0.95) -> RowPlan:
    """For each row count n, W @ x^T where it took under `margin` of the stock time, over the
    rows m >= n whose weight-left forward was fastest, padding only where that was under `margin`
    of n's own time (noise stays stock, and unpadded)."""
    stock, left = timings["stock"], timings["weight_left"]
    plan = {}
    for n in range(1, len(stock) + 1):
        m = min(range(n, len(left) + 1), key=lambda r: (left[r - 1], r))
        m = m if left[m - 1] < margin * left[n - 1] else n
        if left[m - 1] < margin * stock[n - 1]:
            plan[n] = m
    return MappingProxyType(plan)


def tune(model: torch.nn.Module, vocab_size: int, key: str, cache_dir: Path | None) -> RowPlan:
    """Measure (or read from `cache_dir/row-kernels/<key>.json`) and install the choice."""
    if not applies(model):
        return STOCK
    path = Path(cache_dir) / "row-kernels" / f"{key}-t{torch.get_num_threads()}-{METHOD}-{KERNELS}.json" if cache_dir else None
    if path is not None and path.exists():
        timings = json.loads(path.read_text())
    else:
        timings = measure(model, vocab_size)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(timings))
    chosen = choose(timings)
    install(model, chosen)
    return chosen
