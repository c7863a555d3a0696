"""The trace contract: plain records of every verification step and of a whole run.

The engine writes these and knows nothing else about who reads them; the app, the notebooks and
the benchmarks all read the same records, live or from JSON. Records hold token ids only, never
text, so a run recorded on one machine can be replayed with any copy of the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any

ROOT = -1  # parent index of a draft node hanging from the last committed token


@dataclass
class StepRecord:
    """One target verification step.

    The draft is a tree: node i holds `tokens[i]` and hangs from `parents[i]` (ROOT = the last
    committed token); a chain has parents [-1, 0, 1, ...]. `q[i]` is the drafter's probability of
    node i's token (None for point-mass proposals), `p[i]` the target's probability of it given
    its ancestors, under the sampling config. `accepted` is the path of accepted node indices;
    `correction` is the token the target adds after it: a "bonus" when the whole path was
    accepted and nothing was left to verify below it, a "resample" when a draft token was
    rejected, "target" when there was no draft at all. `phase` is "prefill" for the first record
    (the prompt forward, which yields the first new token) and "decode" for every later one.
    """

    step: int
    phase: str
    context_len: int
    tokens: list[int]
    parents: list[int]
    q: list[float] | None
    p: list[float]
    accepted: list[int]
    correction: int
    correction_kind: str
    correction_p: float
    committed: list[int]
    verified: int
    draft_time: float
    verify_time: float
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def accepted_len(self) -> int:
        return len(self.accepted)


@dataclass
class RunRecord:
    """A whole generation: what was asked, every step, what came out and how fast.

    `output_ids` are the new tokens only (the concatenation of every step's `committed`), cut at
    EOS and at the token limit. `metrics` is filled by metrics.summarize.
    """

    method: str
    config: dict[str, Any]
    sampling: dict[str, Any]
    model: str
    device: str
    prompt_ids: list[int]
    steps: list[StepRecord]
    output_ids: list[int]
    finish_reason: str
    prefill_time: float
    metrics: dict[str, Any] = field(default_factory=dict)
    prompt: str | None = None  # the text as given, before any chat template (None when ids were given)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunRecord":
        known = {f.name for f in dataclasses.fields(cls)}
        fields = {k: v for k, v in data.items() if k in known}
        fields["steps"] = [StepRecord(**s) for s in data["steps"]]
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str) -> "RunRecord":
        return cls.from_dict(json.loads(text))
