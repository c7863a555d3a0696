"""The one small interface every drafting method implements, and the method registry.

A drafter sees the committed token ids and returns a draft tree; the engine verifies it with the
target. Drafters that condition on the target's hidden states (DFlash and its kin) name the
layers they need in `feature_layers`, and the engine hands them those features for every
committed position through `observe`. The registry of methods lives in drafters/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import SamplingConfig
from ..tree import DraftTree


@dataclass
class Lookahead:
    """Extra tokens fed in the verification forward but never verified or kept (PTD's draft
    tree): the target's predictions at them are how a self-drafting method drafts.

    `allow` [A, 1 + n + A] says which of the root, the n draft-tree nodes and the A lookahead
    tokens each lookahead token sees (every row also sees the whole committed prefix);
    `positions` are offsets from the root's position.
    """

    tokens: list[int]
    positions: list[int]
    allow: torch.Tensor


@dataclass
class Draft:
    """A proposal: the tree; the proposal distributions q [n, V] used by verification (None =
    point masses, e.g. argmax drafts); the drafter's probability of each node's token, for the
    trace (None where the method has no probabilities); and method extras for the trace."""

    tree: DraftTree
    q: torch.Tensor | None = None
    q_token: list[float] | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    lookahead: Lookahead | None = None

    @classmethod
    def empty(cls) -> "Draft":
        return cls(DraftTree((), ()))

    def feed(self, root: int, start: int) -> tuple[list[int], torch.Tensor, list[int]]:
        """What one verification forward feeds after the `start` cached tokens: the ids
        [root, tree nodes..., lookahead tokens...] (T of them), which of them each row sees
        (bool [T, T]; every row also sees the whole cached prefix) and their absolute positions.
        Tree rows see the root and their ancestors; lookahead rows see what `lookahead.allow` says."""
        tree, look = self.tree, self.lookahead
        n = len(tree) + 1
        a = len(look.tokens) if look is not None else 0
        allow = torch.zeros(n + a, n + a, dtype=torch.bool)
        allow[:n, :n] = tree.ancestor_mask()
        positions = tree.position_ids(start)
        if look is not None:
            allow[n:] = look.allow
            positions += [start + offset for offset in look.positions]
        return [root, *tree.tokens, *(look.tokens if look is not None else [])], allow, positions


class Drafter:
    """Base drafter: proposes nothing (which is plain autoregressive decoding)."""

    name = "ar"
    feature_layers: tuple[int, ...] = ()

    def bind(self, target) -> None:
        """Called once per run, before `begin`, with the target that verifies the drafts: for what
        a drafter must know of it (DFlash drafts chains where the target cannot verify trees)."""

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Called once per run before the prefill."""
        self.sampling = sampling
        self.generator = generator

    def propose(self, context: list[int], max_len: int) -> Draft:
        """A draft of at most `max_len` tokens deep after `context` (all committed ids)."""
        return Draft.empty()

    def observe(self, features: torch.Tensor) -> None:
        """Target features [m, n_layers * H] of the m positions just committed to the target cache."""

    def verified(self, draft: Draft, logits: torch.Tensor, path: list[int], committed: list[int]) -> None:
        """After each verification: the target's logits at every fed row [1 + n + A, V] (root,
        draft nodes, lookahead tokens), the accepted node path and the committed tokens."""

    def config_dict(self) -> dict[str, Any]:
        """The method's knobs, for the trace."""
        return {}
