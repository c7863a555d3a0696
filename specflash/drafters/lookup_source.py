"""Prompt lookup beside a learned drafter: a second source of drafts, chosen step by step.

Why: where the text repeats itself (a rewrite that keeps most of its source's words, code that
quotes a name or a line from the prompt) the tokens that followed the last match of the context's
tail are often a better draft than a small drafter's, and they cost nothing to draft. On the
default model the drafter accepts least on rewrites (held-out τ 1.38) where prompt lookup alone
reaches 2.85 (docs/bench-smollm2-cpu-avx2.json).

Each step that the context's last n tokens (n from `max_ngram` down to `min_ngram`) occurred
before, the lookup continuation is valued like the draft gate values the drafter's chain:
expected committed tokens per unit of verify cost, from running (EMA) estimates of each position's
acceptance given the one before, kept apart per match length n since a longer match predicts
better. It is drafted instead of the drafter's block when its best width is worth more than the
gate's best choice for the drafter (plain decoding included), and the drafter's forward is then
skipped: the features of the positions committed meanwhile wait for its next block. Drafts stay
point masses, so verification, and with it losslessness, is unchanged.

Since a continuation costs nothing to find, every step's is scored, drafted or not: like the
gate's shadow drafts, against the tokens the target commits next, one position at a time as they
arrive, up to the first miss. So an estimate that fell while the text did not repeat itself rises again as soon as it
does, without paying to verify a draft to find out. Scoring by exact match is exact at T = 0 and
unbiased above it (a point mass x is accepted with probability p(x), the chance the target samples
x), and for a drafted continuation it gives just what verification gave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import PromptLookupConfig
from .gate import chain_rates, chain_value, score_arrivals
from .prompt_lookup import lookup_match


@dataclass(frozen=True)
class Continuation:
    """What followed the last earlier occurrence of the context's tail: its tokens, the length of
    the n-gram that matched, the acceptance estimates per position for that length, and `branch`,
    the estimate for its first token off a drafted tree where the tree holds other tokens in that
    place (given the tokens before it right): lower than `rates` there, since the two sources agree
    where both are likely right, and a branch is where they disagree (lookup_graft.py)."""

    tokens: list[int]
    ngram: int
    rates: list[float]
    branch: float = 0.5


@dataclass(frozen=True)
class LookupOffer:
    """A lookup draft worth more than the drafter's this step: its tokens, the length of the
    n-gram that matched, the value of its width and of the drafter's best choice."""

    tokens: list[int]
    ngram: int
    value: float
    against: float

    def to_dict(self) -> dict:
        return {"tokens": list(self.tokens), "ngram": self.ngram, "value": self.value, "against": self.against}


Match = Callable[[list[int], int], tuple[list[int], int]]  # (context, k) -> (continuation, n-gram length)


class LookupSource:
    def __init__(self, depth: int, max_ngram: int = 3, min_ngram: int = 1, smoothing: float = 0.1,
                 match: Match | None = None) -> None:
        """`match` finds a continuation of the context's tail elsewhere (default: earlier in the
        context itself, prompt lookup; datastore.py: in the target's earlier answers)."""
        self.cfg = PromptLookupConfig(k=depth, max_ngram=max_ngram, min_ngram=min_ngram)
        self.match = match or (lambda context, k: lookup_match(context, self.cfg, k))
        self.smoothing = smoothing
        self.accept: dict[int, list[float | None]] = {n: [None] * depth for n in range(min_ngram, max_ngram + 1)}
        # Continuation.branch by n: [hits, tries], read by the rule of succession (hits + 1) / (tries + 2), since
        # a branch hits rarely and a run sees few of them per n, too few for an EMA to leave its prior
        self.branch: dict[int, list[int]] = {n: [0, 0] for n in self.accept}
        # continuations being scored: [context length, tokens, n, positions scored, where it branched off a tree]
        self.pending: list[list] = []

    def rates(self, ngram: int) -> list[float]:
        """Acceptance estimates per position of a continuation found by an n-gram match."""
        return chain_rates(self.accept[ngram])

    def find(self, context: list[int], room: int) -> Continuation | None:
        """This step's continuation, at most `room` tokens, or None where the context's tail never
        occurred before. Call once per step with the whole context: it also scores the
        continuations found before, and this one from the next step on."""
        self.committed(context)
        tokens, ngram = self.match(context, self.cfg.k)
        if not tokens:
            return None
        self.pending.append([len(context), tokens, ngram, 0, None])
        hits, tries = self.branch[ngram]
        return Continuation(tokens[:room], ngram, self.rates(ngram), (hits + 1) / (tries + 2)) if room > 0 else None

    def branched(self, at: int | None) -> None:
        """This step's continuation leaves the drafted tree at position `at`, where the tree holds
        other tokens (None: it does not, or nothing was drafted): its token there is scored into the
        branch estimate, once the target has committed that far and only if the ones before it were
        right."""
        if self.pending:
            self.pending[-1][4] = at

    def offer(self, found: Continuation, cost: Sequence[float], against: float) -> LookupOffer | None:
        """The continuation to verify instead of the drafter's draft, at its best width, when one is
        worth more than `against` (the drafter's best value, 1.0 being plain decoding); else None."""
        values = [chain_value(found.rates, m, cost) for m in range(len(found.tokens) + 1)]
        width = max(range(len(values)), key=lambda m: (values[m], -m))
        if width == 0 or values[width] <= against:
            return None
        return LookupOffer(found.tokens[:width], found.ngram, values[width], against)

    def committed(self, context: list[int]) -> None:
        """Score each pending continuation against the tokens committed after it, one position at
        a time as they arrive: its run ends at its first miss, or when it matched all of them."""
        still = []
        for start, tokens, ngram, scored, branch in self.pending:
            got = context[start : start + len(tokens)]
            if branch is not None and len(got) > branch:
                if got[:branch] == tokens[:branch]:
                    self.branch[ngram][0] += got[branch] == tokens[branch]
                    self.branch[ngram][1] += 1
                branch = None
            # a run that ended before its branch position ended at a miss before it: nothing to score there
            if not score_arrivals(self.accept[ngram], tokens, got, scored, self.smoothing):
                still.append([start, tokens, ngram, len(got), branch])
        self.pending = still
