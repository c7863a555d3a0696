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
from .data import read_shard
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


def _stored_layers(shard: Path) -> list[int] | None:
    """The layers whose features are stored beside a harvested shard (its file's metadata only)."""
    path = features_path(shard)
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        return json.loads(f.metadata()["layer_ids"])


def harvested_features(shard: Path, layer_ids: tuple[int, ...], n_samples: int) -> list[torch.Tensor] | None:
    """The features stored beside a harvested shard, restricted to `layer_ids` (None when the
    shard has none, or they lack one of the layers)."""
    stored = _stored_layers(shard)
    if stored is None or not set(layer_ids) <= set(stored):
        return None
    path = features_path(shard)
    t = load_file(str(path))
    width = t["features"].shape[1] // len(stored)
    cols = torch.cat([torch.arange(width) + stored.index(i) * width for i in layer_ids])
    bounds = t["offsets"].tolist()
    if len(bounds) != n_samples + 1:
        raise ValueError(f"{path} holds {len(bounds) - 1} samples, its shard {n_samples}")
    feats = t["features"][:, cols]
    return [feats[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def _saved_features(samples: list, shard: Path, layer_ids: tuple[int, ...],
                    path: Path | None) -> list[torch.Tensor] | None:
    """The shard's features stored beside it or cached at `path`, or None."""
    stored = harvested_features(shard, layer_ids, len(samples))
    if stored is not None or path is None or not path.is_file():
        return stored
    try:
        t = load_file(str(path))
        bounds = t["offsets"].tolist()
        if len(bounds) == len(samples) + 1:
            return [t["features"][a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    except (SafetensorError, OSError, KeyError):
        pass  # unreadable: recompute and overwrite
    return None


def _cache_path(target: TargetModel, shard: Path, layer_ids: tuple[int, ...], cache_dir: Path | None) -> Path | None:
    return cache_dir / shard_key(target.name, layer_ids, shard) if cache_dir is not None else None


def shard_features(
    target: TargetModel, samples: list, shard: Path, layer_ids: tuple[int, ...], cache_dir: Path | None
) -> list[torch.Tensor]:
    """Features of each sample of a shard (float16, on CPU): stored beside it, cached, or computed now."""
    path = _cache_path(target, shard, layer_ids, cache_dir)
    saved = _saved_features(samples, shard, layer_ids, path)
    if saved is not None:
        return saved
    target.capture_layers(layer_ids)
    feats = [sequence_features(target, s.token_ids).to("cpu", torch.float16) for s in samples]
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        offsets = torch.tensor([0] + [len(f) for f in feats], dtype=torch.int64).cumsum(0)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file({"features": torch.cat(feats), "offsets": offsets}, str(tmp))
        os.replace(tmp, path)
    return feats


def picked_features(target: TargetModel, samples: list, picked: list[int], shard: Path, layer_ids: tuple[int, ...],
                    cache_dir: Path | None) -> list[torch.Tensor]:
    """Features of the `picked` samples only: validation scores a few sequences of a shard, and
    computing the whole shard for them cost minutes of target forwards (nothing is cached then)."""
    saved = _saved_features(samples, shard, layer_ids, _cache_path(target, shard, layer_ids, cache_dir))
    if saved is not None:
        return [saved[i] for i in picked]
    target.capture_layers(layer_ids)
    return [sequence_features(target, samples[i].token_ids).to("cpu", torch.float16) for i in picked]


def warm_cache(target: TargetModel, shards: list[Path], layer_ids: tuple[int, ...], cache_dir: Path) -> int:
    """Compute and cache the features of `shards` in order, skipping those cached or claimed by
    another process (a lock file), so several workers (and a trainer reading the same order)
    share the work of one feature pass. Returns how many shards this call computed."""
    done = 0
    for shard in shards:
        path = _cache_path(target, shard, layer_ids, cache_dir)
        stored = _stored_layers(shard)
        if path.is_file() or (stored is not None and set(layer_ids) <= set(stored)):
            continue  # a file present is enough here: reading a shard's features back costs a second or more
        lock = path.with_name(path.name + ".lock")
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            continue
        try:
            shard_features(target, read_shard(shard), shard, layer_ids, cache_dir)
            done += 1
        finally:
            lock.unlink(missing_ok=True)
    return done
