"""PTD's speed/acceptance curve against the tokens it feeds per forward, on held-out prompts.

On a CPU every token fed to the target costs time, so PTD's tree budgets trade acceptance for
per-forward cost; this sweep finds where that trade pays. Each (prompt, config) run is paired
with a plain autoregressive run of the same prompt measured right before it, and the speedup is
the median of those paired wall-time ratios (the machine is shared, so absolute speeds drift).
Greedy (temperature 0) only; the output of every run is checked against ar's.

It lives in the library, not in scripts/, so that notebook 04 runs the very sweep behind
docs/ptd.md's table; scripts/ptd_sweep.py is the command that docs/ptd.md quotes.

    python -m specflash.bench_ptd --domains code,math --prompts-per-domain 2 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from statistics import median
from typing import Any, Sequence

import torch

from .api import encode_prompt, generate, load
from .models.target import TargetModel
from .prompts import heldout_prompts
from .trace import RunRecord

# (guess_budget, lookahead_budget, window, max_depth, max_children): from pool-only to the paper's shape.
GRID = [
    (4, 0, 0, 3, 2),
    (8, 0, 0, 3, 2),
    (16, 0, 0, 3, 2),
    (8, 4, 2, 2, 2),
    (8, 8, 3, 3, 2),
    (16, 16, 4, 4, 3),
    (60, 64, 4, 6, 4),
]

HEADER = f"{'guess':>6}{'look':>6}{'win':>5}{'depth':>6}{'kids':>5}{'fed/fwd':>9}{'look/fwd':>9}{'accept len':>11}{'speedup':>9}  same"


def options_of(row: tuple[int, ...]) -> dict[str, Any]:
    """PTD's method options for one grid row."""
    guess, look, window, depth, children = row
    return dict(guess_budget=guess, lookahead_budget=look, window=window, max_depth=depth, max_children=children)


def _timed(target: TargetModel, ids: list[int], method: str, max_new: int,
           options: dict | None = None) -> tuple[RunRecord, float]:
    t0 = time.perf_counter()
    run = generate(target, ids, method, max_new_tokens=max_new, options=options)
    return run, time.perf_counter() - t0


def sweep(target: TargetModel, prompts: dict[str, list[int]], grid: list[tuple[int, ...]],
          max_new: int) -> list[dict[str, Any]]:
    """One row per grid point: pooled acceptance length and fed tokens, median paired speedup.
    Each row is printed (under HEADER) as soon as it is measured."""
    rows = []
    for row in grid:
        opts = options_of(row)
        ratios, steps, committed, fed, same, lookahead = [], 0, 0, 0, True, 0
        for ids in prompts.values():
            base, base_wall = _timed(target, ids, "ar", max_new)
            run, wall = _timed(target, ids, "ptd", max_new, opts)
            ratios.append(base_wall / wall)
            decode = [s for s in run.steps if s.phase == "decode"]
            steps += len(decode)
            committed += sum(len(s.committed) for s in decode)
            fed += sum(s.verified for s in decode)
            lookahead += sum(s.extras["ptd"]["lookahead_size"] for s in decode)
            same &= run.output_ids == base.output_ids
        rows.append({**opts, "tokens_per_forward": fed / steps, "lookahead_per_forward": lookahead / steps,
                     "mean_acceptance_length": committed / steps, "speedup": median(ratios), "identical_to_ar": same})
        print(format_row(rows[-1]), flush=True)
    return rows


def format_row(r: dict[str, Any]) -> str:
    """One sweep row as a line of the table under HEADER."""
    return (f"{r['guess_budget']:>6}{r['lookahead_budget']:>6}{r['window']:>5}{r['max_depth']:>6}{r['max_children']:>5}"
            f"{r['tokens_per_forward']:>9.2f}{r['lookahead_per_forward']:>9.2f}{r['mean_acceptance_length']:>11.2f}"
            f"{r['speedup']:>9.2f}  {r['identical_to_ar']}")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: sweep GRID on the held-out prompts, print the table and write the rows as JSON to --out."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--domains", default="code,math")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    p.add_argument("--out", type=Path, default=Path("bench-out/ptd_sweep.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load(args.model)
    prompts = {q.id: encode_prompt(target, q.text) for d in args.domains.split(",")
               for q in heldout_prompts(d.strip())[: args.prompts_per_domain]}
    generate(target, next(iter(prompts.values())), "ptd", max_new_tokens=4)  # warm-up
    print(HEADER, flush=True)
    rows = sweep(target, prompts, GRID, args.max_new_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "domains": args.domains, "prompts": list(prompts),
                                    "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
                                    "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
