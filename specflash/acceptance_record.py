"""Recording, for every position of the target's greedy answers, how many drafts of a DFlash
block greedy verification would accept there: the records `gate_replay` replays policies on.

Why teacher-forced: a DFlash block at an anchor sees only the target's features of the committed
context and the anchor token, so one target forward over prompt + answer gives the features every
anchor needs (and the target's probability of each answer token), and one drafter forward scores
all anchors at once. The engine computes the same
features piece by piece as it decodes, equal up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .api import encode_prompt, generate
from .gate_replay import AcceptanceRun
from .models.dflash import DFlashDrafter
from .training.dflash_objective import block_forward, block_labels, draft_labels, leading_correct, make_sequence


@torch.inference_mode()
def anchor_acceptance(model: DFlashDrafter, target, token_ids: list[int],
                      prompt_len: int) -> tuple[list[int], list[list[float]], list[float]]:
    """For each answer token i (token_ids[prompt_len + i] as the last committed one): the leading
    drafts of the block anchored there that equal the tokens after it (0 for the last token); the
    drafter's probability of each token it drafts there (what AdaFlash's cut rules read); and the
    target's probability of the anchor token itself, known before drafting."""
    target.capture_layers(tuple(model.spec.target_layer_ids))
    out = target.forward(token_ids, target.new_cache(), 0)
    answer = torch.tensor(token_ids[prompt_len:], device=out.logits.device)
    target_p = torch.softmax(out.logits[prompt_len - 1 : -1].float(), dim=-1).gather(1, answer[:, None])[:, 0]
    target_p = [round(p, 4) for p in target_p.tolist()]
    features = out.features.to(next(model.parameters()).device, torch.float32)
    seq = make_sequence(token_ids, prompt_len, None)
    anchors = torch.arange(prompt_len, len(token_ids) - 1)
    if not len(anchors):
        return [0] * len(answer), [[] for _ in range(len(answer))], target_p
    hidden = block_forward(model, seq, features, anchors)[:, 1:]
    labels, valid = block_labels(seq.next_ids.to(hidden.device), anchors.to(hidden.device), model.spec.block_size)
    if model.draft_ids is not None:
        labels, inside = draft_labels(model.draft_ids, labels)
        logits, valid = model.draft_logits(hidden), valid & inside
    else:
        logits = model.logits(hidden).float()
    confidence = torch.softmax(logits, dim=-1).amax(dim=-1)  # [N, L-1]
    return (leading_correct(logits, labels, valid).tolist() + [0],
            [[round(c, 4) for c in row] for row in confidence.tolist()] + [[]], target_p)


def record_runs(target, model: DFlashDrafter, prompts: Sequence[tuple[str, str]], max_new_tokens: int) -> list[AcceptanceRun]:
    """Each (domain, prompt text)'s greedy answer (plain decoding, stopping where it stops) with
    its acceptance at every anchor."""
    runs = []
    for domain, text in prompts:
        ids = encode_prompt(target, text)
        answer = list(generate(target, ids, "ar", max_new_tokens=max_new_tokens).output_ids)
        runs.append(AcceptanceRun(domain, answer, *anchor_acceptance(model, target, ids + answer, len(ids))))
    return runs
