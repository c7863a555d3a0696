"""The draft gate: its choice of width, its probes, and a useless drafter switched off (counted)."""

from __future__ import annotations

import pytest

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.gate import DraftGate
from specflash.errors import MethodConfigError
from test_draft_vocab import vocab_drafter

STEEP = [1.0 + 0.3 * i for i in range(9)]  # c(n): verifying n tokens costs like a CPU
FLAT = [1.0] * 9


def test_width_maximises_tokens_per_cost():
    gate = DraftGate(FLAT, depth=7, draft_cost=0.1)
    gate.accept = [0.9] * 7
    assert gate.decide(7).width == 7  # free verification: draft everything
    gate = DraftGate(STEEP, depth=7, draft_cost=0.1)
    gate.accept = [0.9, 0.5, 0.2, 0.2, 0.2, 0.2, 0.2]
    values = [gate.value(m) for m in range(8)]
    decision = gate.decide(7)
    assert decision.state == "on" and decision.width == values.index(max(values)) == 2
    assert gate.value(2) == pytest.approx((1 + 0.9 + 0.9 * 0.5) / (STEEP[2] + 0.1))
    gate.accept = [0.05] * 7
    assert gate.decide(7).state == "off"


def test_probe_interval_doubles_while_drafting_does_not_pay():
    gate = DraftGate(STEEP, depth=3, probe_every=2, draft_cost=0.5)
    probes, states = [], []
    for step in range(80):
        decision = gate.decide(3)
        states.append(decision.state)
        if decision.state == "probe":
            probes.append(step)
        gate.drafted(decision, 0.0)
        gate.verified(decision.width, 0)
    assert states[0] == "probe" and states[1] == "off"
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    # the first step's probe already failed: 2 * 2, 4, 8 steps between probes, then capped at 8x
    assert gaps[:3] == [4, 8, 16]
    assert gaps[3:] == [16] * len(gaps[3:]) and len(gaps) >= 4


def test_gate_needs_a_cost_curve(tiny_targets):
    model = vocab_drafter(tiny_targets["llama"], [5, 9])
    with pytest.raises(MethodConfigError, match="verify-cost"):
        DFlashEngineDrafter(model, DFlashConfig())
    with pytest.raises(MethodConfigError, match="probe_every"):
        DFlashConfig(probe_every=0)


def _useless(target, prompt_ids, n):
    """A drafter that can only draft one token the target never emits here: acceptance is 0."""
    never = next(t for t in range(3, target.vocab_size) if t not in hf_greedy(target, prompt_ids, n))
    return vocab_drafter(target, [never], feature_layers=(1,))


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("method", ["dflash", "adaflash"])
def test_useless_drafter_is_switched_off_and_runs_only_on_probes(tiny_targets, arch, method):
    target = tiny_targets[arch]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    model = _useless(target, prompt_ids, 60)
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    cfg = {"dflash": DFlashConfig(probe_every=4), "adaflash": AdaFlashConfig(probe_every=4, rule="fixed", fixed_len=7)}
    drafter = {"dflash": DFlashEngineDrafter, "adaflash": AdaFlashDrafter}[method](model, cfg[method], STEEP)
    run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=60)
    assert run.output_ids == hf_greedy(target, prompt_ids, 60)
    decode = run.steps[1:]
    gates = [s.extras["gate"] for s in decode]
    assert gates[0]["state"] == "probe" and gates[1]["state"] == "off"
    assert "does not pay" in gates[1]["reason"]
    off = [s for s, g in zip(decode, gates) if g["state"] == "off"]
    assert all(s.tokens == [] and s.verified == 1 and len(s.committed) == 1 for s in off)
    probe_lengths = [len(s.tokens) for s, g in zip(decode, gates) if g["state"] == "probe"]
    assert probe_lengths[0] == 3 and max(probe_lengths) == 3  # short probes (fewer only where the budget ends)
    probes = sum(g["state"] == "probe" for g in gates)
    assert sum(g["state"] == "on" for g in gates) == 0
    assert len(forwards) == probes == sum(bool(s.tokens) for s in decode)  # the drafter ran on probes only
    assert probes <= 5  # steps 1, 9, 25, 57 with a doubling interval from 8 (the first probe failed)
    # one target forward per committed token, plus the probes' drafted tokens
    assert sum(len(s.committed) for s in decode) == len(decode)
    assert sum(s.verified for s in decode) == len(decode) + sum(len(s.tokens) for s in decode)


PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def test_gated_dflash_stays_lossless_and_keeps_drafting_when_it_pays(tiny_targets):
    target = tiny_targets["llama"]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    greedy = hf_greedy(target, prompt_ids, 40)
    # a drafter whose vocabulary is exactly the target's greedy tokens, on a free verifier, drafts on
    model = vocab_drafter(target, sorted(set(greedy)), feature_layers=(1,))
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(), FLAT), max_new_tokens=40,
                   stop_on_eos=False)
    assert run.output_ids == greedy
    assert all("gate" in s.extras for s in run.steps[1:])


def test_gate_records_are_plain_json(tiny_targets):
    target = tiny_targets["qwen3"]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    model = _useless(target, prompt_ids, 12)
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(), STEEP), max_new_tokens=12)
    from specflash.trace import RunRecord

    again = RunRecord.from_json(run.to_json())
    assert [s.extras.get("gate") for s in again.steps] == [s.extras.get("gate") for s in run.steps]
    assert again.steps[2].extras["gate"]["state"] == "off"
