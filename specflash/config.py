"""Frozen, validated configuration: how to sample and how each method drafts.

Validation lives here, once, so the engine, the CLI and the app all reject the same bad values
with the same message.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from .errors import MethodConfigError, SamplingConfigError


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's (and the drafter's) logits become a distribution.

    temperature 0 means greedy: argmax, no randomness. top_k 0 means no top-k cut.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise SamplingConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingConfigError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise SamplingConfigError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _positive(name: str, value: Any, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise MethodConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class DraftModelConfig:
    """Classic draft-model speculative decoding: the drafter proposes `k` tokens per step."""

    k: int = 4

    def __post_init__(self) -> None:
        _positive("k (draft length)", self.k)


@dataclass(frozen=True)
class PromptLookupConfig:
    """Prompt lookup: match the last `max_ngram`..`min_ngram` tokens earlier in the text and
    propose the `k` tokens that followed the most recent match."""

    k: int = 8
    max_ngram: int = 3
    min_ngram: int = 1

    def __post_init__(self) -> None:
        _positive("k (draft length)", self.k)
        _positive("min_ngram", self.min_ngram)
        _positive("max_ngram", self.max_ngram)
        if self.max_ngram < self.min_ngram:
            raise MethodConfigError(f"max_ngram ({self.max_ngram}) must be >= min_ngram ({self.min_ngram})")


@dataclass(frozen=True)
class NoConfig:
    """Methods with no knobs of their own (plain autoregressive decoding)."""


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Plain dict of a config, for the JSON trace."""
    return asdict(cfg) if cfg is not None else {}
