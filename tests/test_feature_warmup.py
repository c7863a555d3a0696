"""Sharing one feature pass between a trainer and workers on other cores (`--features-only`),
validation computing only the sequences it scores, and rehearsal shards of older folders."""

from __future__ import annotations

import pytest
import torch

from specflash.training import archive, dflash, dflash_features
from specflash.training.data import read_shard
from specflash.training.dflash_features import _cache_path, picked_features, shard_features, warm_cache
from test_train_dflash2 import setup  # noqa: F401  (the tiny harvest fixture: two shards of 4 answers)

LAYERS = (1,)


@pytest.fixture(scope="module")
def packed(setup, tmp_path_factory):  # noqa: F811
    """Two token-only copies of the tiny harvest (no stored features: they must be computed)."""
    tmp, target, model_dir = setup
    root = tmp_path_factory.mktemp("packed")
    first, _ = archive.pack(tmp / "data", root / "a")
    second, _ = archive.pack(tmp / "data", root / "b")
    return first, second, target, model_dir


def _shards(folder):
    return sorted(folder.glob("shard-0000?.safetensors"))


def test_warm_cache_computes_each_missing_shard_once_and_skips_claimed_ones(packed, tmp_path):
    first, _, target, _ = packed
    shards = _shards(first)
    claimed = _cache_path(target, shards[1], LAYERS, tmp_path)
    claimed.parent.mkdir(parents=True, exist_ok=True)
    claimed.with_name(claimed.name + ".lock").touch()  # another worker is on it
    assert warm_cache(target, shards, LAYERS, tmp_path) == 1
    assert _cache_path(target, shards[0], LAYERS, tmp_path).is_file() and not claimed.is_file()
    assert not list(tmp_path.glob("*.tmp")) and len(list(tmp_path.glob("*.lock"))) == 1  # its own lock removed
    assert warm_cache(target, shards[:1], LAYERS, tmp_path) == 0  # cached: nothing recomputed
    samples = read_shard(shards[0])
    direct = shard_features(target, samples, shards[0], LAYERS, None)
    cached = shard_features(target, samples, shards[0], LAYERS, tmp_path)
    assert [len(f) for f in cached] == [len(s.token_ids) for s in samples]
    assert all(torch.equal(a, b) for a, b in zip(cached, direct))


def test_picked_features_compute_only_the_picked_sequences(packed, tmp_path, monkeypatch):
    first, _, target, _ = packed
    shard = _shards(first)[0]
    samples = read_shard(shard)
    whole = shard_features(target, samples, shard, LAYERS, None)
    calls = []
    real = dflash_features.sequence_features
    monkeypatch.setattr(dflash_features, "sequence_features", lambda t, ids: calls.append(ids) or real(t, ids))
    picked = picked_features(target, samples, [2, 0], shard, LAYERS, tmp_path)
    assert calls == [samples[2].token_ids, samples[0].token_ids] and not list(tmp_path.iterdir())
    assert torch.equal(picked[0], whole[2]) and torch.equal(picked[1], whole[0])


def _args(packed, tmp_path, *extra):
    first, second, _, model_dir = packed
    return ["--model", str(model_dir), "--data", str(first), "--rehearse", str(second), "--rehearse-shards", "1",
            "--target-layer-ids", "1", "--feature-cache", str(tmp_path / "features"), "--anchors", "8",
            "--seqs-per-step", "2", "--steps", "4", "--lr", "3e-3", *extra]


def test_rehearsal_takes_the_first_shards_of_older_folders_but_the_held_out(packed, tmp_path):
    first, second, _, _ = packed
    args = dflash.parse_args(_args(packed, tmp_path))
    assert dflash.training_shards(args) == _shards(first) + _shards(second)[:1]
    args = dflash.parse_args(_args(packed, tmp_path, "--hold-out", "shard-00000.safetensors"))
    assert dflash.training_shards(args) == _shards(first)[1:] + _shards(second)[1:2]
    with pytest.raises(SystemExit):
        dflash.parse_args(_args(packed, tmp_path, "--rehearse-shards", "0"))


def test_a_run_after_features_only_computes_no_feature(packed, tmp_path, monkeypatch, capsys):
    assert dflash.main(_args(packed, tmp_path, "--out", str(tmp_path / "warm"), "--features-only")) == 0
    assert "computed the features of 3 of 3 shard(s)" in capsys.readouterr().err
    assert not (tmp_path / "warm" / "checkpoint").exists()  # the worker trains nothing
    assert len(list((tmp_path / "features").glob("*.safetensors"))) == 3  # 2 shards + 1 rehearsed

    def refuse(*_):
        raise AssertionError("the trainer recomputed a feature the worker had cached")

    monkeypatch.setattr(dflash_features, "sequence_features", refuse)
    assert dflash.main(_args(packed, tmp_path, "--out", str(tmp_path / "run"))) == 0
    assert (tmp_path / "run" / "checkpoint").is_dir()


def test_features_only_needs_the_cache(packed, tmp_path):
    with pytest.raises(SystemExit):
        dflash.parse_args(_args(packed, tmp_path, "--features-only", "--no-feature-cache"))
