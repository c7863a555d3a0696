"""Batched drafters: plain decoding, DFlash and AdaFlash for B rows, one drafter forward per step.

They mirror the single-sequence drafters (drafters/dflash.py, drafters/adaflash.py) and reuse
their networks, configs, cost curves and length heads, so a batch of one drafts exactly what the
single engine drafts with `gate=false, lookup=false` (and, for dflash, `tree=false`). The draft
gate and prompt lookup beside the drafter (drafters/gate.py, lookup_source.py) are per-sequence
policies, read from one sequence's own timings and acceptance, and do not run here: every row
drafts its full block (or its AdaFlash cut) every step, as a chain (a rectangular verification
forward has no per-row tree masks here). The DFlash context cache is batched like the target's (batch/target.py):
one slot axis shared by all rows plus a validity mask, new context padded to the row with the
most newly committed positions, holes compacted away when they dominate.

AdaFlash in a batch: the verification forward is rectangular, so every row feeds the same T
positions. Each row's rule gives its own cut m_b; T = max_b(m_b) + 1, and each row verifies
min(T - 1, its draft length) of its drafted tokens (those positions are computed anyway, so
verifying them is free). The `cost` rule at B > 1 picks one common cut from the batch's own
verify-cost curve c_B (verify_cost.best_common_cut): a batched step pays for its longest row.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import SamplingConfig
from ..drafters.adaflash import AdaFlashDrafter, acceptance_estimate, cut_length, kept_length
from ..drafters.base import Draft, Drafter
from ..drafters.dflash import DFlashEngineDrafter
from ..errors import MethodConfigError, UnbatchableMethodError
from ..models.dflash import DFlashCache
from ..tree import DraftTree
from ..verify_cost import best_common_cut
from .target import compact_index, gather_slots, worth_compacting


class BatchDrafter:
    """Plain decoding for every row: no drafts."""

    name = "ar"
    feature_layers: tuple[int, ...] = ()

    def begin(self, rows: int, sampling: SamplingConfig) -> None:
        """Called once per run before the prefill, with the number of rows."""
        self.sampling = sampling

    def observe(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        """Target features [B, C, F] of newly committed positions [B, C]; valid [B, C] marks the real ones."""

    def propose(self, roots: list[int], root_pos: list[int], max_lens: list[int]) -> list[Draft]:
        """One draft per row, at most max_lens[b] deep, after root token roots[b] at root_pos[b]."""
        return [Draft.empty() for _ in roots]

    def verified(self, row: int, draft: Draft, path: list[int]) -> None:
        """After verification: the accepted node path of batch row `row`."""

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (the others finished)."""

    def config_dict(self) -> dict[str, Any]:
        return {}


class BatchDFlash(BatchDrafter):
    """DFlash for B rows: one block forward [root_b, MASK x (L-1)] per row, all rows at once."""

    name = "dflash"

    def __init__(self, single: DFlashEngineDrafter) -> None:
        self.single = single  # its network, config and trace knobs
        self.model, self.spec = single.model, single.spec
        self.feature_layers = single.feature_layers
        self.device = single.device

    def begin(self, rows: int, sampling: SamplingConfig) -> None:
        super().begin(rows, sampling)
        self.cache = DFlashCache(self.spec.num_layers)
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=self.device)  # [B, S] context slots
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def observe(self, features: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> None:
        self.pending.append((features, positions, valid))

    @torch.inference_mode()
    def block_hidden(self, roots: list[int], root_pos: list[int]) -> torch.Tensor:
        """Final-normed hidden states [B, L, H] of every row's block; moves the pending features
        into the context cache first."""
        L, b = self.spec.block_size, len(roots)
        # the prefill and every step observe, so something is always pending: [B, C, F], [B, C], [B, C]
        features, ctx_pos, new_valid = (torch.cat(parts, dim=1) for parts in zip(*self.pending))
        self.pending = []
        self.valid = torch.cat([self.valid, new_valid], dim=1)  # [B, S]
        block = torch.full((b, L), self.spec.mask_token_id, dtype=torch.long, device=self.device)
        block[:, 0] = torch.tensor(roots, device=self.device)
        block_pos = torch.tensor(root_pos, device=self.device)[:, None] + torch.arange(L, device=self.device)[None]
        # the block sees its row's valid context and itself, bidirectionally: bool [B, 1, L, S + L]
        see = torch.cat([self.valid, self.valid.new_ones(b, L)], dim=1)[:, None, None, :].expand(-1, 1, L, -1)
        hidden = self.model(block, block_pos, features, ctx_pos, see, self.cache)
        if worth_compacting(self.valid):
            self._compact()
        return hidden

    def _compact(self) -> None:
        index, self.valid = compact_index(self.valid)
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            self.cache.keys[i], self.cache.values[i] = gather_slots(k, index), gather_slots(v, index)
        self.cache.positions = self.cache.positions.gather(1, index)

    def block_probs(self, roots: list[int], root_pos: list[int], ks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One drafter forward for every row: block hidden states [B, L, H] and the draft
        distributions of the first max(ks) slots [B, K, V]."""
        hidden = self.block_hidden(roots, root_pos)
        return hidden, torch.softmax(self.model.logits(hidden[:, 1 : max(ks) + 1]).float(), dim=-1)

    @torch.inference_mode()
    def propose(self, roots: list[int], root_pos: list[int], max_lens: list[int]) -> list[Draft]:
        ks = [min(self.single.draft_len, m) for m in max_lens]
        if max(ks) <= 0:
            return [Draft.empty() for _ in roots]
        best = self.block_probs(roots, root_pos, ks)[1].max(dim=-1)  # [B, K]
        return [self._draft(best.indices[b, :k].tolist(), best.values[b, :k].tolist()) for b, k in enumerate(ks)]

    def _draft(self, tokens: list[int], q: list[float]) -> Draft:
        if not tokens:
            return Draft.empty()
        extras = {"dflash": {"block_size": self.spec.block_size}}
        return Draft(DraftTree.chain(tokens), q=None, q_token=q, extras=extras)

    def select_rows(self, rows: torch.Tensor) -> None:
        self.valid = self.valid[rows]
        self.pending = [(f[rows], p[rows], v[rows]) for f, p, v in self.pending]
        for i, (k, v) in enumerate(zip(self.cache.keys, self.cache.values)):
            if k is not None:
                self.cache.keys[i], self.cache.values[i] = k[rows], v[rows]
        if self.cache.positions is not None:
            self.cache.positions = self.cache.positions[rows]
        if worth_compacting(self.valid):
            self._compact()

    def config_dict(self) -> dict[str, Any]:
        return {**self.single.config_dict(), "tree": False}  # what it drafted: chains


class BatchAdaFlash(BatchDFlash):
    """AdaFlash for B rows: the full block drafted, per-row cuts made rectangular (module docstring).
    `cost` is the verify-cost curve measured at the run's batch size (c_B), used for every step."""

    name = "adaflash"

    def __init__(self, single: AdaFlashDrafter, cost: list[float] | None = None) -> None:
        super().__init__(single)
        self.cfg, self.head = single.cfg, single.head
        self.cost = single.cost if cost is None else cost
        if self.cfg.needs_head and self.head is None:
            raise MethodConfigError(f"rule {self.cfg.rule!r} with estimate {self.cfg.estimate!r} needs a length head: "
                                    "this AdaFlash drafter has none")
        if self.cfg.rule == "cost" and self.cost is None:
            raise MethodConfigError("rule 'cost' needs the verify-cost curve of the batch")

    def begin(self, rows: int, sampling: SamplingConfig) -> None:
        super().begin(rows, sampling)
        self.windows = [max(1, self.cfg.fixed_len)] * rows  # the heuristic rule's per-row window

    @torch.inference_mode()
    def propose(self, roots: list[int], root_pos: list[int], max_lens: list[int]) -> list[Draft]:
        ks = [min(self.single.draft_len, m) for m in max_lens]
        if max(ks) <= 0:
            return [Draft.empty() for _ in roots]
        hidden, probs = self.block_probs(roots, root_pos, ks)  # [B, L, H], [B, K, V]
        scores = self.head(hidden).tolist() if self.cfg.needs_head else [None] * len(roots)  # r [B] where read
        keeps = self._cuts([probs[b, :k] for b, k in enumerate(ks)], scores)
        verify = max(keeps)  # T - 1: every row verifies this many, or all it drafted if fewer
        best = probs.max(dim=-1)
        drafts = []
        for b, k in enumerate(ks):
            tokens, q, keep = best.indices[b, :k].tolist(), best.values[b, :k].tolist(), min(verify, k)
            draft = self._draft(tokens[:keep], q[:keep])
            if k > 0:  # a block was drafted, even where it is dropped whole (the single drafter's trace)
                draft.extras["dflash"] = {"block_size": self.spec.block_size}
                draft.extras["adaflash"] = {"rule": self.cfg.rule, "score": scores[b], "verify_len": keep + 1,
                                            "cut_tokens": tokens[keep:], "cut_q": q[keep:]}
            drafts.append(draft)
        return drafts

    def _cuts(self, probs: list[torch.Tensor], scores: list[float | None]) -> list[int]:
        """Each row's clamped cut m_b (as the single drafter clamps it); the cost rule at batch
        B > 1 gives every row the batch's common cut instead."""
        cfg, L = self.cfg, self.spec.block_size
        if cfg.rule == "cost" and len(probs) > 1:
            confidences = [acceptance_estimate(p, cfg, s, L) for p, s in zip(probs, scores)]
            common = best_common_cut(confidences, self.cost)
            cuts = [common] * len(probs)
        else:
            cuts = [cut_length(cfg.rule, p, cfg, self.cost, w, s, L) for p, w, s in zip(probs, self.windows, scores)]
        return [kept_length(cut, len(p), cfg) for cut, p in zip(cuts, probs)]

    def verified(self, row: int, draft: Draft, path: list[int]) -> None:
        if self.cfg.rule == "heuristic" and len(draft.tree):
            grow = len(path) == len(draft.tree)
            self.windows[row] = self.windows[row] + 2 if grow else max(1, self.windows[row] - 1)

    def select_rows(self, rows: torch.Tensor) -> None:
        super().select_rows(rows)
        self.windows = [self.windows[i] for i in rows.tolist()]


BATCH_METHODS = ("ar", "dflash", "adaflash")


def batch_drafter(single: Drafter, cost: list[float] | None = None) -> BatchDrafter:
    """The batched twin of a single-sequence drafter (ar, dflash or adaflash), sharing its
    network; `cost` overrides an AdaFlash drafter's curve with the batch's own c_B."""
    if type(single) is Drafter:
        return BatchDrafter()
    if type(single) is DFlashEngineDrafter:
        return BatchDFlash(single)
    if type(single) is AdaFlashDrafter:
        return BatchAdaFlash(single, cost)
    raise _unbatchable(single.name)


def _unbatchable(method: str) -> UnbatchableMethodError:
    return UnbatchableMethodError(f"method {method!r} does not decode in batches; batched methods: "
                                  f"{', '.join(BATCH_METHODS)}")


def build_batch_drafter(method: str, target, options: dict[str, Any] | None = None, drafter: str | None = None,
                        batch: int = 1, cache_dir=None) -> BatchDrafter:
    """A batched drafter for `method` built as the single engine builds it; AdaFlash's cost rule
    gets the verify-cost curve measured at `batch` rows (cached beside the batch-1 curve)."""
    from ..drafters import build_drafter, method_info
    from ..models.acquire import default_cache_dir
    from ..verify_cost import cached_verify_cost

    method_info(method)  # an unknown name is its own error
    if method not in BATCH_METHODS:
        raise _unbatchable(method)
    single = build_drafter(method, target, options, drafter, cache_dir=cache_dir)
    cost = None
    if isinstance(single, AdaFlashDrafter) and single.cfg.rule == "cost" and batch > 1:
        cost = cached_verify_cost(target, single.spec.block_size, cache_dir or default_cache_dir(), batch=batch)
    return batch_drafter(single, cost)
