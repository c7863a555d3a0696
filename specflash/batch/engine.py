"""The batched decoding loop: B sequences, one target forward per step, lossless per row.

The single engine's loop (engine.py), row-wise: prefill all prompts at once, then per step
(propose for every row -> one rectangular verification forward -> per-row acceptance -> commit).
The cache invariant holds per row: the target cache holds every committed token of row b but
the last, which is row b's root in the next block. How the shared cache stays correct while rows
keep different counts is batch/target.py's business (validity masks, no re-alignment).

Finished rows (EOS or budget) leave the batch: their rows are dropped from the target cache, the
drafter's cache and every per-row list, so a finished row costs nothing from the next step on
(keeping them masked would still pay for their positions in every forward).

Each row's StepRecord is the single engine's, with two batch facts made explicit: `verified` is
the number of positions the target computed for that row in the step, padding included (every
row of a rectangular forward pays for the longest), so `verified_per_committed` is the real
cost; and `draft_time` / `verify_time` are the whole batch step's, which is how long the row
waited for its tokens.

Temperature > 0: row b draws from its own torch.Generator seeded with sampling.seed + b, and
consumes it exactly as the single engine would, so a row whose drafts match the single run's
(ar, dflash, fixed-length cuts) reproduces the single engine's output at seed + b.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..config import SamplingConfig
from ..drafters.base import Draft
from ..engine import _cut, sync_device, token_budget
from ..errors import EmptyPromptError
from ..models.target import TargetModel
from ..sampling import choose, probabilities
from ..trace import StepRecord
from ..verify import Verdict, walk_greedy, walk_sampled
from .dflash import BatchDrafter
from .target import BatchCache, BatchTarget


@dataclass
class Row:
    """One sequence of the batch: its prompt, budget, random stream and what it produced."""

    index: int
    prompt: list[int]
    budget: int
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)


class BatchDecoding:
    """One batched run. Iterating yields, per target forward, {row index: its StepRecord} for the
    rows still in the batch; afterwards `rows` hold each row's steps, output and finish reason,
    and `fed` the number of positions each forward computed (rows x block, padding included)."""

    def __init__(
        self,
        target: TargetModel,
        drafter: BatchDrafter,
        prompts: list[list[int]],
        sampling: SamplingConfig,
        max_new_tokens: int | None,
        stop_on_eos: bool = True,
    ) -> None:
        if not prompts:
            raise EmptyPromptError("the batch has no prompts: give at least one")
        device = target.device
        self.target, self.batch_target, self.drafter = target, BatchTarget(target), drafter
        self.sampling, self.stop_on_eos = sampling, stop_on_eos
        self.to_context_limit = max_new_tokens is None
        self.rows = [
            Row(b, list(p), token_budget(len(p), max_new_tokens, target.context_length),
                torch.Generator(device=device).manual_seed(sampling.seed + b))
            for b, p in enumerate(prompts)
        ]
        self.eos = target.eos_ids
        self.fed: list[int] = []

    def __iter__(self) -> Iterator[dict[int, StepRecord]]:
        self.drafter.begin(len(self.rows), self.sampling)
        self.target.capture_layers(self.drafter.feature_layers)
        live = list(self.rows)  # batch order of the rows still decoding
        state, records = self._prefill(live)
        yield records
        live = self._drop_finished(state, live)
        step = 1
        while live:
            records = self._step(step, state, live)
            yield records
            live = self._drop_finished(state, live)
            step += 1

    def _prefill(self, live: list[Row]) -> tuple[BatchCache, dict[int, StepRecord]]:
        # 1. Prefill: every prompt, left-padded, in one forward gives each row its first token.
        device = self.target.device
        sync_device(device)
        t0 = time.perf_counter()
        state, out = self.batch_target.prefill([row.prompt for row in live])
        logits = out.logits[:, -1]  # [B, V]
        probs = probabilities(logits, self.sampling)
        firsts = [choose(logits[b], probs[b], self.sampling, row.generator) for b, row in enumerate(live)]
        sync_device(device)
        elapsed = time.perf_counter() - t0
        width = state.length
        self.fed.append(width * len(live))
        if out.features is not None:
            positions = (torch.arange(width, device=device)[None] - (width - state.valid.sum(1))[:, None]).clamp_min(0)
            self.drafter.observe(out.features, positions, state.valid)
        records = {}
        for b, row in enumerate(live):
            commit = self._commit(row, [firsts[b]])
            records[row.index] = StepRecord(
                step=0, phase="prefill", context_len=len(row.prompt), tokens=[], parents=[], q=None, p=[],
                accepted=[], correction=firsts[b], correction_kind="target", correction_p=float(probs[b, firsts[b]]),
                committed=commit, verified=width, draft_time=0.0, verify_time=elapsed,
            )
            row.steps.append(records[row.index])
        return state, records

    def _step(self, step: int, state: BatchCache, live: list[Row]) -> dict[int, StepRecord]:
        device = self.target.device
        roots = [row.output[-1] for row in live]
        root_pos = [row.context_len - 1 for row in live]  # the cache holds all but the last token

        # 2. Propose: every row at most room - 1 deep, so the target's own token still fits.
        sync_device(device)
        t0 = time.perf_counter()
        drafts = self.drafter.propose(roots, root_pos, [row.budget - len(row.output) - 1 for row in live])
        sync_device(device)
        t1 = time.perf_counter()

        # 3. Verify: one forward of [root, draft..., pad...] per row, T positions each; walk each row.
        width = max(len(d.tree) for d in drafts) + 1
        ids = torch.zeros(len(live), width, dtype=torch.long, device=device)
        for b, (root, draft) in enumerate(zip(roots, drafts)):
            ids[b, : len(draft.tree) + 1] = torch.tensor([root, *draft.tree.tokens])
        fed_len = torch.tensor([len(d.tree) + 1 for d in drafts], device=device)
        block_valid = torch.arange(width, device=device)[None] < fed_len[:, None]  # [B, T]
        start = state.length
        out = self.batch_target.verify(state, ids, block_valid, torch.tensor(root_pos, device=device))
        verdicts, probs = [], []
        for b, (row, draft) in enumerate(zip(live, drafts)):
            row_logits = out.logits[b, : len(draft.tree) + 1]  # [n+1, V]
            probs.append(probabilities(row_logits, self.sampling))
            verdicts.append(walk_greedy(draft.tree, row_logits.argmax(dim=-1).tolist()) if self.sampling.greedy
                            else walk_sampled(draft.tree, probs[b], row.generator, draft.q))

        # 4. Commit: each row keeps its root and accepted path; the drafter sees their features.
        kept = torch.tensor([1 + len(v.path) for v in verdicts], device=device)
        self.batch_target.commit(state, start, kept)
        if out.features is not None:
            longest = int(kept.max())
            offsets = torch.arange(longest, device=device)[None]
            positions = torch.tensor(root_pos, device=device)[:, None] + offsets
            self.drafter.observe(out.features[:, :longest], positions, offsets < kept[:, None])
        sync_device(device)
        t2 = time.perf_counter()
        self.fed.append(width * len(live))
        records = {}
        for b, (row, draft, verdict) in enumerate(zip(live, drafts, verdicts)):
            records[row.index] = self._record(step, row, draft, verdict, probs[b], width, t1 - t0, t2 - t1)
            self.drafter.verified(b, draft, verdict.path)
        return records

    def _record(self, step: int, row: Row, draft: Draft, verdict: Verdict, probs: torch.Tensor, width: int,
                draft_time: float, verify_time: float) -> StepRecord:
        """Row `row`'s StepRecord (as the single engine writes it) and its commit."""
        tree = draft.tree
        context_len = row.context_len
        committed = self._commit(row, [tree.tokens[i] for i in verdict.path] + [verdict.token])
        record = StepRecord(
            step=step, phase="decode", context_len=context_len, tokens=list(tree.tokens), parents=list(tree.parents),
            q=draft.q_token, p=[float(probs[parent + 1, token]) for token, parent in zip(tree.tokens, tree.parents)],
            accepted=verdict.path, correction=verdict.token, correction_kind=verdict.kind if tree.tokens else "target",
            correction_p=float(probs[len(verdict.path), verdict.token]), committed=committed, verified=width,
            draft_time=draft_time, verify_time=verify_time, extras=draft.extras,
        )
        row.steps.append(record)
        return record

    def _commit(self, row: Row, tokens: list[int]) -> list[int]:
        """Append to the row's output, never past EOS or its budget; mark it finished if so."""
        commit = _cut(tokens, row.budget - len(row.output), self.eos, self.stop_on_eos)
        row.output.extend(commit.tokens)
        if commit.finished is not None:
            row.finish_reason = "context" if commit.finished == "length" and self.to_context_limit else commit.finished
        return commit.tokens

    def _drop_finished(self, state: BatchCache, live: list[Row]) -> list[Row]:
        """Finished rows leave the target cache, the drafter and the batch."""
        keep = [b for b, row in enumerate(live) if row.finish_reason is None]
        if len(keep) < len(live) and keep:
            index = torch.tensor(keep, device=self.target.device)
            state.select_rows(index)
            self.drafter.select_rows(index)
        return [live[b] for b in keep]
