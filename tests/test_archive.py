"""Committed token-only copies of harvest folders: they hold the same samples without the
features, the trainers recompute those features from the tokens, and a restored copy resumes."""

from __future__ import annotations

import json

import pytest
import torch

from specflash.errors import SpecFlashError
from specflash.models.target import TargetModel
from specflash.training import archive, harvest
from specflash.training.data import load_shards, load_target, read_manifest
from specflash.training.dflash_features import harvested_features, shard_features

LAYERS = (0, 1)


@pytest.fixture(scope="module")
def harvested(tiny_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("cache") / "harvest-test"
    argv = ["--model", str(tiny_dirs["llama"]), "--out", str(out), "--sources", "prompts,arithmetic",
            "--layers", "0,1", "--max-new-tokens", "6", "--batch-size", "3", "--shard-size", "3",
            "--per-source", "4", "--limit", "6"]
    harvest.harvest(harvest.parse_args(argv))
    return out, argv


def test_packed_folder_keeps_the_samples_and_drops_the_features(harvested, tmp_path):
    src, _ = harvested
    dst, copied = archive.pack(src, tmp_path)
    assert dst == tmp_path / read_manifest(src)["model"] / src.name
    assert copied == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert not list(dst.glob("*.features.safetensors"))
    assert [(s.sample_id, s.token_ids, s.prompt_len) for s in load_shards(dst)] == \
        [(s.sample_id, s.token_ids, s.prompt_len) for s in load_shards(src)]
    assert archive.pack(src, tmp_path)[1] == []  # up to date: nothing copied again


def test_features_recomputed_from_packed_tokens_match_the_harvested_ones(harvested, tiny_dirs, tmp_path):
    src, _ = harvested
    dst, _ = archive.pack(src, tmp_path / "archive")
    model, tokenizer = load_target(tiny_dirs["llama"], "cpu", torch.float32)
    target = TargetModel(model, tokenizer, name="tiny")
    shard = "shard-00001.safetensors"
    samples = [s for s in load_shards(dst) if s.sample_id in read_manifest(dst)["shards"][1]["ids"]]
    assert harvested_features(dst / shard, LAYERS, len(samples)) is None
    recomputed = shard_features(target, samples, dst / shard, LAYERS, tmp_path / "features")
    stored = harvested_features(src / shard, LAYERS, len(samples))
    for new, old, sample in zip(recomputed, stored, samples):
        assert len(new) == len(sample.token_ids) and len(old) == len(sample.token_ids) - 1
        assert torch.allclose(new[: len(old)].float(), old.float(), atol=2e-2, rtol=1e-2)


def test_restored_folder_resumes_its_harvest(harvested, tmp_path):
    src, argv = harvested
    packed, _ = archive.pack(src, tmp_path / "archive")
    cache = tmp_path / "cache"
    restored, copied = archive.restore(packed, cache)
    assert restored == cache / read_manifest(src)["model"] / src.name and len(copied) == 2
    assert archive.restore(packed, cache)[1] == []  # the cache already holds every shard
    out = ["--out", str(restored)]
    grown = harvest.harvest(harvest.parse_args([*argv[:2], *out, *argv[4:-2], "--limit", "8"]))
    assert grown["made"] == 2  # only the jobs the archive did not hold
    assert [s.sample_id for s in load_shards(restored)][:6] == [s.sample_id for s in load_shards(src)]


def test_pack_refuses_to_shrink_an_archive_and_to_read_other_folders(harvested, tmp_path):
    src, _ = harvested
    dst, _ = archive.pack(src, tmp_path)
    manifest = read_manifest(src)
    smaller = tmp_path / "smaller" / src.name
    smaller.mkdir(parents=True)
    (smaller / "manifest.json").write_text(
        json.dumps({**manifest, "shards": manifest["shards"][:1]}), encoding="utf-8")
    (smaller / "shard-00000.safetensors").write_bytes((src / "shard-00000.safetensors").read_bytes())
    with pytest.raises(SpecFlashError, match="refusing to shrink"):
        archive.pack(smaller, tmp_path)
    with pytest.raises(SpecFlashError, match="no manifest.json"):
        archive.pack(tmp_path / "nowhere", tmp_path)
    assert archive.main([str(tmp_path / "nowhere"), "--to", str(tmp_path)]) == 2
