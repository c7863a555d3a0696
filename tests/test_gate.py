"""The draft gate: its choice of width, its probes, and a useless drafter switched off (counted)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from conftest import LOSSLESS_ARCHS, hf_greedy
from specflash.api import generate
from specflash.drafters.adaflash import AdaFlashConfig, AdaFlashDrafter
from specflash.drafters.dflash import DFlashConfig, DFlashEngineDrafter
from specflash.drafters.gate import DeviceTimings, DraftGate, GateDecision, cost_line
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


def test_switching_on_needs_the_margin_staying_on_does_not():
    gate = DraftGate(STEEP, depth=3, probe_every=10, draft_cost=0.1, switch_on=1.2)
    gate.accept = [0.62] * 3
    assert 1.0 < max(gate.value(m) for m in range(4)) < 1.2
    waiting = gate.decide(3)
    assert waiting.state == "off" and "1.20x" in waiting.reason
    gate.accept = [0.9] * 3
    assert gate.decide(3).state == "on"
    gate.accept = [0.62] * 3
    assert gate.decide(3).state == "on"  # already on: worth more than plain decoding is enough
    gate.accept = [0.05] * 3
    assert gate.decide(3).state == "off"
    gate.accept = [0.62] * 3
    assert gate.decide(3).state == "off"  # off again: the margin applies again


def test_looks_back_off_while_drafting_does_not_pay():
    gate = DraftGate(STEEP, depth=3, probe_every=2, draft_cost=0.5)
    context, looks, states = [1, 2], [], []
    for step in range(90):
        gate.committed(context)
        decision = gate.decide(3)
        states.append(decision.state)
        if decision.state in ("shadow", "probe"):
            looks.append(step)
        if decision.state == "shadow":
            gate.shadowed(len(context), [7, 7, 7])  # the target never commits 7
        gate.drafted(decision, 0.0)
        gate.verified(decision.width if decision.state == "probe" else 0, 0)  # a real look: every draft rejected
        context.append(5)
    assert states[0] == "probe" and states[1] == "off" and "on" not in states
    # the first step and, while the estimates are near the prior, every look drafts for real (worth more per unit cost than
    # a shadow's one token for 1 + d); once misses have pulled them down, the looks are shadows
    kinds = [states[i] for i in looks[1:]]
    assert kinds[0] == "probe" and kinds[-1] == "shadow" and kinds == sorted(kinds)
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    # every look fails: 2 * 2, 2 * 4 steps between looks, then capped at 4x
    assert gaps[:2] == [4, 8]
    assert gaps[2:] == [8] * len(gaps[2:]) and len(gaps) >= 8


def test_shadow_drafts_are_scored_against_what_the_target_commits():
    gate = DraftGate(STEEP, depth=4, draft_cost=0.1, smoothing=0.3)

    def ema(old, hit):
        return 0.7 * old + 0.3 * hit

    gate.shadowed(3, [10, 11, 12, 13])
    gate.committed([1, 2, 3, 10])
    assert gate.shadow is not None and gate.accept == [ema(0.5, 1), None, None, None]  # scored as it arrives
    gate.committed([1, 2, 3, 10, 11, 99])
    a1 = ema(0.5, 1)
    assert gate.shadow is None and gate.accept == pytest.approx([a1, ema(a1, 1), ema(ema(a1, 1), 0), None])
    gate.shadowed(2, [5, 6])
    gate.committed([1, 2, 5, 6])
    assert gate.shadow is None and gate.accept[0] == pytest.approx(ema(a1, 1))


def test_gate_needs_a_cost_curve(tiny_targets):
    model = vocab_drafter(tiny_targets["llama"], [5, 9])
    with pytest.raises(MethodConfigError, match="verify-cost"):
        DFlashEngineDrafter(model, DFlashConfig())
    with pytest.raises(MethodConfigError, match="probe_every"):
        DFlashConfig(probe_every=0)
    with pytest.raises(MethodConfigError, match="switch_on"):
        DFlashConfig(switch_on=0.9)


def _cpu_like_costs(monkeypatch) -> None:
    """Decide from the STEEP curve and a fixed drafter cost: the tiny models verify 8 tokens almost
    as fast as one, so a calibrating gate would (rightly) keep drafting at low acceptance there."""
    import functools

    import specflash.drafters.dflash as dflash_module

    monkeypatch.setattr(dflash_module, "DraftGate", functools.partial(DraftGate, draft_cost=0.1))


def _useless(target, prompt_ids, n):
    """A drafter that can only draft one token the target never emits here: acceptance is 0."""
    never = next(t for t in range(3, target.vocab_size) if t not in hf_greedy(target, prompt_ids, n))
    return vocab_drafter(target, [never], feature_layers=(1,))


@pytest.mark.parametrize("arch", LOSSLESS_ARCHS)
@pytest.mark.parametrize("method", ["dflash", "adaflash"])
def test_useless_drafter_is_switched_off_and_runs_only_on_probes(tiny_targets, arch, method, monkeypatch):
    _cpu_like_costs(monkeypatch)
    target = tiny_targets[arch]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    model = _useless(target, prompt_ids, 60)
    forwards, head_rows = [], []
    model.register_forward_hook(lambda *_: forwards.append(1))
    draft_probs = model.draft_probs
    monkeypatch.setattr(model, "draft_probs", lambda hidden: head_rows.append(len(hidden)) or draft_probs(hidden))
    # the gate alone: prompt lookup beside it (tests/test_lookup_source.py) would draft on this text
    cfg = {"dflash": DFlashConfig(probe_every=4, lookup=False, tree=False),
           "adaflash": AdaFlashConfig(probe_every=4, rule="fixed", fixed_len=7, lookup=False)}
    drafter = {"dflash": DFlashEngineDrafter, "adaflash": AdaFlashDrafter}[method](model, cfg[method], STEEP)
    run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=60)
    assert run.output_ids == hf_greedy(target, prompt_ids, 60)
    decode = run.steps[1:]
    gates = [s.extras["gate"] for s in decode]
    states = [g["state"] for g in gates]
    # the first step looks for real: at the prior of 0.5, drafting a token is worth 1.5 / (1.3 + 0.1)
    # of plain decoding on these costs, a shadow's token 1 / 1.1
    assert states[0] == "probe" and gates[0]["reason"].startswith("first step")
    off = states.index("off")
    assert off <= 4 and "does not pay" in gates[off]["reason"]  # the prior of 0.5 allows a few tries
    decode, states = decode[off:], states[off:]
    assert set(states) <= {"off", "probe", "shadow"} and "on" not in states  # once off, it stays off
    assert all(len(s.accepted) == 0 and len(s.committed) == 1 for s in decode)  # nothing it drafts is accepted
    assert all(s.tokens == [] and s.verified == 1 for s, state in zip(decode, states) if state != "probe")
    looks = [i for i, state in enumerate(states) if state != "off"]
    # a look drafts for real while the estimates say that is worth more than a shadow, then shadows
    kinds = [states[i] for i in looks]
    assert kinds == sorted(kinds)
    gaps = [b - a for a, b in zip(looks, looks[1:])]
    assert gaps[:2] == [8, 16] and set(gaps[2:]) <= {16}  # every 4 steps, doubling to the 16-step cap
    shadows = [s for s, state in zip(decode, states) if state == "shadow"]
    # full blocks (fewer only where the budget ends), scored later, never verified; the trace
    # keeps the one token computed when drafting (the rest only as the gate reaches them)
    assert all(1 <= s.extras["gate"]["width"] <= 7 and len(s.extras["shadow"]) == 1 for s in shadows)
    # the head ran for every verified drafted slot, and for one slot per shadow: the first missed
    every_shadow = [g for g in gates if g["state"] == "shadow"]
    assert sum(head_rows) == sum(g["width"] for g in gates if g["state"] in ("on", "probe")) + len(every_shadow)
    assert len(forwards) == len(run.steps) - 1 - len(decode) + len(looks)  # then on the looks only
    assert 3 <= len(looks) <= 5


PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown"


def test_gated_dflash_stays_lossless_and_keeps_drafting_when_it_pays(tiny_targets):
    target = tiny_targets["llama"]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    greedy = hf_greedy(target, prompt_ids, 40)
    # a drafter whose vocabulary is exactly the target's greedy tokens, on a free verifier, drafts on
    model = vocab_drafter(target, sorted(set(greedy)), feature_layers=(1,))
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(lookup=False), FLAT),
                   max_new_tokens=40, stop_on_eos=False)
    assert run.output_ids == greedy
    assert all("gate" in s.extras for s in run.steps[1:])


def test_gate_records_are_plain_json(tiny_targets, monkeypatch):
    _cpu_like_costs(monkeypatch)
    target = tiny_targets["qwen3"]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    model = _useless(target, prompt_ids, 12)
    run = generate(target, prompt_ids, drafter=DFlashEngineDrafter(model, DFlashConfig(lookup=False), STEEP),
                   max_new_tokens=12)
    from specflash.trace import RunRecord

    again = RunRecord.from_json(run.to_json())
    assert [s.extras.get("gate") for s in again.steps] == [s.extras.get("gate") for s in run.steps]
    assert "off" in [s.extras["gate"]["state"] for s in again.steps[1:]]
    # where verifying a second token costs more than 1.5 + d / 2 plain steps, the first look is a shadow
    shadow = DraftGate([1.0 + i for i in range(9)], depth=7, draft_cost=0.1).decide(7)
    assert shadow.state == "shadow" and GateDecision(**shadow.to_dict()) == shadow


class _Clock:
    """A fake perf_counter the test advances by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_cost_curve_comes_from_the_runs_own_timings(monkeypatch):
    gate = DraftGate([1.0, 1.1, 1.2, 1.3], depth=3)
    assert gate.cost == [1.0, 1.1, 1.2, 1.3]  # nothing timed yet: the cached curve
    gate.seconds = {1: 0.040, 3: 0.068}
    scale = (0.068 / 0.040) / 1.2
    assert gate.cost == pytest.approx([1.0, 1.1 * scale, 0.068 / 0.040, 1.3 * scale])
    gate.seconds = {1: 0.040, 2: 0.080, 3: 0.060}  # noise: 3 tokens timed cheaper than 2
    assert gate.cost[2] == pytest.approx(2.0) and gate.cost == sorted(gate.cost)
    fixed = DraftGate([1.0, 1.1, 1.2, 1.3], depth=3, draft_cost=0.1)
    fixed.seconds = {1: 0.040, 3: 0.068}
    assert fixed.cost == [1.0, 1.1, 1.2, 1.3]  # a fixed draft cost keeps decisions reproducible


def test_gate_stops_drafting_when_this_run_pays_more_than_the_cached_curve(monkeypatch):
    """The cached curve says verifying is nearly free; the run's clock says a drafted step costs
    1.8 plain ones: at a first-position acceptance of 0.3 the gate must turn drafting off."""
    import specflash.drafters.gate as gate_module

    clock = _Clock()
    monkeypatch.setattr(gate_module.time, "perf_counter", clock)
    gate = DraftGate(FLAT[:4], depth=3)
    states, context = [], [1]
    for step in range(40):
        gate.step_started()
        gate.committed(context)
        decision = gate.decide(3)
        states.append((decision.state, decision.width))
        verified = 0 if decision.state == "shadow" else decision.width
        if decision.state == "shadow":
            gate.shadowed(len(context), [-1] * decision.width)  # scored a miss at the next step
        gate.drafted(decision, 0.004 if decision.width else 0.0)
        clock.now += (0.004 if decision.width else 0.0) + (0.072 if verified else 0.040)
        gate.verified(verified, 1 if verified and step % 3 == 0 else 0)
        context.append(5)
    assert states[0] == ("probe", 3)  # the cached curve's free verification: the first look drafts for real
    assert gate.cost[3] == pytest.approx(1.8)
    assert all(s != "on" for s, _ in states[5:])  # off, but for its looks
    uncalibrated = DraftGate(FLAT[:4], depth=3, draft_cost=gate.drafting_cost(3))
    gate.accept = uncalibrated.accept = [0.4, 0.3, 0.3]
    assert gate.decide(3).state in ("off", "shadow")
    assert uncalibrated.decide(3).state == "on"  # what the cached curve alone would have done


def test_cost_line_fits_drafting_cost_by_width():
    assert cost_line({}, 3) == 0.0
    assert cost_line({7: 0.4}, 1) == pytest.approx(0.4)  # one width timed: flat
    line = {1: 0.25, 3: 0.31, 7: 0.46}  # DeLS-like: a block plus a cost per position
    slope = sum((w - 11 / 3) * (d - 1.02 / 3) for w, d in line.items()) / sum((w - 11 / 3) ** 2 for w in line)
    assert cost_line(line, 5) == pytest.approx(1.02 / 3 + slope * (5 - 11 / 3))
    assert cost_line(line, 2) < cost_line(line, 5) < cost_line(line, 7)
    assert cost_line({1: 0.5, 7: 0.3}, 7) == pytest.approx(0.4)  # noise never makes a wider draft cheaper


def test_gate_prices_each_width_at_its_own_drafting_cost(monkeypatch):
    """A drafter whose block costs 0.2 of a target step plus 0.05 per drafted position: once two
    widths are timed, the gate values width 1 at d(1) = 0.25 and width 3 at d(3) = 0.35, not one
    cost for both. A lazy shadow is timed at the one position it computed."""
    import specflash.drafters.gate as gate_module

    clock = _Clock()
    monkeypatch.setattr(gate_module.time, "perf_counter", clock)
    gate = DraftGate(FLAT[:4], depth=3)
    gate.seconds = {1: 0.040}
    gate.step_time = 0.040
    for width, state in ((3, "on"), (1, "on"), (3, "shadow")):
        positions = 1 if state == "shadow" else None
        gate.drafted(gate_module.GateDecision(state, width, 1.0, ""), 0.040 * (0.2 + 0.05 * (positions or width)),
                     positions)
    assert gate.draft_costs == pytest.approx({3: 0.35, 1: 0.25})
    assert gate.drafting_cost(1) == pytest.approx(0.25) and gate.drafting_cost(2) == pytest.approx(0.30)
    gate.accept = [0.6, 0.6, 0.6]
    assert gate.value(1) == pytest.approx(1.6 / (1.0 + 0.25))
    assert gate.value(3) == pytest.approx((1 + 0.6 + 0.36 + 0.216) / (1.0 + 0.35))
    lookup = gate_module.GateDecision("lookup", 3, 1.0, "")
    gate.drafted(lookup, 0.040)  # prompt lookup's draft is not the drafter's cost
    assert gate.draft_costs == pytest.approx({3: 0.35, 1: 0.25})


def test_a_gate_starts_from_what_the_last_run_measured_of_the_device():
    """A calibrating gate hands its timings to the next run's gate, which reads its cost curve from
    them and needs no plain step to time until `4 * probe_every` steps after the last; a gate with
    a fixed drafter cost measures nothing and takes nothing."""
    gate = DraftGate(FLAT[:4], depth=3, probe_every=2)
    assert gate.device_timings() is None and gate.wants_plain_step  # nothing timed yet
    gate.seconds, gate.step_time, gate.draft_costs = {1: 0.040, 3: 0.068}, 0.040, {3: 0.2}
    gate.step, gate.timed_at, gate.drafted_at = 5, {1: 0, 3: 4}, {3: 5}
    carried = gate.device_timings()
    assert carried == DeviceTimings({1: 0.040, 3: 0.068}, 0.040, {3: 0.2}, {1: 5, 3: 1}, {3: 0})
    following = DraftGate(FLAT[:4], depth=3, probe_every=2, timings=carried)
    assert following.cost == gate.cost and following.drafting_cost(3) == pytest.approx(0.2)
    assert not following.wants_plain_step  # 5 steps since the last plain one, of 8
    following.step = 3
    assert following.wants_plain_step
    gate.seconds[1] = 0.5
    assert following.seconds[1] == 0.040  # a copy: the runs do not share their EMAs
    fixed = DraftGate(FLAT[:4], depth=3, draft_cost=0.1, timings=carried)
    assert fixed.device_timings() is None and fixed.seconds == {} and fixed.drafting_cost(3) == 0.1


def _gate_on_a_clock(monkeypatch) -> tuple[DraftGate, Callable[[int, float], None]]:
    """A calibrating gate on a fake clock, and `step(rows, seconds)`: one step that verified
    `rows` rows and took `seconds`."""
    import specflash.drafters.gate as gate_module

    clock = _Clock()
    monkeypatch.setattr(gate_module.time, "perf_counter", clock)
    gate = DraftGate([1.0, 1.1, 1.2, 1.25], depth=3, probe_every=2)

    def step(rows: int, seconds: float) -> None:
        gate.step_started()
        gate.verified(rows - 1, 0, rows)
        clock.now += seconds

    return gate, step


def test_a_stalled_step_prices_its_width_only_until_its_timing_goes_stale(monkeypatch):
    """One step verifying 4 tokens stalls (0.5 s where it costs 0.05), the width's first timing:
    it counts at most twice what the curve expects (2.5 plain steps, not 12.5), still dear enough
    that the gate, drafting narrower since, never times 4 again. Once that timing is `stale_after`
    steps old, the curve reads 4 tokens from the widths still timed, as it does a width never
    timed, and the next run does not inherit the stall."""
    gate, step = _gate_on_a_clock(monkeypatch)
    step(1, 0.040)
    step(4, 0.500)
    step(1, 0.040)
    assert gate.cost[3] == pytest.approx(2 * 1.25)
    for n in range(gate.stale_after):
        step(1 if n % 4 == 0 else 2, 0.040 if n % 4 == 0 else 0.044)
    step(1, 0.040)  # timed: the steps before it
    scale = (0.044 / 0.040) / 1.1
    assert gate.cost == pytest.approx([1.0, 1.1, 1.2 * scale, 1.25 * scale])
    carried = gate.device_timings()
    assert set(carried.seconds) == {1, 2} and DraftGate([1.0, 1.1, 1.2, 1.25], 3, timings=carried).cost == gate.cost


def test_one_stall_moves_a_timed_price_a_little_and_a_lasting_slowdown_comes_through(monkeypatch):
    """Once a width is timed, a step counts at most twice its running price: a 25x stall moves the
    price of its width by a tenth (smoothing 0.1 x the capped excess), where it had moved it by 2.4
    times itself; a machine that stays 3x slower still reaches its new price, as the EMA alone
    would, a few steps later."""
    gate, step = _gate_on_a_clock(monkeypatch)
    for rows in (1, 2) * 10:
        step(rows, 0.040 if rows == 1 else 0.044)
    step(1, 0.040)
    assert gate.cost[1] == pytest.approx(1.1)
    step(2, 25 * 0.044)
    step(1, 0.040)
    assert gate.seconds[2] == pytest.approx(1.1 * 0.044)
    assert gate.cost[1] == pytest.approx(1.21, rel=0.02)
    for _ in range(40):
        step(1, 0.120)
        step(2, 0.132)
    step(1, 0.120)
    assert gate.seconds[1] == pytest.approx(0.120, rel=0.05) and gate.seconds[2] == pytest.approx(0.132, rel=0.05)
    assert gate.step_time == pytest.approx(0.120, rel=0.05)


def test_a_drafters_next_run_skips_the_plain_timing_step(tiny_targets):
    """The drafter keeps what its gate measured of the device for its next run: the first run
    spends a decode step verifying the root alone to time it, the next drafts from its first step
    (the first look drafts for real where verifying is cheap) and times nothing plain at the start,
    whatever its drafts are worth after (this one's are mostly wrong)."""
    target = tiny_targets["llama"]
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    greedy = hf_greedy(target, prompt_ids, 24)
    model = vocab_drafter(target, sorted(set(greedy)), feature_layers=(1,))
    drafter = DFlashEngineDrafter(model, DFlashConfig(lookup=False, datastore=False), FLAT)
    runs = [generate(target, prompt_ids, drafter=drafter, max_new_tokens=24, stop_on_eos=False) for _ in range(2)]
    assert all(run.output_ids == greedy for run in runs)
    first, second = ([s.extras["gate"] for s in run.steps[1:4]] for run in runs)
    assert first[0]["state"] == "probe" and any("timing one plain step" in g["reason"] for g in first)
    assert second[0]["state"] == "probe" and second[0]["reason"].startswith("first step")
    assert not any("timing one plain step" in g["reason"] for g in second)
    assert runs[1].steps[1].verified == len(runs[1].steps[1].tokens) + 1 > 1  # the look's draft was verified


@pytest.mark.parametrize("method", ["dflash", "adaflash", "dels"])
def test_a_shadow_chain_is_the_eager_draft_computed_as_it_is_read(tiny_targets, method):
    from specflash.drafters.dels import DeLSConfig, DeLSDrafter
    from specflash.drafters.dflash import ShadowChain
    from test_dels import random_head
    from test_draft_vocab import spread_ids

    target = tiny_targets["llama"]
    model = vocab_drafter(target, spread_ids(target, 30), feature_layers=(1,))
    drafter = {"dflash": lambda: DFlashEngineDrafter(model, DFlashConfig(gate=False, tree=False)),
               "adaflash": lambda: AdaFlashDrafter(model, AdaFlashConfig(gate=False, rule="fixed", fixed_len=7, tree=False)),
               "dels": lambda: DeLSDrafter(model, DeLSConfig(gate=False, alpha=0.7, beta=0.3, tree=False),
                                            random_head(target))}[method]()
    prompt_ids = target.tokenizer(PROMPT)["input_ids"]
    run = generate(target, prompt_ids, drafter=drafter, max_new_tokens=9, stop_on_eos=False)
    context = prompt_ids + run.output_ids  # the drafter has observed every position but the last
    rows = []  # drafter head rows computed: one per position (dels's local head reads its own table)
    head = model.draft_logits
    model.draft_logits = lambda hidden: rows.append(hidden.numel() // hidden.shape[-1]) or head(hidden)
    with torch.inference_mode():  # as the engine's propose runs it
        chain = drafter.shadow_tokens(context, 6)
        assert isinstance(chain, ShadowChain) and len(chain) == 6 and chain.known == [] and rows == []
        assert chain.read_first() == chain.known == [chain[0]]  # what a shadow step's trace shows
        assert rows == [1]
        # the same block drafted eagerly (nothing new was observed); adaflash's chain before its cut
        eager = (DFlashEngineDrafter.draft_block(drafter, context, 6) if method == "adaflash"
                 else drafter.draft_block(context, 6)).tree.tokens
        assert chain[2] == eager[2] and chain.known == list(eager[:3])  # up to the position read, no further
        assert list(chain) == list(eager)
    with pytest.raises(IndexError):
        chain[6]
