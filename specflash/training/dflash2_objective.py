"""The DFlash 2 training objective on one teacher-forced sequence: the selector's K-way
cross-entropy, plus DFlash's own cross-entropy on the unary logits.

Selector term (the reference trainers' teacher-forced objective, vLLM speculators'
dflash2/metrics.py): drafted slot k of block n keeps the top-K of its unary scores as candidates;
its label is the rank of the target's token among them. The edge score of candidate b is
S_k(pred, b) = U_k(b) + <A[pred] * W h_k, B[c_k(b)]>, with pred the token before slot k as the
target wrote it: the anchor for slot 1, the label of slot k - 1 after that. That is the
predecessor the walk has at inference whenever the prefix was accepted, the only case in which
slot k matters. Cross-entropy over the K scores, weighted per slot as DFlash's (exp(-(k-1)/gamma)).
A slot whose target token is not among its K candidates carries no selector loss: the walk cannot
draft it whatever the selector does. (The reference instead swaps the target in for the K-th
candidate so every slot has a label; skipping keeps training on exactly the lattice inference
walks.)

Unary term: DFlash's weighted cross-entropy of the slot logits over the drafter's vocabulary (its
draft vocabulary when it has one), as the reference adds it. It is what keeps the target's token
among the top K while the convolutions change the hidden states; the selector term alone only
reorders the K it is given.

The statistics are exact greedy acceptance figures under teacher forcing: with the prefix
accepted, the walk's predecessor is the label, so the leading run of slots where the selector's
argmax (given the label predecessor) is the label is what greedy verification of the walk accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.dflash2 import CandidateSelector, DFlash2Drafter
from .dflash_objective import Sequence, block_forward, block_labels, draft_labels


@dataclass
class Terms:
    """One sequence's loss sums (differentiable) and their weights, plus counts for the log."""

    selector: torch.Tensor  # sum over slots with the label among the candidates of w_k * CE_K
    selector_weight: float
    unary: torch.Tensor  # sum over reachable slots of w_k * CE over the vocabulary (0 when not asked)
    unary_weight: float
    counts: dict[str, torch.Tensor]  # summed over blocks or slots; see `slot_counts`


def unary_logits(model: DFlash2Drafter, hidden: torch.Tensor) -> torch.Tensor:
    """Unary scores over the drafter's vocabulary: [..., N] over the draft vocabulary when it has
    one (its index i is token draft_ids[i]), else [..., V]."""
    if model.draft_ids is None:
        return model.logits(hidden)
    return model.unary(model.draft_logits(hidden))


def teacher_forced_scores(selector: CandidateSelector, hidden: torch.Tensor, predecessors: torch.Tensor,
                          candidates: torch.Tensor, unary: torch.Tensor) -> torch.Tensor:
    """S [..., K]: the row of CandidateSelector.scores for one given predecessor per slot.
    hidden [..., H]; predecessors [...] token ids; candidates, unary [..., K]."""
    context = selector.predecessor_codebook[predecessors].float() * selector.hidden_projection(hidden).float()
    successors = selector.successor_codebook[candidates].float()  # [..., K, r]
    return unary.float() + (successors @ context[..., None])[..., 0]


def leading_run(hit: torch.Tensor) -> torch.Tensor:
    """[N, T] bool -> [N]: how many leading slots hit."""
    return hit.long().cumprod(dim=1).sum(dim=1)


def sequence_terms(model: DFlash2Drafter, seq: Sequence, features: torch.Tensor, anchors: torch.Tensor,
                   weights: torch.Tensor, unary_weight: float = 1.0, backbone_grad: bool = True) -> Terms:
    """The selector and unary loss terms of all anchored blocks of one sequence (module
    docstring). `backbone_grad` False runs the drafter network without autograd (only the
    selector trains); `unary_weight` 0 skips the unary cross-entropy."""
    device, L, K = features.device, model.spec.block_size, model.spec.selector_top_k
    anchors = anchors.to(device)
    with torch.set_grad_enabled(backbone_grad and torch.is_grad_enabled()):
        hidden = block_forward(model, seq, features, anchors)[:, 1:]  # [N, T = L-1, H]
        logits = unary_logits(model, hidden).float()  # [N, T, V']
    labels, valid = block_labels(seq.next_ids.to(device), anchors, L)  # target ids [N, T]
    ranked = logits.detach().topk(K, dim=-1).indices  # [N, T, K] in the drafter's vocabulary
    candidates = ranked if model.draft_ids is None else model.draft_ids[ranked]  # target ids
    match = (candidates == labels[..., None]) & valid[..., None]
    inside = match.any(-1)  # [N, T]
    predecessors = torch.cat([seq.tokens.to(device)[anchors][:, None], labels[:, :-1]], dim=1)
    scores = teacher_forced_scores(model.candidate_selector, hidden, predecessors, candidates,
                                   logits.gather(-1, ranked))
    w = weights.to(device)[None]
    sel_w = w * inside
    ce = F.cross_entropy(scores.flatten(0, 1), match.long().argmax(-1).flatten(), reduction="none")
    selector = (ce.view_as(sel_w) * sel_w).sum()
    unary, unary_w = scores.new_zeros(()), 0.0
    if unary_weight:
        targets, reachable = labels, valid
        if model.draft_ids is not None:
            targets, in_vocab = draft_labels(model.draft_ids, labels)
            reachable = valid & in_vocab
        uw = w * reachable
        uce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view_as(uw)
        unary, unary_w = (uce * uw).sum(), float(uw.sum())
    with torch.no_grad():
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        counts = slot_counts(valid, inside, candidates[..., 0] == labels, chosen == labels)
    return Terms(selector, float(sel_w.sum()), unary, unary_w, counts)


def slot_counts(valid: torch.Tensor, inside: torch.Tensor, unary_hit: torch.Tensor,
                selector_hit: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-slot counts [T] (valid slots, label among the top K, selector right where it could be)
    and per-block sums (blocks; accepted slots under the unary argmax, the selector's walk and the
    oracle that always picks the label when it is a candidate)."""
    return {
        "slots": valid.sum(0), "in_top_k": inside.sum(0),
        "selector_right": (selector_hit & inside).sum(0),
        "blocks": torch.tensor(len(valid)),
        "accepted_unary": leading_run(unary_hit & valid).sum(),
        "accepted_selector": leading_run(selector_hit & valid).sum(),
        "accepted_oracle": leading_run(inside).sum(),
    }


def combine(terms: list[Terms], unary_weight: float) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The step's loss: the selector CE and unary CE each averaged over their own slot weights,
    the unary one times `unary_weight`; and the step's figures for the log (None when no slot
    carries a loss)."""
    sel_w = sum(t.selector_weight for t in terms)
    uni_w = sum(t.unary_weight for t in terms)
    parts, stats = [], {}
    if sel_w > 0:
        parts.append(sum(t.selector for t in terms) / sel_w)
        stats["selector_loss"] = float(parts[-1].detach())
    if unary_weight and uni_w > 0:
        unary = sum(t.unary for t in terms) / uni_w
        parts.append(unary_weight * unary)
        stats["unary_loss"] = float(unary.detach())
    if not parts:
        return None, {}
    loss = sum(parts)
    counts = {k: sum(t.counts[k] for t in terms) for k in terms[0].counts}
    blocks = max(1, int(counts["blocks"]))
    stats.update({
        "loss": float(loss.detach()),
        "recall": float(counts["in_top_k"].sum() / counts["slots"].sum().clamp(min=1)),
        "selector_acc": float(counts["selector_right"].sum() / counts["in_top_k"].sum().clamp(min=1)),
        "tau_unary": 1 + float(counts["accepted_unary"]) / blocks,
        "tau_selector": 1 + float(counts["accepted_selector"]) / blocks,
        "tau_oracle": 1 + float(counts["accepted_oracle"]) / blocks,
    })
    return loss, stats
