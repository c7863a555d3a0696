"""Shaping (temperature, top-k, top-p), trace JSON round-trip and metric definitions."""

from __future__ import annotations

import pytest
import torch

from specflash.config import SamplingConfig
from specflash.metrics import acceptance_histogram, per_position_acceptance, pooled_acceptance, summarize
from specflash.sampling import probabilities
from specflash.trace import RunRecord, StepRecord


def test_top_k_and_top_p():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.7))  # 0.5 + 0.25 reaches 0.7
    assert torch.allclose(p, torch.tensor([2 / 3, 1 / 3, 0, 0]))
    p = probabilities(logits, SamplingConfig(temperature=1.0, top_p=0.5))  # 0.5 alone reaches it
    assert torch.allclose(p, torch.tensor([1.0, 0, 0, 0]))
    p = probabilities(logits, SamplingConfig(temperature=2.0))
    expected = torch.softmax(logits / 2, dim=-1)
    assert torch.allclose(p, expected)


def _step(i, tokens, accepted, committed, verified, phase="decode"):
    return StepRecord(step=i, phase=phase, context_len=10 + i, tokens=tokens, parents=list(range(-1, len(tokens) - 1)),
                      q=None, p=[0.5] * len(tokens), accepted=accepted, correction=committed[-1],
                      correction_kind="resample", correction_p=0.9, committed=committed, verified=verified,
                      draft_time=0.01, verify_time=0.04)


def _run():
    steps = [
        _step(0, [], [], [7], 10, phase="prefill"),
        _step(1, [1, 2, 3], [0, 1], [1, 2, 9], 4),
        _step(2, [4, 5, 6], [], [8], 4),
        _step(3, [1, 2], [0, 1], [1, 2, 3], 3),
    ]
    return RunRecord(method="draft", config={"k": 3}, sampling={"temperature": 0}, model="m", device="cpu",
                     prompt_ids=[1, 2], steps=steps, output_ids=[7, 1, 2, 9, 8, 1, 2, 3], finish_reason="length",
                     prefill_time=0.04)


def test_metrics_definitions():
    m = summarize(_run())
    assert m["decode_steps"] == 3
    assert m["mean_acceptance_length"] == 7 / 3  # committed per target forward, bonus included
    assert m["draft_acceptance_rate"] == 4 / 8
    assert m["verified_per_committed"] == 11 / 7
    assert abs(m["tokens_per_s"] - 7 / 0.15) < 1e-9  # decode only
    steps = _run().steps[1:]
    assert per_position_acceptance(steps) == [2 / 3, 2 / 3, 0 / 2]
    assert acceptance_histogram(steps) == {1: 1, 3: 2}


def test_pooled_acceptance_weighs_runs_by_their_steps():
    one = summarize(_run())  # 7 tokens in 3 steps
    other = {"decode_steps": 1, "mean_acceptance_length": 1.0}
    assert pooled_acceptance([one, other]) == (7 + 1) / (3 + 1)  # not the mean of 7/3 and 1
    assert pooled_acceptance([one, None, {"decode_steps": 0, "mean_acceptance_length": 0.0}]) == 7 / 3
    assert pooled_acceptance([None]) is None


def test_run_record_json_round_trip():
    run = _run()
    run.metrics = summarize(run)
    again = RunRecord.from_json(run.to_json())
    assert again == run
    assert RunRecord.from_dict({**run.to_dict(), "text": "extra keys are ignored"}) == run


def test_plain_sampling_keywords_mean_the_same_as_a_sampling_config(tiny_targets):
    from specflash.api import generate, generate_batch
    from specflash.errors import SamplingConfigError

    target = tiny_targets["llama"]
    ids = target.tokenizer("The quick brown fox")["input_ids"]
    by_config = generate(target, ids, "pld", max_new_tokens=12, sampling=SamplingConfig(temperature=0.7, top_p=0.9, seed=3))
    by_keywords = generate(target, ids, "pld", max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    assert by_keywords.output_ids == by_config.output_ids
    assert by_keywords.sampling == by_config.sampling == {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 3}
    other_seed = [generate(target, ids, "ar", max_new_tokens=12, temperature=1.0, seed=s).output_ids for s in range(4)]
    assert len({tuple(o) for o in other_seed}) > 1  # the keyword seed really seeds
    batch = generate_batch(target, [ids], "ar", max_new_tokens=12, temperature=0.7, top_p=0.9, seed=3)
    assert batch.runs[0].sampling == by_config.sampling
    with pytest.raises(SamplingConfigError, match="not both"):
        generate(target, ids, "ar", sampling=SamplingConfig(), temperature=0.5)
    with pytest.raises(SamplingConfigError, match="top_p"):
        generate(target, ids, "ar", top_p=0.0)
