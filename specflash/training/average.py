"""Average two DFlash drafters of one line, weight by weight.

Why: a continuation on new data has twice forgotten what its start knew (the eighth session's run
lost the recipe's arithmetic, math 2.76 -> 1.98 on the tuning requests) while learning the new
text; the 50/50 average of the two kept both and shipped, twice. Averaging is meaningful only
between drafters that share an initialisation line: the same shape and the same draft vocabulary
(the second is checked; the first follows from the tensor shapes, which must all agree).

    python -m specflash.training.average START CONTINUED --out FOLDER [--weight 0.5]

The output is a drafter folder: the second drafter's config.json with a note of the average in
`specflash_training`, its d2t, and the averaged tensors in float16. Tensors only one of the two
holds (e.g. a length head stored beside the drafter's weights) are dropped: a head fitted to one
drafter's hidden states does not fit the average, and the config's declaration of it goes too.
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from ..models.dflash_io import D2T_FILE, read_config
from ..models.length_head import CONFIG_KEYS as LENGTH_HEAD_KEYS, PREFIX as LENGTH_HEAD
from .entry import run_script

WEIGHTS = "model.safetensors"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    path = folder / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{folder} has no {WEIGHTS}: not a drafter folder")
    return load_file(str(path))


def _d2t(folder: Path) -> torch.Tensor | None:
    path = folder / D2T_FILE
    return load_file(str(path))["d2t"] if path.is_file() else None


def average(first: Path, second: Path, out: Path, weight: float = 0.5) -> dict:
    """`weight` * first + (1 - weight) * second over the tensors both drafters hold; returns the note
    written into the output's config."""
    a, b = _tensors(first), _tensors(second)
    d2t_a, d2t_b = _d2t(first), _d2t(second)
    if (d2t_a is None) != (d2t_b is None) or (d2t_a is not None and not torch.equal(d2t_a, d2t_b)):
        raise CheckpointError(f"{first} and {second} have different draft vocabularies ({D2T_FILE}): "
                              "their weights do not mean the same thing")
    shared = sorted(set(a) & set(b))
    mismatched = [k for k in shared if a[k].shape != b[k].shape]
    if mismatched or not shared:
        example = (mismatched or ["no shared tensor"])[0]
        raise CheckpointError(f"{first} and {second} are not one drafter's shape (e.g. {example})")
    mixed = {k: (weight * a[k].float() + (1 - weight) * b[k].float()).to(torch.float16) for k in shared}
    out.mkdir(parents=True, exist_ok=True)
    save_file(mixed, str(out / WEIGHTS))
    if d2t_b is not None:
        shutil.copyfile(second / D2T_FILE, out / D2T_FILE)
    config = read_config(second)
    if not any(k.startswith(LENGTH_HEAD) for k in mixed):
        for key in LENGTH_HEAD_KEYS:
            config.get("dflash_config", {}).pop(key, None)
    note = {"averaged": [first.name, second.name], "weight_of_first": weight,
            "dropped": sorted(set(a) ^ set(b))}
    config["specflash_training"] = {**config.get("specflash_training", {}), **note}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return note


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.average", description=__doc__.split("\n\n")[0])
    p.add_argument("first", type=Path, help="drafter folder (e.g. the run's start)")
    p.add_argument("second", type=Path,
                   help="drafter folder of the same line (e.g. the run's export); its config is kept")
    p.add_argument("--out", required=True, type=Path, help="folder for the averaged drafter")
    p.add_argument("--weight", type=float, default=0.5, help="share of the first drafter")
    args = p.parse_args(argv)
    if not 0 <= args.weight <= 1:
        p.error("--weight must be between 0 and 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    args = parse_args(argv)
    return run_script(args, lambda a: average(a.first, a.second, a.out, a.weight), json.dumps)


if __name__ == "__main__":
    raise SystemExit(main())
