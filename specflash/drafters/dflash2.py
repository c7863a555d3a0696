"""DFlash 2 in the engine: one drafter forward per step, then the candidate selector walks a path
through the top-K candidates of each block slot (models/dflash2.py has the equations).

Why a method of its own (`dflash2`) rather than `dflash` choosing by checkpoint, as vLLM and
SGLang do: runs, traces and bench rows are labelled by method, so the DFlash vs DFlash 2 table
and the selector's ablation need two names. `dflash` on a DFlash 2 checkpoint is that ablation:
the same network (convolutions included) drafting independent per-slot argmaxes. `dflash2`
refuses a DFlash 1 checkpoint, which has no selector to walk.

Proposals: at temperature 0 the walk takes the argmax of each slot's edge scores given the
previous choice, and is proposed as point masses (q None), which the greedy rule verifies
exactly; with `tree` (the default, where the target verifies trees) the proposal is the
lattice's most probable paths instead, each a product of the selector's q_t(choice | previous
choice) (`lattice_tree`), as many nodes as the walk had tokens. At T > 0 each slot's token is
drawn from q_t = softmax(S_t(previous, .) / T) over its K candidates with the run's generator,
and q_t (zero outside the candidates) goes to verification: speculative sampling with a
proposal that depends on the drafted prefix is exact, because slot t is only tested after the
target accepted the prefix q_t was conditioned on. That sampled walk stays a chain (its q_t are
the proposal the sampled test reads).

The draft gate (gate.py) works as for dflash: it fixes how many slots are walked, and the
first k slots of a walk do not depend on the later ones.

Each step's lattice goes into the trace as `extras["dflash2"]` (plain JSON), for a view that
draws it: per drafted slot the K candidates ranked by unary score with those scores, the edge
scores from the walked predecessor to each candidate, the walked path (ranks and tokens), and
the path independent argmaxes would have taken (rank 0 everywhere, by construction).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import MethodConfigError
from ..models.dflash2 import DFlash2Drafter, Lattice, Walk, walk
from ..tree import DraftTree, Successor, best_first_tree
from .base import Draft
from .dflash import DFlashEngineDrafter, DFlashFamilyConfig, gate_cost, load_dflash_model


@dataclass(frozen=True)
class DFlash2Config(DFlashFamilyConfig):
    """DFlash 2: the same knobs as dflash (max_draft, gate, probe_every); the checkpoint fixes the
    block size, the convolutions and the selector's K."""


class DFlash2EngineDrafter(DFlashEngineDrafter):
    name = "dflash2"

    def __init__(self, model: DFlash2Drafter, cfg: DFlash2Config, cost: list[float] | None = None) -> None:
        if not isinstance(model, DFlash2Drafter):
            raise MethodConfigError("method 'dflash2' needs a DFlash 2 drafter (architectures DFlash2DraftModel); "
                                    "run a DFlash drafter with method 'dflash'")
        super().__init__(model, cfg, cost)

    def shadow_tokens(self, context: list[int], k: int) -> list[int]:
        """The selector's walk, drafted in full: it is chosen over the whole lattice at once."""
        return list(self.draft_block(context, k).extras["dflash2"]["path_tokens"])

    def draft_block(self, context: list[int], k: int) -> Draft:
        lattice = self.model.lattice(self.block_hidden(context)[1 : k + 1], anchor=context[-1])
        sampled = not self.sampling.greedy
        uniforms = None
        if sampled:
            device = self.generator.device if self.generator is not None else self.device
            uniforms = torch.rand(k, generator=self.generator, device=device)
        path = walk(lattice.scores, self.sampling.temperature if sampled else 0.0, uniforms)
        extras = {"dflash2": lattice_extras(lattice, path, self.spec.block_size, sampled)}
        if self.trees and not sampled:  # the lattice's most probable paths; the walk stays in the trace
            tree, q_nodes = lattice_tree(lattice, k, self.cfg.tree_width)
            return Draft(tree, q=None, q_token=q_nodes, extras=extras)
        chosen = torch.tensor(path.ranks, device=lattice.candidates.device)[:, None]
        tokens = lattice.candidates.gather(1, chosen)[:, 0].tolist()
        q_token = path.q.gather(1, chosen.to(path.q.device))[:, 0].tolist()
        q = None
        if sampled:  # the proposal distributions over the target's vocabulary
            q = torch.zeros(k, self.spec.vocab_size, device=path.q.device)
            q.scatter_(1, lattice.candidates.to(q.device), path.q)
        return Draft(DraftTree.chain(tokens), q=q, q_token=q_token, extras=extras)

    def config_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {**super().config_dict(), "selector_top_k": spec.selector_top_k, "selector_rank": spec.selector_rank,
                "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size}


def lattice_tree(lattice: Lattice, nodes: int, width: int) -> tuple[DraftTree, list[float]]:
    """The `nodes` most probable paths through the lattice as a draft tree, and each node's
    probability given its parent. A path's probability is the product along it of the selector's
    q_t(choice | previous choice) = softmax(S_t(previous, .)), each node branching into its `width`
    likeliest successors. Why: unlike DFlash's slots, scored as if independent, the selector
    scores every successor given its actual predecessor, so each branch continues as the selector
    would continue it. Best-first, so every kept path's prefix is kept."""
    probs = torch.softmax(lattice.scores.float(), dim=-1)  # [T, K, K]
    top = probs.topk(min(width, probs.shape[-1]), dim=-1)
    p, ranks, candidates = top.values.tolist(), top.indices.tolist(), lattice.candidates.tolist()

    def successors(node: int, at: tuple[int, int] | None) -> list[Successor]:  # a node's (slot, rank)
        slot, row = (0, 0) if at is None else (at[0] + 1, at[1])  # slot 0 reads the anchor's row
        if slot >= len(p):
            return []
        return [(q, (slot, r, node), candidates[slot][r], (slot, r)) for q, r in zip(p[slot][row], ranks[slot][row])]

    return best_first_tree(successors, nodes)


def _number(x: float) -> float | None:
    return round(x, 4) if math.isfinite(x) else None


def lattice_extras(lattice: Lattice, path: Walk, block_size: int, sampled: bool) -> dict[str, Any]:
    """One step's lattice as plain JSON: lists over the drafted slots, each over the K candidates."""
    candidates = lattice.candidates.tolist()
    return {
        "block_size": block_size,
        "top_k": len(candidates[0]),
        "anchor": lattice.anchor,
        "sampled": sampled,
        "candidates": candidates,  # [slot][rank]: token ids, ranked by unary score
        "unary": [[_number(x) for x in row] for row in lattice.unary.tolist()],
        "scores": [[_number(x) for x in row] for row in path.rows.tolist()],  # S_t(walked predecessor, rank)
        "path": list(path.ranks),  # the walked rank per slot
        "path_tokens": [row[r] for row, r in zip(candidates, path.ranks)],
        "argmax_tokens": [row[0] for row in candidates],  # independent per-slot argmaxes (rank 0)
    }


CONFIG = DFlash2Config


def build(target, cfg: DFlash2Config, drafter: str | None, cache_dir: Path | None = None) -> DFlash2EngineDrafter:
    if not drafter:
        raise MethodConfigError(
            "method 'dflash2' needs a DFlash 2 drafter: pass --drafter PATH (a folder whose config.json declares "
            "DFlash2DraftModel, for this target); the smollm2-135m preset ships one"
        )
    model = load_dflash_model(target, drafter, "dflash2", cfg.draft_dtype)
    if not isinstance(model, DFlash2Drafter):
        raise MethodConfigError(f"method 'dflash2' needs a DFlash 2 drafter (architectures DFlash2DraftModel); "
                                f"{drafter} is a DFlash drafter: run it with method 'dflash'")
    return DFlash2EngineDrafter(model, cfg, gate_cost(target, cfg, model.spec.block_size, cache_dir))
