"""What decoding steps cost in a real run, by drafted width, for `gate_replay`.

Why not the cached verify-cost curve: that one times bare target forwards on a short prefix,
while a step also pays the engine's work around its forward (the cache checkpoint and trim, the
walk, the drafter's bookkeeping), and on the 2-core CPU the two disagreed by up to 30% at some
widths (verifying 4 tokens: 1.98x a plain step cached, 1.53x in the run). Here every width runs
as its own decoding pass over the same prompts, drafting exactly that many tokens each step (gate
off), and the median step time per width is taken relative to plain decoding's median step.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from .api import generate
from .gate_replay import ReplayCost


def measure_step_costs(target, drafter: str, prompts: Sequence[str], depth: int, max_new_tokens: int = 40,
                       draft_dtype: str = "float32") -> ReplayCost:
    """c(1..depth + 1) from the verify side of each step, the drafted block's cost from its draft
    side (the median over all widths), and a shadow's from the shadow steps of a gated pass, all
    in units of plain decoding's median step."""
    options = {"draft_dtype": draft_dtype}
    plain = _medians(target, prompts, "ar", {}, drafter, max_new_tokens, lambda s: True)[1]
    verify, draft = [plain], []
    for width in range(1, depth + 1):
        d, v = _medians(target, prompts, "dflash", {**options, "gate": False, "max_draft": width}, drafter,
                        max_new_tokens, lambda s, w=width: len(s.tokens) == w)
        verify.append(v)
        draft.append(d)
    shadow = _medians(target, prompts, "dflash", options, drafter, max_new_tokens,
                      lambda s: s.extras.get("gate", {}).get("state") == "shadow")[0]
    return ReplayCost([v / plain for v in verify], statistics.median(draft) / plain, shadow / plain)


def _medians(target, prompts: Sequence[str], method: str, options: dict, drafter: str, max_new_tokens: int,
             keep) -> tuple[float, float]:
    """Median draft and verify seconds over the decode steps `keep` selects, across the prompts."""
    steps = [s for text in prompts
             for s in generate(target, text, method, max_new_tokens=max_new_tokens, drafter=drafter,
                               options=options).steps if s.phase == "decode" and keep(s)]
    if not steps:
        raise ValueError(f"no {method} step of the kind measured in {len(prompts)} prompts")
    return statistics.median(s.draft_time for s in steps), statistics.median(s.verify_time for s in steps)
