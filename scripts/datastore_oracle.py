"""How the datastore's continuations and the drafter's chains fail on different steps.

At each step a chain-drafting `dflash` drafted (no gate, no prompt lookup, no datastore), it
counts the tokens the drafter's chain got accepted, the tokens the datastore's continuation of the
same context (its default shortest match) would have matched in the target's greedy output, and the better of the two: what a
tree holding both could get at most. Prints a table per domain and writes JSON.

    python scripts/datastore_oracle.py --prompts dev --prompts-per-domain 8 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specflash.api import generate, load
from specflash.drafters.datastore import Datastore
from specflash.drafters.dflash import DFlashConfig
from specflash.models.presets import preset_datastore
from specflash.prompts import load_prompts

DOMAINS = ("math", "code", "writing", "rewrite")


def matched(tokens: list[int], actual: list[int]) -> int:
    """How many of `tokens` the output repeats, from the first on."""
    count = 0
    for token, truth in zip(tokens, actual):
        if token != truth:
            break
        count += 1
    return count


def domain_row(target, store: Datastore, prompts, max_new_tokens: int) -> dict[str, float]:
    drafter = stored = best = steps = 0
    options = {"gate": False, "lookup": False, "datastore": False, "tree": False}
    for prompt in prompts:
        run = generate(target, prompt.text, "dflash", max_new_tokens=max_new_tokens, options=options)
        context = list(run.prompt_ids)
        for step in run.steps:
            if step.phase == "decode" and step.tokens:
                ahead = run.output_ids[len(context) - len(run.prompt_ids):]
                tokens, _ = store.match(context, len(step.tokens), store.depth, DFlashConfig().datastore_min_ngram)
                mine, theirs = len(step.accepted), matched(tokens, ahead)
                drafter, stored, best, steps = drafter + mine, stored + theirs, best + max(mine, theirs), steps + 1
            context += step.committed
    return {"steps": steps, "drafter": drafter / steps, "datastore": stored / steps, "better": best / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", default="dev", choices=("dev", "heldout"))
    parser.add_argument("--prompts-per-domain", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model, device="cpu")
    folder = preset_datastore(args.model)
    if folder is None:
        raise SystemExit(f"{args.model} is not a preset with a datastore")
    store = Datastore.from_harvests(folder)
    rows = {d: domain_row(target, store, load_prompts(d, split=args.prompts)[: args.prompts_per_domain],
                          args.max_new_tokens) for d in DOMAINS}
    print(f"{'domain':10}{'steps':>7}{'drafter':>10}{'datastore':>11}{'better':>9}   (tokens matched per step)")
    for domain, row in rows.items():
        print(f"{domain:10}{row['steps']:>7}{row['drafter']:>10.3f}{row['datastore']:>11.3f}{row['better']:>9.3f}")
    out = Path(args.out or f"docs/datastore-oracle-{args.prompts}-{args.model}.json")
    out.write_text(json.dumps({"model": args.model, "prompts": args.prompts, "store_tokens": len(store),
                               "prompts_per_domain": args.prompts_per_domain, "max_new_tokens": args.max_new_tokens,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
