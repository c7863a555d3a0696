"""The datastore of the target's own answers: its match against brute force, what it is built from,
and that its continuations grafted onto trees keep the output exactly greedy."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.drafters.datastore import Datastore
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.errors import CheckpointError, DrafterMismatchError, MethodConfigError
from specflash.models.tokenizer_id import tokenizer_fingerprint
from specflash.training.data import Sample, write_shard
from test_draft_vocab import vocab_drafter
from test_lookup_source import _looping

FLAT = [1.0] * 15


def test_match_takes_the_longest_tail_and_votes_its_continuation():
    store = Datastore([[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 8]])
    assert len(store) == 14 and store.largest_id == 9
    # "2 3" occurs three times, followed by 4 5 | 4 6 | 8: 4 by two votes, then 5 and 6 tie (the smaller
    # id wins), then the sequence ends
    assert store.match([0, 2, 3], k=4, max_ngram=8) == ([4, 5], 2)
    assert store.match([1, 2, 3], k=4, max_ngram=8) == ([4, 5], 3)
    assert store.match([9, 2, 3, 4], k=4, max_ngram=8) == ([6], 4)
    assert store.match([9, 2, 3, 4], k=4, max_ngram=2) == ([5], 2)  # "3 4": 5 and 6 tie
    assert store.match([0, 2, 3], k=1, max_ngram=8) == ([4], 2)
    assert store.match([0, 2, 3], k=4, max_ngram=8, min_ngram=3) == ([], 0)
    assert store.match([0, 5], k=4, max_ngram=8) == ([], 0)  # 5 ends a sequence: nothing follows it
    assert store.match([11], k=4, max_ngram=8) == ([], 0)


def test_match_agrees_with_brute_force_on_random_text():
    """For every context, the match length is the longest tail (up to the depth) that occurs inside
    one sequence with a token after it, and the first token is the commonest one after it."""
    rng = random.Random(0)
    sequences = [[rng.randrange(6) for _ in range(rng.randrange(1, 30))] for _ in range(25)]
    store = Datastore(sequences, depth=5)
    for _ in range(300):
        context = [rng.randrange(6) for _ in range(rng.randrange(1, 9))]
        followers: dict[int, Counter] = {}
        for n in range(1, min(5, len(context)) + 1):
            tail = context[-n:]
            found = Counter(seq[i + n] for seq in sequences for i in range(len(seq) - n) if seq[i : i + n] == tail)
            if found:
                followers[n] = found
        tokens, ngram = store.match(context, k=3, max_ngram=5)
        if not followers:
            assert (tokens, ngram) == ([], 0)
            continue
        longest = max(followers)
        counts = followers[longest]
        assert ngram == longest
        if sum(counts.values()) <= 64:  # every occurrence votes
            top = max(counts.values())
            assert tokens[0] == min(t for t, c in counts.items() if c == top)


def _harvest(folder, samples, **manifest):
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "mode": "generate", **manifest}))
    write_shard(folder / "shard-00000.safetensors", samples, "generate")


def _sample(prompt: list[int], answer: list[int], i: int) -> Sample:
    return Sample(token_ids=prompt + answer, prompt_len=len(prompt), domain="writing", source="test", sample_id=str(i))


def test_built_from_greedy_answers_after_their_prompts_tails(tmp_path):
    """Each answer joins the store after its prompt's last 8 tokens, so an answer's first tokens
    match after the chat template's; a folder of sampled answers is left out."""
    prompt = list(range(100, 112))
    _harvest(tmp_path / "harvest-a", [_sample(prompt, [1, 2, 3], 0), _sample(prompt[:4], [4, 5], 1)])
    _harvest(tmp_path / "harvest-b", [_sample(prompt, [7, 7, 7], 0)], temperature=0.7)
    store = Datastore.from_harvests(tmp_path)
    assert len(store) == 8 + 3 + 4 + 2
    assert store.match([110, 111], k=3, max_ngram=8) == ([1, 2, 3], 2)
    assert store.match([101, 102, 103], k=3, max_ngram=8) == ([4, 5], 3)
    assert store.match([103], k=3, max_ngram=8)[0] != [104]  # the prompt before its last 8 tokens is not there
    assert Datastore.from_harvests(tmp_path / "harvest-a").match([111], k=1, max_ngram=8) == ([1], 1)
    with pytest.raises(CheckpointError, match="no harvest folders"):
        Datastore.from_harvests(tmp_path / "missing")


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
def test_datastore_grafts_keep_the_output_greedy(tiny_targets, arch, tmp_path):
    """A target that repeats itself, a drafter that knows only part of its text, no prompt
    lookup: the datastore, built from the target's own greedy answers to other prompts, grafts its
    continuations onto the trees, some of its nodes are accepted, and the output is exactly
    greedy."""
    period = [11, 42, 7, 93, 25, 60]
    target = _looping(tiny_targets[arch], period)
    answers = [_sample(period[i:] + period[:i], hf_greedy(target, period[i:] + period[:i], 24), i) for i in range(3)]
    _harvest(tmp_path / "harvest-0", answers)
    prompt_ids = period * 2 + period[:2]
    model = vocab_drafter(target, [11, 42, 7, 93], feature_layers=(1,))

    class Confident(DFlashEngineDrafter):  # the gate drafts from the start, so there are trees to graft onto
        def begin(self, prompt_ids, sampling, generator) -> None:
            super().begin(prompt_ids, sampling, generator)
            self.gate.accept = [0.9] * self.draft_len

    cfg = DFlashConfig(lookup=False, datastore_folder=str(tmp_path), datastore_min_ngram=2)
    run = generate(target, prompt_ids, drafter=Confident(model, cfg, FLAT), max_new_tokens=40)
    assert run.output_ids == hf_greedy(target, prompt_ids, 40)
    grafted = [s for s in run.steps if "datastore" in s.extras]
    assert grafted and all("graft" not in s.extras for s in grafted)
    assert any(any(node >= s.extras["datastore"]["first_node"] for node in s.accepted) for s in grafted)
    off = generate(target, prompt_ids, drafter=Confident(model, DFlashConfig(lookup=False, datastore=False,
                                                                             datastore_folder=str(tmp_path)), FLAT),
                   max_new_tokens=40)
    assert off.output_ids == run.output_ids and not any("datastore" in s.extras for s in off.steps)
    assert run.config["datastore"] is True and off.config["datastore"] is False  # what each run drafted with


def test_a_presets_missing_harvests_are_skipped_but_a_named_folder_must_exist(tiny_targets, tmp_path, monkeypatch):
    """A copy of the project without its harvests still drafts (without the datastore, as its
    run's config says); a folder the user named that is not there is an error."""
    import specflash.models.presets as presets

    target = tiny_targets["llama"]
    monkeypatch.setattr(presets, "preset_datastore", lambda name: str(tmp_path / "gone"))
    model = vocab_drafter(target, [3, 4, 5], feature_layers=(1,))
    run = generate(target, [1, 2, 3], drafter=DFlashEngineDrafter(model, DFlashConfig(), FLAT), max_new_tokens=4)
    assert run.output_ids == hf_greedy(target, [1, 2, 3], 4) and run.config["datastore"] is False
    named = DFlashEngineDrafter(model, DFlashConfig(datastore_folder=str(tmp_path / "gone")), FLAT)
    with pytest.raises(CheckpointError, match="no harvest folders"):
        generate(target, [1, 2, 3], drafter=named, max_new_tokens=4)


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)


def test_a_tokenizers_fingerprint_changes_when_one_token_moves():
    vocab = {"a": 0, "b": 1, "<mask>": 2}
    same = tokenizer_fingerprint(_Vocab(dict(reversed(list(vocab.items())))))
    assert tokenizer_fingerprint(_Vocab(vocab)) == same and len(same) == 16
    assert tokenizer_fingerprint(_Vocab({"a": 1, "b": 0, "<mask>": 2})) != same
    assert tokenizer_fingerprint(_Vocab({"a": 0, "c": 1, "<mask>": 2})) != same


def test_a_datastore_harvested_with_another_tokenizer_is_refused(tiny_targets, tmp_path):
    """Ids inside the target's vocabulary, but the harvest recorded another tokenizer: refused
    with both fingerprints named; the target's own fingerprint, or none (folders harvested before
    it was recorded), drafts as before."""
    target = tiny_targets["llama"]
    model = vocab_drafter(target, [3, 4, 5], feature_layers=(1,))
    for name, recorded in (("other", "0123456789abcdef"), ("own", target.tokenizer_id), ("none", None)):
        _harvest(tmp_path / name / "harvest-0", [_sample([1, 2], [3, 4], 0)],
                 **({"tokenizer": recorded} if recorded else {}))
    drafter = DFlashEngineDrafter(model, DFlashConfig(datastore_folder=str(tmp_path / "other")), FLAT)
    with pytest.raises(DrafterMismatchError, match=f"another tokenizer.*0123456789abcdef.*{target.tokenizer_id}"):
        generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=4)
    for name in ("own", "none"):
        drafter = DFlashEngineDrafter(model, DFlashConfig(datastore_folder=str(tmp_path / name)), FLAT)
        run = generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=4)
        assert run.config["datastore"] is True and run.output_ids == hf_greedy(target, [1, 2, 3], 4)


def test_a_datastore_of_another_vocabulary_is_refused(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    _harvest(tmp_path / "harvest-0", [_sample([1, 2], [3, target.vocab_size + 5], 0)])
    drafter = DFlashEngineDrafter(vocab_drafter(target, [3, 4, 5], feature_layers=(1,)),
                                  DFlashConfig(datastore_folder=str(tmp_path)), FLAT)
    with pytest.raises(DrafterMismatchError, match="beyond the target's vocabulary"):
        generate(target, [1, 2, 3], drafter=drafter, max_new_tokens=4)
    with pytest.raises(MethodConfigError, match="datastore must be"):
        DFlashConfig(datastore="yes")
    with pytest.raises(MethodConfigError, match="datastore_min_ngram must be"):
        DFlashConfig(datastore_min_ngram=0)
