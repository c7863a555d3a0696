"""Plain autoregressive decoding: the empty draft. Every speedup is measured against it."""

from __future__ import annotations

from pathlib import Path

from ..config import NoConfig
from .base import Drafter

CONFIG = NoConfig


def build(target, cfg: NoConfig, drafter: str | None, cache_dir: Path | None = None) -> Drafter:
    return Drafter()
