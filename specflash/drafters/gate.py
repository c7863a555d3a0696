"""The draft gate: how much to draft this step, from recent acceptance against what drafting costs
on this device, so a drafter that is wrong here costs (almost) nothing.

Why: a speculative step pays for the drafter's forward plus a target forward over the root and
m drafted tokens, c(m + 1) in units of one plain decoding step, and commits 1 + E(m) tokens,
E(m) = sum_{j<=m} prod_{i<=j} a_i with a_i the running (EMA, from a prior of 0.5) rate at which
drafted position i is accepted when position i - 1 was. The gate picks the width m that
maximises (1 + E(m)) / (c(m + 1) + d), d the drafter's own cost in the same units (timed on
every drafting step); m = 0, plain decoding, is worth exactly 1. When that is 0, drafting is off
and the step feeds only the root.

Looking while off. Every `probe_every` steps while off (an interval that doubles after each look
that did not pay, up to 4x, and resets when drafting pays again) the gate looks, and so it does
on the first step, before it has any estimate (from the prior of 0.5). Where verifying is dear,
every look is a shadow draft: a full block, not verified, scored token by token against what the target
commits over the next steps. It costs the drafter's block forward, with the head run only for the
positions scored (their tokens are computed on demand, and scoring stops at the first miss). On
the 2-core AVX2 CPU, one thread, a shadow cost 0.16 of a step where verifying one more token cost
0.36 to 0.6. Where verifying is cheap (the same CPU
after the seventeenth session's kernel fix: 0.04 to 0.2 for up to 3 more tokens), a look drafts
and verifies for real at the best width: it tells the gate as much, and commits what is accepted.
Each look takes whichever its own estimates value more per unit cost, the real draft or the
shadow's one token for 1 + d. Scoring by exact match is exact at T = 0 and
unbiased above it for argmax drafts (a point mass x is accepted with probability p(x), the chance
that the target samples x). While on at a width below the full depth, a full-depth probe every
`2 * probe_every` steps keeps the deeper positions' estimates fresh.

Switching on. While off, drafting starts again only when the best width is worth at least
`switch_on`; once on, it stays on while drafting is worth more than plain decoding. The margin is
for a shadow that matches a few tokens by chance and lifts the estimates for one step, after
which the gate pays to verify drafts that fail. The default, 1.0, is no margin: on the tuning
requests 1.1 and 1.25 measured no gain beyond run-to-run noise (docs/dflash.md, the draft gate).

Memory. The acceptance estimates are EMAs with weight `smoothing` 0.1 on each observation, and the
gate looks every `probe_every` = 8 steps while off (DFlashConfig). With 0.3 an estimate near the
break-even point dipped below it after two or three misses, switching drafting off where it paid
on average; replayed on recorded acceptance (docs/dflash.md, replaying the gate), 0.1 with looks
every 8 steps was at or near the best of the settings tried at both the old and the new costs.

Calibration. The cost curve it starts from is measured once per model and device on a short
prefix and cached; the run itself can pay more per verified token (more threads or fewer, other
processes, the engine's own work around each forward): on this 2-core CPU the cached curve said
1.2x for verifying 2 tokens where the run paid 1.7x, so the gate kept drafting at an acceptance
that lost. So unless `draft_cost` is fixed (the reproducible mode the tests use), the gate times
every step by the number of tokens it verified, and once it has timed a plain one-token step and
a wider one it reads c(n) from its own timings (unseen widths: the cached curve scaled by the
ratio measured at the seen ones). When it has drafted from the start it takes one plain step to
time it, and again every `4 * probe_every` steps, so the estimate follows the machine's load.
What it measured carries over to the same drafter's next run (`DeviceTimings`; a server builds
its drafter once and starts every request afresh): the device does not change between requests,
where every request paying a plain timing step again cost one decode step in every 12 to 20 on
the benchmark's requests (48-64 tokens). The acceptance estimates start from the prior each run:
they are the request's own. A width's timing counts for `8 * probe_every` steps after it was last
timed, then the curve reads that width from the others again. Why: one step slowed by a stall of
the machine (0.5 s injected into a 20 ms step) priced 8-row verification at 3.7 plain steps, the
gate never verified 8 rows again to correct it, and, carried over, that held every later request
of the run to narrower drafts (a dev benchmark run had `dflash` at tau 1.5-1.6 from its fifth
request on, where its other runs measure 2.3-2.4). And a step counts at most twice what was
expected of it (its width's running price, or for a first timing what the curve says of it), so
one stall moves a price by a tenth at most, where a lasting change of the machine still comes
through, at up to 10% a step.

What drafting costs by width. The drafter's own time d grows with the drafted width where
each position costs work of its own: DeLS fuses the positions one at a time (about 7.7 ms for the
block plus 1.2 ms per position on this CPU, one thread, when this was written; in the
twenty-eighth session's runs, two threads, ~2.2 ms for the block and its logits plus ~0.2 ms per
fused node), where DFlash's head reads them all in one product (6.2 ms plus 0.2; in those runs
~2.3 ms in all). So the gate times d by the number of positions drafting computed (a lazy shadow
computes its first only) and reads d(m) off a line d0 + m * d1 fitted to those
timings (slope at least 0; one width timed: flat). With one cost for every width, a drafter
whose full block costs twice its first position priced its narrow drafts at the full block's
cost, and switched drafting off where a short draft paid.

A second source. Beside a learned drafter the gate can also hand a step to prompt lookup
(lookup_source.py, the `lookup` option): its continuation, valued the same way from its own
estimates, is drafted when it is worth more than the gate's best choice for the drafter, except
on the plain steps the gate keeps to time itself.

The gate only changes how many tokens are drafted and from which source, never how they are
verified, so every method that uses it stays lossless. Each decision goes into the trace
(`GateDecision`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

_MAX_BACKOFF = 4
_JUMP = 2.0  # a step's timing counts at most this many times what was expected of it (`_record`)


@dataclass(frozen=True)
class GateDecision:
    """One step's decision, as the trace records it: `state` is "on", "off", "probe",
    "shadow" (drafted, not verified) or "lookup" (prompt lookup's draft verified instead of the
    drafter's, lookup_source.py); `width` the drafted depth allowed; `value` the expected tokens
    per unit cost of that width (1.0 is plain decoding); `reason` in words."""

    state: str
    width: int
    value: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class DeviceTimings:
    """What a calibrating gate measured of the device by the end of a run, for the same drafter's
    next run to start from: the EMAs of a step's time by tokens verified and of the drafter's cost
    by positions, each with its age (steps since it was last timed; only those still current), and
    of one plain step."""

    seconds: dict[int, float]
    step_time: float
    draft_costs: dict[int, float]
    ages: dict[int, int]
    draft_ages: dict[int, int]


class DraftGate:
    def __init__(self, cost: list[float], depth: int, probe_every: int = 8, smoothing: float = 0.1,
                 draft_cost: float | None = None, switch_on: float = 1.0,
                 timings: DeviceTimings | None = None) -> None:
        """`cost` [c(1)=1, c(2), ...] at least depth + 1 long; `draft_cost` fixes d (in units
        of one target step) instead of timing it, for reproducible decisions; `switch_on` is the
        value a width must reach to start drafting while off; `timings` what an earlier run of
        the same drafter measured (a calibrating gate starts from them)."""
        if len(cost) < depth + 1:
            raise ValueError(f"the verify-cost curve has {len(cost)} points, the gate needs {depth + 1}")
        self.prior, self.depth, self.probe_every, self.smoothing = list(cost), depth, probe_every, smoothing
        self.switch_on = switch_on
        self.drafting = False  # on (or probing while on) since the last switch
        self.calibrate = draft_cost is None  # a fixed drafter cost: reproducible decisions, no timing
        self.accept: list[float | None] = [None] * depth  # EMA of P(position i accepted | i-1 accepted)
        self.draft_cost = draft_cost  # d when fixed, for every width
        self.draft_costs: dict[int, float] = {}  # EMA of d (units of one target step) by positions computed
        self.step_time: float | None = None  # EMA of one plain target step, seconds
        self.seconds: dict[int, float] = {}  # EMA of a step's time (less drafting) by tokens verified
        self.step = 0  # steps timed; `timed_at` and `drafted_at`: the step each width was last timed
        self.timed_at: dict[int, int] = {}  # (timings set without one count as current)
        self.drafted_at: dict[int, int] = {}
        self.since_probe = 0
        self.backoff = 1
        self.shadow: tuple[int, Sequence[int], int] | None = None  # (context length, tokens, positions scored)
        self._last: tuple[float, float, int] | None = None  # (step start, draft seconds, verified count)
        self._pending = GateDecision("off", 0, 1.0, "")
        self._cost: tuple[tuple, list[float]] | None = None  # (the timings it came from, the curve)
        if timings is not None and self.calibrate:
            self.seconds, self.draft_costs = dict(timings.seconds), dict(timings.draft_costs)
            self.timed_at = {n: -age for n, age in timings.ages.items()}
            self.drafted_at = {n: -age for n, age in timings.draft_ages.items()}
            self.step_time = timings.step_time

    def device_timings(self) -> DeviceTimings | None:
        """What this run measured of the device and is still current, for the drafter's next run;
        None where the gate does not time itself or has no current plain step."""
        seconds = self.current(self.seconds, self.timed_at)
        if not self.calibrate or self.step_time is None or 1 not in seconds:
            return None
        costs = self.current(self.draft_costs, self.drafted_at)
        return DeviceTimings(seconds, self.step_time, costs, {n: self.age(self.timed_at, n) for n in seconds},
                             {n: self.age(self.drafted_at, n) for n in costs})

    @property
    def stale_after(self) -> int:
        """Steps after which a width's timing no longer counts (`8 * probe_every`): the gate stops
        drafting a width its timing makes look dear, so one slow step (a stall of the machine, not
        the width's cost) would otherwise price it for good, and with timings carried from run to
        run, for every later request. The plain step is timed every `4 * probe_every` steps."""
        return 8 * self.probe_every

    def age(self, timed_at: dict[int, int], n: int) -> int:
        """Steps since width n was timed (0 for a timing set without a step)."""
        return self.step - timed_at.get(n, self.step)

    def current(self, values: dict[int, float], timed_at: dict[int, int]) -> dict[int, float]:
        """The timings by width (`seconds` or `draft_costs`) not older than `stale_after` steps."""
        return {n: v for n, v in values.items() if self.age(timed_at, n) <= self.stale_after}

    # ---- decisions -------------------------------------------------------------------------

    def rates(self) -> list[float]:
        """Per-position acceptance estimates; an unobserved position takes the one before it (0.5 first)."""
        return chain_rates(self.accept)

    @property
    def cost(self) -> list[float]:
        """c(1) = 1, c(2), ...: from this run's timings once a plain step and a wider one are timed,
        else the cached curve; never decreasing, since timing noise can say otherwise. Read several
        times a step (the gate, prompt lookup, each graft), so kept until the timings change."""
        seconds = self.current(self.seconds, self.timed_at)
        timings = tuple(seconds.items())
        if self._cost is None or self._cost[0] != timings:
            self._cost = (timings, self._curve(seconds))
        return self._cost[1]

    def _curve(self, seconds: dict[int, float]) -> list[float]:
        base = seconds.get(1)
        wider = {n: t / base for n, t in seconds.items() if n > 1} if self.calibrate and base else {}
        if not wider:
            return self.prior
        scale = statistics.median(ratio / self.prior[n - 1] for n, ratio in wider.items())
        out, best = [1.0], 1.0
        for n, prior in enumerate(self.prior[1:], 2):
            best = max(best, wider.get(n, prior * scale))
            out.append(best)
        return out

    def value(self, m: int, cost: list[float] | None = None) -> float:
        """Expected committed tokens per unit cost when drafting m tokens."""
        return chain_value(self.rates(), m, cost or self.cost, self.drafting_cost(m))

    def drafting_cost(self, m: int) -> float:
        """d(m), the drafter's time for m positions in units of one target step: the fixed
        `draft_cost`, else the line fitted to this run's timings by width (0 until one is timed)."""
        if not self.calibrate:
            return self.draft_cost or 0.0
        return cost_line(self.current(self.draft_costs, self.drafted_at), m)

    @property
    def wants_plain_step(self) -> bool:
        """Whether the next step should verify the root alone, to time the plain step every cost is
        measured against: none timed yet, or none for `4 * probe_every` steps. A second source of
        drafts (lookup_source.py) yields to it, else a run it drafts throughout never refreshes it."""
        return self.calibrate and (1 not in self.current(self.seconds, self.timed_at)
                                   or self.age(self.timed_at, 1) >= 4 * self.probe_every)

    def best_value(self, room: int) -> float:
        """What the best width up to `room` is worth (plain decoding, 1.0, included), for a second
        source of drafts to beat (lookup_source.py)."""
        cost = self.cost
        return max(self.value(m, cost) for m in range(min(self.depth, room) + 1))

    def decide(self, room: int) -> GateDecision:
        """The width for the next step, at most `room`."""
        depth = min(self.depth, room)
        if depth <= 0:
            return GateDecision("off", 0, 1.0, "no room left to draft")
        cost = self.cost
        values = [self.value(m, cost) for m in range(depth + 1)]
        best = _best_width(values)
        if self.accept[0] is None and self.shadow is None:
            return self._look(values, "first step")
        self.since_probe += 1
        waiting = not self.drafting and best > 0 and values[best] < self.switch_on
        self.drafting = best > 0 and not waiting
        if not self.drafting:
            if self.shadow is None and self.since_probe >= self.probe_every * self.backoff:
                return self._look(values)
            if waiting:
                return GateDecision("off", 0, 1.0, f"drafting off: width {best} is worth {values[best]:.2f}x plain "
                                                   f"decoding, switching on needs {self.switch_on:.2f}x")
            return GateDecision("off", 0, 1.0, f"drafting does not pay: best drafted width is worth "
                                               f"{max(values[1:]):.2f} of plain decoding")
        if self.wants_plain_step:
            return GateDecision("off", 0, 1.0, "timing one plain step: what verifying more tokens costs in this run "
                                               "is measured against it")
        if best < depth and self.since_probe >= 2 * self.probe_every:
            return GateDecision("probe", depth, values[depth], f"refreshing positions past width {best}")
        return GateDecision("on", best, values[best], f"width {best} is worth {values[best]:.2f}x plain decoding "
                                                      f"(verifying {best + 1} tokens costs {cost[best]:.2f}x one)")

    def _look(self, values: list[float], why: str | None = None) -> GateDecision:
        """A look, while off or on the first step (`why` says which): a shadow draft, or a real one
        where verifying it is worth more than a shadow, which commits one token for the block's
        cost (values[m] per unit cost vs 1 / (1 + d))."""
        depth = len(values) - 1
        width = _best_width([0.0, *values[1:]])
        shadow = 1.0 / (1.0 + self.drafting_cost(1))  # a lazy shadow computes the block and its first position
        why = why or f"drafting off for {self.since_probe} steps"
        if values[width] > shadow:
            return GateDecision("probe", width, values[width], f"{why}: a look by drafting {width} for real, worth "
                                f"{values[width]:.2f}x plain decoding against a shadow's {shadow:.2f}x")
        return GateDecision("shadow", depth, values[depth], f"{why}: a shadow draft, scored against the tokens the "
                            "target commits next")

    # ---- observations ----------------------------------------------------------------------

    def step_started(self) -> None:
        """Call first thing in each step: the time since the previous step started, less its
        drafting, was one target forward of its verified width (plus the loop around it)."""
        now = time.perf_counter()
        if self._last is not None:
            start, drafted_for, verified = self._last
            verified = min(verified, len(self.prior))
            seconds = max(now - start - drafted_for, 1e-9)
            self.step += 1
            expected = None if self.step_time is None else self.step_time * self.cost[verified - 1]
            self._record(self.seconds, self.timed_at, verified, seconds, expected)
            one_step = seconds / self.cost[verified - 1]
            self.step_time = (one_step if self.step_time is None
                              else self._ema(self.step_time, min(one_step, _JUMP * self.step_time)))
        self._last = (now, 0.0, 1)

    def drafted(self, decision: GateDecision, seconds: float, positions: int | None = None) -> None:
        """After drafting under `decision` (seconds: the drafter's time, 0 when off; `positions`:
        how many drafted positions that time computed, the decision's width unless said)."""
        if self._last is not None:
            self._last = (self._last[0], seconds, 1)
        width = decision.width if positions is None else positions
        if width and decision.state != "lookup" and self.calibrate and self.step_time is not None:
            self._record(self.draft_costs, self.drafted_at, width, seconds / self.step_time)
        if decision.state in ("probe", "shadow"):
            self.since_probe = 0
        self._pending = decision

    def verified(self, drafted: int, accepted: int, rows: int | None = None) -> None:
        """After verification: a chain `drafted` deep was verified (a tree's depth), the first
        `accepted` of its positions kept; `rows` the forward fed (a tree: its nodes and the root;
        by default drafted + 1), by which the step is timed."""
        if self._last is not None:
            self._last = (self._last[0], self._last[1], drafted + 1 if rows is None else rows)
        if self._pending.state != "lookup":
            observe_chain(self.accept, drafted, accepted, self.smoothing)
        if drafted and self._pending.state == "probe":
            self._looked()

    def shadowed(self, context_len: int, tokens: Sequence[int]) -> None:
        """A shadow draft of `tokens` after the first `context_len` tokens, to score later. The
        sequence is read one position at a time as the target commits, never past the first miss,
        so it may compute its tokens on demand (drafters/dflash.py ShadowChain)."""
        self.shadow = (context_len, tokens, 0) if len(tokens) else None

    def committed(self, context: list[int]) -> None:
        """Score the pending shadow draft against the tokens the target has committed since, one
        position at a time as they arrive: its run ends at the first token the target did not
        commit, or when it matched all of them."""
        if self.shadow is None:
            return
        start, tokens, scored = self.shadow
        got = context[start : start + len(tokens)]
        if score_arrivals(self.accept, tokens, got, scored, self.smoothing):
            self.shadow = None
            self._looked()
        else:
            self.shadow = (start, tokens, len(got))

    def _looked(self) -> None:
        """After a probe or a shadow: look again sooner if drafting now pays, later if not."""
        cost = self.cost
        values = [self.value(m, cost) for m in range(self.depth + 1)]
        best = _best_width(values)
        paid = best > 0 and values[best] >= (1.0 if self.drafting else self.switch_on)
        self.backoff = 1 if paid else min(self.backoff * 2, _MAX_BACKOFF)

    def _record(self, values: dict[int, float], timed_at: dict[int, int], n: int, value: float,
                expected: float | None = None) -> None:
        """Width n timed at `value` this step: into its EMA, or its first value again where its
        last timing went stale; counted at most `_JUMP` times the EMA, or, for a first value, times
        `expected` (what the curve says of the width; None: not capped). Why: one step slowed by
        a stall of the machine (a 25x one, injected, in the tests) otherwise set a width's first
        price at 25 of its cost, or moved its EMA by 2.4 of it, and the gate, drafting narrower
        since, did not time it again until that timing went stale; capped, one stall moves a price
        by at most smoothing x (_JUMP - 1) of it, while a lasting change of the machine still comes
        through, its EMA following at up to 10% a step."""
        current = n in values and self.age(timed_at, n) <= self.stale_after
        if current:
            values[n] = self._ema(values[n], min(value, _JUMP * values[n]))
        else:
            values[n] = value if expected is None else min(value, _JUMP * expected)
        timed_at[n] = self.step

    def _ema(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new


def _best_width(values: list[float]) -> int:
    """The width worth most (values[m]: expected tokens per unit cost of drafting m); the narrower on a tie."""
    return max(range(len(values)), key=lambda m: (values[m], -m))


def cost_line(timed: dict[int, float], m: int) -> float:
    """The drafter's cost at width m from its costs timed by width: a least-squares line
    d0 + m * d1 with d1 >= 0 (so noise never makes a wider draft cheaper), never below 0; flat at
    their mean when fewer than two widths were timed, 0 when none."""
    if not timed:
        return 0.0
    widths, costs = list(timed), list(timed.values())
    mean_w, mean_d = statistics.fmean(widths), statistics.fmean(costs)
    spread = sum((w - mean_w) ** 2 for w in widths)
    slope = max(0.0, sum((w - mean_w) * (d - mean_d) for w, d in zip(widths, costs)) / spread) if spread else 0.0
    return max(0.0, mean_d + slope * (m - mean_w))


def chain_rates(accept: Sequence[float | None]) -> list[float]:
    """Per-position acceptance estimates of a chain; an unobserved position takes the one before
    it (0.5 first)."""
    out, last = [], 0.5
    for a in accept:
        last = a if a is not None else last
        out.append(last)
    return out


def chain_value(rates: Sequence[float], m: int, cost: Sequence[float], draft_cost: float = 0.0) -> float:
    """Expected committed tokens per unit cost of verifying a chain of m drafted tokens whose
    positions are accepted at `rates` (each given the one before), drafted for `draft_cost`."""
    if m == 0:
        return 1.0 / cost[0]
    expected, survive = 1.0, 1.0
    for a in rates[:m]:
        survive *= a
        expected += survive
    return expected / (cost[m] + draft_cost)


def update_rate(accept: list[float | None], position: int, hit: bool, smoothing: float) -> None:
    """EMA of the position's conditional acceptance, from its current estimate (0.5 at first)."""
    old = chain_rates(accept)[position]
    accept[position] = (1 - smoothing) * old + smoothing * (1.0 if hit else 0.0)


def score_arrivals(accept: list[float | None], tokens: Sequence[int], got: Sequence[int], scored: int,
                   smoothing: float) -> bool:
    """Score a chain drafted but not verified against the tokens the target committed after it
    (`got`), from position `scored` on, one position at a time as they arrive. True when its run
    has ended: at its first miss, or once it matched all of its tokens."""
    for i in range(scored, len(got)):
        hit = got[i] == tokens[i]
        update_rate(accept, i, hit, smoothing)
        if not hit or i + 1 == len(tokens):
            return True
    return False


def observe_chain(accept: list[float | None], drafted: int, accepted: int, smoothing: float) -> None:
    """A verified chain of `drafted` tokens kept its first `accepted`: each position up to the
    first miss is scored (the ones after it say nothing, having lost their prefix)."""
    for i in range(min(drafted, accepted + 1)):
        update_rate(accept, i, i < accepted, smoothing)
