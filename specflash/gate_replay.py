"""Replaying drafting policies on recorded acceptance: what the draft gate would pick, and what
those steps would cost, without timing anything.

Why: at T = 0 the committed text does not depend on the method, and neither does what a DFlash
drafter drafts after any committed prefix. So for every position of a greedy answer one can record
once how many drafts of a full block greedy verification accepts there (`AcceptanceRun`), and
then replay any drafting policy over those records exactly: its steps, the tokens each commits,
and what they cost in units of one plain decoding step, from the device's verify-cost curve and
the drafter's measured cost per block (`ReplayCost`). Timed runs on the 2-core machine move by
about 5% from one run to the next, as much as the gate changes being compared; a replay has no
noise, so policies are compared side by side on the same records, then confirmed with `bench`.

What a replay leaves out: the loop's own overhead around each forward, and the gate's timing of
the run (it replays with the cost it is given, the reproducible mode of `DraftGate`). Two bounds
frame the gate: drafting a fixed width at every step, and the oracle, which drafts each step
exactly the tokens that will be accepted there when that beats plain decoding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from .drafters.gate import DraftGate

MISS = -1  # a shadow chain's token after its accepted run: never a committed id


@dataclass(frozen=True)
class AcceptanceRun:
    """One greedy answer: its tokens (the answer only) and, for each anchor i (the answer's i-th
    token as the last committed one), `accepted[i]`, how many drafts of a full block verification
    accepts there; `confidence[i]`, the drafter's probability of each token it drafts there;
    `target_p[i]`, the target's probability of token i, known before drafting from it."""

    domain: str
    tokens: list[int]
    accepted: list[int]
    confidence: list[list[float]] | None = None
    target_p: list[float] | None = None

    def __post_init__(self) -> None:
        if len(self.accepted) != len(self.tokens):
            raise ValueError(f"{len(self.accepted)} acceptance counts for {len(self.tokens)} tokens")


@dataclass(frozen=True)
class ReplayCost:
    """`curve[n - 1]` = c(n), verifying n tokens in units of one plain step (c(1) = 1);
    `draft` a drafted block and `shadow` a shadow draft, in the same units."""

    curve: list[float]
    draft: float
    shadow: float


@dataclass
class ReplayResult:
    tokens: int = 0  # committed by decode steps (the prefill's token is every method's alike)
    cost: float = 0.0  # in plain decoding steps
    steps: int = 0
    drafting_steps: int = 0  # steps that paid for a drafted block
    shadows: int = 0
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0

    @property
    def speedup(self) -> float:
        """Tokens per unit cost: plain decoding is 1."""
        return self.tokens / self.cost if self.cost else 1.0

    def add(self, other: "ReplayResult") -> "ReplayResult":
        return ReplayResult(**{k: v + getattr(other, k) for k, v in asdict(self).items()})

    def to_dict(self) -> dict:
        return {**asdict(self), "speedup": self.speedup}


def _step(result: ReplayResult, cost: ReplayCost, width: int, accepted: int, drafted: int | None = None) -> int:
    """Account one step verifying `width` drafts of the `drafted` (default `width`) the drafter
    made; returns the tokens it commits."""
    taken = min(width, accepted)
    drafted = width if drafted is None else drafted
    result.steps += 1
    result.cost += cost.curve[width] + (cost.draft if drafted else 0.0)
    result.drafting_steps += bool(drafted)
    result.drafted += width
    result.accepted += taken
    result.tokens += taken + 1
    return taken + 1


def replay_fixed(run: AcceptanceRun, cost: ReplayCost, width: int) -> ReplayResult:
    """Drafting `width` tokens at every step (the room permitting)."""
    result, done = ReplayResult(), 1
    while done < len(run.tokens):
        done += _step(result, cost, min(width, len(run.tokens) - done - 1), run.accepted[done - 1])
    return result


def replay_oracle(run: AcceptanceRun, cost: ReplayCost, depth: int) -> ReplayResult:
    """Each step drafts exactly the tokens it will have accepted when that pays more per unit
    cost than plain decoding, else nothing: no gate can do better step by step."""
    result, done = ReplayResult(), 1
    while done < len(run.tokens):
        width = min(run.accepted[done - 1], depth, len(run.tokens) - done - 1)
        pays = width and (width + 1) / (cost.curve[width] + cost.draft) > 1.0
        done += _step(result, cost, width if pays else 0, run.accepted[done - 1])
    return result


Cut = Callable[[list[float]], int]  # the drafted tokens' confidences -> how many of them to verify


def replay_gate(run: AcceptanceRun, cost: ReplayCost, depth: int, gate: DraftGate, cut: Cut | None = None,
                whole_block: bool = False) -> ReplayResult:
    """The gate's decisions in the order the engine asks for them (drafters/dflash.py): each
    step it is told what was committed, decides, is told what drafting cost, then what was
    verified and accepted. A shadow draft commits the target's one token, costs a plain step plus
    the shadow, and is scored by the gate against the tokens committed after it. With `cut`
    (AdaFlash), the drafted tokens are cut to what it keeps of them before verification; with
    `whole_block` too, a step the gate drafts ("on") drafts every slot that fits and the cut
    picks among all of them (AdaFlash's `whole_block`)."""
    result, done = ReplayResult(), 1
    while done < len(run.tokens):
        gate.committed(run.tokens[:done])
        room = len(run.tokens) - done - 1
        decision = gate.decide(room)
        anchor_accepts = run.accepted[done - 1]
        if decision.state == "shadow":
            gate.shadowed(done, _shadow_chain(run, done, decision.width))
            gate.drafted(decision, 0.0)
            result.shadows += 1
            result.cost += cost.shadow
            done += _step(result, cost, 0, 0)
            gate.verified(0, 0)
            continue
        gate.drafted(decision, 0.0)
        width = drafted = decision.width
        if whole_block and cut is not None and decision.state == "on":
            drafted = min(depth, room)
        if width and cut is not None:
            width = min(drafted, cut(run.confidence[done - 1][:drafted]))
        done += _step(result, cost, width, anchor_accepts, drafted=drafted)
        gate.verified(width, min(width, anchor_accepts))
    return result


def _shadow_chain(run: AcceptanceRun, done: int, width: int) -> list[int]:
    """What the gate would score of a shadow draft at this anchor: the accepted run of drafts
    (the committed tokens themselves), then a miss."""
    hits = min(run.accepted[done - 1], width)
    chain = run.tokens[done : done + hits]
    return (chain + [MISS] * (width - len(chain)))[:width]


def gate_policy(depth: int, cost: ReplayCost, **overrides) -> Callable[[], DraftGate]:
    """A fresh gate per answer, as the engine makes one per request, with the replay's fixed
    drafter cost (reproducible decisions) and any of DraftGate's knobs overridden."""
    return lambda: DraftGate(cost.curve, depth, draft_cost=cost.draft, **overrides)


def replay_all(runs: Sequence[AcceptanceRun], play: Callable[[AcceptanceRun], ReplayResult]) -> dict[str, ReplayResult]:
    """Results pooled per domain and over all runs ("all")."""
    pooled: dict[str, ReplayResult] = {"all": ReplayResult()}
    for run in runs:
        result = play(run)
        pooled[run.domain] = pooled.get(run.domain, ReplayResult()).add(result)
        pooled["all"] = pooled["all"].add(result)
    return pooled
