"""PTD, progressive tree drafting: the target drafts for itself, training-free, in the same
forward that verifies.

Each step feeds one target forward with three segments: the root (last committed token, fed by
the engine), a guess tree retrieved from an n-gram pool (`Draft.tree`, verified by the engine's
exact tree walk, so the method is lossless at every temperature), and a draft tree of noisy
lookahead sub-trees (`Draft.lookahead`, never verified; its KV is discarded). The target's
predictions at the draft tree grow it by a level per step and, together with its predictions at
the guess tree and the committed text, feed the pool. See docs/ptd.md and research/methods.md §3.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from ..config import SamplingConfig
from ..errors import MethodConfigError
from .base import Draft, Drafter
from .ptd_pool import NGramPool
from .ptd_tree import DraftForest, Flat

PRESETS: dict[str, dict[str, Any]] = {
    # Few tokens per forward: on a CPU the target's cost grows with every token fed.
    "cpu": dict(max_depth=2, max_children=2, window=2, guess_budget=8, lookahead_budget=4),
    # The reference's tree shape (configs/tree_config.json), for machines where width is cheap.
    "paper": dict(max_depth=6, max_children=4, window=4, guess_budget=60, lookahead_budget=64),
}
UPDATES = ("argmax", "top-k")


@dataclass(frozen=True)
class PTDConfig:
    """PTD's knobs. `preset` fills every size knob left as None ("cpu" or "paper").

    max_depth: levels of a draft sub-tree before it goes deeper; max_children: per draft node;
    window: draft sub-trees; guess_budget: guess-tree nodes verified per step; lookahead_budget:
    draft-tree tokens fed per step; update: "argmax" or "top-k" (each draft node adds its top
    `top_k` predictions); guess_depth: n-gram length kept and retrieved; pool_nodes: trie nodes
    kept per key; seed_prompt: fill the pool with the prompt's n-grams before decoding.
    """

    preset: str = field(default="cpu", metadata={"choices": tuple(PRESETS)})
    max_depth: int | None = None
    max_children: int | None = None
    window: int | None = None
    guess_budget: int | None = None
    lookahead_budget: int | None = None
    update: str = field(default="argmax", metadata={"choices": UPDATES})
    top_k: int = 2
    guess_depth: int = 6
    pool_nodes: int = 60
    seed_prompt: bool = True

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise MethodConfigError(f"ptd preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        for name, value in PRESETS[self.preset].items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.update not in UPDATES:
            raise MethodConfigError(f"ptd update must be one of {', '.join(UPDATES)}, got {self.update!r}")
        if not isinstance(self.seed_prompt, bool):
            raise MethodConfigError(f"ptd seed_prompt must be true or false, got {self.seed_prompt!r}")
        minimum = {"guess_budget": 0, "lookahead_budget": 0, "window": 0}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("preset", "update", "seed_prompt"):
                continue
            low = minimum.get(f.name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise MethodConfigError(f"ptd {f.name} must be an integer >= {low}, got {value!r}")


class PTDDrafter(Drafter):
    """One draft tree and one n-gram pool per run; see the module docstring."""

    name = "ptd"

    def __init__(self, cfg: PTDConfig, eos_ids: frozenset[int], context_length: int) -> None:
        self.cfg = cfg
        self.eos = frozenset(eos_ids)
        self.context_length = context_length

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        super().begin(prompt_ids, sampling, generator)
        self.pool = NGramPool(self.cfg.pool_nodes, self.cfg.guess_depth)
        if self.cfg.seed_prompt:
            self.pool.add_text(list(prompt_ids))
        self.forest = DraftForest()
        self.prompt = list(prompt_ids)
        self.rng = random.Random(sampling.seed)  # the draft tree's perturbations; never the target's
        self._started = False

    def _guess_next(self, token: int) -> int:
        """A token to extend the draft chain where the target has not predicted one: the pool's
        latest continuation, else a prompt token (the reference's controlled perturbation)."""
        follow = [t for t in self.pool.first_continuation(token, 1) if t not in self.eos]
        if follow:
            return follow[0]
        choices = [t for t in self.prompt if t not in self.eos] or [token]
        return self.rng.choice(choices)

    def _fits(self, context_len: int) -> bool:
        return context_len + self.cfg.window + self.cfg.max_depth < self.context_length

    def propose(self, context: list[int], max_len: int) -> Draft:
        if not self._started:
            self._started = True
            self._update_forest(context[-1])
        cfg = self.cfg
        guess = self.pool.guess(context[-1], cfg.guess_budget, min(max_len, cfg.guess_depth))
        feed = max_len > 0 and cfg.lookahead_budget > 0 and self.forest.roots and self._fits(len(context))
        self._flat = self.forest.flat() if feed else Flat([], [], [], [])
        self._context = list(context)
        lookahead = self.forest.lookahead(len(guess)) if feed else None
        extras = {"ptd": {
            "guess_size": len(guess),
            "lookahead_size": len(self._flat.nodes),
            "draft_before": self.forest.snapshot() if feed else {"tokens": [], "parents": []},
        }}
        self._uids_before = [n.uid for n in self._flat.nodes]
        return Draft(guess, lookahead=lookahead, extras=extras)

    def verified(self, draft: Draft, logits: torch.Tensor, path: list[int], committed: list[int]) -> None:
        n, a = len(draft.tree), len(self._flat.nodes)
        argmax = logits[: 1 + n].argmax(dim=-1).tolist()  # [1 + n]: after the root, after each guess node
        key = self._context[-1]
        self.pool.add(key, argmax[:1])
        self.pool.add_tree(key, list(draft.tree.tokens), list(draft.tree.parents),
                           {i: argmax[i + 1] for i in range(n)})
        if a:
            self.forest.record(self._flat, self._predictions(logits[1 + n : 1 + n + a]))
            for chain in self.forest.paths():
                for i in range(len(chain) - 1):
                    self.pool.add(chain[i], chain[i + 1 :])
            self.forest.grow(self._flat, self.cfg.max_children, self.eos)
        text = self._context + committed
        self.pool.add_text(text, range(len(self._context) - 1 - self.cfg.guess_depth, len(text) - 1))
        self.forest.shift(len(committed))
        self._update_forest(text[-1])
        self._trace(draft.extras["ptd"])

    def _predictions(self, rows: torch.Tensor) -> list[list[int]]:
        """The tree update rule at each draft row [A, V]: argmax, or the top-k tokens."""
        k = 1 if self.cfg.update == "argmax" else min(self.cfg.top_k, rows.shape[-1])
        return rows.topk(k, dim=-1).indices.tolist()

    def _update_forest(self, anchor: int) -> None:
        """Slide the window, go deeper, cap children and the token budget."""
        cfg = self.cfg
        self.forest.slide(cfg.window, anchor, self._guess_next, self.eos)
        self.forest.prune_depth(cfg.max_depth, self.eos)
        self.forest.cap_children(cfg.max_children)
        self.forest.cap_tokens(cfg.lookahead_budget)

    def _trace(self, extras: dict[str, Any]) -> None:
        """Growth and pruning of this step, filled in after verification (same dict as the record's)."""
        before = set(self._uids_before)
        after = self.forest.uids()
        survivors = set(after)
        extras["draft_after"] = self.forest.snapshot()
        extras["added"] = [i for i, uid in enumerate(after) if uid not in before]
        extras["inherited"] = [i for i, uid in enumerate(after) if uid in before]
        extras["pruned"] = [i for i, uid in enumerate(self._uids_before) if uid not in survivors]

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.cfg)


CONFIG = PTDConfig


def build(target, cfg: PTDConfig, drafter: str | None, cache_dir: Path | None = None) -> PTDDrafter:
    """PTD needs nothing but the target (its EOS ids and context length), and tree verification
    on it: a target with recurrent layers cannot verify trees, which this says before decoding."""
    target.check_blocks()
    target.family.check_trees()
    return PTDDrafter(cfg, target.eos_ids, target.context_length)
