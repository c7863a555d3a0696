"""Checkpoint choice on prompts, inside the DFlash trainer: the drafter being trained decodes the
dev prompts or the tuning requests (gate off, T = 0, batched, as `training.evaluate` does) and the
best weights so far are kept.

Why: the held-out blocks of the training folders (`--validate-every`) have ranked drafters
opposite to the held-out prompts twice (the thirty-fourth and thirty-fifth sessions' runs rose on
their own folders and fell on every prompt domain), while the tuning requests ranked the same
drafters as the held-out prompts. Scoring those requests during the run replaces exporting
checkpoints by hand and evaluating them afterwards; the held-out prompts stay for figures to report.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..models.dflash_io import save_drafter
from ..prompts import DOMAINS
from .evaluate import acceptance_by_domain

BEST = "best-prompts"  # the run folder's copy of the weights that scored highest so far


class PromptValidation:
    """Callable that scores the model as it is now and returns log fields: `prompts_tau` (the mean
    over domains), `prompts_tau_<domain>`, and `prompts_best` when the mean beats every earlier
    check of the run (read back from its log on resume), whose fp16 export is then copied to
    `out/best-prompts/`."""

    def __init__(self, model: torch.nn.Module, target, out: Path, prompt_set: str, per_domain: int,
                 max_new_tokens: int = 64, recipe: Callable[[], dict] | None = None) -> None:
        self.model, self.target, self.out = model, target, Path(out)
        self.prompt_set, self.per_domain, self.max_new_tokens = prompt_set, per_domain, max_new_tokens
        self.recipe = recipe  # the config's training record, as of the check
        self.best = max((row["prompts_tau"] for row in _log_rows(self.out / "log.jsonl") if "prompts_tau" in row),
                        default=float("-inf"))

    def __call__(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "drafter"
            save_drafter(self.model, folder, dtype=torch.float16, extra=self.recipe() if self.recipe else None)
            result = acceptance_by_domain(self.target, str(folder), DOMAINS, self.per_domain, self.max_new_tokens,
                                          prompt_set=self.prompt_set)
            row: dict[str, Any] = {"prompts_tau": result["mean"],
                                   **{f"prompts_tau_{d}": v for d, v in result["domains"].items()}}
            if result["mean"] > self.best:
                self.best = result["mean"]
                shutil.rmtree(self.out / BEST, ignore_errors=True)
                shutil.copytree(folder, self.out / BEST)
                row["prompts_best"] = True
        return row


def _log_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
