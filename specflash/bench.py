"""Side-by-side benchmark: every method on the same held-out prompts, interleaved, medians.

(`--prompts tuning` runs the same harness on the tuning requests, to choose knobs such as the
draft gate's `switch_on` without looking at the held-out prompts.)

Machines are shared and noisy, so absolute tokens/s drift; what holds is the ratio of two runs
measured back to back. Each (repeat, prompt) round runs every method once, in a rotating order,
and the speedup of a method is the median over rounds of ar's wall time / its wall time on the
same prompt. transformers' own assisted generation and prompt lookup run as reference rows: they
are what a user would pick instead.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable

import torch

from .bench_compare import CompareError, compare_all, format_comparisons, parse_pairs
from .cli_args import add_model_args, parse_options, torch_dtype
from .config import SamplingConfig
from .metrics import pooled_acceptance
from .models.presets import default_drafter, portable_path, preset_datastore, weights_fingerprint

HF_ROWS = {"hf-assisted": True, "hf-pld": False}  # transformers' own rows, and whether each runs a drafter model
PROMPT_SETS = ("heldout", "dev", "tuning")


def add_bench_args(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    p.add_argument("--methods", default=None, help="comma list (default ar,pld,hf-pld); hf-assisted and hf-pld are "
                   "reference rows; labelled variants such as dflash:margin or adaflash:fixed run the method with "
                   "their own knobs (-o dflash:margin.KEY=VALUE; a label naming an adaflash cut rule sets it; "
                   "-o dflash:new.drafter=PATH gives a variant its own drafter, to compare two side by side); with "
                   "--batch-sizes (default ar,dflash,adaflash): ar, dflash, adaflash and their variants")
    p.add_argument("--domains", default="math,code,writing,rewrite")
    p.add_argument("--prompts", choices=PROMPT_SETS, default="heldout",
                   help="held-out prompts (the figures to report), or, to choose knobs on, never on the held-out "
                        "prompts: the dev prompts (written apart from the held-out ones and every recipe) or the "
                        "tuning requests (harvest.tuning_jobs)")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--drafter", default=None, help="drafter for every method that takes one: draft, hf-assisted, dflash, adaflash, dels (default: the preset's)")
    p.add_argument("-o", "--option", action="append", default=[], metavar="METHOD.KEY=VALUE")
    p.add_argument("--out", type=Path, default=Path("bench-out/bench.json"))
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (on a small shared CPU, 1 is often several times faster than 2)")
    p.add_argument("--batch-sizes", default=None, metavar="1,4,16,32",
                   help="sweep batch sizes instead: every method decodes the same batch; throughput across the batch")
    p.add_argument("--compare", default=None, metavar="A:B,...",
                   help="after the tables, each pair A against B with 95%% intervals over prompts (bench_compare.py; "
                        "a labelled variant as dflash/m12); also in the JSON")


@dataclass
class Sample:
    method: str
    domain: str
    prompt_id: str
    repeat: int
    wall: float
    new_tokens: int
    output_ids: list[int]
    metrics: dict[str, Any] = field(default_factory=dict)


def _hf_runner(target, method: str, drafter_model) -> Callable[[list[int], int], tuple[list[int], dict]]:
    def run(ids: list[int], max_new: int) -> tuple[list[int], dict]:
        inputs = torch.tensor([ids], device=target.device)
        kwargs: dict[str, Any] = dict(max_new_tokens=max_new, do_sample=False, attention_mask=torch.ones_like(inputs))
        if method == "hf-assisted":
            kwargs["assistant_model"] = drafter_model
        else:
            kwargs["prompt_lookup_num_tokens"] = 8
        out = target.model.generate(inputs, **kwargs)
        return out[0, len(ids) :].tolist(), {}

    return run


def _engine_runner(target, method: str, drafter: str | None, options: dict, cache_dir):
    """Decodes with the method's drafter, built here once, as the target is loaded once: a server
    loads its drafter at start, not per request. (Built inside every timed sample, loading cost
    0.1-0.4 s on the 2-core CPU, 4-15% of a 48-token request, and it was charged to the learned
    methods alone.) Every request starts the drafter afresh (`Drafter.begin`)."""
    from .api import generate
    from .drafters import build_drafter

    built = build_drafter(method, target, options, drafter, cache_dir=cache_dir)

    def run(ids: list[int], max_new: int) -> tuple[list[int], dict]:
        rec = generate(target, ids, method, max_new_tokens=max_new, drafter=built, sampling=SamplingConfig())
        return rec.output_ids, rec.metrics

    return run


DATASTORE_METHODS = ("dflash", "dflash2", "adaflash", "dels")  # the DFlash family, whose trees take its grafts


def measured_weights(model: str, method: str, drafter: str | None, options: dict,
                     cache_dir: Path | None) -> dict[str, dict[str, str]]:
    """Which weights a method ran with: its drafter, for `dels` its local head, and for a
    DFlash-family method grafting the datastore's continuations the harvests it is built from,
    each as a portable path and a digest (`weights_fingerprint`), recorded in the benchmark's JSON."""
    parts = {"drafter": drafter}
    if method == "dels":
        from .drafters.dels import preset_head

        parts["local_head"] = options.get("local_head") or preset_head(model, cache_dir)
    if method in DATASTORE_METHODS and all(options.get(knob, True) for knob in ("datastore", "gate", "tree")):
        parts["datastore"] = options.get("datastore_folder") or preset_datastore(model)
    digests = {role: weights_fingerprint(path) for role, path in parts.items() if path}
    return {role: {"path": portable_path(parts[role]), "weights": digest} for role, digest in digests.items() if digest}


def _method_options(items: list[str]) -> dict[str, dict]:
    per: dict[str, dict] = {}
    for key, value in parse_options(items).items():
        method, _, knob = key.partition(".")
        per.setdefault(method, {})[knob] = value
    return per


def label_variants(names: list[str], per_method: dict[str, dict]) -> dict[str, tuple[str, dict[str, Any]]]:
    """{variant name: (method, options)} in the given order: `method:label` takes the method's
    options, then its own (`-o method:label.KEY=VALUE`); an adaflash label naming a cut rule sets it."""
    from .drafters.adaflash import RULES

    variants = {}
    for name in names:
        method, _, label = name.partition(":")
        rule = {"rule": label} if method == "adaflash" and label in RULES else {}
        variants[name] = (method, {**per_method.get(method, {}), **rule, **(per_method.get(name, {}) if label else {})})
    return variants


def own_drafter(method: str, options: dict[str, Any]) -> tuple[str | None, dict[str, Any]]:
    """A variant's own drafter (`-o dflash:new.drafter=PATH`) and the method's knobs without it.

    Why: two drafters compared in two runs also compare two states of a shared machine (the gate and
    the trees follow the run's own timings); as variants of one run they share its prompts, repeats
    and host. A drafter given to a method that runs none is an error, not ignored."""
    from .drafters import method_info
    from .errors import MethodConfigError

    knobs = dict(options)
    own = knobs.pop("drafter", None)
    runs_drafter = HF_ROWS[method] if method in HF_ROWS else method_info(method).drafter_role is not None
    if own is not None and not runs_drafter:
        raise MethodConfigError(f"method {method!r} runs no drafter: drafter={own} has nothing to set")
    return own, knobs


def bench_prompts(prompt_set: str, domains: list[str], per_domain: int,
                  cache_dir: Path | None = None) -> list[tuple[str, str, str]]:
    """(domain, prompt id, text), `per_domain` per domain, of the held-out prompts ("heldout"),
    the dev prompts ("dev") or the tuning requests ("tuning": harvest.tuning_jobs)."""
    if prompt_set == "tuning":
        from .models.acquire import default_cache_dir
        from .training.harvest import tuning_jobs

        jobs = tuning_jobs(per_domain, cache_dir or default_cache_dir())
        return [(j.domain, j.sample_id, j.text) for j in jobs if j.domain in domains]
    from .prompts import dev_prompts, heldout_prompts

    read = dev_prompts if prompt_set == "dev" else heldout_prompts
    return [(q.domain, q.id, q.text) for d in domains for q in read(d)[:per_domain]]


def summarize_samples(samples: list[Sample], methods: list[str]) -> list[dict[str, Any]]:
    """One row per method (in the given order): medians, pooled acceptance, speedup as the
    median of paired ratios."""
    base = {(s.prompt_id, s.repeat): s for s in samples if s.method == "ar"}
    rows = []
    for method in methods:
        mine = [s for s in samples if s.method == method]
        ratios = [base[(s.prompt_id, s.repeat)].wall / s.wall for s in mine if (s.prompt_id, s.repeat) in base]
        same = [s.output_ids == base[(s.prompt_id, s.repeat)].output_ids for s in mine if (s.prompt_id, s.repeat) in base]
        with_metrics = [s.metrics for s in mine if s.metrics]
        steps = sum(m["decode_steps"] for m in with_metrics)
        tau = pooled_acceptance(with_metrics)
        committed = (tau or 0.0) * steps
        verified = sum(m["verified_per_committed"] * m["mean_acceptance_length"] * m["decode_steps"] for m in with_metrics)
        looked_up = sum(m.get("lookup_steps", 0) for m in with_metrics)
        rows.append({
            "method": method,
            "tokens_per_s": median(s.new_tokens / s.wall for s in mine),
            "mean_acceptance_length": tau,
            "verified_per_committed": verified / committed if committed else None,
            "lookup_step_share": looked_up / steps if looked_up else None,
            "speedup": median(ratios) if ratios else None,
            "identical_to_ar": all(same) if same else None,
            "samples": len(mine),
        })
    return rows


def format_table(rows: list[dict[str, Any]], device: str) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    lines = [f"device: {device}", f"{'method':<14}{'tok/s':>9}{'accept len':>12}{'verified/tok':>14}{'lookup':>8}"
                                  f"{'speedup':>9}  identical"]
    for r in rows:
        lines.append(
            f"{r['method']:<14}{f(r['tokens_per_s'], '.1f'):>9}{f(r['mean_acceptance_length'], '.2f'):>12}"
            f"{f(r['verified_per_committed'], '.2f'):>14}{f(r.get('lookup_step_share'), '.0%'):>8}"
            f"{f(r['speedup'], '.2f'):>9}  {f(r['identical_to_ar'], '')}"
        )
    return "\n".join(lines)


def device_label(target) -> str:
    if target.device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(target.device)}"
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def run_bench(args: argparse.Namespace) -> int:
    from .api import encode_prompt, load
    from .models.loading import load_causal_lm

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_sizes:
        from .bench_batch import run_batch_bench

        return run_batch_bench(args)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())  # which of a day's runs came last
    methods = [m.strip() for m in (args.methods or "ar,pld,hf-pld").split(",") if m.strip()]
    if "ar" not in methods:
        methods.insert(0, "ar")
    pairs = parse_pairs(args.compare) if args.compare else []
    unknown = [m for pair in pairs for m in pair if m not in methods]
    if unknown:
        raise CompareError(f"--compare names {', '.join(dict.fromkeys(unknown))}, which this run does not bench "
                           f"({', '.join(methods)})")
    target = load(args.model, device=args.device, dtype=torch_dtype(args.dtype), cache_dir=args.cache_dir)
    variants = label_variants(methods, _method_options(args.option))
    drafter = args.drafter or default_drafter(args.model, "draft", args.cache_dir)
    runners, weights = {}, {}
    for name, (m, variant) in variants.items():
        own, options = own_drafter(m, variant)
        if m in HF_ROWS:
            drafter_model = None
            if m == "hf-assisted":
                folder = own or drafter
                drafter_model = load_causal_lm(folder, target.device, target.dtype, args.cache_dir)[0] if folder else None
                if drafter_model is None:
                    print("skipping hf-assisted: no draft model (pass --drafter)")
                    continue
            runners[name] = _hf_runner(target, m, drafter_model)
        else:
            method_drafter = own or (drafter if m == "draft" else args.drafter or default_drafter(args.model, m, args.cache_dir))
            runners[name] = _engine_runner(target, m, method_drafter, options, args.cache_dir)
            weights[name] = measured_weights(args.model, m, method_drafter, options, args.cache_dir)
    prompts = bench_prompts(args.prompts, [d.strip() for d in args.domains.split(",") if d.strip()],
                            args.prompts_per_domain, args.cache_dir)
    encoded = {pid: encode_prompt(target, text) for _, pid, text in prompts}
    names = list(runners)
    for name in names:  # warm-up: first forwards are several times slower
        runners[name](encoded[prompts[0][1]], 4)
    samples: list[Sample] = []
    for repeat in range(args.repeats):
        for i, (domain, pid, _) in enumerate(prompts):
            shift = (repeat * len(prompts) + i) % len(names)
            for name in names[shift:] + names[:shift]:
                t0 = time.perf_counter()
                out, metrics = runners[name](encoded[pid], args.max_new_tokens)
                wall = time.perf_counter() - t0
                samples.append(Sample(name, domain, pid, repeat, wall, len(out), out, metrics))
    rows = summarize_samples(samples, names)
    domains = dict.fromkeys(s.domain for s in samples)
    per_domain = {d: summarize_samples([s for s in samples if s.domain == d], names) for d in domains}
    device = device_label(target)
    print(format_table(rows, device))
    for domain, drows in per_domain.items():
        print(f"\n[{domain}]\n" + format_table(drows, device))
    ran = [(a, b) for a, b in pairs if a in runners and b in runners]  # a skipped row (hf-assisted) has no samples
    records = [s.__dict__ for s in samples]  # what the JSON holds, and what comparisons read
    comparisons = compare_all(records, ran) if ran else []
    if comparisons:
        print("\n" + format_comparisons(comparisons))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": device, "model": args.model, "prompt_set": args.prompts, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "options": {name: options for name, (_, options) in variants.items() if options},
        "weights": {name: w for name, w in weights.items() if w}, "date": time.strftime("%Y-%m-%d"),
        "started": started, "rows": rows, "per_domain": per_domain,
        **({"comparisons": [c.to_dict() for c in comparisons]} if comparisons else {}),
        "samples": records,
        "note": "speedup = median over (prompt, repeat) of ar wall time / method wall time, both end to end",
    }, indent=1))
    print(f"\nwrote {args.out}")
    return 0
