"""On-policy distillation (AdaFlash) of a DFlash drafter, or its SFT baseline, in resumable rounds.

Each round (1) draws the next slice of the training prompt pool and lets the engine answer it
with the target (batched; what the deployed drafter would face), then (2) trains the drafter on
those fresh trajectories, teacher-forced, with the loss of training/opd_objective.py. As in the
reference pipeline, the trajectories are the target's own: at temperature 0 they do not depend
on the drafter, so round data is shared by every run with the same generation settings (an SFT
run and an OPD run compare on identical data and steps). Rounds, data batches and optimizer
steps all checkpoint into a cache folder outside the repo; the same command resumes.

    python -m specflash.training.opd --model smollm2-135m --objective opd|sft --name NAME
        [--drafter DIR] [--rounds 3] [--prompts-per-round 48] [--max-new-tokens 128] [--export DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from collections.abc import Sequence as Seq
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import platformdirs
import torch
from tqdm import tqdm

from ..config import SamplingConfig
from ..models.dflash import loss_weights
from ..models.dflash_io import load_state, save_drafter
from ..models.presets import default_drafter, portable_path
from ..models.target import TargetModel
from ..prompts import training_prompts
from .data import Sample, append_shard, read_manifest, read_shard
from .dflash import CHECKPOINT, TRAINER_STATE, save_checkpoint
from .dflash_features import shard_features
from .entry import run_script
from .dflash_objective import make_sequence, sample_anchors
from .opd_objective import OBJECTIVES, DistillConfig, block_terms, combine


@dataclass
class Progress:
    round: int = 0
    round_step: int = 0
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0


def cache_root() -> Path:
    return Path(platformdirs.user_cache_dir("specflash")) / "train"


def round_prompts(round_index: int, per_round: int, seed: int) -> list:
    """Round r's slice of a seeded permutation of the training prompts (wrapping around)."""
    pool = training_prompts()
    order = torch.randperm(len(pool), generator=torch.Generator().manual_seed(seed)).tolist()
    return [pool[order[(round_index * per_round + i) % len(pool)]] for i in range(per_round)]


def data_folder(args: argparse.Namespace, target: TargetModel) -> Path:
    """Round data is keyed by everything that shapes it, so runs that differ only in their
    objective share it."""
    key = {"model": Path(str(target.name)).name, "per_round": args.prompts_per_round, "seed": args.seed,
           "max_new_tokens": args.max_new_tokens, "temperature": args.gen_temperature, "method": args.gen_method}
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:10]
    return Path(args.data_dir or cache_root() / "opd-data") / f"{key['model']}-{digest}"


def round_data(args: argparse.Namespace, target: TargetModel, round_index: int) -> list[tuple[Path, list[Sample]]]:
    """The round's (shard, samples), answering whatever prompts are not answered yet, one
    engine batch per shard."""
    from ..api import encode_prompt, generate_batch

    out = data_folder(args, target) / f"round-{round_index:03d}"
    out.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(out) or {"shards": []}
    done = {sid for shard in manifest["shards"] for sid in shard["ids"]}
    todo = [p for p in round_prompts(round_index, args.prompts_per_round, args.seed) if f"{p.id}-r{round_index}" not in done]
    sampling = SamplingConfig(temperature=args.gen_temperature, seed=args.seed + round_index)
    drafter = args.drafter if args.gen_method != "ar" else None
    for i in tqdm(range(0, len(todo), args.gen_batch), desc=f"round {round_index}: answering", unit="batch"):
        batch = todo[i : i + args.gen_batch]
        prompts = [encode_prompt(target, p.text) for p in batch]
        result = generate_batch(target, prompts, method=args.gen_method, max_new_tokens=args.max_new_tokens,
                                sampling=sampling, drafter=drafter)
        samples = [Sample(ids + run.output_ids, len(ids), p.domain, f"opd-round-{round_index}", f"{p.id}-r{round_index}")
                   for p, ids, run in zip(batch, prompts, result.runs)]
        append_shard(out, manifest, samples, "generate")
    return [(out / s["file"], read_shard(out / s["file"])) for s in manifest["shards"]]


def load_start(args: argparse.Namespace, target: TargetModel, out: Path):
    """The drafter to train (fp32) with its optimizer and progress: the last checkpoint in `out`,
    or the --drafter checkpoint to start from."""
    from safetensors.torch import load_file

    from ..drafters.dflash import load_dflash_model

    model = load_dflash_model(target, args.drafter, "opd").float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    ckpt = out / CHECKPOINT
    if not (ckpt / TRAINER_STATE).is_file():
        return model, opt, Progress()
    load_state(model, load_file(str(ckpt / "model.safetensors")), str(ckpt))
    state = torch.load(ckpt / TRAINER_STATE, map_location=target.device, weights_only=True)
    opt.load_state_dict(state["optimizer"])
    return model, opt, Progress(**state["progress"])


def train_round(args, target, model, opt, progress: Progress, shards, out: Path, bar: tqdm, clock: float) -> bool:
    """Steps over one round's data (`--passes` times); False when `--minutes` ran out first."""
    cfg = DistillConfig(args.objective, args.alpha, args.temperature, args.clip)
    last = target.num_layers - 1
    layers = tuple(model.spec.target_layer_ids) + (last,)
    width = len(model.spec.target_layer_ids) * target.hidden_size
    data = []
    for shard, samples in shards:
        feats = shard_features(target, samples, shard, layers, Path(args.feature_cache or cache_root() / "features"))
        data += [(make_sequence(s.token_ids, s.prompt_len, None), f) for s, f in zip(samples, feats)]
    per_pass = math.ceil(len(data) / args.seqs_per_step)
    weights = loss_weights(model.spec.block_size, args.gamma or model.spec.block_size / 2)
    while progress.round_step < per_pass * args.passes:
        if args.minutes and progress.seconds > args.minutes * 60:
            return False
        p, s = divmod(progress.round_step, per_pass)
        order = torch.randperm(len(data), generator=torch.Generator().manual_seed(hash((args.seed, progress.round, p)) & 0x7FFFFFFF))
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + progress.step)
        terms = []
        for i in order[s * args.seqs_per_step : (s + 1) * args.seqs_per_step].tolist():
            seq, feats = data[i]
            anchors = sample_anchors(seq, args.anchors, g)
            if len(anchors):
                feats = feats.to(target.device, torch.float32)
                terms.append(block_terms(model, seq, feats[:, :width], feats[:, width:], anchors, weights,
                                         target.head_logits, cfg))
        if terms:
            loss, stats = combine(terms, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            bar.set_postfix(loss=f"{stats['loss']:.3f}", tau=f"{stats['tau']:.2f}")
            with (out / "log.jsonl").open("a", encoding="utf-8") as f:
                f.write(json.dumps({**asdict(progress), **stats}) + "\n")
        progress.round_step, progress.step = progress.round_step + 1, progress.step + 1
        progress.tokens += sum(int(t.weight.gt(0).sum()) for t in terms)  # supervised block slots
        progress.seconds = time.perf_counter() - clock
        bar.update(1)
        if progress.step % args.save_every == 0:
            save_checkpoint(out, model, opt, progress)
    return True


_RECIPE = ("objective", "alpha", "temperature", "clip", "rounds", "prompts_per_round", "max_new_tokens",
           "gen_temperature", "gen_method", "passes", "anchors", "seqs_per_step", "lr", "seed")


def recipe(args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """What the exported drafter's config.json records about how it was trained (`specflash_opd`)."""
    return {"specflash_opd": {**{k: getattr(args, k) for k in _RECIPE}, "drafter": portable_path(args.drafter),
                              "rounds_done": progress.round, "steps": progress.step,
                              "minutes": round(progress.seconds / 60, 1)}}


def train(args: argparse.Namespace) -> Progress:
    from ..api import load

    out = Path(args.out or cache_root() / f"{args.objective}-{args.name}")
    out.mkdir(parents=True, exist_ok=True)
    target = load(args.model, device=args.device, dtype=torch.float32)
    if not args.drafter:
        args.drafter = default_drafter(args.model, "dflash", None)
    model, opt, progress = load_start(args, target, out)
    bar = tqdm(desc=f"{args.objective}-{args.name}", unit="step", initial=progress.step)
    clock = time.perf_counter() - progress.seconds
    while progress.round < args.rounds:
        shards = round_data(args, target, progress.round)
        if not train_round(args, target, model, opt, progress, shards, out, bar, clock):
            break
        progress.round, progress.round_step = progress.round + 1, 0
        save_checkpoint(out, model, opt, progress)
    bar.close()
    save_checkpoint(out, model, opt, progress)
    extra = recipe(args, progress)
    save_drafter(model, out / "export", dtype=torch.float16, extra=extra)
    if args.export:
        save_drafter(model, args.export, dtype=torch.float16, extra=extra)
    return progress


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.opd", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="preset, local folder or cached hub id of the target")
    p.add_argument("--drafter", default=None, help="DFlash drafter folder to start from (default: the preset's)")
    p.add_argument("--objective", choices=OBJECTIVES, default="opd", help="opd: CE + reverse KL; sft: CE on data tokens")
    p.add_argument("--name", default="run", help="run name: the cache folder is train/OBJECTIVE-NAME")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--export", type=Path, default=None, help="also write the final fp16 drafter here")
    p.add_argument("--alpha", type=float, default=0.8, help="weight of the hard-label CE in the OPD loss")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature T")
    p.add_argument("--clip", type=float, default=0.01, help="tau: per-slot clip on RKL / N")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts-per-round", type=int, default=48)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--gen-temperature", type=float, default=0.0, help="temperature of the target's answers")
    p.add_argument("--gen-method", default="ar", choices=("ar", "dflash"), help="how the engine answers (same tokens at T=0)")
    p.add_argument("--gen-batch", type=int, default=16)
    p.add_argument("--data-dir", type=Path, default=None, help="where round data lives (default: train/opd-data)")
    p.add_argument("--feature-cache", type=Path, default=None)
    p.add_argument("--passes", type=int, default=2, help="passes over each round's data (the reference: 2)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--gamma", type=float, default=None, help="loss decay exp(-(k-1)/gamma); default block_size/2")
    p.add_argument("--lr", type=float, default=3e-4, help="constant, as the reference pipeline")
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--minutes", type=float, default=None, help="stop (with a checkpoint) after this much time")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for flag in ("rounds", "prompts_per_round", "max_new_tokens", "gen_batch", "passes", "anchors", "seqs_per_step", "save_every"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.alpha <= 1.0:
        p.error("--alpha must be in [0, 1]")
    return args


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    args = parse_args(argv)
    return run_script(args, train, lambda p: f"{args.objective}: {p.round} rounds, {p.step} steps, {p.seconds / 60:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
