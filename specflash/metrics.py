"""Speed and acceptance figures, as pure functions over RunRecords.

Names follow vLLM's spec-decode metrics so numbers can be compared with server logs:
mean_acceptance_length counts tokens committed per target forward, the target's own token
included (so plain decoding scores 1.0); draft_acceptance_rate is accepted / drafted tokens.
Only decode steps count; the prefill forward is timed on its own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Mapping

from .trace import RunRecord, StepRecord


def decode_steps(run: RunRecord) -> list[StepRecord]:
    return [s for s in run.steps if s.phase == "decode"]


def _depth(step: StepRecord) -> int:
    """Deepest node of the draft (a chain's length)."""
    depth: list[int] = []
    for parent in step.parents:
        depth.append(1 if parent < 0 else depth[parent] + 1)
    return max(depth, default=0)


def pooled_acceptance(metrics: Iterable[Mapping[str, Any] | None]) -> float | None:
    """Mean acceptance length over several runs, pooled by their decode steps (a run of many short
    steps weighs what its steps weigh, not one vote), from each run's `summarize` figures; runs
    without decode steps count nothing. None when none has any."""
    steps = committed = 0.0
    for m in metrics:
        if m and m.get("decode_steps"):
            steps += m["decode_steps"]
            committed += m["mean_acceptance_length"] * m["decode_steps"]
    return committed / steps if steps else None


def per_position_acceptance(steps: Iterable[StepRecord]) -> list[float]:
    """Rate at which draft position i (1-based) was accepted, over steps whose draft reached it."""
    offered: Counter[int] = Counter()
    kept: Counter[int] = Counter()
    for step in steps:
        for i in range(1, _depth(step) + 1):
            offered[i] += 1
            kept[i] += step.accepted_len >= i
    return [kept[i] / offered[i] for i in sorted(offered)]


def acceptance_histogram(steps: Iterable[StepRecord]) -> dict[int, int]:
    """How many steps committed 1, 2, 3... tokens."""
    return dict(sorted(Counter(len(s.committed) for s in steps).items()))


def summarize(run: RunRecord) -> dict[str, Any]:
    steps = decode_steps(run)
    committed = sum(len(s.committed) for s in steps)
    drafted = sum(len(s.tokens) for s in steps)
    accepted = sum(s.accepted_len for s in steps)
    verified = sum(s.verified for s in steps)
    draft_time = sum(s.draft_time for s in steps)
    verify_time = sum(s.verify_time for s in steps)
    decode_time = draft_time + verify_time
    return {
        "new_tokens": len(run.output_ids),
        "decode_steps": len(steps),
        "lookup_steps": sum("lookup" in s.extras for s in steps),  # drafted by prompt lookup beside the drafter
        "mean_acceptance_length": committed / len(steps) if steps else 0.0,
        "draft_acceptance_rate": accepted / drafted if drafted else 0.0,
        "per_position_acceptance": per_position_acceptance(steps),
        "acceptance_histogram": {str(k): v for k, v in acceptance_histogram(steps).items()},
        "tokens_per_s": committed / decode_time if decode_time > 0 else 0.0,
        "verified_per_committed": verified / committed if committed else 0.0,
        "prefill_time": run.prefill_time,
        "decode_time": decode_time,
        "draft_time": draft_time,
        "verify_time": verify_time,
    }
