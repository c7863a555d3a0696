"""Side by side in one process: decoding with the row plan the tuner chose (packed kernel
included) against the plan it would choose without the packed kernel, on the same target,
prompts and methods, interleaved. Why a script and not the bench: the bench compares methods on
one runtime; this compares runtimes for the same methods, so the packed kernel's own gain (on
plain decoding too) is measured on one machine at one time.

    python scripts/kernel_ab.py --methods ar,dflash --threads 1 --prompts-per-domain 2 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from specflash.api import build_drafter, generate, load
from specflash.models import row_kernels
from specflash.models.acquire import default_cache_dir
from specflash.models.presets import default_drafter
from specflash.prompts import DOMAINS, heldout_prompts


def plans(target) -> dict[str, row_kernels.RowPlan]:
    """The tuned plan and the one chosen from the same timings without the packed kernel."""
    timings = json.loads(row_kernels.timings_path(target.row_kernel_key, default_cache_dir()).read_text())
    return {"without packed": row_kernels.choose(row_kernels.without_packed(timings)), "tuned": target.row_plan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--methods", default="ar,dflash")
    p.add_argument("--prompts-per-domain", type=int, default=2)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=Path("bench-out/kernel_ab.json"))
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load(args.model)
    ways = plans(target)
    methods = args.methods.split(",")
    prompts = [q.text for d in DOMAINS for q in heldout_prompts(d)[: args.prompts_per_domain]]
    speed: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[int, str], set[tuple[int, ...]]] = {}
    for _ in range(args.repeats):
        for way, plan in ways.items():
            row_kernels.install(target.model, plan)
            target.row_plan = plan
            for method in methods:
                drafter = None if method == "ar" else build_drafter(method, target, None,
                                                                    default_drafter(target.name, method, None))
                for i, prompt in enumerate(prompts):
                    t0 = time.perf_counter()
                    run = generate(target, prompt, method, drafter=drafter, max_new_tokens=args.max_new_tokens)
                    speed.setdefault((way, method), []).append(len(run.output_ids) / (time.perf_counter() - t0))
                    outputs.setdefault((i, method), set()).add(tuple(run.output_ids))
    identical = all(len(o) == 1 for o in outputs.values()) and all(
        outputs[(i, m)] == outputs[(i, "ar")] for i in range(len(prompts)) for m in methods if "ar" in methods)
    rows = [{"plan": way, "method": m, "tokens_per_s": statistics.median(speed[(way, m)]),
             "tag": row_kernels.tag(ways[way])} for way in ways for m in methods]
    print(f"{'plan':<16}{'method':<10}{'tok/s':>8}")
    for r in rows:
        print(f"{r['plan']:<16}{r['method']:<10}{r['tokens_per_s']:>8.1f}")
    print("every output identical across plans and methods:", identical)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "rows": rows, "identical": identical,
                                    "prompts_per_domain": args.prompts_per_domain, "repeats": args.repeats,
                                    "max_new_tokens": args.max_new_tokens}, indent=1))


if __name__ == "__main__":
    main()
