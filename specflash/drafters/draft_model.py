"""Classic draft-model speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

A small causal LM sharing the target's tokenizer drafts k tokens one at a time, keeping its own
KV cache. Above temperature 0 it samples from its shaped distribution q and hands q to the
engine, so verification can use the exact min(1, p/q) rule.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from ..config import DraftModelConfig
from ..errors import DrafterMismatchError, MethodConfigError
from ..kv import Checkpoint, checkpoint, is_recurrent, new_cache, restore, rollback
from ..sampling import choose, probabilities
from ..tree import DraftTree
from .base import Draft, Drafter


def check_same_vocabulary(target_tokenizer: Any, drafter_tokenizer: Any, target_name: str, drafter_name: str) -> None:
    """Token ids mean the same thing in both models, or speculation is meaningless."""
    if target_tokenizer is None or drafter_tokenizer is None:
        return
    if target_tokenizer.get_vocab() != drafter_tokenizer.get_vocab():
        raise DrafterMismatchError(
            f"drafter {drafter_name!r} has a different vocabulary ({len(drafter_tokenizer)} tokens) from the "
            f"target {target_name!r} ({len(target_tokenizer)} tokens); a draft model must share the target's tokenizer"
        )


class DraftModelDrafter(Drafter):
    name = "draft"

    def __init__(self, model: PreTrainedModel, cfg: DraftModelConfig, vocab_size: int) -> None:
        self.model = model.eval()
        self.cfg = cfg
        self.vocab_size = vocab_size  # the target's logits width: q must live on the same support

    def begin(self, prompt_ids: list[int], sampling, generator) -> None:
        super().begin(prompt_ids, sampling, generator)
        self.cache = new_cache(self.model.config)  # full-length layers: rollback works past any sliding window
        self.cached: list[int] = []
        # A recurrent drafter (linear attention) cannot crop its cache: it keeps a checkpoint per
        # token it feeds while drafting and goes back to the one at the accepted length.
        self.saved: dict[int, Checkpoint] = {}

    def _rewind(self, keep: int) -> None:
        """Forget every cached token after the first `keep`."""
        if not is_recurrent(self.cache):
            rollback(self.cache, len(self.cached) - keep)
        else:
            if keep < len(self.cached) and keep in self.saved:
                restore(self.cache, self.saved[keep])
            elif keep < len(self.cached):  # no checkpoint there (the context changed): start over
                self.cache, keep = new_cache(self.model.config), 0
            self.saved = {keep: self.saved[keep]} if keep in self.saved else {}  # the context only grows
        del self.cached[keep:]

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """Pad or cut the drafter's logits to the target's vocabulary width."""
        v = logits.shape[-1]
        if v >= self.vocab_size:
            return logits[..., : self.vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _feed(self, ids: list[int]) -> torch.Tensor:
        start = len(self.cached)  # what the cache holds (a Mamba cache cannot say)
        device = next(self.model.parameters()).device
        positions = torch.arange(start, start + len(ids), device=device)[None]
        out = self.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cached.extend(ids)
        if is_recurrent(self.cache):
            self.saved[len(self.cached)] = checkpoint(self.cache)
        return self._fit(out.logits[0, -1].float())

    @torch.inference_mode()
    def propose(self, context: list[int], max_len: int) -> Draft:
        k = min(self.cfg.k, max_len)
        if k <= 0:
            return Draft.empty()
        # 1. Roll the drafter cache back to the longest prefix it shares with the context.
        keep = 0
        for a, b in zip(self.cached, context[:-1]):
            if a != b:
                break
            keep += 1
        self._rewind(keep)
        # 2. Draft k tokens autoregressively from the same shaped distribution as the target.
        logits = self._feed(context[keep:])
        tokens, dists = [], []
        for i in range(k):
            probs = probabilities(logits, self.sampling)
            token = choose(logits, probs, self.sampling, self.generator)
            tokens.append(token)
            dists.append(probs)
            if i + 1 < k:
                logits = self._feed([token])
        q = None if self.sampling.greedy else torch.stack(dists)
        return Draft(DraftTree.chain(tokens), q, [float(d[t]) for d, t in zip(dists, tokens)])

    def config_dict(self) -> dict[str, Any]:
        return asdict(self.cfg)


CONFIG = DraftModelConfig


def build(target, cfg: DraftModelConfig, drafter: str | None, cache_dir: Path | None = None) -> DraftModelDrafter:
    from ..models.loading import load_causal_lm

    if not drafter:
        raise MethodConfigError(
            "method 'draft' needs a drafter: pass --drafter PATH_OR_PRESET (a small causal LM that shares "
            "the target's tokenizer)"
        )
    model, tokenizer = load_causal_lm(drafter, device=target.device, dtype=target.dtype, cache_dir=cache_dir)
    check_same_vocabulary(target.tokenizer, tokenizer, target.name, drafter)
    return DraftModelDrafter(model, cfg, target.vocab_size)
