"""DFlash vs DFlash 2 on the held-out prompts: acceptance per domain (greedy and sampled), the
selector's headroom and the cost of a block, all from the engine's own traces.

Why a module beside evaluate.py: `dflash2` does not decode in batches and its figures need the
lattice each step records (`extras["dflash2"]`), so every prompt runs single-sequence here, with
the draft gate off (every step drafts the whole block, so each slot is offered on every step).
Per prompt and in turn (machine noise hits every row alike): plain `ar` decoding, then every
drafter at every temperature. Acceptance length = committed tokens per decode step, pooled over
a domain's prompts, the target's own token included (evaluate.py's figure).

Headroom, from the greedy DFlash 2 runs: at T = 0 the output is the target's greedy text, so the
target's token for every slot of every step is known, accepted or not. Per slot, how often it is
among the K candidates; the oracle's acceptance (the longest prefix of slots whose candidates hold
it: what a perfect selector would get from these candidates); and the acceptance of the unary
argmax path at the same steps (the selector switched off). All three are over the steps the walk
visited.

Cost: the median drafting time of a step (the block forward plus, for DFlash 2, the lattice and
the walk) over the median plain `ar` step on the same prompts; drafter_cost.py's figure, for
both methods.

    python -m specflash.training.evaluate_dflash2 --model smollm2-135m --dflash DFLASH_FOLDER \
        --dflash2 FOLDER[,FOLDER] [--labels start,trained] [--per-domain 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..metrics import decode_steps
from ..prompts import DOMAINS, heldout_prompts
from ..trace import RunRecord
from .entry import run_script


@dataclass
class Headroom:
    """Counts over the greedy steps of one drafter: per slot, steps that offered it with a known
    target token and those whose candidates held it; per step, accepted slots of the oracle, of
    the unary argmax path and of the walk (what verification accepted)."""

    offered: list[int] = field(default_factory=list)
    in_top_k: list[int] = field(default_factory=list)
    steps: int = 0
    oracle: int = 0
    unary: int = 0
    walk: int = 0

    def add(self, run: RunRecord) -> None:
        full = run.prompt_ids + run.output_ids
        for step in decode_steps(run):
            lattice = step.extras.get("dflash2")
            if not lattice:
                continue
            hits, argmax_hits = [], []
            for t, (candidates, argmax) in enumerate(zip(lattice["candidates"], lattice["argmax_tokens"])):
                position = step.context_len + t
                if position >= len(full):  # past the end of the output: the target's token is unknown
                    break
                hits.append(full[position] in candidates)
                argmax_hits.append(full[position] == argmax)
            for t, hit in enumerate(hits):
                if t == len(self.offered):
                    self.offered.append(0)
                    self.in_top_k.append(0)
                self.offered[t] += 1
                self.in_top_k[t] += hit
            self.steps += 1
            self.oracle += _leading(hits)
            self.unary += _leading(argmax_hits)
            self.walk += step.accepted_len

    def summary(self) -> dict[str, Any]:
        n = max(1, self.steps)
        return {"in_top_k_by_slot": [h / max(1, o) for h, o in zip(self.in_top_k, self.offered)],
                "oracle_acceptance": 1 + self.oracle / n, "unary_acceptance_same_steps": 1 + self.unary / n,
                "walk_acceptance": 1 + self.walk / n, "steps": self.steps}


def _leading(hits: list[bool]) -> int:
    n = 0
    while n < len(hits) and hits[n]:
        n += 1
    return n


def engines(target, dflash: str | None, dflash2: Seq[str], labels: Seq[str], seed: int = 0) -> dict[str, Any]:
    """Label -> engine drafter, gate off: `dflash` with the DFlash folder (its argmax chain, the
    baseline a DFlash 2 walk replaces), `dflash2` with each
    DFlash 2 folder (a DFlash folder there is converted: its identity start, which drafts exactly
    what DFlash drafts)."""
    from ..drafters.dflash import DFlashConfig, DFlashEngineDrafter, drafter_folder
    from ..drafters.dflash2 import DFlash2Config, DFlash2EngineDrafter
    from ..models.dflash2 import DFlash2Drafter, from_dflash
    from ..models.dflash_io import load_drafter

    out: dict[str, Any] = {}
    if dflash:
        out["dflash"] = DFlashEngineDrafter(load_drafter(drafter_folder(dflash), target), DFlashConfig(gate=False, tree=False))
    for label, folder in zip(labels, dflash2):
        model = load_drafter(drafter_folder(folder), target)
        if not isinstance(model, DFlash2Drafter):
            model = from_dflash(model, torch.Generator().manual_seed(seed)).eval()
        out[label] = DFlash2EngineDrafter(model, DFlash2Config(gate=False, tree=False))
    return out


def evaluate(target, drafters: dict[str, Any], domains: Seq[str] = DOMAINS, per_domain: int = 4,
             max_new_tokens: int = 64, temperatures: Seq[float] = (0.0, 0.8), seed: int = 0) -> dict[str, Any]:
    """Every figure of the module docstring, as plain JSON."""
    from ..api import encode_prompt, generate

    committed: dict[tuple[str, float, str], list[int]] = defaultdict(lambda: [0, 0])  # (label, T, domain) -> [tokens, steps]
    draft_times: dict[str, list[float]] = defaultdict(list)
    target_times: list[float] = []
    headroom = {label: Headroom() for label, d in drafters.items() if d.name == "dflash2"}
    lossless = True
    for domain in domains:
        for i, prompt in enumerate(heldout_prompts(domain)[:per_domain]):
            ids = encode_prompt(target, prompt.text)
            plain = generate(target, ids, "ar", max_new_tokens=max_new_tokens)
            target_times += [s.verify_time for s in decode_steps(plain)]
            for temperature in temperatures:
                for label, drafter in drafters.items():
                    run = generate(target, ids, drafter.name, drafter=drafter, max_new_tokens=max_new_tokens,
                                   temperature=temperature, seed=seed + i)
                    steps = decode_steps(run)
                    tally = committed[label, temperature, domain]
                    tally[0] += sum(len(s.committed) for s in steps)
                    tally[1] += len(steps)
                    if temperature == 0:
                        lossless &= run.output_ids == plain.output_ids
                        draft_times[label] += [s.draft_time for s in steps][1:]  # the first block warms up
                        if label in headroom:
                            headroom[label].add(run)
    target_ms = 1000 * statistics.median(target_times)
    acceptance = {label: {str(t): _by_domain(committed, label, t, domains) for t in temperatures} for label in drafters}
    cost = {label: {"block_ms": 1000 * statistics.median(times), "fraction_of_target_step": statistics.median(times) * 1000 / target_ms}
            for label, times in draft_times.items() if times}
    return {"acceptance": acceptance, "headroom": {k: h.summary() for k, h in headroom.items()},
            "cost": {"target_step_ms": target_ms, "threads": torch.get_num_threads(), "drafters": cost},
            "greedy_outputs_equal_ar": lossless}


def _by_domain(committed, label: str, temperature: float, domains: Seq[str]) -> dict[str, float]:
    rows = {d: committed[label, temperature, d] for d in domains}
    out = {d: tokens / max(1, steps) for d, (tokens, steps) in rows.items()}
    out["mean"] = statistics.fmean(out[d] for d in domains)
    return out


def format_report(result: dict[str, Any]) -> str:
    """Three markdown tables: acceptance, headroom, cost."""
    acceptance = result["acceptance"]
    first = next(iter(acceptance.values()))
    domains = [d for d in next(iter(first.values())) if d != "mean"]
    lines = ["| drafter | T | " + " | ".join(domains) + " | mean |", "|---" * (len(domains) + 3) + "|"]
    for label, by_t in acceptance.items():
        for t, row in by_t.items():
            lines.append(f"| {label} | {t} | " + " | ".join(f"{row[d]:.3f}" for d in [*domains, "mean"]) + " |")
    if result["headroom"]:
        slots = max(len(h["in_top_k_by_slot"]) for h in result["headroom"].values())
        lines += ["", "| drafter (T = 0) | " + " | ".join(f"in top-K, slot {k + 1}" for k in range(slots)) +
                  " | oracle τ | walk τ | unary argmax τ (same steps) |", "|---" * (slots + 4) + "|"]
        for label, h in result["headroom"].items():
            cells = [f"{x:.3f}" for x in h["in_top_k_by_slot"]] + [""] * (slots - len(h["in_top_k_by_slot"]))
            cells += [f"{h['oracle_acceptance']:.3f}", f"{h['walk_acceptance']:.3f}", f"{h['unary_acceptance_same_steps']:.3f}"]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cost = result["cost"]
    lines += ["", f"| drafter | block ms | of a target step ({cost['target_step_ms']:.1f} ms, {cost['threads']} threads) |",
              "|---|---|---|"]
    lines += [f"| {label} | {c['block_ms']:.1f} | {100 * c['fraction_of_target_step']:.0f}% |"
              for label, c in cost["drafters"].items()]
    return "\n".join(lines)


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.evaluate_dflash2", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dflash", default=None, help="the DFlash drafter folder (method dflash)")
    p.add_argument("--dflash2", required=True, type=lambda s: [x for x in s.split(",") if x],
                   help="comma list of DFlash 2 folders (a DFlash folder here is its identity start)")
    p.add_argument("--labels", default=None, type=lambda s: [x for x in s.split(",") if x],
                   help="names of the --dflash2 rows (default dflash2, dflash2-2, ...)")
    p.add_argument("--domains", default=",".join(DOMAINS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--per-domain", type=int, default=4, help="held-out prompts per domain")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperatures", type=_floats, default=[0.0, 0.8], help="comma list; 0 = greedy (headroom, cost)")
    p.add_argument("--seed", type=int, default=0, help="prompt i samples with seed + i")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.labels = args.labels or ["dflash2"] + [f"dflash2-{i + 2}" for i in range(len(args.dflash2) - 1)]
    if len(args.labels) != len(args.dflash2) or len(set(args.labels)) != len(args.labels) or "dflash" in args.labels:
        p.error("--labels needs one distinct name per --dflash2 folder, other than 'dflash'")
    if 0.0 not in args.temperatures:
        p.error("--temperatures must include 0: headroom and cost come from the greedy runs")
    return args


def report(args: argparse.Namespace) -> str:
    """Evaluate, print the tables, write the JSON; the one-line verdict on losslessness."""
    from ..api import load

    target = load(args.model, device=args.device, dtype=torch.float32)
    drafters = engines(target, args.dflash, args.dflash2, args.labels, args.seed)
    result = evaluate(target, drafters, args.domains, args.per_domain, args.max_new_tokens, args.temperatures, args.seed)
    print(format_report(result))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **result}, indent=1) + "\n",
                            encoding="utf-8")
    return f"greedy outputs identical to ar: {result['greedy_outputs_equal_ar']}"


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), report, str)


if __name__ == "__main__":
    raise SystemExit(main())
