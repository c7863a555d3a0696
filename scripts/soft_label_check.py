"""How much a hard label leaves out: on a harvest folder's held-out shard, how often the target's
distribution read from the stored last-layer outputs (norm + LM head, as `--soft-labels` reads
it) puts its argmax on the recorded next token, and its mean entropy at answer positions.

    python scripts/soft_label_check.py --model TARGET_DIR HARVEST_DIR [HARVEST_DIR ...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specflash.models.target import TargetModel
from specflash.training.data import load_training_target, read_shard
from specflash.training.dflash_features import harvested_features
from specflash.training.dflash_objective import make_sequence


def check(target: TargetModel, folder: Path, shard: str, samples: int) -> tuple[float, int, float]:
    """(argmax agreement, answer positions, mean entropy in nats) over the shard's first samples."""
    path = folder / shard
    rows = read_shard(path)
    feats = harvested_features(path, (target.num_layers - 1,), len(rows))
    if feats is None:
        raise SystemExit(f"{path} stores no outputs of the target's last layer")
    agree = total = 0
    entropy = 0.0
    for sample, hidden in list(zip(rows, feats))[:samples]:
        next_ids = make_sequence(sample.token_ids, sample.prompt_len, sample.labels).next_ids
        with torch.no_grad():
            logits = target.head_logits(hidden.float())[sample.prompt_len : len(next_ids)].float()
        agree += int((logits.argmax(-1) == next_ids[sample.prompt_len :]).sum())
        total += len(logits)
        p = logits.softmax(-1)
        entropy += float(-(p * p.clamp_min(1e-12).log()).sum())
    return agree / total, total, entropy / total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--shard", default="shard-00001.safetensors")
    p.add_argument("--samples", type=int, default=40)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("folders", nargs="+", type=Path)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    target = load_training_target(args.model, args.device)
    print("| folder | argmax = recorded token | answer positions | mean entropy (nats) |\n|---|---|---|---|")
    for folder in args.folders:
        agree, total, entropy = check(target, folder, args.shard, args.samples)
        print(f"| {folder.name} | {agree:.4f} | {total} | {entropy:.3f} |")


if __name__ == "__main__":
    main()
