"""Prompt lookup decoding: drafts copied from earlier in the text, no model at all.

Find the most recent earlier occurrence of the last n committed tokens (longest n first) and
propose the tokens that followed it. It pays on inputs that repeat themselves: code edits,
summaries quoting their source, structured output.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import PromptLookupConfig
from .base import Draft, Drafter
from ..tree import DraftTree


def lookup(context: list[int], cfg: PromptLookupConfig, max_len: int) -> list[int]:
    """Tokens that followed the latest earlier match of the context's last n-gram."""
    return lookup_match(context, cfg, max_len)[0]


def lookup_match(context: list[int], cfg: PromptLookupConfig, max_len: int) -> tuple[list[int], int]:
    """`lookup`'s tokens and the length n of the n-gram that matched (0 and no tokens: none did),
    since a longer match predicts its continuation better."""
    limit = min(cfg.k, max_len)
    if limit <= 0:
        return [], 0
    for n in range(min(cfg.max_ngram, len(context) - 1), cfg.min_ngram - 1, -1):
        tail = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == tail:
                follow = context[start + n : start + n + limit]
                if follow:
                    return follow, n
    return [], 0


class PromptLookupDrafter(Drafter):
    name = "pld"

    def __init__(self, cfg: PromptLookupConfig) -> None:
        self.cfg = cfg

    def propose(self, context: list[int], max_len: int) -> Draft:
        return Draft(DraftTree.chain(lookup(context, self.cfg, max_len)))

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.cfg)


CONFIG = PromptLookupConfig


def build(target, cfg: PromptLookupConfig, drafter: str | None, cache_dir: Path | None = None) -> PromptLookupDrafter:
    return PromptLookupDrafter(cfg)
