"""AdaFlash: DFlash drafts the full block; a cut rule decides how much of it the target verifies.

The draft side stays full length (the drafter was trained on fixed blocks); only the number of
tokens sent to verification changes, so the method is lossless by construction. Rules, each
selectable by name:

- `fixed`: verify `fixed_len` drafted tokens.
- `heuristic`: transformers' assisted-generation schedule: +2 after a fully accepted draft, -1
  otherwise (never below 1).
- `confidence`: stop at the first drafted token whose draft probability is below `threshold`.
- `entropy`: stop at the first position whose draft distribution has entropy above `threshold`
  (nats).
- `cost` (default): the cost-aware cut: with the device's measured verify-cost curve c(l), keep
  the m drafts that maximise expected committed tokens per unit of verify cost, reading the
  per-position draft probabilities as acceptance estimates; `rate` scales the estimates.
- `head`: AdaFlash's length head (needs a trained head; not shipped yet).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import MethodConfigError
from ..tree import DraftTree
from ..verify_cost import best_cut, cached_verify_cost
from .base import Draft
from .dflash import DFlashConfig, DFlashEngineDrafter, load_dflash_model

RULES = ("cost", "fixed", "heuristic", "confidence", "entropy")


@dataclass(frozen=True)
class AdaFlashConfig(DFlashConfig):
    rule: str = "cost"
    fixed_len: int = 3
    threshold: float = 0.5
    rate: float = 1.0
    min_len: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rule not in RULES:
            raise MethodConfigError(f"unknown cut rule {self.rule!r}; choose from {', '.join(RULES)}")
        for name in ("fixed_len", "min_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise MethodConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.rate, (int, float)) or self.rate <= 0:
            raise MethodConfigError(f"rate must be > 0, got {self.rate!r}")
        if not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise MethodConfigError(f"threshold must be >= 0, got {self.threshold!r}")


def cut_length(rule: str, probs: torch.Tensor, cfg: AdaFlashConfig, cost: list[float] | None, window: int) -> int:
    """How many of the drafted tokens (rows of probs [k, V]) to verify, before clamping."""
    k = probs.shape[0]
    conf = probs.max(dim=-1).values.tolist()
    if rule == "fixed":
        return cfg.fixed_len
    if rule == "heuristic":
        return window
    if rule == "confidence":
        return next((i for i, c in enumerate(conf) if c < cfg.threshold), k)
    if rule == "entropy":
        entropy = (-(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)).tolist()
        return next((i for i, h in enumerate(entropy) if h > cfg.threshold), k)
    return best_cut([min(1.0, c * cfg.rate) for c in conf], cost)


class AdaFlashDrafter(DFlashEngineDrafter):
    name = "adaflash"

    def __init__(self, model, cfg: AdaFlashConfig, cost: list[float] | None = None) -> None:
        super().__init__(model, cfg)
        self.cost = cost
        self.window = cfg.fixed_len

    def begin(self, prompt_ids, sampling, generator) -> None:
        super().begin(prompt_ids, sampling, generator)
        self.window = max(1, self.cfg.fixed_len)

    @torch.inference_mode()
    def propose(self, context: list[int], max_len: int) -> Draft:
        k = min(self.draft_len, max_len)
        if k <= 0:
            return Draft.empty()
        probs = torch.softmax(self.block_logits(context, k).float(), dim=-1)  # [k, V], the full block
        best = probs.max(dim=-1)
        tokens = best.indices.tolist()
        keep = max(min(cut_length(self.cfg.rule, probs, self.cfg, self.cost, self.window), k), min(self.cfg.min_len, k))
        return Draft(
            DraftTree.chain(tokens[:keep]),
            q=None,
            q_token=best.values.tolist()[:keep],
            extras={
                "dflash": {"block_size": self.spec.block_size},
                "adaflash": {"rule": self.cfg.rule, "score": None, "verify_len": keep + 1, "cut_tokens": tokens[keep:],
                             "cut_q": best.values.tolist()[keep:]},
            },
        )

    def verified(self, draft: Draft, logits: torch.Tensor, path: list[int], committed: list[int]) -> None:
        if self.cfg.rule == "heuristic" and len(draft.tree):
            self.window = self.window + 2 if len(path) == len(draft.tree) else max(1, self.window - 1)

    def config_dict(self) -> dict[str, Any]:
        return {**super().config_dict(), **asdict(self.cfg)}


CONFIG = AdaFlashConfig


def build(target, cfg: AdaFlashConfig, drafter: str | None, cache_dir: Path | None = None) -> AdaFlashDrafter:
    from ..models.acquire import default_cache_dir

    model = load_dflash_model(target, drafter, "adaflash")
    cost = None
    if cfg.rule == "cost":
        cost = cached_verify_cost(target, model.spec.block_size, cache_dir or default_cache_dir())
    return AdaFlashDrafter(model, cfg, cost)
