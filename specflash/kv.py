"""KV-cache rollback and path compaction: the only code that touches cache internals.

After a verification forward the cache holds keys/values for every fed token; only the root and
the accepted path may stay. A chain keeps a prefix (crop the tail). A tree keeps scattered rows,
which are gathered into consecutive slots so the cache again reads as sequential decoding.
"""

from __future__ import annotations

import torch
from transformers import Cache


def cache_len(cache: Cache) -> int:
    return int(cache.get_seq_length())


def rollback(cache: Cache, n_tokens: int) -> None:
    """Drop the last `n_tokens` entries."""
    if n_tokens > 0:
        cache.crop(-n_tokens)


def keep_rows(cache: Cache, start: int, rows: list[int]) -> None:
    """Keep entries [0, start) plus, in order, the entries at start + rows; drop the rest.

    `rows` are offsets into the block fed at `start`. When they are 0..m-1 this is a plain crop.
    """
    total = cache_len(cache)
    if rows == list(range(len(rows))):
        rollback(cache, total - start - len(rows))
        return
    for layer in cache.layers:
        index = torch.tensor(rows, device=layer.keys.device) + start
        # keys/values: [batch, kv_heads, seq, head_dim]
        layer.keys = torch.cat([layer.keys[:, :, :start], layer.keys.index_select(2, index)], dim=2)
        layer.values = torch.cat([layer.values[:, :, :start], layer.values.index_select(2, index)], dim=2)
