"""What the engine must know about a target's layers to verify drafts on it.

Plain attention layers take any visibility pattern through a 4-D mask and are cropped after
verification. Two kinds of layer are different:

- sliding-window attention: the model builds its window into the masks it makes itself, and a
  custom mask replaces those, so a tree mask must carry the window. When windowed and full
  layers alternate (gpt-oss, Qwen2 with `use_sliding_window`), the model takes one mask per
  layer type.
- recurrent layers (Gated DeltaNet linear attention in Qwen3-Next and Qwen3.5, short
  convolutions): a token's state folds in every token fed before it in its row, whatever the
  mask, so one forward verifies a chain but never a tree; rollback restores a checkpoint and
  replays the kept tokens (kv.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..errors import UnsupportedModelError
from ..kv import is_recurrent, new_cache
from ..tree import additive_mask

FULL, SLIDING, LINEAR = "full_attention", "sliding_attention", "linear_attention"
CHAIN_METHODS = "ar, draft, pld, dflash, adaflash or dels"
# What a model forward raises when its family lacks something SpecFlash's calls need (Family.unsupported).
MODEL_ERRORS = (IndexError, KeyError, TypeError, ValueError, NotImplementedError, AttributeError)


@dataclass(frozen=True)
class Family:
    """The target's model type and the layer kinds that change how drafts are verified."""

    name: str
    layer_types: tuple[str, ...]  # one per layer, as the config names them; () when it names none
    window: int | None  # the sliding window of windowed layers
    recurrent: bool  # some layer keeps a recurrent state

    @classmethod
    def of(cls, model: PreTrainedModel) -> "Family":
        config = model.config.get_text_config()
        layer_types = tuple(getattr(config, "layer_types", None) or ())
        window = getattr(config, "sliding_window", None)
        uses_window = getattr(config, "use_sliding_window", True) or SLIDING in layer_types
        return cls(
            name=str(getattr(model.config, "model_type", "") or type(model).__name__),
            layer_types=layer_types,
            window=int(window) if window and uses_window else None,
            recurrent=is_recurrent(new_cache(model.config)),
        )

    def check_trees(self) -> None:
        """Raise the one-line reason when a draft tree (or lookahead) cannot be verified here."""
        if self.recurrent:
            raise UnsupportedModelError(
                f"{self.name} has recurrent layers (linear attention, state space or convolution), whose state one "
                "forward can only advance along a chain: tree drafts and lookahead tokens cannot be verified on it; "
                f"use {CHAIN_METHODS}"
            )
        other = sorted(set(self.layer_types) - {FULL, SLIDING})
        if other:
            raise UnsupportedModelError(
                f"{self.name} has {', '.join(other)} layers, for which SpecFlash has no tree mask; use {CHAIN_METHODS}"
            )

    @property
    def recurrent_types(self) -> tuple[str, ...]:
        """The layer types that are neither full nor windowed attention, in config order."""
        return tuple(dict.fromkeys(t for t in self.layer_types if t not in (FULL, SLIDING)))

    def check_batch(self) -> None:
        """Raise the one-line reason when rows cannot be decoded as one batch here: left padding
        must not reach a recurrent state, which takes a padding mask per layer type, written for
        linear attention only."""
        if not self.recurrent:
            return
        other = [t for t in self.recurrent_types if t != LINEAR]
        if other or FULL not in self.layer_types:
            what = f"{', '.join(other)} layers" if other else "no attention layers beside its recurrent ones"
            raise UnsupportedModelError(
                f"{self.name} has {what}, and batched decoding has a padding mask per layer type only for "
                "linear attention beside attention, so left padding would reach its recurrent states; decode "
                "one prompt at a time (generate or stream)"
            )

    def tree_mask(
        self, allow: torch.Tensor, start: int, positions: list[int], dtype: torch.dtype
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The additive mask(s) for rows `allow` [T, T] at `positions` on top of `start` cached
        entries: one tensor when every layer attends alike, else one per layer type."""
        self.check_trees()
        if self.window is None:
            return additive_mask(allow, start, dtype)
        windowed = additive_mask(allow, start, dtype, positions, self.window)
        return self.layer_masks(additive_mask(allow, start, dtype), windowed)

    def layer_masks(self, full: torch.Tensor, windowed: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention_mask argument when windowed layers need `windowed` and the rest `full`:
        one mask per layer type where the config names them, else the windowed one (Mistral)."""
        if SLIDING not in self.layer_types:
            return windowed
        return {FULL: full, SLIDING: windowed}

    def unsupported(self, exc: Exception) -> UnsupportedModelError:
        """A model forward that failed inside transformers: what SpecFlash asked of which family."""
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return UnsupportedModelError(
            f"{self.name} cannot run the cached, position-explicit forward SpecFlash needs "
            f"({type(exc).__name__}{': ' + detail if detail else ''})"
        )
