"""Batched target forwards over one shared KV cache whose slots carry per-row validity.

Rows differ in prompt length and in how many drafted tokens each keeps, yet one rectangular
forward serves them all. The cache is one [B, kv_heads, S, head_dim] tensor per layer plus a
validity mask `valid` [B, S]: slot s of row b either holds one of row b's committed tokens or is
a hole (left padding of a shorter prompt, or a block position the row did not keep).

Why validity masks rather than re-aligning rows after every step: every batched method drafts a
chain, so row b keeps a prefix (root + accepted path) of the block it fed. Cropping the shared
cache at the longest kept prefix and marking the rest of each row's block invalid costs nothing,
whereas re-aligning would copy the whole cache every step. Keys are rotated at their own absolute
positions (per-row position ids), so a key's slot never matters, only whether its row may see it,
which the 4-D additive mask says. Holes are reclaimed by `compact` (each row's valid slots
gathered together, right-aligned as after the prefill) once more than half the slot axis is
removable, and after finished rows are dropped, so the waste stays bounded.

Masks are additive with finfo.min (eager attention adds them; a bool mask would be silently wrong
there), and every query sees at least itself, so pad queries never meet an all-masked row (NaN).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from transformers import DynamicCache

from ..kv import checkpoint, rollback, select_batch_rows
from ..models.family import FULL, MODEL_ERRORS
from ..models.target import TargetModel
from .recurrent import Pending, replay


def batch_mask(
    cache_valid: torch.Tensor,
    block_valid: torch.Tensor,
    dtype: torch.dtype,
    window: int | None = None,
    block_pos: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask [B, 1, T, S + T]: query t of row b sees row b's valid cache slots, the valid
    block slots up to t, and always itself. cache_valid [B, S], block_valid [B, T] (bool).

    With a sliding `window`, a query at position p also loses keys at p - window or earlier:
    row b's valid cache slots hold its positions 0, 1, ... in order (compaction keeps the
    order), and its block slots sit at `block_pos` [B, T]."""
    b, t = block_valid.shape
    device = block_valid.device
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    block = (causal[None] & block_valid[:, None, :]) | torch.eye(t, dtype=torch.bool, device=device)[None]  # [B, T, T]
    allow = torch.cat([cache_valid[:, None, :].expand(b, t, -1), block], dim=-1)  # [B, T, S + T]
    if window is not None:
        key_pos = torch.cat([cache_valid.long().cumsum(dim=1) - 1, block_pos], dim=1)  # [B, S + T]
        allow &= key_pos[:, None, :] > block_pos[:, :, None] - window
    mask = torch.zeros(b, 1, t, allow.shape[-1], dtype=dtype, device=device)
    return mask.masked_fill(~allow[:, None], torch.finfo(dtype).min)


def compact_index(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather index [B, S'] that moves each row's valid slots, in order, to the right end of a
    slot axis of S' = the largest valid count, and the new validity [B, S']."""
    s = valid.shape[1]
    order = torch.argsort(valid.long() * s + torch.arange(s, device=valid.device), dim=1)  # holes first
    counts = valid.sum(dim=1)
    width = int(counts.max()) if valid.numel() else 0
    new_valid = torch.arange(width, device=valid.device)[None] >= (width - counts)[:, None]
    return order[:, s - width :], new_valid


def gather_slots(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, hd], index [B, S'] -> [B, heads, S', hd]."""
    return x.gather(2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def worth_compacting(valid: torch.Tensor) -> bool:
    """More than half the slot axis could go."""
    return valid.shape[1] > 0 and 2 * (valid.shape[1] - int(valid.sum(dim=1).max())) > valid.shape[1]


@dataclass
class BatchCache:
    """The shared HF cache and which of its slots each row may see."""

    cache: DynamicCache
    valid: torch.Tensor  # [B, S] bool

    @property
    def length(self) -> int:
        return int(self.valid.shape[1])

    def commit(self, start: int, kept: torch.Tensor) -> None:
        """After a block fed at slot `start`, row b keeps its first kept[b] block slots ([B] long)."""
        longest = int(kept.max())
        rollback(self.cache, int(self.cache.get_seq_length()) - start - longest)
        block = torch.arange(longest, device=kept.device)[None] < kept[:, None]  # [B, longest]
        self.valid = torch.cat([self.valid[:, :start], block], dim=1)
        if worth_compacting(self.valid):
            self.compact()

    def select_rows(self, rows: torch.Tensor) -> None:
        """Keep only these batch rows (finished rows leave the batch), then drop shared holes."""
        select_batch_rows(self.cache, rows)
        self.valid = self.valid[rows]
        if worth_compacting(self.valid):
            self.compact()

    def compact(self) -> None:
        index, self.valid = compact_index(self.valid)
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is None:  # a recurrent layer: no slots
                continue
            # keys/values: [B, kv_heads, S, head_dim]
            layer.keys, layer.values = gather_slots(layer.keys, index), gather_slots(layer.values, index)


@dataclass
class BatchOutput:
    logits: torch.Tensor  # [B, T, V] float32 (T = 1 after a prefill: the last prompt token)
    features: torch.Tensor | None  # [B, T, n_layers * H] hooked layer outputs


class BatchTarget:
    """The target's batched forwards: a left-padded prefill and per-row verification blocks."""

    def __init__(self, target: TargetModel) -> None:
        target.family.check_batch()
        self.target = target
        self.pending: Pending | None = None  # a recurrent target's last verification, until commit

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> tuple[BatchCache, BatchOutput]:
        """All prompts, left-padded to the longest, in one forward. Logits are the last prompt
        token's; features cover every slot (pads included; the cache's `valid` says which)."""
        device, width = self.target.device, max(len(p) for p in prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        slots = torch.arange(width, device=device)[None]
        valid = slots >= (width - lengths)[:, None]  # [B, P]
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)  # [B, P]
        positions = (slots - (width - lengths)[:, None]).clamp_min(0)  # [B, P]; pads at 0
        empty = torch.zeros(len(prompts), 0, dtype=torch.bool, device=device)
        state = BatchCache(self.target.new_cache(), empty)
        out = self._forward(ids, positions, self._mask(empty, valid, positions), state.cache, last_only=True)
        state.valid = valid
        return state, out

    @torch.inference_mode()
    def verify(
        self, state: BatchCache, ids: torch.Tensor, block_valid: torch.Tensor, root_pos: torch.Tensor
    ) -> BatchOutput:
        """Feed ids [B, T] (root, drafts, pads) at positions root_pos[b] + t on top of the cache;
        block_valid [B, T] marks the real (non-pad) positions."""
        positions = root_pos[:, None] + torch.arange(ids.shape[1], device=ids.device)[None]  # [B, T]
        if self.target.family.recurrent:
            if ids.shape[1] > 1:
                self.target.check_blocks()
            self.pending = Pending(ids, positions, checkpoint(state.cache))
        return self._forward(ids, positions, self._mask(state.valid, block_valid, positions), state.cache)

    @torch.inference_mode()
    def commit(self, state: BatchCache, start: int, kept: torch.Tensor) -> None:
        """Row b keeps its first kept[b] slots of the block verified at `start`; a recurrent target
        first replays them (batch/recurrent.py)."""
        if self.pending is not None:
            replay(partial(self._replay_forward, state.cache), state.cache, state.valid, self.pending, kept)
            self.pending = None
            self.target._captured.clear()
        state.commit(start, kept)

    def _replay_forward(self, cache, ids, positions, cache_valid, block_valid) -> None:
        self._forward(ids, positions, self._mask(cache_valid, block_valid, positions), cache, last_only=True)

    def _mask(self, cache_valid: torch.Tensor, block_valid: torch.Tensor, positions: torch.Tensor):
        """The attention mask(s) of a forward: windowed layers get the window (Family.layer_masks),
        recurrent layers the 2-D padding mask that keeps pads out of their states."""
        family, dtype, window = self.target.family, self.target.dtype, self.target.sliding_window
        masks = full = batch_mask(cache_valid, block_valid, dtype)
        if window is not None:
            masks = family.layer_masks(full, batch_mask(cache_valid, block_valid, dtype, window, positions))
        if not family.recurrent:
            return masks
        padding = dict.fromkeys(family.recurrent_types, block_valid)  # 2-D: which fed tokens are real
        return {**(masks if isinstance(masks, dict) else {FULL: masks}), **padding}

    def _forward(self, ids, positions, mask, cache, last_only: bool = False) -> BatchOutput:
        try:
            out = self.target.model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache,
                                    use_cache=True, logits_to_keep=1 if last_only else 0)
        except MODEL_ERRORS as exc:
            self.target._captured.clear()
            raise self.target.family.unsupported(exc) from exc
        return BatchOutput(out.logits.float(), self._features())

    def _features(self) -> torch.Tensor | None:
        """The hooked layers' outputs of the last forward, [B, T, n_layers * H]: the hooks are the
        target wrapper's own (TargetModel.capture_layers), read here for every batch row."""
        hooked, captured = self.target._hooked, self.target._captured
        if not hooked:
            return None
        features = torch.cat([captured[i] for i in hooked], dim=-1)
        captured.clear()
        return features
