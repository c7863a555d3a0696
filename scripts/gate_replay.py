"""Draft-gate replay: each policy's modeled speed-up over plain decoding, per domain, on recorded
acceptance (specflash/gate_replay.py says why and what it leaves out).

    python scripts/gate_replay.py --prompts dev --prompts-per-domain 8 --draft-dtype float32 \
        --gate default: --gate slow:smoothing=0.1 --runs-out /tmp/runs.json --out bench-out/gate_replay.json

Recording the acceptance is the slow part (one greedy answer per prompt); `--runs FILE` replays
policies on a recording made before. What each step costs is measured in this run, on a quiet
machine (specflash/step_costs.py: one prompt per domain, every width), or read back from an
earlier output with `--costs FILE`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import specflash
from specflash.acceptance_record import record_runs
from specflash.bench import PROMPT_SETS, bench_prompts
from specflash.drafters import build_drafter
from specflash.drafters.adaflash import AdaFlashConfig, cut_length, kept_length
from specflash.gate_replay import (AcceptanceRun, ReplayCost, gate_policy, replay_all, replay_fixed, replay_gate,
                                   replay_oracle)
from specflash.models.dflash_io import DRAFTER_DTYPE_CHOICES
from specflash.models.presets import default_drafter, portable_path
from specflash.prompts import DOMAINS
from specflash.step_costs import measure_step_costs


def parse_gate(text: str) -> tuple[str, dict]:
    """"label:key=value,key=value" -> (label, DraftGate overrides)."""
    label, _, rest = text.partition(":")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.isdigit() else float(value)
    return label, overrides


def cost_cut(rate: float, curve: list[float], min_len: int):
    """AdaFlash's default rule, its own code, on recorded confidences (each a one-column distribution
    whose maximum is the confidence)."""
    cfg = AdaFlashConfig(rate=rate, min_len=min_len)
    return lambda conf: kept_length(cut_length("cost", torch.tensor(conf)[:, None], cfg, curve, 0), len(conf), cfg)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafter", default=None, help="DFlash drafter (default: the preset's)")
    p.add_argument("--draft-dtype", choices=DRAFTER_DTYPE_CHOICES, default="float32")
    p.add_argument("--prompts", choices=PROMPT_SETS, default="dev")
    p.add_argument("--prompts-per-domain", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="torch threads while measuring the costs")
    p.add_argument("--costs", type=Path, default=None, help="the costs of an earlier output JSON instead of measuring")
    p.add_argument("--gate", action="append", default=[], type=parse_gate,
                   help="label:key=value,...: a DraftGate variant (repeatable; default: the gate as shipped)")
    p.add_argument("--cut-rate", action="append", default=[], type=float,
                   help="also the gate with AdaFlash's cost cut reading confidences x RATE (repeatable)")
    p.add_argument("--whole-block", action="store_true",
                   help="also each cut with AdaFlash's whole_block: the gate's drafting steps draft every slot")
    p.add_argument("--cut-min", action="append", default=[], type=int,
                   help="the cuts' min_len values to replay (repeatable; default: AdaFlash's)")
    p.add_argument("--runs", type=Path, default=None, help="replay this recording instead of recording")
    p.add_argument("--runs-out", type=Path, default=None, help="save the recording here")
    p.add_argument("--out", type=Path, default=Path("bench-out/gate_replay.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    target = specflash.load(args.model)
    drafter = args.drafter or default_drafter(args.model, "dflash", None)
    engine = build_drafter("dflash", target, {"draft_dtype": args.draft_dtype}, drafter)
    depth = engine.draft_len
    if args.costs:
        cost = ReplayCost(**json.loads(args.costs.read_text())["cost"])
    else:
        probes = [text for _, _, text in bench_prompts(args.prompts, list(DOMAINS), 1)]
        cost = measure_step_costs(target, drafter, probes, depth, draft_dtype=args.draft_dtype)
    if args.runs:
        runs = [AcceptanceRun(**r) for r in json.loads(args.runs.read_text())["runs"]]
    else:
        prompts = bench_prompts(args.prompts, list(DOMAINS), args.prompts_per_domain)
        runs = record_runs(target, engine.model, [(d, text) for d, _, text in prompts], args.max_new_tokens)
    if args.runs_out:
        args.runs_out.parent.mkdir(parents=True, exist_ok=True)
        args.runs_out.write_text(json.dumps({"prompts": args.prompts, "draft_dtype": args.draft_dtype,
                                             "runs": [vars(r) for r in runs]}))
    curve = cost.curve

    policies = {"oracle": lambda r: replay_oracle(r, cost, depth)}
    policies.update({f"fixed {w}": (lambda r, w=w: replay_fixed(r, cost, w)) for w in range(1, depth + 1)})
    for label, overrides in args.gate or [("gate", {})]:
        make = gate_policy(depth, cost, **overrides)
        policies[label or "gate"] = lambda r, make=make: replay_gate(r, cost, depth, make())
    for rate in args.cut_rate:
        for min_len in args.cut_min or [AdaFlashConfig().min_len]:
            cut = cost_cut(rate, curve, min_len)
            policies[f"gate + cost cut x{rate:g} min {min_len}"] = \
                lambda r, cut=cut: replay_gate(r, cost, depth, gate_policy(depth, cost)(), cut)
            if args.whole_block:
                policies[f"gate + block cut x{rate:g} min {min_len}"] = \
                    lambda r, cut=cut: replay_gate(r, cost, depth, gate_policy(depth, cost)(), cut, whole_block=True)
    table = {name: replay_all(runs, play) for name, play in policies.items()}

    domains = [d for d in DOMAINS if d in table["oracle"]]
    print(f"cost: curve {' '.join(f'{c:.2f}' for c in curve)}  block {cost.draft:.3f}  shadow {cost.shadow:.3f}")
    print(f"{'policy':<30}" + "".join(f"{d:>9}" for d in domains) + f"{'all':>9}{'tau':>7}{'drafting':>10}")
    for name, pooled in table.items():
        a = pooled["all"]
        cells = "".join(f"{pooled[d].speedup:>9.3f}" for d in domains)
        print(f"{name:<30}{cells}{a.speedup:>9.3f}{a.tokens / a.steps:>7.2f}{a.drafting_steps / a.steps:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "model": args.model, "drafter": portable_path(drafter), "threads": args.threads, "draft_dtype": args.draft_dtype, "prompts": args.prompts,
        "prompts_per_domain": args.prompts_per_domain, "max_new_tokens": args.max_new_tokens,
        "cost": vars(cost), "policies": {n: {d: r.to_dict() for d, r in pooled.items()} for n, pooled in table.items()},
    }, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
