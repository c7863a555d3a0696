"""The prompt sets: enough prompts per domain, a clean train / held-out split, strict loading."""

import json
import re

import pytest

from specflash.errors import SpecFlashError
from specflash.prompts import DOMAINS, Prompt, dev_prompts, heldout_prompts, load_prompts, training_prompts


@pytest.mark.parametrize("domain", DOMAINS)
def test_each_domain_has_enough_prompts(domain):
    prompts = load_prompts(domain)
    assert len(prompts) >= 40
    assert len(heldout_prompts(domain)) >= 12
    assert {p.domain for p in prompts} == {domain}
    assert all(p.text.strip() for p in prompts)


def test_every_domain_present_in_the_full_load():
    assert {p.domain for p in load_prompts()} == set(DOMAINS)


def test_ids_are_unique_and_well_formed():
    ids = [p.id for p in load_prompts()]
    assert len(ids) == len(set(ids))
    assert all(re.fullmatch(r"(math|code|writing|rewrite)-\d{3}", i) for i in ids)


def test_split_follows_the_data_card_rule():
    for p in load_prompts():
        number = int(p.id.split("-")[1])
        expected = "dev" if number >= 101 else "heldout" if number % 10 in (3, 6, 9) else "train"
        assert p.split == expected, p.id


def test_train_heldout_and_dev_do_not_overlap():
    splits = {"train": training_prompts(), "heldout": heldout_prompts(), "dev": dev_prompts()}
    assert all(len(dev_prompts(d)) >= 8 for d in DOMAINS)
    for a, b in (("train", "heldout"), ("train", "dev"), ("heldout", "dev")):
        assert {p.id for p in splits[a]}.isdisjoint(p.id for p in splits[b])
        assert {p.text.strip().lower() for p in splits[a]}.isdisjoint(p.text.strip().lower() for p in splits[b])
    assert sum(len(v) for v in splits.values()) == len(load_prompts())


@pytest.mark.parametrize("domain", (None,) + DOMAINS)
def test_training_prompts_never_return_heldout(domain):
    prompts = training_prompts(domain)
    assert prompts and all(p.split == "train" for p in prompts)


def test_unknown_domain_and_split_raise():
    with pytest.raises(SpecFlashError, match="domain"):
        load_prompts("poetry")
    with pytest.raises(SpecFlashError, match="split"):
        load_prompts(split="test")
    with pytest.raises(SpecFlashError):
        training_prompts("Math")


def test_custom_root_and_bad_files(tmp_path):
    line = {"id": "math-001", "domain": "math", "split": "train", "prompt": "What is 2 + 2?"}
    (tmp_path / "math.jsonl").write_text(json.dumps(line) + "\n\n")
    assert load_prompts("math", root=tmp_path) == [Prompt("math-001", "math", "train", "What is 2 + 2?")]
    with pytest.raises(SpecFlashError, match="missing"):
        load_prompts("code", root=tmp_path)
    (tmp_path / "math.jsonl").write_text(json.dumps({**line, "domain": "code"}) + "\n")
    with pytest.raises(SpecFlashError, match="math.jsonl:1"):
        load_prompts("math", root=tmp_path)
    (tmp_path / "math.jsonl").write_text("{not json\n")
    with pytest.raises(SpecFlashError, match="not a prompt record"):
        load_prompts("math", root=tmp_path)


def test_bench_reads_each_prompt_set_from_its_own_split():
    from specflash.bench import bench_prompts

    assert [pid for _, pid, _ in bench_prompts("dev", ["math", "code"], 2)] == ["math-101", "math-102", "code-101",
                                                                                 "code-102"]
    assert [pid for _, pid, _ in bench_prompts("heldout", ["math"], 2)] == [p.id for p in heldout_prompts("math")[:2]]
