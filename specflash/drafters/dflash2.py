"""DFlash 2 in the engine: one drafter forward per step, then the candidate selector walks a path
through the top-K candidates of each block slot (models/dflash2.py has the equations).

Why a method of its own (`dflash2`) rather than `dflash` choosing by checkpoint, as vLLM and
SGLang do: runs, traces and bench rows are labelled by method, so the DFlash vs DFlash 2 table
and the selector's ablation need two names. `dflash` on a DFlash 2 checkpoint is that ablation:
the same network (convolutions included) drafting independent per-slot argmaxes. `dflash2`
refuses a DFlash 1 checkpoint, which has no selector to walk.

Proposals: at temperature 0 the walk takes the argmax of each slot's edge scores given the
previous choice, and the chain is proposed as point masses (q None), which the greedy rule
verifies exactly. At T > 0 each slot's token is drawn from q_t = softmax(S_t(previous, .) / T)
over its K candidates with the run's generator, and q_t (zero outside the candidates) goes to
verification: speculative sampling with a proposal that depends on the drafted prefix is exact,
because slot t is only tested after the target accepted the prefix q_t was conditioned on.

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
from ..tree import DraftTree
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
        """The selector's path, drafted in full: it is chosen over the whole lattice at once."""
        return list(self.draft_block(context, k).tree.tokens)

    def draft_block(self, context: list[int], k: int) -> Draft:
        lattice = self.model.lattice(self.block_hidden(context)[1 : k + 1], anchor=context[-1])
        sampled = not self.sampling.greedy
        uniforms = None
        if sampled:
            device = self.generator.device if self.generator is not None else self.device
            uniforms = torch.rand(k, generator=self.generator, device=device)
        path = walk(lattice.scores, self.sampling.temperature if sampled else 0.0, uniforms)
        chosen = torch.tensor(path.ranks, device=lattice.candidates.device)[:, None]
        tokens = lattice.candidates.gather(1, chosen)[:, 0].tolist()
        q_token = path.q.gather(1, chosen.to(path.q.device))[:, 0].tolist()
        q = None
        if sampled:  # the proposal distributions over the target's vocabulary
            q = torch.zeros(k, self.spec.vocab_size, device=path.q.device)
            q.scatter_(1, lattice.candidates.to(q.device), path.q)
        draft = Draft(DraftTree.chain(tokens), q=q, q_token=q_token,
                      extras={"dflash2": lattice_extras(lattice, path, self.spec.block_size, sampled)})
        return draft

    def config_dict(self) -> dict[str, Any]:
        spec = self.spec
        return {**super().config_dict(), "selector_top_k": spec.selector_top_k, "selector_rank": spec.selector_rank,
                "conv_kernel_size": spec.conv_kernel_size, "conv_group_size": spec.conv_group_size}


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
