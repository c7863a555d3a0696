"""AdaFlash's distillation objective for a DFlash drafter, and the SFT baseline it is measured against.

For block slot k of anchor a (label position t = a + k - 1, the token after position t), with the
target's next-token distribution p_T at t and the drafter's p_S (research/methods.md §2.3):

    CE_k  = -log p_S(argmax p_T)                           (the target's hard label)
    RKL_k = T^2 * sum_v p_S(v) (log p_S(v) - log p_T(v))   (reverse KL, exact over the vocabulary)
    loss  = alpha * sum_k w_k CE_k / N + (1 - alpha) * sum_k w_k min(RKL_k / N, tau)

with the DFlash decay weights w_k and N = sum of w_k over the whole step (so the clip, applied
after dividing by N as the reference does, only removes outliers). Reverse KL is mode-seeking: it
pushes the drafter's mass onto the target's own top tokens rather than spreading it over
everything the target finds plausible, which is what greedy acceptance rewards. The SFT baseline
is plain decay-weighted cross-entropy on the data tokens. Both read the target's last-layer
outputs (cached with the drafter's features) and rebuild p_T through the target's own head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..models.dflash import DFlashDrafter
from .dflash_objective import Sequence, block_forward, block_labels, draft_labels, label_positions, leading_correct

OBJECTIVES = ("opd", "sft")


@dataclass(frozen=True)
class DistillConfig:
    objective: str = "opd"
    alpha: float = 0.8  # weight of the hard-label CE (the reference pipeline's value)
    temperature: float = 1.0
    clip: float = 0.01  # tau, on RKL_k / N


@dataclass
class BlockTerms:
    """Per-slot terms of one sequence's anchored blocks, all [N, L-1]."""

    ce: torch.Tensor
    rkl: torch.Tensor | None
    weight: torch.Tensor
    accepted: torch.Tensor  # [N] leading slots whose argmax is the target's label


def block_terms(
    model: DFlashDrafter,
    seq: Sequence,
    features: torch.Tensor,  # [S, n_feat*H] the drafter's target features
    teacher_hidden: torch.Tensor,  # [S, H] the target's last-layer outputs (before its final norm)
    anchors: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [L-1]
    head_logits: Callable[[torch.Tensor], torch.Tensor],  # target last-layer outputs -> logits
    cfg: DistillConfig,
) -> BlockTerms:
    device, L = features.device, model.spec.block_size
    anchors = anchors.to(device)
    hidden = block_forward(model, seq, features, anchors)  # [N, L, H]
    data_labels, valid = block_labels(seq.next_ids.to(device), anchors, L)  # [N, L-1]
    # With a draft vocabulary the student's support is those ids: labels map into it, a label
    # outside it carries no loss, and the reverse KL runs over the support (q = 0 elsewhere).
    vocab = model.draft_ids
    student = (model.logits(hidden[:, 1:]) if vocab is None else model.draft_logits(hidden[:, 1:])).float()
    if cfg.objective == "sft":
        labels, inside = _student_labels(vocab, data_labels)
        w = weights.to(device)[None] * valid * inside
        ce = F.cross_entropy(student.flatten(0, 1), labels.flatten(), reduction="none").view_as(w)
        with torch.no_grad():
            accepted = leading_correct(student, labels, valid & inside)
        return BlockTerms(ce, None, w, accepted)
    index, _ = label_positions(anchors, L, len(teacher_hidden))  # [N, L-1]
    with torch.no_grad():
        teacher = head_logits(teacher_hidden[index]).float()  # [N, L-1, V]
        labels, inside = _student_labels(vocab, teacher.argmax(-1))
        log_p_t = F.log_softmax(teacher / cfg.temperature, dim=-1)
        if vocab is not None:
            log_p_t = log_p_t[..., vocab]
    w = weights.to(device)[None] * valid * inside
    ce = F.cross_entropy(student.flatten(0, 1), labels.flatten(), reduction="none").view_as(w)
    log_p_s = F.log_softmax(student / cfg.temperature, dim=-1)
    rkl = cfg.temperature**2 * (log_p_s.exp() * (log_p_s - log_p_t)).sum(-1)  # [N, L-1]
    with torch.no_grad():
        accepted = leading_correct(student, labels, valid & inside)
    return BlockTerms(ce, rkl, w, accepted)


def _student_labels(vocab: torch.Tensor | None, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-id labels as indices of the student's logits, and which of them it can express."""
    if vocab is None:
        return labels, torch.ones_like(labels, dtype=torch.bool)
    return draft_labels(vocab, labels)


def combine(terms: list[BlockTerms], cfg: DistillConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's loss over every sequence's terms, and what to log (clip_ratio: the share of
    weighted slots whose RKL the clip cut)."""
    n = sum(float(t.weight.sum()) for t in terms)
    ce = sum((t.ce * t.weight).sum() for t in terms) / n
    blocks = sum(len(t.accepted) for t in terms)
    stats = {"ce": float(ce.detach()), "tau": 1 + sum(int(t.accepted.sum()) for t in terms) / max(1, blocks)}
    if cfg.objective == "sft":
        return ce, {"loss": stats["ce"], **stats}
    scaled = [t.rkl / n for t in terms]
    rkl = sum((torch.clamp(s, max=cfg.clip) * t.weight).sum() for s, t in zip(scaled, terms))
    clipped = sum(float(((s > cfg.clip) & (t.weight > 0)).sum()) for s, t in zip(scaled, terms))
    slots = sum(float((t.weight > 0).sum()) for t in terms)
    loss = cfg.alpha * ce + (1 - cfg.alpha) * rkl
    raw_rkl = sum(float((t.rkl.detach() * t.weight).sum()) for t in terms) / n
    return loss, {"loss": float(loss.detach()), **stats, "rkl": raw_rkl, "clip_ratio": clipped / max(1.0, slots)}
