"""Command-line pieces shared by `python -m specflash` and its `bench` subcommand.

They live apart so that cli.py and bench.py / bench_batch.py import them at top level without
importing each other: cli imports bench (to add the subcommand), never the other way round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from .errors import SpecFlashError

if TYPE_CHECKING:
    import torch


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """KEY=VALUE method knobs; values are read as JSON when they parse (numbers, booleans)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SpecFlashError(f"method option {item!r} is not KEY=VALUE (e.g. -o k=4)")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype and --cache-dir: which target to load, and where."""
    p.add_argument("--model", default="smollm2-135m", help="preset name, local folder or cached hub id")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--cache-dir", type=Path, default=None, help="where presets keep converted models")


def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype a --dtype value names, or None (the loader picks) when none was given.

    torch is imported here, not at the top, so that parsing arguments stays fast.
    """
    import torch

    return None if name is None else getattr(torch, name)
