"""Train a DFlash 2 drafter (convolutions + candidate selector) from a trained DFlash drafter.

Why start from DFlash: identity convolutions and a zero transition term make the converted
drafter draft exactly what the DFlash one drafts (models/dflash2.py `from_dflash`), so training
can only add to it, and DFlash vs DFlash 2 measures what the two new parts bring.

What trains (`--train`):
  convs (default)  the convolutions and the selector; the DFlash weights stay frozen. The
                   convolutions see the selector's and DFlash's unary loss (dflash2_objective.py),
                   so they can fix the hidden states the selector reads without the base drifting
                   from the committed drafter (a separate DFlash run may still be improving it,
                   and a frozen base keeps the comparison about the new parts). No weight
                   gradients for the 4.5 M base parameters, either.
  selector         only the selector: the drafter network runs without autograd (cheapest step).
  all              everything; the DFlash weights at `--base-lr` (default a tenth of `--lr`), low
                   enough not to undo their training in the first steps of a fresh schedule.
The new parts train at `--lr`. No weight decay on the convolutions' base kernels (it would pull
the identity tap off 1) nor on the codebooks (rows of rarely drafted tokens would shrink between
their updates).

Data, features, schedule, checkpoints and resume are the DFlash trainer's (training/dflash.py):
the same harvest shards in the same seeded order, their stored features, AdamW with warmup and
cosine decay, a checkpoint every `--save-every` steps and when `--minutes` run out in
train/dflash2-NAME, resumed by running the same command again. The export is fp16 in the DFlash 2
release layout, with the DFlash drafter's d2t draft vocabulary when it has one (the selector's
candidates are then the top K of that vocabulary). An AdaFlash length head stored beside the
DFlash drafter is not carried over: it was fitted to DFlash's hidden states.

    python -m specflash.training.dflash2 --model PATH --data DIR[,DIR...] --init-from DFLASH_DRAFTER
        [--name NAME] [--train convs] [--minutes 30] [--threads 1] [--export DIR]
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Sequence as Seq
from pathlib import Path

import platformdirs
import torch
from tqdm import tqdm

from ..errors import SpecFlashError
from ..models.dflash import loss_weights
from ..models.dflash2 import DFlash2Drafter, DFlash2Spec, from_dflash
from ..models.dflash_io import DFLASH2_KEYS, load_drafter, save_drafter
from ..models.target import TargetModel
from .data import load_training_target
from .dflash import (CHECKPOINT, EPOCHS_HELP, TRAINER_STATE, Progress, TrainLoop, _total_steps, add_hold_out_arg,
                     add_precision_arg, add_rehearse_args, default_epochs, learning_rate, resolve_precision)
from .dflash2_objective import combine, sequence_terms
from .dflash_objective import sample_anchors
from .entry import run_script

RELEASE_SHAPE = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}


def trainable_groups(model: DFlash2Drafter, train: str, lr: float, base_lr: float) -> list[dict]:
    """Freeze what `train` keeps fixed; AdamW groups of the rest, each with its peak `lr`."""
    groups: dict[tuple[bool, float], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        selector = name.startswith("candidate_selector.")
        new = selector or "_conv." in name
        p.requires_grad_({"all": True, "convs": new, "selector": selector}[train])
        if p.requires_grad:
            decay = 0.0 if name.endswith(("base_kernel", "_codebook")) else 0.01
            groups.setdefault((new, decay), []).append(p)
    return [{"params": ps, "lr": lr if new else base_lr, "peak_lr": lr if new else base_lr, "weight_decay": decay}
            for (new, decay), ps in groups.items()]


def _shape_args(args: argparse.Namespace) -> dict[str, int]:
    """The convolution and selector shape options given on the command line."""
    return {k: getattr(args, k) for k in DFLASH2_KEYS if getattr(args, k) is not None}


def starting_drafter(args: argparse.Namespace, target: TargetModel) -> DFlash2Drafter:
    """`--init-from` as a DFlash 2 drafter: converted from a DFlash one (identity start), or a
    DFlash 2 one as it is (to train it further)."""
    source = load_drafter(args.init_from, target)
    if isinstance(source, DFlash2Drafter):
        _check_shape(source.spec, args, str(args.init_from))
        return source
    try:
        return from_dflash(source, torch.Generator().manual_seed(args.seed), codebook_std=args.codebook_std,
                           **{**RELEASE_SHAPE, **_shape_args(args)})
    except ValueError as exc:
        raise SpecFlashError(f"{args.init_from}: {exc}") from None


def _check_shape(spec: DFlash2Spec, args: argparse.Namespace, name: str) -> None:
    wrong = {k: v for k, v in _shape_args(args).items() if getattr(spec, k) != v}
    if wrong:
        raise SpecFlashError(f"{name} has " + ", ".join(f"{k} {getattr(spec, k)}" for k in wrong) +
                             f", not the asked {wrong}; drop those options or use another --name")


def init_or_resume(args, target: TargetModel, out: Path) -> tuple[DFlash2Drafter, torch.optim.Optimizer, Progress]:
    """The starting drafter and a fresh optimizer, or the last checkpoint in `out` with its
    optimizer and position in the data."""
    ckpt = out / CHECKPOINT
    resuming = (ckpt / TRAINER_STATE).is_file()
    model = load_drafter(ckpt, target) if resuming else starting_drafter(args, target)
    if resuming:
        _check_shape(model.spec, args, str(ckpt))
    model = model.float().train()
    # fused: one kernel over the 2 x V x r codebooks (on one CPU thread 20 ms a step, not 450 ms)
    opt = torch.optim.AdamW(trainable_groups(model, args.train, args.lr, args.base_lr), betas=(0.9, 0.95), fused=True)
    if not resuming:
        return model, opt, Progress()
    state = torch.load(ckpt / TRAINER_STATE, map_location=target.device, weights_only=True)
    try:
        opt.load_state_dict(state["optimizer"])
    except ValueError:
        raise SpecFlashError(f"{ckpt} was trained with another --train; pass the same one or another --name") from None
    return model, opt, Progress(**state["progress"])


def _step(args, model, opt, batch, weights, progress: Progress, total: int) -> dict:
    """One optimizer step over a few sequences (each its own forward; terms pooled by combine)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + progress.step)
    unary_weight = 0.0 if args.train == "selector" else args.unary_weight
    device_type = next(model.parameters()).device.type
    terms = []
    for seq, feats in batch:
        anchors = sample_anchors(seq, args.anchors, g)
        if len(anchors) == 0:
            continue
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            terms.append(sequence_terms(model, seq, feats, anchors, weights, unary_weight, args.train != "selector"))
    loss, stats = combine(terms, unary_weight) if terms else (None, {})
    if loss is None:
        return {}
    scale = learning_rate(args, progress.step, total, progress.seconds) / args.lr
    for group in opt.param_groups:
        group["lr"] = group["peak_lr"] * scale
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for group in opt.param_groups for p in group["params"]], args.clip)
    opt.step()
    return stats


def train(args: argparse.Namespace) -> Progress:
    """Run (or resume) training until `--epochs`/`--steps` or `--minutes` are used up; export."""
    out = Path(args.out or Path(platformdirs.user_cache_dir("specflash")) / "train" / f"dflash2-{args.name}")
    out.mkdir(parents=True, exist_ok=True)
    target = load_training_target(args.model, args.device)
    model, opt, progress = init_or_resume(args, target, out)
    total = _total_steps(args)
    cache = None if args.no_feature_cache else Path(args.feature_cache or out.parent / "features")
    args.gamma = args.gamma or model.spec.block_size / 2
    weights = loss_weights(model.spec.block_size, args.gamma)
    TrainLoop(
        args, target, model, opt, progress, out, total, cache,
        tqdm(total=total, initial=progress.step, unit="step", desc=f"dflash2-{args.name}"),
        step=lambda batch: _step(args, model, opt, batch, weights, progress, total),
        postfix=lambda s: {"sel": f"{s.get('selector_loss', 0):.3f}", "recall": f"{s['recall']:.2f}",
                           "tau": f"{s['tau_selector']:.2f}/{s['tau_unary']:.2f}"},
    ).run()
    save_drafter(model, out / "export", dtype=torch.float16, extra=recipe(args, progress))
    if args.export:
        shutil.copytree(out / "export", args.export, dirs_exist_ok=True)
    return progress


def recipe(args: argparse.Namespace, progress: Progress) -> dict:
    """How the drafter was trained, stored in its config.json (ignored by loaders). Paths by
    folder name only: the config may ship in assets/."""
    keep = ("train", "lr", "base_lr", "unary_weight", "gamma", "anchors", "seqs_per_step", "warmup", "clip", "seed",
            "codebook_std")
    return {"specflash_training": {**{k: getattr(args, k) for k in keep}, "init_from": Path(args.init_from).name,
                                   "data": [Path(d).name for d in args.data], "held_out": list(args.hold_out),
                                   "steps": progress.step,
                                   "tokens": progress.tokens, "minutes": round(progress.seconds / 60, 1)}}


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.dflash2", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder of the target")
    p.add_argument("--data", required=True, type=lambda s: [Path(x) for x in s.split(",") if x],
                   help="comma list of data folders (harvest or data shards)")
    p.add_argument("--init-from", required=True, type=Path,
                   help="the DFlash drafter to start from (converted, identity start), or a DFlash 2 one to continue")
    add_hold_out_arg(p)
    add_rehearse_args(p)
    p.add_argument("--name", default="run", help="run name: the cache folder is train/dflash2-NAME")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: per-user cache)")
    p.add_argument("--export", type=Path, default=None, help="also copy the final fp16 drafter here")
    p.add_argument("--train", choices=("convs", "selector", "all"), default="convs",
                   help="what trains: convolutions + selector (DFlash weights frozen), the selector only, or all")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the convolutions and the selector")
    p.add_argument("--base-lr", type=float, default=None, help="peak learning rate of the DFlash weights "
                   "(--train all; default --lr / 10)")
    p.add_argument("--unary-weight", type=float, default=1.0,
                   help="weight of DFlash's cross-entropy on the unary logits beside the selector's (0 = selector only)")
    for key, help_ in (("conv_kernel_size", "convolution taps"), ("conv_group_size", "channels per dynamic group"),
                       ("selector_rank", "codebook rank r"), ("selector_top_k", "candidates K per slot")):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None,
                       help=f"{help_} (default {RELEASE_SHAPE[key]}, the release's; or the --init-from DFlash 2 drafter's)")
    p.add_argument("--codebook-std", type=float, default=0.02, help="std of the codebooks' normal init")
    p.add_argument("--gamma", type=float, default=None, help="slot weight decay exp(-(k-1)/gamma); default block_size/2")
    p.add_argument("--warmup", type=float, default=0.04, help="fraction of steps")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: the epochs)")
    p.add_argument("--minutes", type=float, default=None, help="stop (with a checkpoint) after this much training")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--feature-cache", type=Path, default=None, help="default: train/features next to the run")
    p.add_argument("--no-feature-cache", action="store_true")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_precision_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    default_epochs(args)
    resolve_precision(args)
    for flag in ("anchors", "seqs_per_step", "epochs", "save_every", "log_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    args.base_lr = args.base_lr if args.base_lr is not None else args.lr / 10
    return args


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), train,
                      lambda p: f"trained {p.step} steps, {p.tokens} tokens, {p.seconds / 60:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
