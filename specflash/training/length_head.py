"""Train AdaFlash's length head on a frozen DFlash drafter (methods.md §2.3, "offline head init").

For anchored blocks of the target's own responses, the frozen drafter drafts as it would at
inference; the label is r* = (accepted + 1) / L, the verify length that would have sufficed
(greedy acceptance against the target's tokens), and the head regresses it with MSE on the
detached block hidden states. The drafter never changes, so its hidden states are computed once
and the head then trains for many cheap epochs. A tenth of the sequences is held out to report
how well the head predicts (MSE, and the mean |verify length error| in tokens). The head is
written into a copy of the drafter folder (AdaFlash's tensor names), ready for `-o rule=head`.

    python -m specflash.training.length_head --model smollm2-135m --drafter DIR --data DIR[,DIR...]
        --export OUT_DIR [--anchors 64] [--epochs 30]
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import platformdirs
import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..errors import SpecFlashError
from ..models.dflash import DFlashDrafter
from ..models.dflash_io import D2T_FILE
from ..models.length_head import LengthHead, length_labels, load_length_head, save_length_head, verify_len
from ..models.presets import portable_path
from ..models.target import TargetModel
from .data import read_shard
from .dflash import recorded_hold_out, shard_paths
from .dflash_features import shard_features
from .entry import run_script
from .dflash_objective import block_forward, block_labels, leading_correct, make_sequence, sample_anchors, slot_logits


@dataclass
class Blocks:
    hidden: torch.Tensor  # [N, L, H] float16, the frozen drafter's block states
    accepted: torch.Tensor  # [N] greedy acceptance of each block's drafts


@torch.inference_mode()
def collect_blocks(target: TargetModel, model: DFlashDrafter, shards: list[Path], anchors: int, seed: int,
                   feature_cache: Path | None) -> list[Blocks]:
    """One Blocks per sequence, in shard order."""
    g = torch.Generator().manual_seed(seed)
    L, out = model.spec.block_size, []
    for shard in tqdm(shards, desc="drafting blocks", unit="shard"):
        samples = read_shard(shard)
        feats = shard_features(target, samples, shard, model.spec.target_layer_ids, feature_cache)
        for sample, f in zip(samples, feats):
            seq = make_sequence(sample.token_ids, sample.prompt_len, sample.labels)
            picks = sample_anchors(seq, anchors, g)
            if len(picks) == 0:
                continue
            hidden = block_forward(model, seq, f.to(target.device, torch.float32), picks)  # [N, L, H]
            labels, valid = block_labels(seq.next_ids.to(target.device), picks.to(target.device), L)
            logits, labels, reachable = slot_logits(model, hidden, labels, valid)  # draft vocabulary only
            accepted = leading_correct(logits, labels, reachable)
            out.append(Blocks(hidden.to("cpu", torch.float16), accepted.cpu()))
    return out


@dataclass
class FitLog:
    """Mean training loss per epoch, the stopping set's MSE after each (empty without one), and
    the epoch whose weights the head keeps (the last without a stopping set)."""

    train: list[float] = field(default_factory=list)
    stop: list[float] = field(default_factory=list)
    best_epoch: int = 0


def fit(head: LengthHead, train: Blocks, epochs: int, lr: float, batch: int, seed: int, block_size: int,
        stop_on: Blocks | None = None) -> FitLog:
    """MSE training of a fresh head. With `stop_on`, blocks of sequences it does not fit on, the
    head keeps the weights of the epoch with the lowest MSE there: fitted for 30 epochs on 3
    shards, the shipped head reached MSE 0.005 on its training blocks and 0.028 on held-out ones.

    The output starts at the mean label (bias = its logit, small weights): labels sit near 0 when
    drafts are rarely accepted, and a head started at r = 0.5 can overshoot into the flat tail
    of the sigmoid, where MSE has no gradient left (seen on SmolLM2 at lr 1e-3: r ~ 1e-12
    everywhere)."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    target = length_labels(train.accepted, block_size)
    with torch.no_grad():
        head.out.bias.fill_(float(torch.logit(target.mean().clamp(1e-3, 1 - 1e-3))))
        head.out.weight.mul_(0.1)
    log, best = FitLog(), None
    for epoch in tqdm(range(1, epochs + 1), desc="length head", unit="epoch"):
        order, total = torch.randperm(len(target), generator=g), 0.0
        for i in range(0, len(order), batch):
            idx = order[i : i + batch]
            loss = F.mse_loss(head(train.hidden[idx].float()), target[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(idx)
        log.train.append(total / len(target))
        if stop_on is not None:
            log.stop.append(mse(head, stop_on, block_size))
            if log.stop[-1] == min(log.stop):
                best, log.best_epoch = copy.deepcopy(head.state_dict()), epoch
    if best is None:
        log.best_epoch = epochs
    else:
        head.load_state_dict(best)
    return log


@torch.inference_mode()
def predict(head: LengthHead, blocks: Blocks) -> torch.Tensor:
    """The head's r for every block, a chunk at a time: all at once, the 92 k training blocks of
    seven shards took over 20 GB and were killed."""
    return torch.cat([head(chunk.float()) for chunk in blocks.hidden.split(4096)])


def mse(head: LengthHead, blocks: Blocks, block_size: int, r: torch.Tensor | None = None) -> float:
    """MSE of the head's r (`predict`, unless given) against the blocks' labels (what `fit`
    minimises and stops on)."""
    r = predict(head, blocks) if r is None else r
    return float(F.mse_loss(r, length_labels(blocks.accepted, block_size)))


@torch.inference_mode()
def score(head: LengthHead, blocks: Blocks, block_size: int, rate: float = 1.0, min_len: int = 1) -> dict[str, float]:
    """How well the head predicts: MSE on r, mean |verify_len - (accepted + 1)| in tokens, the
    share of blocks it cuts short of their accepted run (lost acceptance), and the verify length
    it asks for against the full block."""
    r = predict(head, blocks)
    want = blocks.accepted + 1
    lengths = torch.tensor([verify_len(float(x), block_size, rate, min_len) for x in r])
    return {
        "mse": mse(head, blocks, block_size, r),
        "mean_abs_len_error": float((lengths - want).abs().float().mean()),
        "cut_short": float((lengths < want).float().mean()),
        "mean_verify_len": float(lengths.float().mean()),
        "mean_needed_len": float(want.float().mean()),
        "blocks": len(want),
    }


def _join(blocks: list[Blocks]) -> Blocks:
    return Blocks(torch.cat([b.hidden for b in blocks]), torch.cat([b.accepted for b in blocks]))


def pick_shards(args: argparse.Namespace) -> tuple[list[Path], bool]:
    """The shards to fit on, and whether the drafter never trained on them: the shards its config
    says it held out (`--hold-out` of the trainer) when the data holds them, else the first
    `--max-shards`. On shards it trained on, a drafter accepts more than on new text, and a head
    fitted there asks for too long drafts."""
    from ..drafters.dflash import drafter_folder

    every = shard_paths(args.data)
    held = recorded_hold_out(drafter_folder(str(args.drafter)))
    unseen = [p for p in every if p.name in held]
    if unseen:
        return unseen[: args.max_shards], True
    return every[: args.max_shards], False


def train(args: argparse.Namespace) -> dict:
    from ..api import load
    from ..drafters.dflash import drafter_folder, load_dflash_model

    target = load(args.model, device=args.device, dtype=torch.float32)
    model = load_dflash_model(target, args.drafter, "length_head").float().eval()
    cache = Path(args.feature_cache or Path(platformdirs.user_cache_dir("specflash")) / "train" / "features")
    shards, unseen = pick_shards(args)
    per_seq = collect_blocks(target, model, shards, args.anchors, args.seed, cache)
    if len(per_seq) < 2:
        raise SpecFlashError("too little data: need at least two sequences with response tokens")
    # sequences apart: a tenth to report on, a tenth (with 3 sequences or more) to stop on, the rest to fit
    n_val = max(1, len(per_seq) // 10)
    n_stop = max(1, len(per_seq) // 10) if len(per_seq) >= 3 else 0
    order = torch.randperm(len(per_seq), generator=torch.Generator().manual_seed(args.seed)).tolist()
    val = _join([per_seq[i] for i in order[:n_val]])
    stop_on = _join([per_seq[i] for i in order[n_val : n_val + n_stop]]) if n_stop else None
    fit_on = _join([per_seq[i] for i in order[n_val + n_stop :]])
    previous = load_length_head(drafter_folder(str(args.drafter)), model.spec.hidden_size)
    torch.manual_seed(args.seed)
    head = LengthHead(model.spec.hidden_size, args.bottleneck)
    L = model.spec.block_size
    log = fit(head, fit_on, args.epochs, args.lr, args.batch, args.seed, L, stop_on)
    report = {"train": score(head, fit_on, L), "heldout": score(head, val, L), "epoch_losses": log.train,
              "stop_mse": log.stop, "best_epoch": log.best_epoch,
              # the head the drafter folder holds already, if any, on the same held-out blocks: what a refit replaces
              "heldout_previous": None if previous is None else score(previous, val, L),
              "recipe": {k: getattr(args, k) for k in ("anchors", "epochs", "lr", "batch", "bottleneck", "seed", "max_shards")},
              "data": [portable_path(d) for d in args.data], "drafter": portable_path(args.drafter),
              "shards": [p.name for p in shards], "shards_unseen_by_drafter": unseen}
    args.export.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", D2T_FILE):
        source = drafter_folder(str(args.drafter)) / name
        if source.is_file() and source.resolve() != (args.export / name).resolve():
            shutil.copyfile(source, args.export / name)
    save_length_head(head, args.export)
    (args.export / "length_head_report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return report


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.length_head", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="preset, local folder or cached hub id of the target")
    p.add_argument("--drafter", required=True, help="the frozen DFlash drafter folder")
    p.add_argument("--data", required=True, type=lambda s: [Path(x) for x in s.split(",") if x],
                   help="comma list of data folders (training.data or training.opd rounds) of target responses")
    p.add_argument("--export", required=True, type=Path, help="folder for the drafter + head (a copy of --drafter)")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--max-shards", type=int, default=None, help="use at most N shards (drafting the blocks is most of "
                   "the time): the drafter's held-out shards when its config lists them, else the first N")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--bottleneck", type=int, default=256)
    p.add_argument("--feature-cache", type=Path, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("anchors", "epochs", "batch", "bottleneck"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} must be at least 1")
    return args


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), train, lambda r: json.dumps({k: r[k] for k in ("train", "heldout")}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
