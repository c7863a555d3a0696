"""Batched decoding: B sequences at once for ar, dflash and adaflash, lossless per row.

`target` runs the rectangular forwards over one shared KV cache with per-row validity, `dflash`
holds the batched drafters, `engine` the loop. The public entry point is api.generate_batch.
"""

from .dflash import BATCH_METHODS, BatchDrafter, batch_drafter, build_batch_drafter
from .engine import BatchDecoding

__all__ = ["BATCH_METHODS", "BatchDecoding", "BatchDrafter", "batch_drafter", "build_batch_drafter"]
