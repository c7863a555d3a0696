"""Gate replay (specflash/gate_replay.py, acceptance_record.py, step_costs.py): the recorded
acceptance is what the engine accepts step by step, and replayed policies account tokens and cost
as the engine's steps would."""

from __future__ import annotations

import pytest

from conftest import hf_greedy
from specflash.acceptance_record import record_runs
from specflash.api import encode_prompt, generate
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.gate_replay import (AcceptanceRun, ReplayCost, gate_policy, replay_all, replay_fixed, replay_gate,
                                   replay_oracle)
from specflash.models.dflash_io import save_drafter
from specflash.step_costs import measure_step_costs
from test_dflash import PROMPTS, _fit, random_drafter

CURVE = [1.0, 1.36, 1.71, 1.71, 1.71, 1.74, 2.24, 2.24]  # the 2-core CPU's, c(1) .. c(8)
COST = ReplayCost(CURVE, draft=0.2, shadow=0.13)


def test_recorded_acceptance_is_what_the_engine_accepts_at_every_step(tiny_targets):
    target = tiny_targets["qwen3"]
    ids = encode_prompt(target, PROMPTS[0])  # as record_runs encodes it
    model = random_drafter(target, std=0.02, block=4, feature_layers=(0, 1)).train()
    _fit(target, model, ids + hf_greedy(target, ids, 60), len(ids), steps=60)
    model.eval()
    [run] = record_runs(target, model, [("code", PROMPTS[0])], 60)
    engine = generate(target, ids, drafter=DFlashEngineDrafter(model, DFlashConfig(gate=False, tree=False)), max_new_tokens=60)  # the record is the chain's
    assert engine.output_ids == run.tokens
    done, accepted = 1, []
    for step in engine.steps[1:]:
        assert len(step.accepted) == min(run.accepted[done - 1], len(step.tokens))
        accepted.append(len(step.accepted))
        done += len(step.committed)
    assert done == len(run.tokens) and sum(accepted) > 0
    assert run.accepted[-1] == 0 and max(run.accepted) <= 3  # block 4: at most 3 drafts


def test_fixed_width_accounts_tokens_and_cost_by_hand():
    run = AcceptanceRun("math", list(range(9)), [7] * 9)
    result = replay_fixed(run, COST, 3)
    # from 1 committed token: 4 per step (3 drafts + the target's), 1 -> 5 -> 9
    assert (result.steps, result.tokens, result.accepted) == (2, 8, 6)
    assert result.cost == pytest.approx(2 * (CURVE[3] + 0.2))
    assert result.speedup == pytest.approx(8 / (2 * (1.71 + 0.2)))


def test_the_room_left_caps_the_last_step():
    run = AcceptanceRun("math", list(range(4)), [7] * 4)
    result = replay_fixed(run, COST, 7)
    assert (result.steps, result.tokens, result.drafted) == (1, 3, 2)  # 3 tokens left: 2 drafts + 1


def test_the_oracle_drafts_only_what_is_accepted_and_pays():
    useless = AcceptanceRun("code", list(range(50)), [0] * 50)
    assert replay_oracle(useless, COST, 7).speedup == 1.0 and replay_oracle(useless, COST, 7).drafted == 0
    # one accepted draft pays 2 / (1.36 + 0.2) > 1; at a block costing 0.7 it does not
    one = AcceptanceRun("code", list(range(50)), [1] * 50)
    assert replay_oracle(one, COST, 7).drafted == replay_oracle(one, COST, 7).accepted > 0
    assert replay_oracle(one, ReplayCost(CURVE, 0.7, 0.13), 7).drafted == 0


def test_the_gate_switches_a_useless_drafter_off_and_pays_only_its_looks():
    run = AcceptanceRun("writing", list(range(400)), [0] * 400)
    result = replay_gate(run, COST, 7, gate_policy(7, COST)())
    # a few real drafts while its estimates fall from the prior, then shadows only
    assert 0 < result.drafting_steps <= 5 and result.accepted == 0 and 0 < result.shadows < result.steps / 8
    looks = result.cost - (result.steps + result.shadows * COST.shadow)
    assert 0 < looks <= result.drafting_steps * (max(CURVE) - 1 + COST.draft)
    assert result.speedup > 0.97


def test_the_gate_drafts_a_perfect_drafter_at_full_width():
    run = AcceptanceRun("code", list(range(400)), [7] * 400)
    gated = replay_gate(run, COST, 7, gate_policy(7, COST)())
    full = replay_fixed(run, COST, 7)
    assert gated.drafting_steps > 0.8 * gated.steps
    assert gated.speedup > 0.9 * full.speedup > 2


def test_a_block_cut_picks_among_every_slot_the_gate_would_not_draft():
    """Confidences say the first 5 drafts are sure: a gate held at width 1 verifies 1 of them,
    the same gate with the cut over the whole block verifies all 5 the cut keeps."""
    run = AcceptanceRun("code", list(range(60)), [5] * 60, confidence=[[0.99] * 5 + [0.01] * 2] * 60)
    narrow = fixed_width_gate(1)
    gated = replay_gate(run, COST, 7, narrow(), sure)
    block = replay_gate(run, COST, 7, narrow(), sure, whole_block=True)
    assert gated.drafted == gated.accepted == gated.drafting_steps  # one draft a step
    assert block.accepted == block.drafted > 4 * block.drafting_steps - 5  # five a step, the room permitting
    assert block.cost == pytest.approx(block.steps * (CURVE[5] + COST.draft), rel=0.2)
    assert block.speedup > 1.5 * gated.speedup


def sure(conf: list[float]) -> int:
    """A cut that keeps the drafts up to the first below 0.5."""
    return next((i for i, c in enumerate(conf) if c < 0.5), len(conf))


def fixed_width_gate(width: int):
    """A gate that decides to draft at `width` on every step (its value and reason aside)."""
    from specflash.drafters.gate import DraftGate, GateDecision

    class Fixed(DraftGate):
        def decide(self, room: int) -> GateDecision:
            return GateDecision("on", min(width, room), 1.0, "fixed")

    return lambda: Fixed(CURVE, 7, draft_cost=COST.draft)


def test_pooling_sums_domains_and_all():
    runs = [AcceptanceRun("math", list(range(20)), [2] * 20), AcceptanceRun("code", list(range(30)), [0] * 30)]
    pooled = replay_all(runs, lambda r: replay_fixed(r, COST, 2))
    assert set(pooled) == {"all", "math", "code"}
    assert pooled["all"].tokens == pooled["math"].tokens + pooled["code"].tokens == 19 + 29
    assert pooled["all"].cost == pytest.approx(pooled["math"].cost + pooled["code"].cost)


def test_acceptance_and_tokens_must_pair_up():
    with pytest.raises(ValueError, match="3 acceptance counts for 2 tokens"):
        AcceptanceRun("math", [1, 2], [0, 0, 0])


def test_step_costs_come_from_real_steps_relative_to_plain_decoding(tiny_targets, tmp_path):
    target = tiny_targets["llama"]
    save_drafter(random_drafter(target, block=4), tmp_path)
    cost = measure_step_costs(target, str(tmp_path), [PROMPTS[0]], depth=3, max_new_tokens=12)
    assert len(cost.curve) == 4 and cost.curve[0] == 1.0
    assert all(c > 0 for c in cost.curve) and cost.draft > 0 and cost.shadow > 0


def test_step_costs_leave_out_the_first_decode_step(tiny_targets, tmp_path, monkeypatch):
    """There the drafter also reads the prompt's features: a cost measured on it is no step's."""
    import specflash.step_costs as step_costs

    target = tiny_targets["llama"]
    save_drafter(random_drafter(target, block=4), tmp_path)
    real = step_costs.generate

    def slow_first_step(*args, **kwargs):
        run = real(*args, **kwargs)
        first = next(s for s in run.steps if s.phase == "decode")
        first.draft_time += 100.0
        first.verify_time += 100.0
        return run

    monkeypatch.setattr(step_costs, "generate", slow_first_step)
    cost = measure_step_costs(target, str(tmp_path), [PROMPTS[0]], depth=3, max_new_tokens=12)
    assert max(cost.curve) < 50 and cost.draft < 50 and cost.shadow < 50
