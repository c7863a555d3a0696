"""DeLS-Spec: the DFlash drafter as long-context expert, fused with a local (short-context) head.

Within a block, DFlash's logits for every position come from one forward pass and stay fixed;
the local head then walks the block left to right, and each drafted token is

    x_k = argmax( l_long[k] + alpha * l_short(x_0..x_{k-1}) - beta * l_prior )

where l_prior is the log unigram frequency of the local head's training tokens (both experts
already carry that frequency prior; subtracting it once avoids counting it twice). alpha =
beta = 0 is exactly `dflash`. Like DFlash's, the draft is a tree of the block's most probable
paths (`tree`, by default, where the target verifies trees), each node's successors fused with
the local head after it read that node's own path (`fused_tree`). Point-mass proposals either
way, so the engine's verification keeps the method lossless at every temperature.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import torch

from ..errors import MethodConfigError
from ..models.local_head import LocalHead, load_local_head
from ..trace import ROOT
from ..tree import DraftTree, Successor, best_first_tree
from .base import Draft
from .dflash import DFlashEngineDrafter, DFlashFamilyConfig, ShadowChain, gate_cost, load_dflash_model

_TOP = 3  # alternatives kept in the trace per drafted token


@dataclass(frozen=True)
class DeLSConfig(DFlashFamilyConfig):
    """alpha and beta default to what scripts/dels_sweep.py chose for the shipped SmolLM2 head on
    the dev prompts, which no training data holds (the head's README has the table); sweep again
    for another head."""

    alpha: float = 0.45
    beta: float = 0.3
    local_head: str | None = None  # folder of the trained local head (default: the preset's)
    candidates: int = 64  # fuse only the long expert's top tokens (fuse_block); 0 = every token

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("alpha", "beta"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value < 0:
                raise MethodConfigError(f"{name} must be a number >= 0, got {value!r}")
        if isinstance(self.candidates, bool) or not isinstance(self.candidates, int) or self.candidates < 0:
            raise MethodConfigError(f"candidates must be a whole number >= 0 (0: every token), got {self.candidates!r}")


@torch.inference_mode()
def fuse_block(long_logits: torch.Tensor, head: LocalHead, root: int, alpha: float, beta: float,
               vocab: torch.Tensor | None = None, candidates: int = 0) -> dict[str, Any]:
    """Draft the block token by token: long_logits [k, V] are DFlash's, fixed; the local head
    reads the root and each chosen token. With a draft vocabulary `vocab` (target ids [N]),
    long_logits are [k, N] over it and the fusion runs there only: every other token has a long
    logit of -inf, so it could never win. The local head's logits are then read over the same N
    tokens (its readout table, models/local_head.py TokenStep), at N/V of the full LM head's cost.

    `candidates` > 0 fuses only the `candidates` tokens ranked highest by long - beta * prior
    (re-ranking, as fusion drafters commonly do): the local head's readout, most of its cost per
    token, then computes that many rows of the LM head instead of N. A token outside them could
    win the full rule only when the short expert outweighs the long one's margin; the draft is
    verified either way, so this changes speed, never the output. 0 fuses every token.
    Returns target token ids, fused probabilities and the trace."""
    return collect_fused(fuse_positions(iter(long_logits), head, root, alpha, beta, vocab, candidates))


def collect_fused(positions: Iterable[FusedPosition]) -> dict[str, Any]:
    """Fused positions as one block: target token ids, fused probabilities, each position's top
    fused tokens, the trace."""
    tokens, q, top, trace = [], [], [], {"long": [], "short": [], "prior": [], "flipped": [], "alternatives": []}
    for position in (position.record() for position in positions):
        tokens.append(position.pop("token"))
        q.append(position.pop("q"))
        top.append(position.pop("top"))
        for key, value in position.items():
            trace[key].append(value)
    return {"tokens": tokens, "q": q, "top": top, "trace": trace}


@dataclass
class Fusion:
    """What fusing one position needs besides its long logits: the local head, the knobs, and
    the frequency prior over the draft vocabulary (or every token)."""

    head: LocalHead
    alpha: float
    beta: float
    vocab: torch.Tensor | None = None
    candidates: int = 0
    width: int = 1

    def prior(self, device: torch.device) -> torch.Tensor:
        prior = self.head.log_prior.to(device)
        return prior if self.vocab is None else prior[self.vocab.to(device)]

    def slot(self, row: torch.Tensor, prior: torch.Tensor) -> FusionSlot:
        """What fusing at a position needs before the local head speaks, from DFlash's logits
        `row` ([V] or [N]) alone: the same for every tree node that drafts this position, so a
        tree prepares it once per position rather than once per node."""
        return self.slots(row[None], prior)[0]

    def slots(self, rows: torch.Tensor, prior: torch.Tensor) -> list[FusionSlot]:
        """`slot` for every row of `rows` [k, V] or [k, N] in one set of ops: a tree prepares its
        block's slots at once (about 0.1 ms a slot, one by one, on the 2-core CPU)."""
        base = rows - self.beta * prior
        # the pool in index order, so argmax breaks ties as DFlash's does (the first index): with
        # bf16 drafter logits, ties at the top are common, and topk orders them arbitrarily
        pooled = 0 < self.candidates < base.shape[-1]
        pools = base.topk(self.candidates, dim=-1).indices.sort(dim=-1).values if pooled else None
        vocab = None if self.vocab is None else self.vocab.to(rows.device)
        ids = pools if vocab is None else vocab if pools is None else vocab[pools]  # target ids of the scores
        scores = base if pools is None else base.gather(-1, pools)
        k = len(rows)
        step = self.head.token_step(self.vocab) if self.alpha else None
        readouts = [None] * k  # the native node reads the pool's rows of the readout table in place
        if step is not None and not step.native:  # the head's readout over the pool: rows of its token set, else ids
            readouts = [step.readout(pool) for pool in self._rows(pools, k)]
        columns = (rows.unbind(0), [prior] * k, scores.unbind(0), self._rows(pools, k), self._rows(ids, k), readouts,
                   rows.max(-1).indices.tolist())  # max: argmax's first index, in half its time here
        return [FusionSlot(*fields) for fields in zip(*columns)]

    @staticmethod
    def _rows(batched: torch.Tensor | None, k: int) -> list[torch.Tensor | None]:
        """Per slot: a [k, ...] tensor's rows, or a shared [N] one (or None) k times."""
        return [batched] * k if batched is None or batched.dim() == 1 else list(batched.unbind(0))

    def step(self, slot: FusionSlot, last: int,
             state: torch.Tensor | None) -> tuple[FusedPosition, torch.Tensor | None]:
        """One position: the prepared `slot` fused with the local head after it reads `last` from
        `state`; the position (its trace record read only when asked) and the head's state after
        `last`."""
        step = self.head.token_step(self.vocab) if self.alpha else None
        if step is not None and step.native:  # the whole node in one native call
            state, short, fused, at, values = step.fused(last, state, slot.pool, slot.scores, self.alpha, self.width)
        else:
            if step is not None:
                short, state = step(last, state, slot.readout)  # over the pool, or every token
                fused = slot.scores + self.alpha * short
            else:
                short, fused = None, slot.scores
            j = fused.argmax()
            probs = torch.softmax(fused, -1)
            best = probs.topk(min(self.width, probs.numel()))
            at = torch.cat([j[None], best.indices])  # the chosen token, then the top `width`
            values = torch.cat([probs[j][None], best.values])
        tokens = (at if slot.ids is None else slot.ids[at]).tolist()  # read in one transfer each
        values = values.tolist()
        return FusedPosition(tokens[0], values[0], (values[1:], tokens[1:]), self, slot, fused, short), state


@dataclass(frozen=True)
class FusedPosition:
    """One fused position: what a tree needs of every node at once (the chosen token, its fused
    probability, the top `width` as (probabilities, target ids)), and what its trace record is
    read from, only for the positions the trace keeps (a tree's fused chain)."""

    token: int
    q: float
    top: tuple[list[float], list[int]]
    fusion: Fusion
    slot: FusionSlot
    fused: torch.Tensor
    short: torch.Tensor | None

    def record(self) -> dict[str, Any]:
        """The position as the trace records it: the chosen token's long, short and prior terms,
        whether the local head flipped DFlash's choice, and the fused top _TOP's terms."""
        slot, fusion, fused = self.slot, self.fusion, self.fused
        at = torch.cat([fused.argmax()[None], fused.topk(min(_TOP, fused.numel())).indices])  # fused positions
        where = at if slot.pool is None else slot.pool[at]  # base indices
        short = torch.zeros(len(at), device=fused.device) if self.short is None else fusion.alpha * self.short[at]
        values = torch.stack([slot.row[where], short.to(slot.row.dtype), -fusion.beta * slot.prior[where]]).tolist()
        tokens = (at if slot.ids is None else slot.ids[at]).tolist()
        return {
            "token": self.token,
            "q": self.q,
            "top": self.top,
            "long": values[0][0],
            "short": values[1][0],
            "prior": values[2][0],
            "flipped": int(where[0]) != slot.argmax,
            "alternatives": [{"token": tokens[i], "long": values[0][i], "short": values[1][i], "prior": values[2][i]}
                             for i in range(1, len(at))],
        }


@dataclass(frozen=True)
class FusionSlot:
    """One position's part of the fusion that does not depend on the path: DFlash's logits `row`,
    the prior, the pool's base scores (long - beta * prior over `pool`, or every token when `pool`
    is None), their target ids (None: the scores' indices are the ids), the local head's readout
    over the pool, and DFlash's own argmax there."""

    row: torch.Tensor
    prior: torch.Tensor
    scores: torch.Tensor
    pool: torch.Tensor | None
    ids: torch.Tensor | None
    readout: Callable[[torch.Tensor], torch.Tensor] | None
    argmax: int


def fuse_positions(long_rows: Iterator[torch.Tensor], head: LocalHead, root: int, alpha: float, beta: float,
                   vocab: torch.Tensor | None = None, candidates: int = 0,
                   width: int = 1) -> Iterator[FusedPosition]:
    """fuse_block one position at a time, each from the next of `long_rows` (DFlash's logits for
    that slot, [V] or [N]), pulled only when that position is asked for: a shadow draft that
    misses early never computes the rest (drafters/dflash.py ShadowChain). Each position's `top`
    holds its `width` most probable fused tokens, (probabilities, target ids)."""
    fusion = Fusion(head, alpha, beta, vocab, candidates, width)
    prior, state, last = None, None, root
    for row in long_rows:
        prior = fusion.prior(row.device) if prior is None else prior
        position, state = fusion.step(fusion.slot(row, prior), last, state)
        last = position.token
        yield position


def fused_tree(long_logits: torch.Tensor, fusion: Fusion, root: int, nodes: int) -> tuple[DraftTree, list[float],
                                                                                         list[FusedPosition]]:
    """The `nodes` most probable paths through the block as a draft tree, each node's successors
    fused with the local head after it read that node's own path: every branch is scored as the
    method would continue it, where a tree over the fused chain's per-position tops scores a
    runner-up's successors as if the chain's token came first. It costs what the chain costs,
    one fusion per expanded node (the root and each node above the last slot, at most `nodes`).
    Returns the tree, each node's probability given its parent, and the positions of the fused
    chain (the root's argmax child, its argmax child, ..., as far as they were expanded), for
    the trace. Best-first over path probabilities, so every kept path's prefix is kept."""
    slots = fusion.slots(long_logits, fusion.prior(long_logits.device))
    expanded: dict[int, FusedPosition] = {}  # node -> the position after it
    order = count()  # ties in probability pop in push order

    def successors(node: int, at: tuple[int, int, torch.Tensor | None] | None) -> list[Successor]:
        # `at`: the node's slot, its token and the head's state before reading it
        slot, last, state = (0, root, None) if at is None else (at[0] + 1, at[1], at[2])
        if slot >= len(long_logits):
            return []
        position, after = fusion.step(slots[slot], last, state)
        expanded[node] = position
        return [(p, next(order), token, (slot, token, after)) for p, token in zip(*position.top)]

    tree, q = best_first_tree(successors, nodes)
    chain, node = [], ROOT
    while node in expanded:
        chain.append(expanded[node])
        node = next((i for i in tree.children(node) if tree.tokens[i] == expanded[node].token), None)
    return tree, q, chain


class DeLSDrafter(DFlashEngineDrafter):
    name = "dels"

    def __init__(self, model, cfg: DeLSConfig, head: LocalHead, cost: list[float] | None = None) -> None:
        super().__init__(model, cfg, cost)
        self.head = head.eval()
        head.token_step(model.draft_ids)  # its table now, not inside the first step the gate times

    def long_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """DFlash's logits [k, V], or [k, N] over its draft vocabulary, for hidden [k, H]."""
        vocab = self.model.draft_ids
        return (self.model.logits(hidden) if vocab is None else self.model.draft_logits(hidden)).float()

    def fusion(self, long_rows: Iterator[torch.Tensor], root: int) -> Iterator[FusedPosition]:
        """fuse_positions with this drafter's head, knobs and draft vocabulary."""
        return fuse_positions(long_rows, self.head, root, self.cfg.alpha, self.cfg.beta, self.model.draft_ids,
                              self.cfg.candidates)

    def shadow_tokens(self, context: list[int], k: int) -> ShadowChain:
        """The fused chain, each position's long logits and fusion computed when it is scored."""
        hidden = self.block_hidden(context)[1 : k + 1]
        fused = self.fusion((self.long_logits(row[None])[0] for row in hidden), context[-1])
        return ShadowChain(k, (position.token for position in fused))

    def draft_block(self, context: list[int], k: int) -> Draft:
        """The fused chain's k positions, drafted as it (and recorded in the trace as `chain`), or
        as the tree of the most probable paths through each position's top fused tokens."""
        hidden = self.block_hidden(context)[1 : k + 1]
        long = self.long_logits(hidden)
        if self.trees:
            fusion = Fusion(self.head, self.cfg.alpha, self.cfg.beta, self.model.draft_ids, self.cfg.candidates,
                            self.cfg.tree_width)
            tree, q, chain = fused_tree(long, fusion, context[-1], k)
            fused = collect_fused(chain)
        else:
            fused = collect_fused(self.fusion(iter(long), context[-1]))
            tree, q = DraftTree.chain(fused["tokens"]), fused["q"]
        return Draft(tree, q=None, q_token=q, extras={"dflash": {"block_size": self.spec.block_size},
                                                      "dels": {**fused["trace"], "chain": fused["tokens"]}})

CONFIG = DeLSConfig


def build(target, cfg: DeLSConfig, drafter: str | None, cache_dir: Path | None = None) -> DeLSDrafter:
    model = load_dflash_model(target, drafter, "dels", cfg.draft_dtype)
    location = cfg.local_head or preset_head(target.name, cache_dir)
    if not location:
        raise MethodConfigError(
            "method 'dels' needs a local head: pass -o local_head=PATH (train one with "
            "python -m specflash.training.local_head)"
        )
    return DeLSDrafter(model, cfg, load_local_head(location, target), gate_cost(target, cfg, model.spec.block_size, cache_dir))


def preset_head(model_name: str, cache_dir: Path | None) -> str | None:
    """The preset's local head folder, when `model_name` is a preset with one (`build`'s default; the
    bench records its weights)."""
    from ..models.presets import PRESETS, resolve_drafter

    if model_name not in PRESETS:
        return None
    path = resolve_drafter(model_name, "local_head", cache_dir)
    return None if path is None else str(path)
