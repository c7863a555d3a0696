"""Held-out acceptance during DFlash training: τ on the `--hold-out` shards every N steps.

Why: a DFlash block conditions only on the target's own context (its slots are mask tokens, not
drafts), so the leading run of correct slots on a held-out sequence is exactly what greedy
verification would accept there. Scoring fixed blocks of the held-out shards while training gives
each run a held-out curve for the price of a few forwards, where the logged training-batch τ
mixes in what the drafter has memorised of examples it saw before (2.18 on seen shards against
1.66 on new ones in the eleventh session), and a decoding evaluation costs minutes per point.

The same figures for finished drafters, side by side on the same blocks:

    python -m specflash.training.validation --model TARGET --data DIR,DIR --hold-out shard-00001.safetensors \
        --drafters A,B [--labels a,b] [--samples 256]
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence as Seq
from pathlib import Path

import torch

from ..errors import SpecFlashError
from ..models.dflash import DFlashDrafter, loss_weights
from ..models.dflash_io import load_drafter
from ..models.target import TargetModel
from .data import load_training_target, read_shard
from .dflash_features import picked_features
from .dflash_objective import Sequence, make_sequence, sample_anchors, sequence_loss
from .entry import run_script

Block = tuple[Sequence, torch.Tensor, torch.Tensor]  # (sequence, features [S, n_feat*H], anchors [N])


def held_out_blocks(target: TargetModel, data_dirs: Seq[Path], hold_out: Seq[str], layer_ids: tuple[int, ...],
                    cache_dir: Path | None, samples: int, anchors: int, seed: int = 0) -> list[Block]:
    """Up to `samples` sequences drawn evenly from every held-out shard present in the data
    folders (a seeded choice), each with its features and a fixed set of anchors."""
    paths = [Path(d) / name for d in data_dirs for name in hold_out if (Path(d) / name).is_file()]
    if not paths:
        raise SpecFlashError("--validate-every scores the --hold-out shards, and none of them is in the data folders")
    g = torch.Generator().manual_seed(seed)
    per_shard = math.ceil(samples / len(paths))
    blocks: list[Block] = []
    for path in paths:
        rows = read_shard(path)
        chosen = torch.randperm(len(rows), generator=g)[:per_shard].tolist()
        feats = picked_features(target, rows, chosen, path, layer_ids, cache_dir)
        for i, feat in zip(chosen, feats):
            seq = make_sequence(rows[i].token_ids, rows[i].prompt_len, rows[i].labels)
            picked = sample_anchors(seq, anchors, g)
            if len(picked):
                blocks.append((seq, feat.clone(), picked))
    return blocks[:samples]


@torch.no_grad()
def held_out_acceptance(model: DFlashDrafter, blocks: list[Block], weights: torch.Tensor,
                        bf16: bool = False) -> dict[str, float]:
    """val_tau (1 + mean accepted slots per block), val_acc1 (slot 1 right) and val_loss (the
    weighted hard-label CE) of the drafter on the held-out blocks."""
    device = next(model.parameters()).device
    loss = weight = 0.0
    slot1 = accepted = count = 0
    for seq, feats, anchors in blocks:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            stats = sequence_loss(model, seq, feats.to(device, torch.float32), anchors, weights)
        loss, weight = loss + float(stats.loss), weight + stats.weight
        slot1, accepted, count = slot1 + stats.slot1_correct, accepted + stats.accepted, count + stats.blocks
    count = max(count, 1)
    return {"val_tau": 1 + accepted / count, "val_acc1": slot1 / count, "val_loss": loss / max(weight, 1e-9)}


def compare(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Each drafter's held-out figures on the same blocks (they must share feature layers)."""
    labels = args.labels or [Path(d).name for d in args.drafters]
    if len(labels) != len(args.drafters):
        raise SpecFlashError(f"{len(labels)} labels for {len(args.drafters)} drafters")
    target = load_training_target(args.model, args.device)
    drafters = [load_drafter(d, target) for d in args.drafters]
    layers = {tuple(d.spec.target_layer_ids) for d in drafters}
    if len(layers) > 1:
        raise SpecFlashError(f"the drafters read different target layers ({sorted(layers)}); compare them one at a time")
    layer_ids = layers.pop()
    if args.per_folder:  # the same number of sequences from each folder, scored apart and together
        per = math.ceil(args.samples / len(args.data))
        folders = [d for d in args.data if any((Path(d) / name).is_file() for name in args.hold_out)]
        groups = {Path(d).name: held_out_blocks(target, [d], args.hold_out, layer_ids, None, per, args.anchors,
                                                args.seed) for d in folders}
    else:
        groups = {"": held_out_blocks(target, args.data, args.hold_out, layer_ids, None, args.samples,
                                      args.anchors, args.seed)}

    def figures(d: DFlashDrafter, blocks: list[Block]) -> dict[str, float]:
        weights = loss_weights(d.spec.block_size, d.spec.block_size / 2)
        return {**held_out_acceptance(d, blocks, weights), "blocks": sum(len(a) for _, _, a in blocks)}

    every = [b for blocks in groups.values() for b in blocks]
    out = {label: figures(d.float(), every) for label, d in zip(labels, drafters)}
    if args.per_folder:
        for label, d in zip(labels, drafters):
            out[label]["folders"] = {name: figures(d, blocks) for name, blocks in groups.items()}
    return out


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    def paths(text: str) -> list[Path]:
        return [Path(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(prog="python -m specflash.training.validation", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder of the target")
    p.add_argument("--data", required=True, type=paths, help="comma list of harvest folders")
    p.add_argument("--hold-out", required=True, type=lambda s: [x for x in s.split(",") if x], metavar="SHARD,...")
    p.add_argument("--drafters", required=True, type=paths, help="comma list of DFlash drafter folders")
    p.add_argument("--labels", default=None, type=lambda s: [x for x in s.split(",") if x])
    p.add_argument("--samples", type=int, default=256, help="held-out sequences, spread over the held-out shards")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--per-folder", action="store_true",
                   help="draw --samples evenly from each folder and also score each folder apart (e.g. greedy "
                        "harvests against sampled ones)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p.parse_args(argv)


def report(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """`compare`, printed as JSON on stdout."""
    result = compare(args)
    print(json.dumps(result, indent=1))
    return result


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), report, lambda r: f"scored {len(r)} drafters on the same held-out blocks")


if __name__ == "__main__":
    raise SystemExit(main())
