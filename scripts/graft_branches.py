"""How often a grafted continuation's first new node is accepted, by source and match length.

Runs `dflash` (its defaults: trees, prompt lookup and the datastore grafted on) and, for every
step with a graft, counts whether the target accepted any of that source's new nodes: what the
graft's value estimates, against what each source's running rates alone would say. Prints a table
and writes JSON.

    python scripts/graft_branches.py --prompts dev --prompts-per-domain 4 --max-new-tokens 64 [--datastore-min-ngram 2]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specflash.api import generate, load
from specflash.drafters.lookup_graft import graft_spans
from specflash.prompts import load_prompts

DOMAINS = ("math", "code", "writing", "rewrite")
NAMES = {"graft": "prompt lookup", "datastore": "datastore"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="dev", choices=("dev", "heldout"))
    parser.add_argument("--prompts-per-domain", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--datastore-min-ngram", type=int, default=None, help="default: the method's")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model, device="cpu")
    options = {} if args.datastore_min_ngram is None else {"datastore_min_ngram": args.datastore_min_ngram}
    counts: dict[tuple[str, int], list[int]] = defaultdict(lambda: [0, 0])
    for domain in DOMAINS:
        for prompt in load_prompts(domain, split=args.prompts)[: args.prompts_per_domain]:
            run = generate(target, prompt.text, "dflash", max_new_tokens=args.max_new_tokens, options=options)
            for step in run.steps:
                for key, first, last in graft_spans(step.extras, len(step.tokens)):
                    row = counts[(key, step.extras[key]["ngram"])]
                    row[0] += 1
                    row[1] += any(first <= node <= last for node in step.accepted)
    print(f"{'source':15}{'n':>3}{'grafts':>8}{'accepted':>10}{'share':>8}")
    for (key, n), (grafts, hits) in sorted(counts.items()):
        print(f"{NAMES[key]:15}{n:>3}{grafts:>8}{hits:>10}{hits / grafts:>8.2f}")
    out = Path(args.out or f"docs/graft-branches-{args.prompts}-{args.model}.json")
    out.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "options": options,
                               "prompts_per_domain": args.prompts_per_domain, "max_new_tokens": args.max_new_tokens,
                               "rows": [{"source": NAMES[k], "ngram": n, "grafts": g, "accepted": h}
                                        for (k, n), (g, h) in sorted(counts.items())]}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
