"""Acceptance rules: which drafted tokens the target keeps, and what it adds after them.

Notation, used everywhere in SpecFlash: p is the target's distribution, q the drafter's, both
shaped by the same SamplingConfig. Rules:

- greedy: a drafted token is kept iff it equals the target's argmax at its parent; the token
  after the kept path is the target's argmax there. Output = plain greedy decoding.
- speculative sampling with a proposal q (Leviathan et al. 2023, Alg. 1): keep token x with
  probability min(1, p(x)/q(x)); on rejection draw from norm(max(0, p - q)); if every token was
  kept, draw a bonus token from p at the end.
- point mass (argmax or deterministic proposals, q = one-hot at x): keep x with probability
  p(x); on rejection draw from p with x removed, renormalised. The same rule with q = one-hot.
- multi-candidate tree walk: at a node, try its children in order with the point-mass rule,
  each rejection removing that child's token from p; move to the first kept child; if all are
  rejected, draw from what is left of p (never an argmax fallback: that would bias the output).

Each rule leaves the emitted tokens distributed exactly as sampling from p one token at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample
from .trace import ROOT
from .tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one draft: kept node path, the target's token after it, and its kind."""

    path: list[int]
    token: int
    kind: str


def accept_token(
    p: torch.Tensor, q: torch.Tensor | None, token: int, generator: torch.Generator | None
) -> tuple[bool, torch.Tensor]:
    """One speculative-sampling test of `token` drawn from q (None = point mass at `token`).

    Returns whether it is kept and the residual distribution to draw from (or to test the next
    candidate against) when it is not.
    """
    p_x = float(p[token])
    q_x = 1.0 if q is None else float(q[token])
    u = float(torch.rand((), generator=generator, device=p.device))
    if q_x > 0 and u < min(1.0, p_x / q_x):
        return True, p
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    # p == q on the support makes rejection a zero-probability event; keep p if rounding gets here.
    return False, (residual / total if total > 0 else p)


def _child_rows(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {ROOT: []}
    for i, parent in enumerate(tree.parents):
        kids.setdefault(parent, []).append(i)
        kids.setdefault(i, [])
    return kids


def walk_greedy(tree: DraftTree, target_argmax: list[int]) -> Verdict:
    """Greedy tree walk. `target_argmax[0]` is the target's argmax after the root, `[i + 1]`
    after node i."""
    kids = _child_rows(tree)
    node, path = ROOT, []
    while True:
        want = target_argmax[node + 1]
        match = next((c for c in kids[node] if tree.tokens[c] == want), None)
        if match is None:
            return Verdict(path, want, "resample" if kids[node] else "bonus")
        path.append(match)
        node = match


def walk_sampled(
    tree: DraftTree,
    p: torch.Tensor,
    generator: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> Verdict:
    """Exact speculative sampling over a tree. `p` is [n+1, V] (row 0 after the root, row i+1
    after node i). `q` is [n, V], node i's proposal distribution, or None for point masses; a
    proposal distribution is only exact with one candidate per node, so it needs a chain."""
    if q is not None and not tree.is_chain:
        raise ValueError("proposal distributions q need a chain draft; trees use point-mass proposals")
    kids = _child_rows(tree)
    node, path = ROOT, []
    while True:
        dist = p[node + 1]
        candidates = kids[node]
        if not candidates:
            return Verdict(path, sample(dist, generator), "bonus")
        kept = None
        for child in candidates:
            ok, dist = accept_token(dist, None if q is None else q[child], tree.tokens[child], generator)
            if ok:
                kept = child
                break
        if kept is None:
            return Verdict(path, sample(dist, generator), "resample")
        path.append(kept)
        node = kept


def greedy_chain(draft: list[int], target_argmax: list[int]) -> Verdict:
    """Greedy rule on a chain: keep the longest prefix matching the target's argmax."""
    return walk_greedy(DraftTree.chain(draft), target_argmax)


def sampled_chain(
    draft: list[int], p: torch.Tensor, generator: torch.Generator | None, q: torch.Tensor | None = None
) -> Verdict:
    """Speculative sampling on a chain, with proposal distributions q or point masses (q None)."""
    return walk_sampled(DraftTree.chain(draft), p, generator, q)
