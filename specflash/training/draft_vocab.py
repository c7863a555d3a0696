"""Choosing a drafter's reduced vocabulary: the target's most frequent output tokens, and how much
of its output they cover.

Why: on a CPU the LM head over the full vocabulary is most of a small drafter's cost, while a
chat model's answers use a small part of its vocabulary. A token outside the draft vocabulary
can never be drafted (q = 0; verification stays exact), so what matters is the share of the
target's output tokens the vocabulary covers: measured here on shards it was not chosen from.

    python -m specflash.training.draft_vocab --data DIR[,DIR] [--sizes 4096,8192,16384]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from .data import MANIFEST, read_shard
from .entry import run_script


def token_counts(shards: Sequence[Path], vocab_size: int) -> torch.Tensor:
    """How often the target emitted each token id in these shards (answers, or teacher-forced labels)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for shard in shards:
        for s in read_shard(shard):
            ids = s.labels if s.labels is not None else s.token_ids[max(1, s.prompt_len):]
            counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab_size)
    return counts


def frequent_tokens(shards: Sequence[Path], k: int, vocab_size: int) -> torch.Tensor:
    """The `k` ids the target emits most often in the data, sorted (ties: lower id first)."""
    counts = token_counts(shards, vocab_size)
    order = torch.sort(counts, descending=True, stable=True).indices
    return order[:k].sort().values


def coverage(chosen_from: Sequence[Path], measured_on: Sequence[Path], sizes: Sequence[int],
             vocab_size: int) -> dict[int, float]:
    """Share of the output tokens of `measured_on` inside the top-N of `chosen_from`, per N."""
    counts = token_counts(measured_on, vocab_size)
    total = max(1, int(counts.sum()))
    return {n: int(counts[frequent_tokens(chosen_from, n, vocab_size)].sum()) / total for n in sizes}


def _shards(dirs: Sequence[Path]) -> list[Path]:
    return [d / s["file"] for d in dirs for s in json.loads((d / MANIFEST).read_text(encoding="utf-8"))["shards"]]


def report(args: argparse.Namespace) -> dict[int, float]:
    shards = _shards(args.data)
    if len(shards) < 2:
        raise SystemExit("error: coverage needs at least two shards (one to choose from, one to measure on)")
    split = max(1, int(len(shards) * args.choose_fraction))
    result = coverage(shards[:split], shards[split:], args.sizes, args.vocab_size)
    print(f"chosen from {split} shard(s), measured on {len(shards) - split}")
    print("| draft vocabulary | coverage of the target's output tokens |\n|---|---|")
    for n, share in result.items():
        print(f"| {n} | {100 * share:.2f}% |")
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.draft_vocab", description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=lambda s: [Path(x) for x in s.split(",") if x])
    p.add_argument("--sizes", default="2048,4096,8192,16384", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--vocab-size", type=int, default=49152, help="the target's vocabulary size")
    p.add_argument("--choose-fraction", type=float, default=0.5, help="share of shards the vocabulary is chosen from")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(parse_args(argv), report, lambda r: "")


if __name__ == "__main__":
    raise SystemExit(main())
