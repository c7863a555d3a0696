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
class Draft:
    """A proposal: the tree; the proposal distributions q [n, V] used by verification (None =
    point masses, e.g. argmax drafts); the drafter's probability of each node's token, for the
    trace (None where the method has no probabilities); and method extras for the trace."""

    tree: DraftTree
    q: torch.Tensor | None = None
    q_token: list[float] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "Draft":
        return cls(DraftTree((), ()))


class Drafter:
    """Base drafter: proposes nothing (which is plain autoregressive decoding)."""

    name = "ar"
    feature_layers: tuple[int, ...] = ()

    def begin(self, prompt_ids: list[int], sampling: SamplingConfig, generator: torch.Generator | None) -> None:
        """Called once per run before the prefill."""
        self.sampling = sampling
        self.generator = generator

    def propose(self, context: list[int], max_len: int) -> Draft:
        """A draft of at most `max_len` tokens deep after `context` (all committed ids)."""
        return Draft.empty()

    def observe(self, features: torch.Tensor) -> None:
        """Target features [m, n_layers * H] of the m positions just committed to the target cache."""

    def config_dict(self) -> dict[str, Any]:
        """The method's knobs, for the trace."""
        return {}
