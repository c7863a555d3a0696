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

A third way, where this machine can build it: the packed kernel (packed_kernel.py), which
streams a copy of each weight packed in panels and costs, for up to 12 rows, about what one row
costs; its products are also the same bits for a row whatever rows share the step. It is timed
beside the other two and chosen per row count like them, and also against the stock GEMM at a
few wider counts (WIDE_ROWS: prefills, PTD trees, batches), where on SmolLM2 it still took half
the time at 256 rows; where it wins at the widest count timed, it also takes every wider forward
(a long prompt, a teacher-forced training sequence, a harvest batch's prefill: 512 and 1024 rows
took 455 and 1040 ms against 825 and 1818 here, untimed by the tuner to keep it short). Its copies (as much memory again as the linear weights) are made only for
models whose weights take under a quarter of the memory.

Only the kernel changes: each output row is the same dot products, summed in another order, so
logits differ from the stock path by float rounding (about 1e-4 on SmolLM2), as they already
do between a one-row and a many-row forward. Installed on CPU float32 models only.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F

from . import packed_kernel

MAX_ROWS = 16  # each row count up to this is timed every way (a decoding step's forwards)
WIDE_ROWS = (32, 64, 128, 256)  # wider forwards (a prefill, a PTD tree, a batch), timed stock vs packed
METHOD = "alternating"  # names how `measure` times, in its cache files: older ones are measured again
KERNELS = "v6"  # names the kernels' code in timing caches (v2: row-major output, v3: padded rows, v4: packed,
# v5: packed on all threads, v6: wide row counts)
PACKED = "packed"  # a row plan's value for the packed kernel
ANY_ROWS = 0  # a row plan's key for the row counts it does not list (its value can only be PACKED)
MEMORY_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1

RowPlan = Mapping[int, "int | str"]  # row count -> rows computed as W @ x^T (>= it), or PACKED; absent: stock
STOCK: RowPlan = MappingProxyType({})
PACKED_EVERYWHERE: RowPlan = MappingProxyType({ANY_ROWS: PACKED})


class RowKernelLinear(torch.nn.Linear):
    """nn.Linear that follows a row plan (shared by all layers of one model), with the packed
    copy of its weight when the plan uses the packed kernel."""

    row_plan: RowPlan = STOCK
    uses_packed = False
    packed: tuple[tuple[int, int], torch.Tensor] | None = None  # ((data_ptr, version) packed from, panels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.row_plan, self.panels() if self.uses_packed else None)

    def panels(self) -> torch.Tensor:
        """The packed weight, packed again if the weight changed since (a drafter being trained)."""
        source = (self.weight.data_ptr(), _version(self.weight))
        if self.packed is None or self.packed[0] != source:
            self.packed = (source, packed_kernel.pack(self.weight))
        return self.packed[1]


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place update count (0 for inference tensors, which are never updated)."""
    try:
        return tensor._version
    except RuntimeError:
        return 0


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: RowPlan,
           panels: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, computed as W @ x^T over zero-padded rows, or from the packed `panels` of W,
    where `plan` says so (stock where it says packed but no panels are given, where x is not
    float32 (an autocast region), or where autograd records the product: the packed kernel has no
    backward, and a drafter in training, e.g. training/opd.py's, runs through its target's plan)."""
    rows = x.numel() // x.shape[-1]
    way = plan.get(rows, plan.get(ANY_ROWS))
    if (way == PACKED and panels is not None and x.dtype == torch.float32
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return packed_kernel.packed_linear(x, panels, weight.shape[0], bias)
    if way is None or way == PACKED:
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    padded = max(way, 2)  # a GEMM needs two rows
    if padded > rows:
        flat = torch.cat([flat, flat.new_zeros(padded - rows, flat.shape[-1])])
    # row-major again: elementwise ops keep their input's layout, so a transposed result would
    # reach the next product (the MLP's down projection) as a [K, rows] operand, which took 3x as
    # long there (SmolLM2-135M, 2 threads: verifying 2 tokens cost 1.37x one, 1.12x with this copy)
    out = torch.mm(weight, flat.t()).t()[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def panels_for(weight: torch.Tensor, plan: RowPlan) -> torch.Tensor | None:
    """The packed copy of a weight used outside nn.Linear (a drafter's draft-vocabulary head),
    where `plan` uses the packed kernel and the weight is CPU float32; else None."""
    uses = PACKED in plan.values() and weight.device.type == "cpu" and weight.dtype == torch.float32
    return packed_kernel.pack(weight) if uses else None


def install(model: torch.nn.Module, plan: RowPlan, keep_panels: bool = False) -> int:
    """Route the model's plain nn.Linear layers through RowKernelLinear with this plan; returns
    how many layers it covers. The weights are not copied; a plan with packed rows adds each
    layer's packed copy (made once), which a plan without them frees unless `keep_panels`
    (`measure`, switching plans back and forth)."""
    layers = [m for m in model.modules() if type(m) in (torch.nn.Linear, RowKernelLinear)]
    frozen = MappingProxyType(dict(plan))
    uses_packed = PACKED in frozen.values()
    for layer in layers:
        layer.__class__ = RowKernelLinear
        layer.row_plan, layer.uses_packed = frozen, uses_packed
        if uses_packed:
            layer.panels()
        elif not keep_panels:
            layer.packed = None
    return len(layers)


def tag(plan: RowPlan) -> str:
    """Names a plan in file names, "-wl1.2.3p4-pk5.7-9-<KERNELS>" (n, or n padded to m as "npm",
    for W @ x^T; the packed kernel's rows after "pk", runs as "a-b", and "all" for the counts the
    plan does not list; "" when stock)."""
    if not plan:
        return ""
    left = ".".join(str(n) if plan[n] == n else f"{n}p{plan[n]}" for n in sorted(plan) if plan[n] != PACKED)
    listed = _runs(sorted(n for n in plan if plan[n] == PACKED and n != ANY_ROWS))
    packed = ".".join(listed + ["all"] * (plan.get(ANY_ROWS) == PACKED))
    return "".join((f"-wl{left}" if left else "", f"-pk{packed}" if packed else "", f"-{KERNELS}"))


def _runs(numbers: list[int]) -> list[str]:
    """Sorted integers as runs: [1, 2, 3, 5] -> ["1-3", "5"]."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][1] == n - 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return [str(a) if a == b else f"{a}-{b}" for a, b in runs]


def packed_usable(model: torch.nn.Module, cache_dir: Path | None) -> bool:
    """Whether the packed kernel is loaded (built into `cache_dir` if need be) and a packed copy
    of the model's linear weights fits in memory (packed_fits)."""
    from .acquire import default_cache_dir

    return packed_fits(model) and packed_kernel.load(Path(cache_dir) if cache_dir else default_cache_dir())


def packed_fits(model: torch.nn.Module) -> bool:
    """Whether a packed copy of the linear weights takes under a quarter of the memory this
    process may use: the machine's RAM, or a container's smaller limit (a Space's cgroup)."""
    weights = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, torch.nn.Linear))
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return False
    for limit in MEMORY_LIMITS:
        try:
            ram = min(ram, int(Path(limit).read_text().strip()))
        except (OSError, ValueError):  # absent, or "max": no limit there
            continue
    return weights < ram / 4


def applies(model: torch.nn.Module) -> bool:
    """CPU float32 weights: where the measured difference was found and the cost is only rounding."""
    weight = next(model.parameters(), None)
    return weight is not None and weight.device.type == "cpu" and weight.dtype == torch.float32


@torch.inference_mode()
def measure(model: torch.nn.Module, vocab_size: int, max_rows: int = MAX_ROWS, repeats: int = 9,
            prefix_len: int = 64, packed: bool = False, wide: Sequence[int] = WIDE_ROWS) -> dict[str, list]:
    """Seconds of a forward of n = 1..max_rows tokens on top of a `prefix_len` cache, each way
    (medians over `repeats`, after one warm-up), as {"stock": [...], "weight_left": [...]}, and
    with `packed` (the kernel loaded: packed_kernel.load) "packed": [...] plus, for the wider
    forwards of a prefill, a PTD tree or a batch, stock and packed at the row counts `wide`
    ("wide_rows", "wide_stock", "wide_packed"; medians of fewer repeats, these take longer).

    The ways alternate forward by forward at each row count, so a change in the machine's
    load while measuring weighs on all alike. Timed one way for every row count and then the
    other, under a background job on the 2-core CPU, the stock kernel looked faster at 5 and 7
    rows; in decoding, steps verifying 5 and 7 tokens then took 94 and 113 ms, against 77 and 96
    ms with the other kernel (SmolLM2-135M, 2 threads). Medians of 9 because a quiet machine
    still moves some row counts by 5-10% between passes."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prefix = torch.tensor([[(10 + i) % vocab_size for i in range(prefix_len)]], device=device)
    cache = DynamicCache()
    model(input_ids=prefix, cache=cache, use_cache=True, logits_to_keep=1)

    def timed(ways: dict[str, RowPlan], counts: Sequence[int], rounds: int) -> dict[str, list[float]]:
        result: dict[str, list[float]] = {name: [] for name in ways}
        for n in counts:
            block = torch.tensor([[(20 + i) % vocab_size for i in range(n)]], device=device)
            positions = torch.arange(prefix_len, prefix_len + n, device=device)[None]
            times: dict[str, list[float]] = {name: [] for name in ways}
            for _ in range(rounds + 1):
                for name, rows in ways.items():
                    install(model, rows, keep_panels=True)
                    t0 = time.perf_counter()
                    model(input_ids=block, position_ids=positions, cache=cache, use_cache=True)
                    times[name].append(time.perf_counter() - t0)
                    cache.crop(-n)
            for name, seconds in times.items():
                kept = sorted(seconds[1:])
                result[name].append(kept[len(kept) // 2])
        return result

    few = range(1, max_rows + 1)
    ways = {"stock": STOCK, "weight_left": {n: n for n in few}}
    if packed:
        ways["packed"] = {n: PACKED for n in few}
    result: dict[str, list] = timed(ways, few, repeats)
    if packed and wide:
        wide_times = timed({"stock": STOCK, "packed": {n: PACKED for n in wide}}, wide, max(2, repeats // 2))
        result |= {"wide_rows": list(wide), "wide_stock": wide_times["stock"], "wide_packed": wide_times["packed"]}
    return result


def choose(timings: dict[str, list], margin: float = 0.95) -> RowPlan:
    """For each row count n, the faster of W @ x^T (over the rows m >= n whose weight-left
    forward was fastest, padding only where that was under `margin` of n's own time) and the
    packed kernel (when timed), where it took under `margin` of the stock time (noise stays
    stock, and unpadded). Above the few rows, each timed wide row count decides for the counts
    from the one below it: packed where it took under `margin` of the stock time there; the
    widest one decides also for every count above it (ANY_ROWS)."""
    stock, left, packed = timings["stock"], timings["weight_left"], timings.get("packed")
    plan: dict[int, int | str] = {}
    for n in range(1, len(stock) + 1):
        m = min(range(n, len(left) + 1), key=lambda r: (left[r - 1], r))
        m = m if left[m - 1] < margin * left[n - 1] else n
        way, seconds = m, left[m - 1]
        if packed is not None and packed[n - 1] <= seconds:
            way, seconds = PACKED, packed[n - 1]
        if seconds < margin * stock[n - 1]:
            plan[n] = way
    below, wins = len(stock), False
    for rows, wide_stock, wide_packed in zip(timings.get("wide_rows", ()), timings.get("wide_stock", ()),
                                             timings.get("wide_packed", ())):
        wins = wide_packed < margin * wide_stock
        if wins:
            plan.update(dict.fromkeys(range(below + 1, rows + 1), PACKED))
        below = rows
    if wins:
        plan[ANY_ROWS] = PACKED
    return MappingProxyType(plan)


def timings_path(key: str, cache_dir: Path) -> Path:
    """Where `tune` keeps the timings of the model named `key` at the current thread count."""
    return Path(cache_dir) / "row-kernels" / f"{key}-t{torch.get_num_threads()}-{METHOD}-{KERNELS}.json"


def without_packed(timings: dict[str, list]) -> dict[str, list]:
    """The timings of PyTorch's two ways only: what `choose` would pick with no packed kernel."""
    return {way: seconds for way, seconds in timings.items() if way in ("stock", "weight_left")}


def tune(model: torch.nn.Module, vocab_size: int, key: str, cache_dir: Path | None) -> RowPlan:
    """Measure (or read from `cache_dir/row-kernels/<key>.json`) and install the choice."""
    if not applies(model):
        return STOCK
    path = timings_path(key, cache_dir) if cache_dir else None
    if path is not None and path.exists():
        timings = json.loads(path.read_text())
    else:
        timings = measure(model, vocab_size, packed=packed_usable(model, cache_dir))
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(timings))
    if "packed" in timings and not packed_usable(model, cache_dir):  # timed on a run that could build it
        timings = without_packed(timings)
    chosen = choose(timings)
    install(model, chosen)
    return chosen
