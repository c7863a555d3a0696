"""The decoding loop every method shares: prefill, then (propose -> verify -> commit) per step.

The cache invariant: before each step the target's KV cache holds every committed token but the
last one, which is fed as the root of the next draft. So one forward of [last, draft...] yields
the target's distribution after the root and after every draft node, and plain decoding is the
case of an empty draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

import torch

from .config import SamplingConfig
from .drafters.base import Drafter
from .errors import ContextLengthError, EmptyPromptError, TokenLimitError
from .models.target import TargetModel
from .sampling import choose, probabilities
from .trace import StepRecord
from .verify import walk_greedy, walk_sampled


def sync_device(device: torch.device) -> None:
    """Make wall-clock timings honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def token_budget(prompt_len: int, max_new_tokens: int | None, context_length: int) -> int:
    """How many new tokens may be generated; None asks for everything up to the context limit."""
    if prompt_len == 0:
        raise EmptyPromptError("the prompt is empty: give at least one token of text")
    if prompt_len >= context_length:
        raise ContextLengthError(
            f"the prompt has {prompt_len} tokens but the model's context holds {context_length}; shorten the prompt"
        )
    if max_new_tokens is None:
        return context_length - prompt_len
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise TokenLimitError(f"max_new_tokens must be an integer >= 1 (or None for up to the context), got {max_new_tokens!r}")
    if prompt_len + max_new_tokens > context_length:
        raise ContextLengthError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context of "
            f"{context_length} tokens; ask for at most {context_length - prompt_len} new tokens"
        )
    return max_new_tokens


@dataclass
class _Commit:
    tokens: list[int]
    finished: str | None


def _cut(tokens: list[int], room: int, eos: frozenset[int], stop_on_eos: bool) -> _Commit:
    """Never emit past EOS (inclusive) or past the token budget."""
    if stop_on_eos:
        for i, token in enumerate(tokens):
            if token in eos and i < room:
                return _Commit(tokens[: i + 1], "eos")
    if len(tokens) >= room:
        return _Commit(tokens[:room], "length")
    return _Commit(tokens, None)


class Decoding:
    """One run, iterated step by step. Iterating yields StepRecords; afterwards `finish_reason`
    says why it stopped ("eos", "length", or "context" when it ran to the context limit)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: Drafter,
        prompt_ids: list[int],
        sampling: SamplingConfig,
        max_new_tokens: int | None,
        stop_on_eos: bool = True,
        prompt_text: str | None = None,
    ) -> None:
        """`prompt_text`: the prompt as the user wrote it, kept only so the run's record can say it."""
        self.target = target
        self.prompt_text = prompt_text
        self.drafter = drafter
        self.prompt_ids = list(prompt_ids)
        self.sampling = sampling
        self.budget = token_budget(len(self.prompt_ids), max_new_tokens, target.context_length)
        self.to_context_limit = max_new_tokens is None
        self.stop_on_eos = stop_on_eos
        self.output: list[int] = []
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[StepRecord]:
        device = self.target.device
        generator = torch.Generator(device=device).manual_seed(self.sampling.seed)
        eos = self.target.eos_ids
        self.drafter.bind(self.target)
        self.drafter.begin(self.prompt_ids, self.sampling, generator)
        self.target.capture_layers(self.drafter.feature_layers)
        cache = self.target.new_cache()

        # 1. Prefill: the prompt in one forward gives the first new token.
        sync_device(device)
        t0 = time.perf_counter()
        out = self.target.forward(self.prompt_ids, cache, 0, last_only=True)
        probs = probabilities(out.logits[-1], self.sampling)
        first = choose(out.logits[-1], probs, self.sampling, generator)
        sync_device(device)
        prefill_time = time.perf_counter() - t0
        if out.features is not None:
            self.drafter.observe(out.features)
        commit = _cut([first], self.budget, eos, self.stop_on_eos)
        self.output.extend(commit.tokens)
        yield StepRecord(
            step=0, phase="prefill", context_len=len(self.prompt_ids), tokens=[], parents=[], q=None, p=[],
            accepted=[], correction=first, correction_kind="target", correction_p=float(probs[first]),
            committed=commit.tokens, verified=len(self.prompt_ids), draft_time=0.0, verify_time=prefill_time,
        )
        step = 1
        while commit.finished is None:
            record, commit = self._step(step, cache, generator, eos)
            self.output.extend(commit.tokens)
            yield record
            step += 1
        self.finish_reason = "context" if commit.finished == "length" and self.to_context_limit else commit.finished

    def _step(self, step: int, cache, generator: torch.Generator, eos: frozenset[int]) -> tuple[StepRecord, _Commit]:
        device = self.target.device
        context = self.prompt_ids + self.output
        start = len(context) - 1  # the cache holds all but the last committed token
        room = self.budget - len(self.output)

        # 2. Propose: at most room - 1 draft tokens deep, so the target's own token still fits.
        sync_device(device)
        t0 = time.perf_counter()
        draft = self.drafter.propose(context, room - 1)
        sync_device(device)
        t1 = time.perf_counter()
        tree = draft.tree

        # 3. Verify: one target forward over [last, draft..., lookahead...]; walk the draft.
        saved = self.target.checkpoint(cache) if tree.tokens else None  # the root alone is always kept
        out = self._verify_forward(context[-1], draft, cache, start)
        probs = probabilities(out.logits[: len(tree) + 1], self.sampling)  # [n+1, V]
        if self.sampling.greedy:
            verdict = walk_greedy(tree, out.logits[: len(tree) + 1].argmax(dim=-1).tolist())
        else:
            verdict = walk_sampled(tree, probs, generator, draft.q)

        # 4. Commit: keep the root and the accepted path in the target cache, drop the rest.
        kept_rows = [0] + [node + 1 for node in verdict.path]
        fed = [context[-1], *tree.tokens, *(draft.lookahead.tokens if draft.lookahead else [])]
        self.target.keep(cache, start, fed, kept_rows, saved)
        if out.features is not None:
            self.drafter.observe(out.features[kept_rows])
        sync_device(device)
        t2 = time.perf_counter()

        last_row = kept_rows[-1]
        accepted_tokens = [tree.tokens[i] for i in verdict.path]
        commit = _cut(accepted_tokens + [verdict.token], room, eos, self.stop_on_eos)
        self.drafter.verified(draft, out.logits, verdict.path, commit.tokens)
        record = StepRecord(
            step=step,
            phase="decode",
            context_len=len(context),
            tokens=list(tree.tokens),
            parents=list(tree.parents),
            q=draft.q_token,
            p=[float(probs[parent + 1, token]) for token, parent in zip(tree.tokens, tree.parents)],
            accepted=verdict.path,
            correction=verdict.token,
            correction_kind=verdict.kind if tree.tokens else "target",
            correction_p=float(probs[last_row, verdict.token]),
            committed=commit.tokens,
            verified=len(tree) + 1 + (len(draft.lookahead.tokens) if draft.lookahead else 0),
            draft_time=t1 - t0,
            verify_time=t2 - t1,
            extras=draft.extras,
        )
        return record, commit

    def _verify_forward(self, root: int, draft, cache, start: int):
        tree = draft.tree
        if draft.lookahead is None:
            return self.target.forward([root, *tree.tokens], cache, start, tree=None if tree.is_chain else tree)
        ids, allow, positions = draft.feed(root, start)
        return self.target.forward(ids, cache, start, allow=allow, positions=positions)
