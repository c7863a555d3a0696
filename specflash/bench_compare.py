"""How sure a side-by-side benchmark is that one method beats another: paired ratios with
bootstrap intervals over prompts.

Why: on the shared 2-core CPU two held-out runs of the same command put `adaflash` at 1.34x and
1.53x plain decoding beside `dflash`'s 1.35x and 1.57x; whether a gap of that size is a
difference or noise, two medians cannot say. Every (prompt, repeat) round of `bench` runs every
method back to back, so a pair of samples shares the prompt and the machine's load at the time,
and the ratio of their wall times is what one method gains on the other there. The repeats of one
prompt are not independent draws (the same text, mostly the same drafts), so the intervals come
from a bootstrap that resamples prompts, each with all of its repeats (a cluster bootstrap), and
recomputes the statistic the benchmark reports: the median of the paired ratios for speed, the
pooled acceptance length (committed tokens over decode steps) for τ.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np

from .errors import SpecFlashError
from .metrics import pooled_acceptance

ALL = "all"  # the domain key of a comparison over every prompt


class CompareError(SpecFlashError):
    """A comparison the benchmark's samples cannot answer (unknown method, no shared prompts)."""


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


@dataclass(frozen=True)
class PairedComparison:
    """Method `a` against method `b` on one domain (or ALL): `speed` is the median over paired
    samples of b's wall time / a's (above 1: `a` is faster), `tau_difference` a's pooled
    acceptance length minus b's (None where the samples carry no engine metrics), each with its
    bootstrap interval; `prompts` and `pairs` are what it rests on."""

    a: str
    b: str
    domain: str
    prompts: int
    pairs: int
    speed: Interval
    tau_difference: Interval | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pairs_by_prompt(samples: Sequence[Mapping[str, Any]], a: str, b: str,
                     domain: str) -> dict[str, list[tuple[Mapping[str, Any], Mapping[str, Any]]]]:
    """The (a, b) sample pairs of each prompt: same prompt, same repeat."""
    keyed: dict[tuple[str, str, int], Mapping[str, Any]] = {}
    for s in samples:
        if s["method"] in (a, b) and domain in (ALL, s["domain"]):
            keyed[(s["method"], s["prompt_id"], s["repeat"])] = s
    pairs: dict[str, list] = {}
    for (method, prompt, repeat), mine in keyed.items():
        other = keyed.get((b, prompt, repeat))
        if method == a and other is not None:
            pairs.setdefault(prompt, []).append((mine, other))
    return pairs


def _statistics(groups: Sequence[list[tuple[Mapping[str, Any], Mapping[str, Any]]]]) -> tuple[float, float | None]:
    pairs = [pair for group in groups for pair in group]
    speed = median(other["wall"] / mine["wall"] for mine, other in pairs)
    tau_a = pooled_acceptance(mine.get("metrics") for mine, _ in pairs)
    tau_b = pooled_acceptance(other.get("metrics") for _, other in pairs)
    return speed, None if tau_a is None or tau_b is None else tau_a - tau_b


def compare(samples: Sequence[Mapping[str, Any]], a: str, b: str, domain: str = ALL, resamples: int = 2000,
            level: float = 0.95, seed: int = 0) -> PairedComparison:
    """`a` against `b` over the benchmark's `samples` (its JSON's "samples": method, domain,
    prompt_id, repeat, wall, metrics), on one domain or ALL, with percentile intervals at `level`
    from `resamples` cluster-bootstrap draws of the prompts (seeded: the same samples give the same
    intervals)."""
    methods = {s["method"] for s in samples}
    missing = [m for m in (a, b) if m not in methods]
    if missing:
        raise CompareError(f"no samples of {', '.join(missing)} in this benchmark; it ran {', '.join(sorted(methods))}")
    if a == b:
        raise CompareError(f"compare two different methods, not {a} with itself")
    by_prompt = _pairs_by_prompt(samples, a, b, domain)
    if not by_prompt:
        raise CompareError(f"{a} and {b} share no (prompt, repeat) round" + ("" if domain == ALL else f" on {domain}"))
    return _compare_groups(a, b, domain, list(by_prompt.values()), resamples, level, seed)


def _compare_groups(a: str, b: str, domain: str, groups: list[list[tuple[Mapping[str, Any], Mapping[str, Any]]]],
                    resamples: int, level: float, seed: int) -> PairedComparison:
    """compare() once the pairs are grouped by prompt (at least one group)."""
    speed, tau = _statistics(groups)
    rng = np.random.default_rng(seed)
    draws = [_statistics([groups[i] for i in rng.integers(0, len(groups), len(groups))]) for _ in range(resamples)]
    tail = (1 - level) / 2 * 100

    def interval(estimate: float, values: list[float]) -> Interval:
        low, high = np.percentile(values, [tail, 100 - tail])
        return Interval(estimate, float(low), float(high))

    return PairedComparison(a, b, domain, len(groups), sum(len(g) for g in groups),
                            interval(speed, [d[0] for d in draws]),
                            None if tau is None else interval(tau, [d[1] for d in draws]))


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """"adaflash:dflash,dels:dflash" -> [("adaflash", "dflash"), ("dels", "dflash")]; a method
    named with a label (dflash:m12) is written with "/" inside a pair ("dflash/m12:dflash")."""
    pairs = []
    for item in (part.strip() for part in text.split(",") if part.strip()):
        left, sep, right = item.partition(":")
        if not sep or not left or not right or ":" in right:
            raise CompareError(f"a pair is A:B (e.g. adaflash:dflash), got {item!r}")
        pairs.append((left.replace("/", ":"), right.replace("/", ":")))
    if not pairs:
        raise CompareError("name at least one pair A:B to compare")
    return pairs


def compare_all(samples: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]], resamples: int = 2000,
                level: float = 0.95, seed: int = 0) -> list[PairedComparison]:
    """Every pair, over all prompts and then each domain the pair shares, in the samples' order."""
    domains = list(dict.fromkeys(s["domain"] for s in samples))
    out = []
    for a, b in pairs:
        out.append(compare(samples, a, b, ALL, resamples, level, seed))
        for domain in domains:
            by_prompt = _pairs_by_prompt(samples, a, b, domain)
            if by_prompt:
                out.append(_compare_groups(a, b, domain, list(by_prompt.values()), resamples, level, seed))
    return out


def format_comparisons(results: Sequence[PairedComparison], level: float = 0.95) -> str:
    """A table: per pair and domain, the speed ratio and τ difference with their intervals."""
    pct = f"{level:.0%}"
    lines = [f"{'A vs B':<22}{'domain':<10}{'prompts':>8}{'speed A/B':>11}  {pct + ' interval':<16}"
             f"{'τ A-B':>8}  {pct + ' interval'}"]
    for r in results:
        tau = r.tau_difference
        tau_text = (f"{tau.estimate:>+8.2f}  [{tau.low:+.2f}, {tau.high:+.2f}]" if tau is not None else f"{'-':>8}")
        lines.append(f"{r.a + ' vs ' + r.b:<22}{r.domain:<10}{r.prompts:>8}{r.speed.estimate:>11.3f}  "
                     f"{f'[{r.speed.low:.3f}, {r.speed.high:.3f}]':<16}{tau_text}")
    return "\n".join(lines)


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("bench_json", type=Path, help="a benchmark's JSON (python -m specflash bench --out)")
    p.add_argument("--pairs", required=True, metavar="A:B,...",
                   help="methods to compare, A against B (e.g. adaflash:dflash,dels:dflash; a labelled variant "
                        "as dflash/m12)")
    p.add_argument("--resamples", type=int, default=2000)
    p.add_argument("--level", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="also write the comparisons here as JSON")


def run_compare(args: argparse.Namespace) -> int:
    if not 0 < args.level < 1:
        raise CompareError(f"--level must be between 0 and 1, got {args.level}")
    if args.resamples < 1:
        raise CompareError(f"--resamples must be at least 1, got {args.resamples}")
    try:
        bench = json.loads(args.bench_json.read_text())
    except (OSError, ValueError) as exc:
        raise CompareError(f"cannot read the benchmark {args.bench_json}: {exc}") from None
    if not isinstance(bench, dict) or not bench.get("samples"):
        raise CompareError(f"{args.bench_json} holds no benchmark samples (write one with python -m specflash bench)")
    results = compare_all(bench["samples"], parse_pairs(args.pairs), args.resamples, args.level, args.seed)
    print(f"{args.bench_json}: {bench.get('device', '?')}, {bench.get('prompt_set', '?')} prompts, "
          f"{bench.get('repeats', '?')} repeats; cluster bootstrap over prompts, {args.resamples} draws")
    print(format_comparisons(results, args.level))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"bench": str(args.bench_json), "level": args.level,
                                        "resamples": args.resamples, "seed": args.seed,
                                        "comparisons": [r.to_dict() for r in results]}, indent=1))
    return 0
