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
    in units of plain decoding's median step. The first decode step of every pass is left out:
    there the drafter also reads the prompt's features (a shadow measured on it alone came out at
    1.4 steps). Where a gated pass made no shadow after it (the gate looks by drafting for real
    where verifying is cheap), the block's cost stands in: a shadow is the block forward with the
    head for one slot."""
    options = {"draft_dtype": draft_dtype}
    plain = statistics.median(s.verify_time for s in _steps(target, prompts, "ar", {}, drafter, max_new_tokens,
                                                            lambda s: True))
    verify, draft = [plain], []
    for width in range(1, depth + 1):
        steps = _steps(target, prompts, "dflash", {**options, "gate": False, "max_draft": width}, drafter,
                       max_new_tokens, lambda s, w=width: len(s.tokens) == w)
        if not steps:
            raise ValueError(f"no step drafting {width} tokens in {len(prompts)} prompts")
        verify.append(statistics.median(s.verify_time for s in steps))
        draft.append(statistics.median(s.draft_time for s in steps))
    block = statistics.median(draft)
    shadows = _steps(target, prompts, "dflash", options, drafter, max_new_tokens,
                     lambda s: s.extras.get("gate", {}).get("state") == "shadow")
    shadow = statistics.median(s.draft_time for s in shadows) if shadows else block
    return ReplayCost([v / plain for v in verify], block / plain, shadow / plain)


def _steps(target, prompts: Sequence[str], method: str, options: dict, drafter: str, max_new_tokens: int,
           keep) -> list:
    """The decode steps after the first that `keep` selects, across the prompts."""
    return [s for text in prompts
            for s in generate(target, text, method, max_new_tokens=max_new_tokens, drafter=drafter,
                              options=options).steps if s.phase == "decode" and s.step > 1 and keep(s)]
