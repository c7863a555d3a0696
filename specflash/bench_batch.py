"""The bench's batch-size sweep: ar, dflash and adaflash variants decoding the same batch side by side.

Why a sweep: speculative decoding buys fewer target forwards with more verified positions per
forward. At batch B every forward already carries B rows, so each extra position costs more
(the verify-cost curve c_B is steeper) and the trade can flip; AdaFlash's cut exists for that
regime. The figure that matters is throughput across the batch (new tokens of all rows / wall
time). For each batch size, the held-out prompts (cycled to fill the batch) are decoded by every
method once per repeat, back to back in a rotating order; ratios vs ar and vs dflash are medians
over repeats of the paired throughput ratios, since only back-to-back pairs survive a shared,
noisy machine.

Variants: a method name may carry a label, `adaflash:fixed`; for adaflash a label that names a
cut rule sets that rule, and `-o adaflash:fixed.KEY=VALUE` sets knobs of that variant only
(`-o adaflash.KEY=VALUE` sets them for every adaflash variant).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from .cli_args import torch_dtype
from .config import SamplingConfig
from .errors import SpecFlashError
from .metrics import decode_steps
from .models.presets import default_drafter


@dataclass
class BatchSample:
    """One method's decoding of one batch in one repeat; counts pooled over its rows."""

    method: str
    batch: int
    repeat: int
    wall: float
    new_tokens: int
    outputs: list[list[int]]
    steps: int  # decode steps summed over rows
    committed: int
    verified: int  # positions the target computed for the rows, padding included

    @property
    def throughput(self) -> float:
        return self.new_tokens / self.wall


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or any(b < 1 for b in sizes):
        raise SpecFlashError(f"--batch-sizes must be a comma list of integers >= 1 (e.g. 1,4,16,32), got {text!r}")
    return sizes


def parse_variants(methods: str, per_method: dict[str, dict]) -> dict[str, tuple[str, dict[str, Any]]]:
    """{variant name: (method, options)} in the given order, ar first."""
    from .batch import BATCH_METHODS
    from .bench import label_variants
    from .errors import UnbatchableMethodError

    names = [m.strip() for m in methods.split(",") if m.strip()]
    if "ar" not in names:
        names.insert(0, "ar")
    variants = label_variants(names, per_method)
    for method, _ in variants.values():
        if method not in BATCH_METHODS:
            raise UnbatchableMethodError(
                f"method {method!r} does not decode in batches; --batch-sizes takes {', '.join(BATCH_METHODS)}"
            )
    return variants


def _paired(samples: list[BatchSample], method: str, base: str) -> float | None:
    """Median over repeats of this method's throughput over `base`'s."""
    theirs = {s.repeat: s for s in samples if s.method == base}
    ratios = [s.throughput / theirs[s.repeat].throughput for s in samples if s.method == method and s.repeat in theirs]
    return median(ratios) if ratios else None


def summarize_batch(samples: list[BatchSample], names: list[str]) -> list[dict[str, Any]]:
    """One row per method, in the given order, for samples of one batch size."""
    ar = {s.repeat: s.outputs for s in samples if s.method == "ar"}
    rows = []
    for name in names:
        mine = [s for s in samples if s.method == name]
        steps, committed = sum(s.steps for s in mine), sum(s.committed for s in mine)
        same = [s.outputs == ar[s.repeat] for s in mine if s.repeat in ar]
        rows.append({
            "method": name,
            "tokens_per_s": median(s.throughput for s in mine),
            "mean_acceptance_length": committed / steps if steps else None,
            "verified_per_committed": sum(s.verified for s in mine) / committed if committed else None,
            "vs_ar": _paired(samples, name, "ar"),
            "vs_dflash": _paired(samples, name, "dflash"),
            "identical_to_ar": all(same) if same else None,
            "samples": len(mine),
        })
    return rows


def format_batch_table(rows: list[dict[str, Any]], batch: int, device: str) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"batch {batch} | device: {device}",
             f"{'method':<18}{'tok/s':>9}{'accept len':>12}{'verified/tok':>14}{'vs ar':>8}{'vs dflash':>11}"
             "  identical"]
    for r in rows:
        lines.append(
            f"{r['method']:<18}{f(r['tokens_per_s'], '.1f'):>9}{f(r['mean_acceptance_length'], '.2f'):>12}"
            f"{f(r['verified_per_committed'], '.2f'):>14}{f(r['vs_ar'], '.2f'):>8}{f(r['vs_dflash'], '.2f'):>11}"
            f"  {f(r['identical_to_ar'], '')}"
        )
    return "\n".join(lines)


def _sample(name: str, batch: int, repeat: int, run) -> BatchSample:
    steps = [step for r in run.runs for step in decode_steps(r)]
    return BatchSample(name, batch, repeat, run.wall, run.new_tokens, [r.output_ids for r in run.runs], len(steps),
                       sum(len(s.committed) for s in steps), sum(s.verified for s in steps))


def sweep_batch(target, prompts: list[list[int]], batch: int, drafters: dict, max_new_tokens: int,
                repeats: int) -> list[BatchSample]:
    """Every variant on the same batch (prompts cycled to `batch` rows), rotating order per repeat."""
    from .api import generate_batch

    rows = [prompts[i % len(prompts)] for i in range(batch)]
    names = list(drafters)
    for name in names:  # warm-up: first forwards are several times slower
        generate_batch(target, rows, drafters[name][0], max_new_tokens=4, drafter=drafters[name][1])
    samples = []
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            method, drafter = drafters[name]
            run = generate_batch(target, rows, method, max_new_tokens=max_new_tokens, drafter=drafter,
                                 sampling=SamplingConfig())
            samples.append(_sample(name, batch, repeat, run))
    return samples


def run_batch_bench(args: argparse.Namespace) -> int:
    """`bench --batch-sizes ...`: print a table per batch size and write the JSON to --out."""
    from .api import encode_prompt, load
    from .batch import build_batch_drafter
    from .bench import _method_options, device_label, own_drafter
    from .prompts import heldout_prompts

    sizes = parse_batch_sizes(args.batch_sizes)
    variants = parse_variants(args.methods or "ar,dflash,adaflash", _method_options(args.option))
    target = load(args.model, device=args.device, dtype=torch_dtype(args.dtype), cache_dir=args.cache_dir)
    prompts = [p for d in args.domains.split(",") for p in heldout_prompts(d.strip())[: args.prompts_per_domain]]
    encoded = [encode_prompt(target, p.text) for p in prompts]
    device = device_label(target)
    results, samples = {}, []
    for batch in sizes:
        drafters = {}
        for name, (method, variant) in variants.items():
            own, options = own_drafter(method, variant)
            folder = own or args.drafter or default_drafter(args.model, method, args.cache_dir)
            drafters[name] = (method, build_batch_drafter(method, target, options, folder, batch=batch,
                                                          cache_dir=args.cache_dir))
        mine = sweep_batch(target, encoded, batch, drafters, args.max_new_tokens, args.repeats)
        results[str(batch)] = summarize_batch(mine, list(variants))
        samples += mine
        print(format_batch_table(results[str(batch)], batch, device) + "\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": device, "model": args.model, "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
        "batch_sizes": sizes, "methods": {n: {"method": m, "options": o} for n, (m, o) in variants.items()},
        "results": results, "samples": [asdict(s) for s in samples],
        "note": "tokens_per_s = new tokens of all rows / wall time (prefill included); vs_ar, vs_dflash = median "
                "over repeats of paired throughput ratios; verified counts padding",
    }, indent=1))
    print(f"wrote {args.out}")
    return 0
