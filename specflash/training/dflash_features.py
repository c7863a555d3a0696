"""Target features for DFlash training, computed with the frozen target and cached per shard.

Shards made by harvest.py carry their features beside them (captured while the target generated
them); `shard_features` reads the chosen layers from there and never runs the target. For other
shards, the target forward (teacher forcing over each whole sequence) costs far more than a
drafter step on CPU, so each shard's features are written once, in float16, to a cache folder keyed by the
target, the feature layers and the shard; a second epoch, a resumed run or a second drafter
trained on the same data (e.g. another block size) reads them back instead of recomputing.
Files are written atomically, so two runs sharing a cache cannot see a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ..models.target import TargetModel
from .harvest import features_path


def shard_key(target_name: str, layer_ids: tuple[int, ...], shard: Path) -> str:
    """A stable file name for the features of one shard under one target + layer choice."""
    stat = shard.stat()
    raw = f"{Path(target_name).name}|{layer_ids}|{shard.resolve()}|{stat.st_size}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16] + ".safetensors"


@torch.inference_mode()
def sequence_features(target: TargetModel, token_ids: list[int]) -> torch.Tensor:
    """Hooked-layer outputs of every position of one sequence [S, n_feat*H] (one forward)."""
    return target.forward(token_ids, target.new_cache(), 0, last_only=True).features


def harvested_features(shard: Path, layer_ids: tuple[int, ...], n_samples: int) -> list[torch.Tensor] | None:
    """The features stored beside a harvested shard, restricted to `layer_ids` (None when the
    shard has none, or they lack one of the layers)."""
    path = features_path(shard)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        stored = json.loads(f.metadata()["layer_ids"])
    if not set(layer_ids) <= set(stored):
        return None
    t = load_file(str(path))
    width = t["features"].shape[1] // len(stored)
    cols = torch.cat([torch.arange(width) + stored.index(i) * width for i in layer_ids])
    bounds = t["offsets"].tolist()
    if len(bounds) != n_samples + 1:
        raise ValueError(f"{path} holds {len(bounds) - 1} samples, its shard {n_samples}")
    feats = t["features"][:, cols]
    return [feats[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def shard_features(
    target: TargetModel, samples: list, shard: Path, layer_ids: tuple[int, ...], cache_dir: Path | None
) -> list[torch.Tensor]:
    """Features of each sample of a shard (float16, on CPU): stored beside it, cached, or computed now."""
    stored = harvested_features(shard, layer_ids, len(samples))
    if stored is not None:
        return stored
    path = cache_dir / shard_key(target.name, layer_ids, shard) if cache_dir is not None else None
    if path is not None and path.is_file():
        try:
            t = load_file(str(path))
            bounds = t["offsets"].tolist()
            if len(bounds) == len(samples) + 1:
                return [t["features"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        except (SafetensorError, OSError, KeyError):
            pass  # unreadable: recompute and overwrite
    target.capture_layers(layer_ids)
    feats = [sequence_features(target, s.token_ids).to("cpu", torch.float16) for s in samples]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = torch.tensor([0] + [len(f) for f in feats], dtype=torch.int64).cumsum(0)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file({"features": torch.cat(feats), "offsets": offsets}, str(tmp))
        os.replace(tmp, path)
    return feats
