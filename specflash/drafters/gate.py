"""The draft gate: how much to draft this step, from recent acceptance against what drafting costs
on this device, so a drafter that is wrong here costs (almost) nothing.

Why: a speculative step pays for the drafter's forward plus a target forward over the root and
m drafted tokens, c(m + 1) in units of one plain decoding step (the device's measured verify-cost
curve, verify_cost.py), and commits 1 + E(m) tokens, E(m) = sum_{j<=m} prod_{i<=j} a_i with a_i
the running (EMA) rate at which drafted position i is accepted when position i - 1 was. The gate
picks the width m that maximises (1 + E(m)) / (c(m + 1) + d), d the drafter's own cost in the
same units (timed on every drafting step); m = 0, plain decoding, is worth exactly 1. When that
is 0, drafting is off: the step feeds only the root, and the drafter runs again only on a probe
after `probe_every` steps, an interval that doubles after each probe that did not
pay (up to 8x) and resets when drafting pays again. While on at a width below the full depth, a
full-depth probe every `probe_every` steps keeps the deeper positions' estimates fresh. The first
step's probe and the probes while off draft only `probe_width` tokens: on a CPU verifying 8 tokens
costs about two plain steps, and the first positions already tell whether drafting pays (deeper
positions take the estimate of the last one observed until a full-depth probe measures them).

The gate only changes how many tokens are drafted, never what is verified or how, so every
method that uses it stays lossless. Each decision goes into the trace (`GateDecision`).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

_MAX_BACKOFF = 8


@dataclass(frozen=True)
class GateDecision:
    """One step's decision, as the trace records it: `state` is "on", "off" or "probe"; `width`
    the drafted depth allowed; `value` the expected tokens per unit cost of that width (1.0 is
    plain decoding); `reason` in words."""

    state: str
    width: int
    value: float
    reason: str

    def to_dict(self) -> dict:
        return asdict(self)


class DraftGate:
    def __init__(self, cost: list[float], depth: int, probe_every: int = 8, smoothing: float = 0.3,
                 draft_cost: float | None = None, probe_width: int = 3) -> None:
        """`cost` [c(1)=1, c(2), ...] at least depth + 1 long; `draft_cost` fixes d (in units
        of one target step) instead of timing it, for reproducible decisions."""
        if len(cost) < depth + 1:
            raise ValueError(f"the verify-cost curve has {len(cost)} points, the gate needs {depth + 1}")
        self.cost, self.depth, self.probe_every, self.smoothing = list(cost), depth, probe_every, smoothing
        self.probe_width = probe_width
        self.fixed_draft_cost = draft_cost
        self.accept: list[float | None] = [None] * depth  # EMA of P(position i accepted | i-1 accepted)
        self.draft_cost = draft_cost  # d, EMA; None until timed
        self.step_time: float | None = None  # EMA of one plain target step, seconds
        self.since_probe = 0
        self.backoff = 1
        self._last: tuple[float, float, int] | None = None  # (step start, draft seconds, verified count)
        self._pending = GateDecision("off", 0, 1.0, "")

    # ---- decisions -------------------------------------------------------------------------

    def rates(self) -> list[float]:
        """Per-position acceptance estimates; an unobserved position takes the one before it (0.5 first)."""
        out, last = [], 0.5
        for a in self.accept:
            last = a if a is not None else last
            out.append(last)
        return out

    def value(self, m: int) -> float:
        """Expected committed tokens per unit cost when drafting m tokens."""
        if m == 0:
            return 1.0 / self.cost[0]
        expected, survive = 1.0, 1.0
        for a in self.rates()[:m]:
            survive *= a
            expected += survive
        return expected / (self.cost[m] + (self.draft_cost or 0.0))

    def decide(self, room: int) -> GateDecision:
        """The width for the next step, at most `room`."""
        depth = min(self.depth, room)
        if depth <= 0:
            return GateDecision("off", 0, 1.0, "no room left to draft")
        best = max(range(depth + 1), key=lambda m: (self.value(m), -m))
        if self.accept[0] is None:
            short = min(depth, self.probe_width)
            return GateDecision("probe", short, self.value(short), "first step: measuring acceptance")
        self.since_probe += 1
        if best == 0:
            if self.since_probe >= self.probe_every * self.backoff:
                short = min(depth, self.probe_width)
                return GateDecision("probe", short, self.value(short), f"drafting off for {self.since_probe} steps: probing")
            return GateDecision("off", 0, 1.0, f"drafting does not pay: best drafted width is worth "
                                               f"{max(self.value(m) for m in range(1, depth + 1)):.2f} of plain decoding")
        if best < depth and self.since_probe >= self.probe_every:
            return GateDecision("probe", depth, self.value(depth), f"refreshing positions past width {best}")
        return GateDecision("on", best, self.value(best), f"width {best} is worth {self.value(best):.2f}x plain decoding")

    # ---- observations ----------------------------------------------------------------------

    def step_started(self) -> None:
        """Call first thing in each step: the time since the previous step started, less its
        drafting, was one target forward of its verified width (plus the loop around it)."""
        now = time.perf_counter()
        if self._last is not None:
            start, drafted_for, verified = self._last
            one_step = max(now - start - drafted_for, 1e-9) / self.cost[min(verified, len(self.cost)) - 1]
            self.step_time = one_step if self.step_time is None else self._ema(self.step_time, one_step)
        self._last = (now, 0.0, 1)

    def drafted(self, decision: GateDecision, seconds: float) -> None:
        """After drafting under `decision` (seconds: the drafter's time, 0 when off)."""
        if self._last is not None:
            self._last = (self._last[0], seconds, 1)
        if decision.width and self.fixed_draft_cost is None and self.step_time is not None:
            d = seconds / self.step_time
            self.draft_cost = d if self.draft_cost is None else self._ema(self.draft_cost, d)
        if decision.state == "probe":
            self.since_probe = 0
        self._pending = decision

    def verified(self, drafted: int, accepted: int) -> None:
        """After verification: `drafted` tokens were verified, the first `accepted` of them kept."""
        if self._last is not None:
            self._last = (self._last[0], self._last[1], drafted + 1)
        for i in range(min(drafted, accepted + 1)):
            hit = 1.0 if i < accepted else 0.0
            self.accept[i] = hit if self.accept[i] is None else self._ema(self.accept[i], hit)
        if drafted and self._pending.state == "probe":
            paid = max(range(self.depth + 1), key=lambda m: (self.value(m), -m)) > 0
            self.backoff = 1 if paid else min(self.backoff * 2, _MAX_BACKOFF)

    def _ema(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new
