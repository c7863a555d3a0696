"""How well prompt lookup's continuation predicts the target, by the length of the n-gram that matched.

Why: the learned methods' gate keeps lookup's acceptance estimates apart per match length
(specflash/drafters/lookup_source.py, n = 1..3); whether longer matches deserve their own
estimates (and the source location a longer match picks) is read from this table. At every
position of the target's greedy answers to held-out prompts, the longest n-gram match (up to
--max-ngram) proposes up to 7 tokens; the table gives, per n, how often that happened, how often
its first token was the target's, and the mean run of matching tokens. No timing: it reads
greedy text only, so it is exact and repeatable.

    python scripts/lookup_match_lengths.py --per-domain 6 --max-new-tokens 48 --max-ngram 6
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from specflash.api import encode_prompt, generate, load
from specflash.config import PromptLookupConfig
from specflash.drafters.prompt_lookup import lookup_match
from specflash.prompts import DOMAINS, heldout_prompts

DEPTH = 7  # the shipped drafter's draft depth (block 8)


def match_stats(context: list[int], answer: list[int], max_ngram: int) -> dict[int, list[int]]:
    """n -> [positions where the longest match had length n, first token right, tokens matched]."""
    cfg = PromptLookupConfig(k=DEPTH, max_ngram=max_ngram, min_ngram=1)
    stats: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
    context = list(context)
    for i, token in enumerate(answer):
        proposed, n = lookup_match(context, cfg, DEPTH)
        if proposed:
            actual = answer[i : i + len(proposed)]
            run = next((j for j, (a, b) in enumerate(zip(proposed, actual)) if a != b), min(len(proposed), len(actual)))
            row = stats[n]
            row[0], row[1], row[2] = row[0] + 1, row[1] + (run > 0), row[2] + run
        context.append(token)
    return stats


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--per-domain", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--max-ngram", type=int, default=6)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="also write the table as JSON")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model)
    table = {}
    for domain in DOMAINS:
        totals: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for prompt in heldout_prompts(domain)[: args.per_domain]:
            ids = encode_prompt(target, prompt.text)
            answer = generate(target, ids, "ar", max_new_tokens=args.max_new_tokens).output_ids
            for n, (seen, first, run) in match_stats(ids, answer, args.max_ngram).items():
                row = totals[n]
                row[0], row[1], row[2] = row[0] + seen, row[1] + first, row[2] + run
        table[domain] = {n: {"positions": c, "first_right": f / c, "mean_run": r / c} for n, (c, f, r) in sorted(totals.items())}
        print(domain, "  ".join(f"n={n}: {v['positions']} at, first {v['first_right']:.2f}, run {v['mean_run']:.2f}"
                                for n, v in table[domain].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
