"""Acceptance per domain on the held-out prompts: the yardstick for drafters before and after training.
(`--prompts dev|tuning` measures on prompts meant for choosing a checkpoint instead.)

Each drafter decodes the same held-out prompts of every domain (batched, temperature 0, so every
output is the target's and only acceptance differs). Mean acceptance length per domain pools a
domain's rows (committed tokens over decode steps); the spread across domains is their standard
deviation and range, the figure AdaFlash says on-policy distillation lowers.

    python -m specflash.training.evaluate --model smollm2-135m --drafters A,B,C --labels before,sft,opd
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from collections.abc import Sequence as Seq
from pathlib import Path
from typing import Any

import torch

from ..bench import PROMPT_SETS, bench_prompts
from ..metrics import decode_steps
from ..prompts import DOMAINS
from .entry import run_script


def acceptance_by_domain(target, drafter: str, domains: Seq[str] = DOMAINS, per_domain: int = 4,
                         max_new_tokens: int = 64, method: str = "dflash",
                         max_draft: int | None = None, prompt_set: str = "heldout") -> dict[str, Any]:
    """{"domains": {domain: mean acceptance length}, "mean", "std", "range", "drafted_per_step":
    {domain: mean drafted tokens per decode step}, "outputs": ids per prompt}.
    `max_draft` caps the drafted tokens per step (a DFlash-family option), so that drafters of
    different block sizes compare at the same depth. `prompt_set` is `bench`'s: the held-out
    prompts (the figures to report), or the dev prompts or tuning requests to choose a checkpoint
    on without spending the held-out ones."""
    from ..api import encode_prompt, generate_batch
    from ..drafters import build_drafter, method_info
    from ..drafters.dflash import DFlashFamilyConfig

    # loaded once, shared by every domain's batch; a DFlash drafter in the target's dtype, so the
    # table measures its own weights, not the int8 or bf16 copy the engine may run on some CPUs
    dflash_family = issubclass(method_info(method).load().CONFIG, DFlashFamilyConfig)
    options = {"draft_dtype": "target"} if dflash_family else {}
    if max_draft is not None:
        options["max_draft"] = max_draft
    single = build_drafter(method, target, options or None, drafter)
    by_domain, drafted, outputs = {}, {}, {}
    every = bench_prompts(prompt_set, list(domains), per_domain)  # once: the tuning requests are built, not read
    for domain in domains:
        prompts = [p for p in every if p[0] == domain]
        result = generate_batch(target, [encode_prompt(target, text) for _, _, text in prompts], method=method,
                                max_new_tokens=max_new_tokens, drafter=single)
        steps = [s for run in result.runs for s in decode_steps(run)]
        by_domain[domain] = sum(len(s.committed) for s in steps) / max(1, len(steps))
        drafted[domain] = sum(len(s.tokens) for s in steps) / max(1, len(steps))
        outputs.update({pid: run.output_ids for (_, pid, _), run in zip(prompts, result.runs)})
    values = list(by_domain.values())
    return {"domains": by_domain, "mean": statistics.fmean(values), "std": statistics.pstdev(values),
            "range": max(values) - min(values), "drafted_per_step": drafted, "outputs": outputs}


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """Markdown: one row per drafter, a column per domain, then mean, std and range."""
    domains = list(next(iter(results.values()))["domains"])
    lines = ["| drafter | " + " | ".join(domains) + " | mean | std across domains | range |",
             "|---" * (len(domains) + 4) + "|"]
    for label, r in results.items():
        cells = [f"{r['domains'][d]:.3f}" for d in domains] + [f"{r['mean']:.3f}", f"{r['std']:.3f}", f"{r['range']:.3f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafters", required=True, type=lambda s: [x for x in s.split(",") if x], help="comma list of folders")
    p.add_argument("--labels", default=None, type=lambda s: [x for x in s.split(",") if x], help="names for the table")
    p.add_argument("--domains", default=",".join(DOMAINS), type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--per-domain", type=int, default=4, help="prompts per domain")
    p.add_argument("--prompts", choices=PROMPT_SETS, default="heldout",
                   help="as bench's: the held-out prompts (to report), or the dev prompts or tuning requests "
                        "(to choose checkpoints on)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-draft", type=int, default=None,
                   help="draft at most this many tokens per step (default: the drafter's block size - 1)")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    p.add_argument("--zlab-view", action="store_true",
                   help="also evaluate each drafter as a full-vocabulary z-lab loader reads it (no d2t map)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    args.labels = args.labels or args.drafters
    if len(args.labels) != len(args.drafters):
        p.error("--labels needs one name per drafter")
    return args


def zlab_view(folder: Path, dest: Path) -> Path:
    """What a full-vocabulary z-lab loader (vLLM, SGLang) reads of a drafter folder: config.json
    without our `draft_vocab_size` and model.safetensors; no d2t map, no length head."""
    from ..models.dflash_io import CONFIG_FILE, WEIGHTS_FILE, read_config

    dest.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in read_config(folder).items() if k != "draft_vocab_size"}
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    shutil.copyfile(Path(folder) / WEIGHTS_FILE, dest / WEIGHTS_FILE)
    return dest


def compare(args: argparse.Namespace) -> str:
    """Evaluate every drafter, print the table, write the JSON; the one-line verdict on outputs."""
    from ..api import load

    target = load(args.model, device=args.device, dtype=torch.float32)
    runs = list(zip(args.labels, args.drafters))
    with tempfile.TemporaryDirectory() as scratch:
        if args.zlab_view:
            runs += [(f"{label} (z-lab loader, full vocabulary)", str(zlab_view(Path(d), Path(scratch) / str(i))))
                     for i, (label, d) in enumerate(runs)]
        results = {label: acceptance_by_domain(target, drafter, args.domains, args.per_domain, args.max_new_tokens,
                                               max_draft=args.max_draft, prompt_set=args.prompts)
                   for label, drafter in runs}
    outputs = [r.pop("outputs") for r in results.values()]
    identical = all(o == outputs[0] for o in outputs)
    print(format_table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                        "outputs_identical": identical}, indent=1) + "\n", encoding="utf-8")
    return f"outputs identical across drafters: {identical}"


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), compare, str)


if __name__ == "__main__":
    raise SystemExit(main())
