"""Requests the target writes itself: the user-turn frame is the chat template's, a slot's request
depends only on the seed (a rerun and a resumed run write the same file), and only requests that
ended, say something beyond their opening, and are new become harvest jobs."""

from __future__ import annotations

import json

import pytest
import torch

from specflash.errors import SpecFlashError
from specflash.training import harvest, self_prompts
from specflash.training.data import load_shards, load_target


@pytest.fixture(scope="module")
def llama(tiny_dirs):
    return load_target(tiny_dirs["llama"], "cpu", torch.float32)


def test_user_turn_frame_is_the_chat_template_around_a_message(llama):
    _, tokenizer = llama
    before, after = self_prompts.user_turn_frame(tokenizer)
    message = "Sort this list: 3, 1, 2"
    expected = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                             tokenize=False)
    assert before + message + after == expected


def test_requests_depend_on_the_seed_only_and_a_cut_run_resumes(llama, tmp_path):
    model, tokenizer = llama
    n = self_prompts.BATCH + 8
    first = self_prompts.self_prompt_jobs(model, tokenizer, n, 0, tmp_path / "a.jsonl")
    again = self_prompts.self_prompt_jobs(model, tokenizer, n, 0, tmp_path / "b.jsonl")
    assert first and first == again
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    other = self_prompts.self_prompt_jobs(model, tokenizer, n, 1, tmp_path / "c.jsonl")
    assert [j.text for j in other] != [j.text for j in first]

    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert [json.loads(line)["slot"] for line in lines] == list(range(n))
    (tmp_path / "a.jsonl").write_text("\n".join(lines[: n - 3]) + "\n")  # killed inside the second batch
    resumed = self_prompts.self_prompt_jobs(model, tokenizer, n, 0, tmp_path / "a.jsonl")
    assert resumed == first
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()

    slots = self_prompts.slot_openings(n, 0)
    for job in first:
        domain, opening = slots[int(job.sample_id.removeprefix("self-"))]
        assert job.domain == domain and job.text.startswith(opening) and job.source == "self-prompts"


def test_unfinished_bare_and_repeated_requests_are_dropped(llama, tmp_path, monkeypatch):
    model, tokenizer = llama
    slots = self_prompts.slot_openings(4, 0)
    texts = [None, slots[1][1], f"{slots[2][1]} one two three four", f"{slots[2][1]} one two three four"]
    monkeypatch.setattr(self_prompts, "sample_user_turns", lambda *args, **kw: texts)
    jobs = self_prompts.self_prompt_jobs(model, tokenizer, 4, 0, tmp_path / "p.jsonl")
    assert [(j.sample_id, j.text) for j in jobs] == [("self-00002", texts[2])]


def test_harvest_answers_the_written_requests_and_the_recipe_alone_cannot(tiny_dirs, tmp_path):
    out = tmp_path / "data"
    argv = ["--model", str(tiny_dirs["llama"]), "--out", str(out), "--sources", "self-prompts", "--layers", "0,1",
            "--max-new-tokens", "4", "--batch-size", "4", "--shard-size", "4", "--per-source", "64", "--limit", "3"]
    assert harvest.harvest(harvest.parse_args(argv))["made"] == 3
    written = [json.loads(line)["text"] for line in (out / "self-prompts.jsonl").read_text().splitlines()]
    model, tokenizer = load_target(tiny_dirs["llama"], "cpu", torch.float32)
    for sample in load_shards(out):
        assert sample.source == "self-prompts"
        prompt = tokenizer.decode(sample.token_ids[: sample.prompt_len])
        assert written[int(sample.sample_id.removeprefix("self-"))] in prompt
    with pytest.raises(SpecFlashError, match="written by the target"):
        harvest.recipe_jobs(0, 5, ["self-prompts"], tmp_path)


def test_a_domain_subset_cycles_over_those_domains_and_keys_its_own_folder(tiny_dirs):
    slots = self_prompts.slot_openings(9, 0, ["writing", "rewrite", "chat"])
    assert [d for d, _ in slots] == ["writing", "rewrite", "chat"] * 3
    assert all(opening in self_prompts.OPENINGS[domain] for domain, opening in slots)
    assert self_prompts.slot_openings(10, 0, list(self_prompts.OPENINGS)) == self_prompts.slot_openings(10, 0)
    for bad in (["poetry"], [], ["math", "math"]):
        with pytest.raises(SpecFlashError, match="self-prompt domains"):
            self_prompts.slot_openings(4, 0, bad)

    base = ["--model", str(tiny_dirs["llama"]), "--sources", "self-prompts", "--kernel", "stock"]
    plain = harvest._settings(harvest.parse_args(base))
    assert "self_prompt_domains" not in plain  # folders made before the option keep their key
    subset = harvest._settings(harvest.parse_args([*base, "--self-prompt-domains", "writing,rewrite"]))
    assert subset["self_prompt_domains"] == ["writing", "rewrite"]
    assert harvest.default_out(tiny_dirs["llama"], subset) != harvest.default_out(tiny_dirs["llama"], plain)
    with pytest.raises(SystemExit):
        harvest.parse_args([*base, "--self-prompt-domains", "poetry"])


def test_requests_of_a_domain_subset_open_with_those_domains(llama, tmp_path, monkeypatch):
    model, tokenizer = llama
    asked = []

    def write(model, tokenizer, openings, *args, **kw):
        asked.extend(openings)
        return [f"{o} about {i} one two three four" for i, o in enumerate(openings)]

    monkeypatch.setattr(self_prompts, "sample_user_turns", write)
    jobs = self_prompts.self_prompt_jobs(model, tokenizer, 12, 0, tmp_path / "w.jsonl", domains=["writing", "rewrite"])
    assert [j.domain for j in jobs] == ["writing", "rewrite"] * 6
    assert [j.text for j in jobs] == [f"{o} about {i} one two three four" for i, o in enumerate(asked)]
    for job in jobs:
        assert any(job.text.startswith(o) for o in self_prompts.OPENINGS[job.domain])
