"""Command line: `python -m specflash methods|generate|bench|compare|fetch-models`.

Bad input ends with one line on stderr and exit status 2; the JSON of `generate --json` is the
RunRecord plus `text` and `stats`, so scripts and tests read exactly what the app reads.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from .bench import add_bench_args, run_bench
from .bench_compare import add_compare_args, run_compare
from .cli_args import add_model_args, parse_options, torch_dtype
from .errors import SpecFlashError
from .models.presets import default_drafter


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2, like every other bad input
        self.exit(2, f"error: {message}\n")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--raw", action="store_true", help="feed the prompt as plain text, no chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m specflash", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("methods", help="list the decoding methods and what each needs")

    gen = sub.add_parser("generate", help="run one method on one prompt")
    add_model_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--method", default="ar")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--drafter", default=None, help="drafter model/checkpoint (default: the preset's)")
    gen.add_argument("-o", "--option", action="append", default=[], metavar="KEY=VALUE", help="method knob")
    gen.add_argument("--json", action="store_true", help="print the RunRecord with text and stats as JSON")

    add_bench_args(sub.add_parser("bench", help="side-by-side benchmark of methods on held-out prompts"))
    add_compare_args(sub.add_parser("compare", help="how sure a benchmark is that one method beats another: "
                                                    "paired ratios with bootstrap intervals over prompts"))

    fetch = sub.add_parser("fetch-models", help="fetch and convert the default model into the cache")
    fetch.add_argument("--cache-dir", type=Path, default=None)
    return parser


def cmd_methods() -> int:
    from .drafters import METHODS

    width = max(len(name) for name in METHODS)
    for info in METHODS.values():
        print(f"{info.name:<{width}}  {info.summary}; needs {info.needs}")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from .api import generate, load
    from .config import SamplingConfig
    from .drafters import method_info

    method_info(args.method)  # an unknown method fails before any model loads
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    options = parse_options(args.option)
    target = load(args.model, device=args.device, dtype=torch_dtype(args.dtype), cache_dir=args.cache_dir)
    drafter = args.drafter or default_drafter(args.model, args.method, args.cache_dir)
    run = generate(
        target, args.prompt, args.method, max_new_tokens=args.max_new_tokens, sampling=sampling, raw=args.raw,
        drafter=drafter, options=options, cache_dir=args.cache_dir,
    )
    if args.method == "adaflash":
        from .drafters.adaflash import annotate_cuts

        annotate_cuts(run)  # hindsight on the cut tokens, after the timed run
    text = target.tokenizer.decode(run.output_ids, skip_special_tokens=True)
    if args.json:
        print(json.dumps({**run.to_dict(), "text": text, "stats": run.metrics}))
    else:
        m = run.metrics
        print(text)
        print(
            f"[{run.method}] {m['new_tokens']} tokens, {m['tokens_per_s']:.1f} tok/s decode, "
            f"mean acceptance length {m['mean_acceptance_length']:.2f}, finish: {run.finish_reason}",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr is for our one-line errors and summaries
    try:
        if args.command == "methods":
            return cmd_methods()
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "bench":
            return run_bench(args)
        if args.command == "compare":
            return run_compare(args)
        if args.command == "fetch-models":
            from .models.acquire import fetch_default_model

            print(fetch_default_model(args.cache_dir))
            return 0
    except SpecFlashError as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 2
