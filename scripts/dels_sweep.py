"""DeLS-Spec alpha/beta sweep: mean acceptance length per domain and per block position.

Greedy decoding with the draft gate off, so every setting writes the same tokens and drafts on
every step; only acceptance changes, and it is deterministic (no timing), so one pass per setting
suffices. alpha = beta = 0 is exactly dflash. Choose alpha and beta on the dev requests
(`--prompts dev`, the default: hand-written, so unlike the recipe-made requests the heads trained
on), then report on the held-out prompts (`--prompts heldout`) without changing them again. `--candidates`
sweeps how many of the long expert's top tokens are fused (0: all); its cost shows as the median
drafting time per block (timed, so run it on an otherwise idle machine).

    source scripts/env.sh && python scripts/dels_sweep.py --model smollm2-135m --alphas 0,0.3,0.6 --betas 0,0.3 --prompts-per-domain 4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import specflash
from specflash.bench import PROMPT_SETS, bench_prompts
from specflash.metrics import per_position_acceptance
from specflash.models.dflash_io import DRAFTER_DTYPE_CHOICES
from specflash.models.presets import default_drafter, portable_path
from specflash.prompts import DOMAINS


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None, help="DFlash drafter (default: the preset's)")
    p.add_argument("--local-head", default=None, help="local head folder (default: the preset's)")
    p.add_argument("--alphas", default="0,0.3,0.6,1.0")
    p.add_argument("--betas", default="0,0.3")
    p.add_argument("--candidates", default=None, help="comma list of candidate counts (default: the method's)")
    p.add_argument("--prompts", choices=PROMPT_SETS, default="dev")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--draft-dtype", choices=DRAFTER_DTYPE_CHOICES, default="auto",
                   help="the drafter's weights (docs/dflash.md, the drafter's own dtype)")
    p.add_argument("--out", type=Path, default=Path("bench-out/dels_sweep.json"))
    args = p.parse_args()

    target = specflash.load(args.model)
    drafter = args.drafter or default_drafter(args.model, "dflash", None)
    prompts = bench_prompts(args.prompts, list(DOMAINS), args.prompts_per_domain)
    rows = []
    counts = [int(c) for c in args.candidates.split(",")] if args.candidates else [None]
    settings = [(float(a), float(b), c) for a in args.alphas.split(",") for b in args.betas.split(",") for c in counts]
    for alpha, beta, candidates in settings:
        options = {"alpha": alpha, "beta": beta, "gate": False, "draft_dtype": args.draft_dtype}
        if candidates is not None:
            options["candidates"] = candidates
        if args.local_head:
            options["local_head"] = args.local_head
        runs = [(domain, specflash.generate(target, text, "dels", max_new_tokens=args.max_new_tokens,
                                            drafter=drafter, options=options)) for domain, _, text in prompts]
        per_domain = {}
        for d in DOMAINS:
            steps = [s for dom, r in runs if dom == d for s in r.steps if s.phase == "decode"]
            if steps:
                per_domain[d] = sum(len(s.committed) for s in steps) / len(steps)
        steps = [s for _, r in runs for s in r.steps if s.phase == "decode"]
        flipped = [f for s in steps if s.tokens for f in s.extras["dels"]["flipped"]]
        rows.append({
            "alpha": alpha, "beta": beta, "candidates": candidates, "per_domain": per_domain,
            "draft_ms": 1000 * statistics.median(s.draft_time for s in steps if s.tokens),
            "mean": sum(len(s.committed) for s in steps) / len(steps),
            "per_position": per_position_acceptance(steps),
            "flipped_rate": sum(flipped) / max(len(flipped), 1),
        })
        r = rows[-1]
        cells = "  ".join(f"{d} {v:.2f}" for d, v in per_domain.items())
        pos = " ".join(f"{x:.2f}" for x in r["per_position"][:8])
        print(f"alpha {alpha:<4} beta {beta:<4} candidates {candidates} mean {r['mean']:.3f}  {cells}  "
              f"flipped {r['flipped_rate']:.2f}  draft {r['draft_ms']:.2f} ms  per-position {pos}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "drafter": portable_path(drafter), "rows": rows,
                                    "max_new_tokens": args.max_new_tokens,
                                    "local_head": args.local_head and portable_path(args.local_head),
                                    "draft_dtype": args.draft_dtype,
                                    "prompt_set": args.prompts, "prompts": [pid for _, pid, _ in prompts]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
