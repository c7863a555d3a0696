"""Batched rollback of recurrent layers: each row back to the state after its own kept tokens.

A recurrent state cannot be cropped (kv.py), and rows keep different numbers of drafted tokens,
while a forward advances every row by the same count; a padding token still moves a state (Gated
DeltaNet's decay applies whatever the input). So after restoring the checkpoint taken before
verification, the kept tokens are replayed: the count every row kept, in one block, then one token
per forward, each row's states copied out once it has fed its own count. Rows that kept
everything they fed (plain decoding) need no replay. The attention layers get the same slots the
verification gave them, pads included, which BatchCache.commit marks invalid.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kv import Checkpoint, put_recurrent_rows, recurrent_rows, restore

# forward(ids [B, t], positions [B, t], cache_valid [B, S], block_valid [B, t]) on the cache
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass
class Pending:
    """What a verification fed (ids, positions, both [B, T]) and the cache before it."""

    ids: torch.Tensor
    positions: torch.Tensor
    saved: Checkpoint


def replay(forward: Forward, cache, cache_valid: torch.Tensor, pending: Pending, kept: torch.Tensor) -> None:
    """Leave `cache` as if row b had been fed only its first kept[b] tokens of `pending.ids`
    (kept [B] long, each >= 1), in max(kept) slots after the cache's `cache_valid` [B, S]."""
    low, high = int(kept.min()), int(kept.max())
    if low == high == pending.ids.shape[1]:
        return
    restore(cache, pending.saved)
    everyone = torch.ones_like(pending.ids[:, :low], dtype=torch.bool)
    forward(pending.ids[:, :low], pending.positions[:, :low], cache_valid, everyone)
    finals = []
    for j in range(low, high + 1):
        rows = (kept == j).nonzero().flatten()
        if len(rows):
            finals.append((rows, recurrent_rows(cache, rows)))
        if j < high:
            fed = torch.arange(j, device=kept.device)[None] < kept[:, None]  # replayed slots each row keeps
            forward(pending.ids[:, j : j + 1], pending.positions[:, j : j + 1],
                    torch.cat([cache_valid, fed], dim=1), (kept > j)[:, None])
    for rows, copies in finals:
        put_recurrent_rows(cache, rows, copies)
