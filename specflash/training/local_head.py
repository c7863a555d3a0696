"""Train DeLS-Spec's local head: `python -m specflash.training.local_head`.

Plain next-token prediction on the same anchored blocks DFlash trains on, decay-weighted, with
no target forward at all (only the target's frozen embeddings and LM head), so it costs minutes
where a drafter costs hours. Checkpoints (weights + optimizer + step) go to a cache folder and a
restart resumes from the last one; `train_log.json` there holds the run's summary and its loss at
every step; `--export` writes the fp16 head that the `dels` method loads.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from ..errors import SpecFlashError
from ..models.local_head import LocalHead, LocalHeadSpec, build_local_head, load_local_head, save_local_head
from .data import Sample, read_shard, shard_entries


def unigram_log_prior(samples: Sequence[Sample], vocab_size: int) -> torch.Tensor:
    """log p(token) over the loss tokens of the training data, add-one smoothed: l_prior."""
    counts = torch.ones(vocab_size, dtype=torch.float64)
    for s in samples:
        ids = torch.tensor(s.token_ids[s.prompt_len :], dtype=torch.long)
        counts += torch.bincount(ids[ids < vocab_size], minlength=vocab_size).double()
    return (counts / counts.sum()).log().float()


def anchored_blocks(samples: Sequence[Sample], block_size: int, per_sample: int, rng: random.Random) -> torch.Tensor:
    """[N, L] token blocks whose first token is committed context and whose next L-1 tokens are
    response tokens (the ones a drafter would have to predict)."""
    blocks = []
    for s in samples:
        first, last = max(s.prompt_len - 1, 0), len(s.token_ids) - block_size
        if last < first:
            continue
        for a in rng.sample(range(first, last + 1), min(per_sample, last - first + 1)):
            blocks.append(s.token_ids[a : a + block_size])
    if not blocks:
        raise ValueError(f"no sample is long enough for blocks of {block_size} tokens")
    return torch.tensor(blocks, dtype=torch.long)


def split_by_shard(dirs: Sequence[Path], hold_out: Sequence[str]) -> tuple[list[Sample], list[Sample]]:
    """(training, held-out) samples of the data folders: shards named in `hold_out` are held out,
    the same shard names the drafter's trainer holds out, so one split serves both."""
    train, held = [], []
    for d, shard in shard_entries(dirs):
        (held if shard["file"] in hold_out else train).extend(read_shard(d / shard["file"]))
    if hold_out and not held:
        raise SpecFlashError(f"none of the --hold-out shards {list(hold_out)} is in the data folders")
    return train, held


def held_out_blocks(held: Sequence[Sample], block_size: int, per_sample: int, limit: int, seed: int) -> torch.Tensor:
    """At most `limit` anchored blocks of the held-out samples, a seeded choice: scoring every
    block through the full-vocabulary LM head would cost as much as the training itself."""
    blocks = anchored_blocks(held, block_size, per_sample, random.Random(seed))
    keep = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(seed))[:limit]
    return blocks[keep.sort().values]


@torch.no_grad()
def mean_block_loss(head: LocalHead, blocks: torch.Tensor, gamma: float, batch: int = 256) -> float:
    """`block_loss` over many blocks, in batches; every block counts the same."""
    total = 0.0
    for i in range(0, len(blocks), batch):
        part = blocks[i : i + batch]
        total += block_loss(head, part, gamma).item() * len(part)
    return total / len(blocks)


def baseline_loss(folder: Path, target, blocks: torch.Tensor, gamma: float) -> float:
    """An existing head's loss on the new head's held-out blocks: the one comparison that says
    whether the new head is worth shipping, on data neither was trained on."""
    head = load_local_head(folder, target).float().eval()
    if head.spec.block_size != blocks.shape[1]:
        raise SpecFlashError(f"--baseline {folder} has block size {head.spec.block_size}, the new head "
                             f"{blocks.shape[1]}: their losses are not comparable")
    return mean_block_loss(head, blocks, gamma)


def block_loss(head: LocalHead, blocks: torch.Tensor, gamma: float) -> torch.Tensor:
    """Decay-weighted CE: slot k (1..L-1) predicted from tokens 0..k-1, weight exp(-(k-1)/gamma)."""
    logits, _ = head(blocks[:, :-1])  # [B, L-1, V]
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), blocks[:, 1:].flatten(), reduction="none")
    k = torch.arange(blocks.shape[1] - 1, device=blocks.device, dtype=torch.float32)
    weights = torch.exp(-k / gamma).repeat(blocks.shape[0])
    return (ce * weights).sum() / weights.sum()


def _checkpoint(out: Path, head: LocalHead, opt: torch.optim.Optimizer, step: int, args: argparse.Namespace) -> None:
    tmp = out / "checkpoint.pt.tmp"
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "args": vars(args)}, tmp)
    tmp.replace(out / "checkpoint.pt")


def train(args: argparse.Namespace) -> Path:
    from ..api import load

    torch.manual_seed(args.seed)
    target = load(args.model, device=args.device, dtype=torch.float32)
    for p in target.model.parameters():
        p.requires_grad_(False)
    samples, held = split_by_shard([Path(d).expanduser() for d in args.data.split(",")], args.hold_out)
    spec = LocalHeadSpec(target.vocab_size, target.hidden_size, args.hidden, args.block_size)
    head = build_local_head(spec, target)
    head.log_prior.copy_(unigram_log_prior(samples, target.vocab_size))
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    step = 0
    if (out / "checkpoint.pt").exists():
        state = torch.load(out / "checkpoint.pt", map_location=target.device)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
        print(f"resuming from step {step}", file=sys.stderr)
    step_start = step
    rng = random.Random(args.seed + step)
    blocks = anchored_blocks(samples, args.block_size, args.anchors_per_sample, rng).to(target.device)
    log = []
    t0 = time.perf_counter()
    bar = tqdm(range(step, args.steps), initial=step, total=args.steps, desc="local head")
    for step in bar:
        batch = blocks[torch.randint(len(blocks), (args.batch,))]
        loss = block_loss(head, batch, args.gamma)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
        log.append(loss.item())
        if (step + 1) % args.checkpoint_every == 0 or step + 1 == args.steps:
            _checkpoint(out, head, opt, step + 1, args)
    summary = {
        "steps": args.steps, "blocks": len(blocks), "samples": len(samples), "seconds_this_run": time.perf_counter() - t0,
        "final_loss": sum(log[-20:]) / max(len(log[-20:]), 1) if log else None,
        "tokens_trained": args.steps * args.batch * (args.block_size - 1),
    }
    if held:
        held_blocks = held_out_blocks(held, args.block_size, args.anchors_per_sample, args.held_out_blocks, args.seed)
        held_blocks = held_blocks.to(target.device)
        summary |= {"held_out_samples": len(held), "held_out_blocks": len(held_blocks),
                    "held_out_loss": mean_block_loss(head.eval(), held_blocks, args.gamma)}
        if args.baseline:
            summary["baseline_held_out_loss"] = {
                str(folder): baseline_loss(Path(folder), target, held_blocks, args.gamma) for folder in args.baseline}
    log_path = out / "train_log.json"
    if log or not log_path.exists():
        log_path.write_text(json.dumps({**summary, "losses": {"first_step": step_start, "loss": log}, "args": vars(args)},
                                       indent=2))
    else:  # a rerun with nothing left to train (e.g. to export): the last run's summary stands
        summary = {k: v for k, v in json.loads(log_path.read_text()).items() if k in summary}
    if args.export:
        save_local_head(head, Path(args.export), extra={"training": summary})
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.local_head", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--data", required=True, help="comma-separated shard folders from specflash.training.data")
    p.add_argument("--out", default=None, help="checkpoint folder (default: ~/.cache/specflash/train/local-head-<model>)")
    p.add_argument("--hold-out", default=[], type=lambda s: [x for x in s.split(",") if x], metavar="SHARD,...",
                   help="shard files left out of training and scored at the end (held_out_loss)")
    p.add_argument("--baseline", default=[], type=lambda s: [x for x in s.split(",") if x], metavar="HEAD,...",
                   help="existing head folders scored on the same held-out blocks (baseline_held_out_loss)")
    p.add_argument("--held-out-blocks", type=int, default=2048, help="at most this many held-out blocks are scored")
    p.add_argument("--export", default=None, help="write the fp16 head here when done (e.g. assets/heads/...)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--gamma", type=float, default=7.0)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch", type=int, default=64, help="blocks per step")
    p.add_argument("--anchors-per-sample", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out is None:
        from ..models.acquire import default_cache_dir

        args.out = str(default_cache_dir() / "train" / f"local-head-{Path(args.model).name}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    train(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
