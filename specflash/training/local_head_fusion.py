"""Train DeLS-Spec's local head against a DFlash drafter: `python -m specflash.training.local_head_fusion`.

Why: the local head of `training.local_head` learns plain next-token prediction, on its own. In
the method it only ever acts through the fusion rule, added to one particular drafter's logits
and only among that drafter's top candidates (drafters/dels.py). Trained alone, it spends its
capacity on what the drafter already gets right, and a lower loss of its own did not raise the
method's acceptance twice (the head's README). Here the drafter is frozen and the head learns the
fused objective itself: for every block slot, the cross-entropy of

    softmax over the drafter's top candidates of  long - beta * prior + alpha * short

against the target's token, the head reading the block's tokens before that slot (what an
accepted draft holds). It learns what to add to this drafter, where it errs.

The examples are drafter-specific, and the drafter must not have trained on them: on its own
training data it is far surer than on new text (training-block τ ran ~0.4 above held-out τ,
docs/dflash.md), and a head fitted there would learn to defer to it. So `--data` takes shard files
as well as folders, to pick shards the drafter never saw; the held-out shards of the folders are
scored for the report, offline: the leading run of fused argmaxes equal to the target's tokens is
what greedy verification accepts with the gate off (scripts/dels_sweep.py measures it by decoding).

    python -m specflash.training.local_head_fusion --model TARGET --drafter DRAFTER --init-from HEAD \
        --data DIR/shard-00006.safetensors,... --eval-data DIR,... --hold-out shard-00001.safetensors \
        --steps 1500 --export OUT
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafters.dels import DeLSConfig
from ..errors import SpecFlashError
from ..models.dflash import DFlashDrafter, loss_weights
from ..models.dflash_io import load_drafter
from ..models.local_head import LocalHead, load_local_head, save_local_head
from .data import load_training_target, read_shard, shard_entries
from .dflash_features import shard_features
from .dflash_objective import block_forward, block_labels, make_sequence, sample_anchors
from .entry import run_script
from .validation import Block, held_out_blocks

_DEFAULTS = DeLSConfig()


@dataclass
class FusionExamples:
    """Anchored blocks with what the fusion needs of the frozen drafter, for slots 1..L-1."""

    blocks: torch.Tensor  # [N, L] anchor token, then the L-1 target tokens (an accepted draft)
    candidates: torch.Tensor  # [N, L-1, C] target ids: the drafter's top C by long - beta * prior
    base: torch.Tensor  # [N, L-1, C] long - beta * prior at those candidates
    label_index: torch.Tensor  # [N, L-1] where the target's token is among them, -1 if it is not
    valid: torch.Tensor  # [N, L-1] the slot lies inside its sequence

    def __len__(self) -> int:
        return len(self.blocks)

    def take(self, index: torch.Tensor) -> FusionExamples:
        return FusionExamples(*(getattr(self, f.name)[index] for f in fields(self)))

    @staticmethod
    def cat(parts: Sequence[FusionExamples]) -> FusionExamples:
        if not parts:
            raise SpecFlashError("no anchored blocks: the sequences are shorter than one block")
        return FusionExamples(*(torch.cat([getattr(p, f.name) for p in parts]) for f in fields(FusionExamples)))


@torch.no_grad()
def block_examples(drafter: DFlashDrafter, block: Block, prior: torch.Tensor, beta: float,
                   candidates: int) -> FusionExamples:
    """The fusion examples of one sequence's anchored blocks (`prior` the head's log_prior [V])."""
    seq, feats, anchors = block
    L = drafter.spec.block_size
    hidden = block_forward(drafter, seq, feats.float(), anchors)[:, 1:]  # [n, L-1, H]
    vocab = drafter.draft_ids
    long = (drafter.logits(hidden) if vocab is None else drafter.draft_logits(hidden)).float()
    base = long - beta * (prior if vocab is None else prior[vocab])
    top = base.topk(min(candidates, base.shape[-1]) if candidates else base.shape[-1])
    ids = top.indices if vocab is None else vocab[top.indices]
    labels, valid = block_labels(seq.next_ids, anchors, L)
    hit = ids == labels[..., None]
    label_index = torch.where(hit.any(-1), hit.float().argmax(-1), torch.full_like(labels, -1))
    blocks = torch.cat([seq.tokens[anchors][:, None], labels], 1)
    return FusionExamples(blocks, ids, top.values, label_index, valid)


def shard_blocks(target, drafter: DFlashDrafter, shards: Sequence[Path], sequences: int, anchors: int,
                 cache_dir: Path | None, seed: int) -> list[Block]:
    """Up to `sequences` sequences spread evenly over `shards` (a seeded choice), each with its
    features (computed once per shard and cached, as the drafter's trainer does) and anchors."""
    g = torch.Generator().manual_seed(seed)
    per_shard = math.ceil(sequences / len(shards))
    layers = tuple(drafter.spec.target_layer_ids)
    out: list[Block] = []
    for shard in shards:
        samples = read_shard(shard)
        feats = shard_features(target, samples, shard, layers, cache_dir)
        for i in torch.randperm(len(samples), generator=g)[:per_shard].tolist():
            seq = make_sequence(samples[i].token_ids, samples[i].prompt_len, samples[i].labels)
            picked = sample_anchors(seq, anchors, g)
            if len(picked):
                out.append((seq, feats[i], picked))
    return out


def build_examples(drafter: DFlashDrafter, blocks: Iterable[Block], prior: torch.Tensor, beta: float,
                   candidates: int) -> FusionExamples:
    return FusionExamples.cat([block_examples(drafter, b, prior, beta, candidates) for b in blocks])


def fused_scores(head: LocalHead, ex: FusionExamples, alpha: float) -> torch.Tensor:
    """base + alpha * short over each slot's candidates ([N, L-1, C]), the local head reading
    the block's tokens before the slot and reading out only the candidates' LM-head rows."""
    if not alpha:
        return ex.base
    short, _ = head(ex.blocks[:, :-1], readout=head.candidate_readout(ex.candidates))
    return ex.base + alpha * short


def fusion_loss(head: LocalHead, ex: FusionExamples, alpha: float, weights: torch.Tensor) -> torch.Tensor:
    """Decay-weighted CE of the fused candidates against the target's token, over the slots whose
    token is among the candidates (no head can make the others win)."""
    scores = fused_scores(head, ex, alpha)
    w = weights[None] * (ex.valid & (ex.label_index >= 0))
    ce = F.cross_entropy(scores.flatten(0, 1), ex.label_index.clamp(min=0).flatten(), reduction="none")
    return (ce * w.flatten()).sum() / w.sum().clamp(min=1e-9)


@torch.no_grad()
def fused_acceptance(head: LocalHead, ex: FusionExamples, alpha: float, batch: int = 512) -> float:
    """1 + the mean leading run of slots whose fused argmax is the target's token: τ with the gate off."""
    accepted = 0
    for i in range(0, len(ex), batch):
        part = ex.take(torch.arange(i, min(i + batch, len(ex))))
        right = (fused_scores(head, part, alpha).argmax(-1) == part.label_index) & part.valid
        accepted += int(right.long().cumprod(1).sum())
    return 1 + accepted / max(len(ex), 1)


def training_shards(items: Sequence[Path], hold_out: Sequence[str]) -> list[Path]:
    """Shard files as given; a folder stands for its finished shards but the held-out ones."""
    shards = []
    for item in items:
        if item.is_dir():
            shards += [d / s["file"] for d, s in shard_entries([item], hold_out)]
        elif item.is_file():
            if item.name in hold_out:
                raise SpecFlashError(f"{item} is a --hold-out shard: it is scored, never trained on")
            shards.append(item)
        else:
            raise SpecFlashError(f"--data {item}: no such shard file or data folder")
    if not shards:
        raise SpecFlashError("--data names no finished shard")
    return shards


def report_grid(start: LocalHead, head: LocalHead, drafter: DFlashDrafter, held: list[Block],
                args: argparse.Namespace) -> dict:
    """Held-out τ of the drafter alone, the starting head and the trained head at the training
    alpha and beta, then the trained head over the --grid (each beta ranks its own candidates)."""
    prior = head.log_prior
    examples = {beta: build_examples(drafter, held, prior, beta, args.candidates)
                for beta in sorted({0.0, args.beta, *args.grid_betas})}
    out = {
        "drafter_alone": fused_acceptance(head, examples[0.0], 0.0),
        "start_head": fused_acceptance(start, examples[args.beta], args.alpha),
        "trained_head": fused_acceptance(head, examples[args.beta], args.alpha),
        "blocks": len(examples[0.0]),
        "grid": [{"alpha": a, "beta": b, "tau": fused_acceptance(head, examples[b], a)}
                 for a in args.grid_alphas for b in args.grid_betas],
    }
    out["best"] = max(out["grid"], key=lambda r: r["tau"]) if out["grid"] else None
    return out


def train(args: argparse.Namespace) -> dict:
    torch.manual_seed(args.seed)
    target = load_training_target(args.model, args.device)
    for p in target.model.parameters():
        p.requires_grad_(False)
    drafter = load_drafter(args.drafter, target).float().eval()
    start = load_local_head(args.init_from, target).float().eval()
    head = load_local_head(args.init_from, target).float().train()
    shards = training_shards(args.data, args.hold_out)
    eval_dirs = args.eval_data or sorted({s.parent for s in shards})
    layers = tuple(drafter.spec.target_layer_ids)
    held = held_out_blocks(target, eval_dirs, args.hold_out, layers, None, args.eval_samples, args.anchors, args.seed)
    t0 = time.perf_counter()
    blocks = shard_blocks(target, drafter, shards, args.sequences, args.anchors, args.feature_cache, args.seed)
    examples = build_examples(drafter, blocks, head.log_prior, args.beta, args.candidates)
    built = time.perf_counter() - t0
    weights = loss_weights(drafter.spec.block_size, args.gamma)
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(args.seed)
    losses, t1 = [], time.perf_counter()
    for step in range(args.steps):
        lr = args.lr * 0.5 * (1 + math.cos(math.pi * step / args.steps))
        for group in opt.param_groups:
            group["lr"] = lr
        loss = fusion_loss(head, examples.take(torch.randint(len(examples), (args.batch,), generator=g)),
                           args.alpha, weights)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            print(f"step {step + 1}: loss {sum(losses[-args.log_every:]) / args.log_every:.4f}", flush=True)
    head.eval()
    summary = {
        "drafter": str(args.drafter), "start": str(args.init_from), "alpha": args.alpha, "beta": args.beta,
        "candidates": args.candidates, "gamma": args.gamma, "shards": [f"{s.parent.name}/{s.name}" for s in shards],
        "sequences": len(blocks), "examples": len(examples),
        "label_among_candidates": float((examples.label_index >= 0)[examples.valid].float().mean()),
        "steps": args.steps, "batch": args.batch, "lr": args.lr, "seconds_examples": built,
        "seconds_training": time.perf_counter() - t1,
        "first_loss": sum(losses[:20]) / max(len(losses[:20]), 1) if losses else None,
        "final_loss": sum(losses[-20:]) / max(len(losses[-20:]), 1) if losses else None,
        "held_out": report_grid(start, head, drafter, held, args),
    }
    if args.export:
        save_local_head(head, Path(args.export), extra={"training": {"objective": "fused with a DFlash drafter",
                                                                     **summary}})
    return summary


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    def paths(text: str) -> list[Path]:
        return [Path(x).expanduser() for x in text.split(",") if x]

    def floats(text: str) -> list[float]:
        return [float(x) for x in text.split(",") if x]

    p = argparse.ArgumentParser(prog="python -m specflash.training.local_head_fusion",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder of the target")
    p.add_argument("--drafter", required=True, type=Path, help="the DFlash drafter the head is fused with")
    p.add_argument("--init-from", required=True, type=Path, help="local head folder to start from")
    p.add_argument("--data", required=True, type=paths,
                   help="comma list of shard files, or folders (all their shards but --hold-out): data the drafter "
                        "never trained on")
    p.add_argument("--eval-data", type=paths, default=None,
                   help="folders whose --hold-out shards are scored (default: the folders of --data)")
    p.add_argument("--hold-out", required=True, type=lambda s: [x for x in s.split(",") if x], metavar="SHARD,...")
    p.add_argument("--alpha", type=float, default=_DEFAULTS.alpha)
    p.add_argument("--beta", type=float, default=_DEFAULTS.beta)
    p.add_argument("--candidates", type=int, default=_DEFAULTS.candidates, help="0: every token")
    p.add_argument("--gamma", type=float, default=4.0, help="slot weights exp(-(k-1)/gamma)")
    p.add_argument("--sequences", type=int, default=1280, help="training sequences, spread over the shards")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=128, help="blocks per step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak rate, cosine to 0")
    p.add_argument("--eval-samples", type=int, default=210, help="held-out sequences scored")
    p.add_argument("--grid-alphas", type=floats, default=[0.3, 0.6, 1.0])
    p.add_argument("--grid-betas", type=floats, default=[0.0, 0.3])
    p.add_argument("--feature-cache", type=Path, default=None,
                   help="the drafter trainer's feature cache (default: train/features in the per-user cache)")
    p.add_argument("--export", type=Path, default=None, help="write the fp16 head here")
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.feature_cache is None:
        from ..models.acquire import default_cache_dir

        args.feature_cache = default_cache_dir() / "train" / "features"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    def summary(result: dict) -> str:
        h = result["held_out"]
        return (f"held-out τ over {h['blocks']} blocks: drafter alone {h['drafter_alone']:.3f}, starting head "
                f"{h['start_head']:.3f}, trained head {h['trained_head']:.3f}")

    def work(args: argparse.Namespace) -> dict:
        result = train(args)
        print(json.dumps(result, indent=1))
        return result

    return run_script(parse_args(argv), work, summary)


if __name__ == "__main__":
    raise SystemExit(main())
