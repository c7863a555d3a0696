"""The DFlash training objective on one teacher-forced sequence (SpecForge's recipe, methods.md §1.5).

Anchors are sampled among response positions; block n is [token at a_n, MASK x (L-1)] at
positions a_n.., it sees the target features of positions < a_n and its own block (the dense
training mask), and slot k learns the token the target emits after position a_n + k - 1. The
cross-entropy of slot k is weighted exp(-(k-1)/gamma): early slots matter most, since a draft is
accepted only up to its first miss. Works for both shard kinds: in generated shards the target's
next token is simply the next token; teacher-forced shards carry it as `labels`.

Soft labels (`Teacher`): the hard label is one token of the target's distribution; the whole
distribution, read from its last layer's outputs through its own norm and LM head, tells the
drafter how sure the target was and what came second, at no extra target forward (harvested
shards store that layer). Slot k's loss is then (1 - w) CE(label) + w CE(target distribution),
the soft term over the same softmax columns the drafter trains (its draft vocabulary). Why: the
drafter's training-block acceptance ran ~0.4 above its acceptance on held-out shards of the
same data (docs/dflash.md), a generalisation gap that more signal per token should narrow.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.dflash import DFlashDrafter, block_inputs, training_block_mask


@dataclass
class Sequence:
    """One training sequence: tokens [S], the target's next token after each position
    (`next_ids` [S'], S' = S - 1 for generated samples, S for teacher-forced), and the first
    position that may anchor a block."""

    tokens: torch.Tensor
    next_ids: torch.Tensor
    first_anchor: int


def make_sequence(token_ids: list[int], prompt_len: int, labels: list[int] | None) -> Sequence:
    tokens = torch.tensor(token_ids, dtype=torch.long)
    if labels is not None:
        return Sequence(tokens, torch.tensor(labels, dtype=torch.long), prompt_len)
    return Sequence(tokens, tokens[1:], prompt_len)


def sample_anchors(seq: Sequence, max_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to `max_anchors` sorted distinct anchors in [first_anchor, len(next_ids) - 1] ([N])."""
    lo, hi = seq.first_anchor, len(seq.next_ids)
    if hi <= lo:
        return torch.zeros(0, dtype=torch.long)
    pick = torch.randperm(hi - lo, generator=generator)[:max_anchors] + lo
    return pick.sort().values


def label_positions(anchors: torch.Tensor, block_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The position whose next token slot k (1..L-1) of block n learns, a_n + k - 1, clamped into
    a sequence of `length` positions, and whether it lies inside: index, valid [N, L-1]."""
    index = anchors[:, None] + torch.arange(block_size - 1, device=anchors.device)  # [N, L-1]
    return index.clamp(max=length - 1), index < length


def block_labels(next_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot k (1..L-1) of block n learns next_ids[a_n + k - 1]: labels, valid [N, L-1]."""
    index, valid = label_positions(anchors, block_size, len(next_ids))
    return next_ids[index], valid


@dataclass
class Teacher:
    """The soft-label source for one sequence: the target's last-layer outputs at every position
    (`hidden` [S, H]; position j's distribution is over the token after j, as `next_ids[j]`),
    `head_logits(hidden, columns)` its final norm + LM head over the given token ids, and the
    weight w of the soft term."""

    hidden: torch.Tensor
    head_logits: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    weight: float


def soft_cross_entropy(logits: torch.Tensor, teacher: Teacher, index: torch.Tensor,
                       columns: torch.Tensor | None) -> torch.Tensor:
    """-sum_v p(v) log q(v) per slot ([N, L-1]): q the drafter's softmax over `columns` (all ids
    when None), p the target's distribution at positions `index` [N, L-1] over the same columns.
    The head runs once per distinct position (blocks overlap), without gradient."""
    with torch.no_grad():
        positions, inverse = torch.unique(index, return_inverse=True)
        p = teacher.head_logits(teacher.hidden[positions], columns).float().softmax(-1)[inverse]
    return -(p * logits.float().log_softmax(-1)).sum(-1)


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, differentiable
    weight: float  # sum of loss weights (for averaging across sequences)
    slot1_correct: int
    blocks: int
    accepted: int  # sum over blocks of the leading run of correct slots (greedy acceptance)


def block_forward(model: DFlashDrafter, seq: Sequence, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """The drafter's final-normed hidden states [N, L, H] of every anchored block of one sequence
    (features [S, n_feat*H] of every position, anchors [N]), as at inference: block n sees the
    context before a_n and its own L slots."""
    spec, device = model.spec, features.device
    L, n = spec.block_size, len(anchors)
    anchors = anchors.to(device)
    ids, pos = block_inputs(seq.tokens.to(device)[None], anchors[None], L, spec.mask_token_id)  # [1, N*L]
    mask = training_block_mask(anchors[None], torch.ones(1, n, dtype=torch.bool, device=device), len(features), L)
    ctx_pos = torch.arange(len(features), device=device)[None]
    return model(ids, pos, features[None], ctx_pos, mask).view(n, L, -1)


def leading_correct(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per block, the run of leading slots whose argmax is the label ([N, L-1] -> [N]): the number
    of drafts greedy verification would accept."""
    correct = (logits.argmax(-1) == labels) & valid
    return correct.long().cumprod(dim=1).sum(dim=1)


def sequence_loss(
    model: DFlashDrafter,
    seq: Sequence,
    features: torch.Tensor,  # [S, n_feat*H] target features of every position
    anchors: torch.Tensor,  # [N]
    weights: torch.Tensor,  # [L-1] exp(-(k-1)/gamma)
    vocab: torch.Tensor | None = None,  # [K] token ids the softmax runs over (None = all)
    teacher: Teacher | None = None,
    tau_weight: float = 0.0,
) -> StepStats:
    """Weighted CE (summed, not yet normalised) of all anchored blocks of one sequence. With
    `vocab`, the softmax covers those ids plus this sequence's labels (a restricted head). A
    drafter with a draft vocabulary trains its softmax over exactly that vocabulary; a label
    outside it can never be drafted, so it carries no hard loss and counts as a miss (the soft
    term still teaches the target's distribution over the draft vocabulary there). `tau_weight`
    mixes acceptance_weights into the slot weights (0: the decay alone)."""
    device, L, n = features.device, model.spec.block_size, len(anchors)
    hidden = block_forward(model, seq, features, anchors)  # [N, L, H]
    next_ids = seq.next_ids.to(device)
    labels, valid = block_labels(next_ids, anchors.to(device), L)
    if vocab is None:
        logits, labels, reachable = slot_logits(model, hidden, labels, valid)  # [N, L-1, N_draft or V]
        columns = model.draft_ids
    else:
        vocab = torch.unique(torch.cat([vocab.to(device), labels.flatten()]))  # sorted [K']
        labels, columns, reachable = torch.searchsorted(vocab, labels), vocab, valid
        logits = model.logits(hidden[:, 1:], vocab).float()  # [N, L-1, K']
    w = weights.to(device)[None] * reachable  # [N, L-1]
    if tau_weight:
        w = (1 - tau_weight) * w + tau_weight * acceptance_weights(logits, labels, reachable, float(w.sum()))
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(n, L - 1)
    loss, total = (ce * w).sum(), float(w.sum())
    if teacher is not None and teacher.weight > 0:
        index, _ = label_positions(anchors.to(device), L, len(next_ids))
        w_soft = weights.to(device)[None] * valid
        soft = soft_cross_entropy(logits, teacher, index, columns)
        loss = (1 - teacher.weight) * loss + teacher.weight * (soft * w_soft).sum()
        total = (1 - teacher.weight) * total + teacher.weight * float(w_soft.sum())
    with torch.no_grad():
        slot1 = int(((logits[:, 0].argmax(-1) == labels[:, 0]) & reachable[:, 0]).sum())
        leading = leading_correct(logits, labels, reachable)
    return StepStats(loss, total, slot1, n, int(leading.sum()))


def acceptance_weights(logits: torch.Tensor, labels: torch.Tensor, reachable: torch.Tensor,
                       total: float) -> torch.Tensor:
    """Slot weights [N, L-1] whose weighted CE has the gradient of the expected acceptance length.

    With p_k the drafter's probability of slot k's label, a block is accepted through slot k
    with probability P_k = p_1 ... p_k (exactly, when drafts are sampled against a greedy
    target), so E[tau - 1] = sum_k P_k, and its gradient is sum_j W_j grad log p_j with
    W_j = sum_{k >= j} P_k. Those W_j (detached) weight each slot by how much acceptance rides
    on it: slots behind a likely miss, and blocks the drafter cannot get right anyway, count
    little, where the fixed decay weights every block alike. Scaled to sum to `total`, so a mix
    with the decay weights keeps the loss's scale."""
    with torch.no_grad():
        p = logits.float().softmax(-1).gather(-1, labels[..., None])[..., 0] * reachable
        reach = p.cumprod(dim=1)
        tail = reach.flip(1).cumsum(1).flip(1)
        mass = float(tail.sum())
        return tail * (total / mass) if mass > 0 else torch.zeros_like(tail)


def slot_logits(model: DFlashDrafter, hidden: torch.Tensor, labels: torch.Tensor,
                valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The drafted slots' logits over what the drafter can draft (its draft vocabulary, or all),
    the labels as indices into those columns, and which labels it could have drafted at all."""
    if model.draft_ids is None:
        return model.logits(hidden[:, 1:]).float(), labels, valid
    labels, inside = draft_labels(model.draft_ids, labels)
    return model.draft_logits(hidden[:, 1:]).float(), labels, valid & inside


def draft_labels(draft_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Target-id labels -> (draft-vocabulary indices, inside [same shape]); sorted `draft_ids`.
    Labels outside the draft vocabulary get index 0 and inside False."""
    index = torch.searchsorted(draft_ids, labels).clamp(max=len(draft_ids) - 1)
    inside = draft_ids[index] == labels
    return torch.where(inside, index, torch.zeros_like(index)), inside
