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
  per-position draft probabilities as acceptance estimates (or, with `estimate=head`, the length
  head's predicted run); `rate` scales the estimates. On a tree (the default, `tree`), the
  block's most probable paths best first, each node priced by its whole path's confidences
  (`tree_cut`; on the dev prompts 1.62x plain decoding beside dflash's 1.61x in the same run,
  where the cut priced by the argmax chain had 1.52x beside dflash's 1.60x: docs/adaflash.md).
- `head`: AdaFlash's learned length head reads the drafter's block hidden states and predicts
  r = verify length / L; the target verifies clamp(round(r * L * rate), min_len, L) positions
  (methods.md §2.2). The head ships inside the drafter folder (models/length_head.py).

With the draft gate on, the gate decides whether to draft at all (and when to look while off);
once it has decided to draft, the step drafts the whole block and the cut, not the gate, decides
how much of it is verified. Why: the gate's width comes from running acceptance rates, the same
for every block, where the cut reads this block's own confidences, and drafting the whole block
costs about what drafting its first slots does (one forward; the head reads every slot in one
product). Replayed on the dev prompts with this CPU's two-thread costs, the gate and the cut over
the whole block model 1.194x plain decoding, the cut within the gate's width 1.173x, the gate
alone (`dflash`) 1.134x (docs/adaflash.md, drafting the whole block). The gate's full-depth
probes keep their width; `whole_block=false` keeps the gate's width on every step (the cut then
works within it).

Whether the cut tokens would have been accepted is never computed on the timed path: at
temperature 0 it follows from the finished run alone (`annotate_cuts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import CheckpointError, MethodConfigError
from ..models.length_head import LengthHead, load_length_head, verify_len
from ..trace import ROOT, RunRecord, StepRecord
from ..tree import DraftTree
from ..verify_cost import best_cut, best_node_count, cached_verify_cost
from .base import Draft
from .dflash import (DFlashEngineDrafter, DFlashFamilyConfig, argmax_chain, candidate_tree, drafter_folder,
                     load_dflash_model, verify_rows)
from .gate import GateDecision
from .lookup_graft import own_share

RULES = ("cost", "fixed", "heuristic", "confidence", "entropy", "head")
ESTIMATES = ("confidence", "head")


@dataclass(frozen=True)
class AdaFlashConfig(DFlashFamilyConfig):
    """DFlash's options plus the cut rule's."""

    rule: str = field(default="cost", metadata={"choices": RULES})
    fixed_len: int = 3
    threshold: float = 0.5
    rate: float = 1.0
    # drafted tokens verified at least (the head rule: verify positions); 0 lets a rule drop a
    # draft whole when verifying any of it does not pay (docs/adaflash.md, dropping a draft)
    min_len: int = 0
    # what the cost rule reads as acceptance: draft confidences or the head
    estimate: str = field(default="confidence", metadata={"choices": ESTIMATES})
    # with the gate on: a step the gate drafts drafts the whole block and the cut picks the width
    # (False: the gate's width, as dflash drafts, and the cut within it)
    whole_block: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rule not in RULES:
            raise MethodConfigError(f"unknown cut rule {self.rule!r}; choose from {', '.join(RULES)}")
        if self.estimate not in ESTIMATES:
            raise MethodConfigError(f"unknown estimate {self.estimate!r}; choose from {', '.join(ESTIMATES)}")
        for name in ("fixed_len", "min_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise MethodConfigError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.whole_block, bool):
            raise MethodConfigError(f"whole_block must be true or false, got {self.whole_block!r}")
        if not isinstance(self.rate, (int, float)) or self.rate <= 0:
            raise MethodConfigError(f"rate must be > 0, got {self.rate!r}")
        if not isinstance(self.threshold, (int, float)) or self.threshold < 0:
            raise MethodConfigError(f"threshold must be >= 0, got {self.threshold!r}")

    @property
    def needs_head(self) -> bool:
        return self.rule == "head" or (self.rule == "cost" and self.estimate == "head")


def acceptance_estimate(probs: torch.Tensor, cfg: AdaFlashConfig, score: float | None,
                        block_size: int | None) -> list[float]:
    """Per drafted position, the chance it is accepted given the ones before it, as the cost rule
    reads it: the draft's own confidence (scaled by `rate`), or, with estimate "head", the head's
    predicted run A = r * L * rate - 1 spread as certain acceptance up to floor(A) and the
    fractional rest at the next position (so the expected run is exactly A)."""
    k = probs.shape[0]
    if cfg.estimate == "head":
        if score is None or block_size is None:
            raise MethodConfigError("estimate 'head' needs the length head's score and the block size")
        run = max(0.0, score * block_size * cfg.rate - 1)
        whole = int(run)
        return [1.0 if j < whole else run - whole if j == whole else 0.0 for j in range(k)]
    return [min(1.0, c * cfg.rate) for c in probs.max(dim=-1).values.tolist()]


def cut_length(
    rule: str, probs: torch.Tensor, cfg: AdaFlashConfig, cost: list[float] | None, window: int,
    score: float | None = None, block_size: int | None = None,
) -> int:
    """How many of the drafted tokens (rows of probs: [k, V], or [k, N] over a draft vocabulary)
    to verify, before clamping. The `head` rule needs the length head's `score` r and the
    drafter's `block_size` L."""
    k = probs.shape[0]
    conf = probs.max(dim=-1).values.tolist()
    if rule == "head":
        if score is None or block_size is None:
            raise MethodConfigError("the head rule needs the length head's score and the block size")
        return verify_len(score, block_size, cfg.rate, cfg.min_len) - 1
    if rule == "fixed":
        return cfg.fixed_len
    if rule == "heuristic":
        return window
    if rule == "confidence":
        return next((i for i, c in enumerate(conf) if c < cfg.threshold), k)
    if rule == "entropy":
        entropy = (-(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)).tolist()
        return next((i for i, h in enumerate(entropy) if h > cfg.threshold), k)
    return best_cut(acceptance_estimate(probs, cfg, score, block_size), cost)


def path_probabilities(tree: DraftTree, q: list[float], rate: float = 1.0) -> list[float]:
    """Per node, the chance its whole path is accepted as the cost rule reads it: the product of
    its path's confidences, each scaled by `rate` (at most 1)."""
    out: list[float] = []
    for parent, conf in zip(tree.parents, q):
        out.append((1.0 if parent == ROOT else out[parent]) * min(1.0, conf * rate))
    return out


def kept_length(cut: int, drafted: int, cfg: AdaFlashConfig) -> int:
    """The drafted tokens a step verifies: the rule's cut within the `drafted` ones, at least
    `min_len` of them (the head rule's floor is in verify_len already)."""
    floor = 0 if cfg.rule == "head" else cfg.min_len
    return max(min(cut, drafted), min(floor, drafted))


class AdaFlashDrafter(DFlashEngineDrafter):
    name = "adaflash"

    def __init__(self, model, cfg: AdaFlashConfig, cost: list[float] | None = None,
                 head: LengthHead | None = None) -> None:
        super().__init__(model, cfg, cost)
        if cfg.needs_head and head is None:
            raise CheckpointError(f"rule {cfg.rule!r} with estimate {cfg.estimate!r} needs a drafter folder with a "
                                  "trained length head (python -m specflash.training.length_head); this one has none")
        self.head = None if head is None else head.to(self.device).eval()
        self.window = cfg.fixed_len

    def begin(self, prompt_ids, sampling, generator) -> None:
        super().begin(prompt_ids, sampling, generator)
        self.window = max(1, self.cfg.fixed_len)

    def step_width(self, context: list[int], max_len: int) -> tuple[int, GateDecision | None]:
        """The gate's width, except that a step the gate drafts drafts every slot that fits: the
        cut then picks how many of them to verify."""
        k, decision = super().step_width(context, max_len)
        room = min(self.draft_len, max_len)
        if not self.cfg.whole_block or decision is None or decision.state != "on" or k >= room:
            return k, decision
        return room, GateDecision("on", room, decision.value,
                                  f"{decision.reason}; the whole block is drafted, the cut picks how much to verify")

    def draft_block(self, context: list[int], k: int) -> Draft:
        hidden = self.block_hidden(context)  # [L, H]
        probs, ids = self.model.draft_probs(hidden[1 : k + 1])  # [k, N or V], the full block
        tokens, q = argmax_chain(probs, ids)
        score = float(self.head(hidden[None])[0]) if self.cfg.needs_head else None  # unread otherwise: 0.17 ms a step
        L = self.spec.block_size
        cost = self.gate.cost if self.gate is not None else self.cost  # the gate's, calibrated in this run
        if self.trees and self.cfg.rule == "cost" and self.cfg.estimate == "confidence":
            return self.tree_cut(probs, ids, tokens, q, score, cost)
        cut = cut_length(self.cfg.rule, probs, self.cfg, cost, self.window, score, L)
        keep = kept_length(cut, k, self.cfg)
        ada = {"rule": self.cfg.rule, "score": score, "verify_len": keep + 1, "cut_tokens": tokens[keep:], "cut_q": q[keep:]}
        tree, q_nodes = DraftTree.chain(tokens[:keep]), q[:keep]
        if self.trees and keep:  # the same rows, the most probable paths instead of the chain
            tree, q_nodes = candidate_tree(probs, ids, keep, self.cfg.tree_width)
            ada["chain"] = tokens[:keep]  # what the cut tokens would have followed
        return Draft(tree, q=None, q_token=q_nodes, extras={"dflash": {"block_size": self.spec.block_size}, "adaflash": ada})

    def tree_cut(self, probs: torch.Tensor, ids: torch.Tensor | None, tokens: list[int], q: list[float],
                 score: float | None, cost: list[float]) -> Draft:
        """The cost rule on a tree: the block's most probable paths, best first, as many nodes as
        maximise expected committed tokens per unit of verify cost, each node's chance the product
        of its path's confidences (scaled by `rate`): a doubtful slot's runners-up are priced as
        what they are, where the chain's cut, read off the argmax confidences, priced them as if
        the chain were all that was verified. Within the block's k nodes, at least `min_len`."""
        full, q_nodes = candidate_tree(probs, ids, len(tokens), self.cfg.tree_width)
        keep = kept_length(best_node_count(path_probabilities(full, q_nodes, self.cfg.rate), cost), len(full), self.cfg)
        tree = DraftTree(full.tokens[:keep], full.parents[:keep])
        on_chain = len(tree.follow(tokens))
        ada = {"rule": self.cfg.rule, "score": score, "verify_len": keep + 1, "cut_tokens": tokens[on_chain:],
               "cut_q": q[on_chain:], **({"chain": tokens[:on_chain]} if keep else {})}  # as a chain's cut records
        return Draft(tree, q=None, q_token=q_nodes[:keep],
                     extras={"dflash": {"block_size": self.spec.block_size}, "adaflash": ada})

    def verified(self, draft: Draft, logits: torch.Tensor, path: list[int], committed: list[int]) -> None:
        super().verified(draft, logits, path, committed)
        if self.cfg.rule == "heuristic" and len(draft.tree) and "lookup" not in draft.extras:
            depth, accepted = own_share(draft.tree, draft.extras, path)
            self.window = self.window + 2 if accepted == depth else max(1, self.window - 1)

CONFIG = AdaFlashConfig


def build(target, cfg: AdaFlashConfig, drafter: str | None, cache_dir: Path | None = None) -> AdaFlashDrafter:
    from ..models.acquire import default_cache_dir

    model = load_dflash_model(target, drafter, "adaflash", cfg.draft_dtype)
    head = load_length_head(drafter_folder(str(drafter)), model.spec.hidden_size)
    cost = None
    if cfg.rule == "cost" or cfg.gate:
        cost = cached_verify_cost(target, verify_rows(model.spec.block_size), cache_dir or default_cache_dir())
    return AdaFlashDrafter(model, cfg, cost, head)


def annotate_cuts(run: RunRecord) -> RunRecord:
    """Analysis mode, after the fact: how many of each step's cut tokens greedy verification would
    have accepted, as extras["adaflash"]["cut_would_accept"] (in place; returns the run).

    At temperature 0 the output is the target's greedy continuation, so a cut token would have
    been accepted exactly when every verified draft was accepted and it matches the output at its
    position: no extra target forward, nothing on the timed path. None where that cannot be told
    (temperature > 0, or the run ended before the cut tokens' positions).
    """
    greedy = float(run.sampling.get("temperature", 0.0)) == 0.0
    position = 0
    for step in run.steps:
        ada = step.extras.get("adaflash")
        if ada is not None:
            ada["cut_would_accept"] = _would_accept(step, ada["cut_tokens"], run.output_ids, position) if greedy else None
        position += len(step.committed)
    return run


def _would_accept(step: StepRecord, cut: list[int], output: list[int], start: int) -> int | None:
    if not cut:
        return 0
    chain = step.extras["adaflash"].get("chain", step.tokens)  # a tree step verified paths beside the chain
    if [step.tokens[i] for i in step.accepted] != chain:
        return 0  # the chain broke inside the verified part: nothing after it could count
    after = start + len(chain)  # where the first cut token would have stood
    if after >= len(output):
        return None
    matched = 0
    for token, actual in zip(cut, output[after:]):
        if token != actual:
            return matched
        matched += 1
    return matched if matched == len(cut) or after + matched < len(output) else None
