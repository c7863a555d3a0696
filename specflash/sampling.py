"""Logits to probabilities, and drawing from them.

The same shaping (temperature, top-k, top-p) is applied to the target's p and the drafter's q,
because speculative sampling is exact only when both live on the same warped distribution.
"""

from __future__ import annotations

import torch

from .config import SamplingConfig


def probabilities(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities under `cfg`.

    At temperature 0 decisions are argmax of the logits; the plain softmax returned here is only
    what traces show as p and q.
    """
    logits = logits.float()
    if cfg.greedy:
        return torch.softmax(logits, dim=-1)
    logits = logits / cfg.temperature
    if cfg.top_k and cfg.top_k < logits.shape[-1]:
        kth = torch.topk(logits, cfg.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= cfg.top_p  # keep the smallest prefix whose mass reaches top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def choose(logits: torch.Tensor, probs: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> int:
    """The next token from one position: argmax when greedy, else a draw from `probs`."""
    if cfg.greedy:
        return int(torch.argmax(logits).item())
    return sample(probs, generator)
