"""Train a DFlash drafter for a target on shards from specflash.training.data.

Why this shape: the target is frozen and only supplies teacher-forced hidden features (cached
per shard, see dflash_features.py), so a step is one drafter forward over up to `--anchors`
anchored blocks per sequence under the dense training mask, plus the borrowed LM head. AdamW,
linear warmup then cosine decay, grad-norm clipping. Checkpoints (z-lab format + optimizer
state + position in the data) are written every `--save-every` steps and when `--minutes` run
out, into a cache folder outside the repo; running the same command again resumes from the last
one, sample for sample.

    python -m specflash.training.dflash --model PATH --data DIR[,DIR...] [--name NAME]
        [--layers 1] [--block-size 8] [--feature-layers 3] [--minutes 30] [--export DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

import platformdirs
import torch
from tqdm import tqdm

from ..errors import SpecFlashError
from ..models.dflash import DFlashDrafter, DFlashSpec, default_target_layers, loss_weights
from ..models.dflash_io import (bf16_matrix_units, load_state, new_drafter, pick_mask_token, read_config, read_draft_ids,
                                save_drafter, spec_from_config)
from .dflash_init import can_grow, grow_from, init_from_target
from .draft_vocab import frequent_tokens
from ..models.target import TargetModel
from .data import load_training_target, read_shard, shard_entries
from .dflash_features import shard_features, warm_cache
from .entry import run_script
from .dflash_objective import Teacher, make_sequence, sample_anchors, sequence_loss
from .validation import held_out_acceptance, held_out_blocks
from .prompt_validation import PromptValidation

CHECKPOINT = "checkpoint"
TRAINER_STATE = "trainer.pt"


@dataclass
class Progress:
    """Where training stands: epoch, shard index within the epoch order, sequence within it."""

    epoch: int = 0
    shard_pos: int = 0
    sample_pos: int = 0
    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    shards: list[str] = field(default_factory=list)  # this epoch's shards, in training order


def shard_paths(data_dirs: Seq[Path], hold_out: Seq[str] = ()) -> list[Path]:
    """Every finished shard of every data folder, in manifest order, but those whose file name is
    in `hold_out`."""
    paths = [d / s["file"] for d, s in shard_entries(data_dirs, hold_out)]
    if not paths:
        raise SpecFlashError("no finished shards in " + ", ".join(map(str, data_dirs)))
    return paths


def training_entries(args: argparse.Namespace) -> list[tuple[Path, dict]]:
    """(folder, manifest entry) of the shards a run trains on: every finished shard of `--data`,
    plus the first `--rehearse-shards` of each `--rehearse` folder, all but the `--hold-out` names."""
    rehearsal = [e for folder in args.rehearse for e in shard_entries([folder], args.hold_out)[: args.rehearse_shards]]
    return shard_entries(args.data, args.hold_out) + rehearsal


def training_shards(args: argparse.Namespace) -> list[Path]:
    paths = [d / s["file"] for d, s in training_entries(args)]
    if not paths:
        raise SpecFlashError("no finished shards in " + ", ".join(map(str, args.data + args.rehearse)))
    return paths


def recorded_hold_out(drafter: Path | str) -> list[str]:
    """The shards a drafter folder's config says its training held out (none if it says nothing)."""
    return read_config(drafter).get("specflash_training", {}).get("held_out", [])


def add_hold_out_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hold-out", type=lambda s: [x for x in s.split(",") if x], default=[], metavar="SHARD,...",
                   help="shard file names never trained on, recorded in the drafter's config: data the drafter has "
                        "not seen, for its length head and for honest validation")


def add_rehearse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rehearse", type=lambda s: [Path(x) for x in s.split(",") if x], default=[], metavar="DIR,...",
                   help="data folders of which only the first --rehearse-shards shards join the run: older data "
                        "kept in sight, or a sample of a large folder, at a fraction of its feature cost")
    p.add_argument("--rehearse-shards", type=int, default=2, help="shards taken from each --rehearse folder")


def add_precision_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                   help="matmuls under bf16 autocast (weights and optimizer stay fp32; on a CPU with bf16 matrix "
                        "units a step ran 2x faster at the same loss, docs/dflash.md), or all fp32; auto: bf16 on "
                        "CUDA and on CPUs with bf16 matrix units, fp32 elsewhere")


def resolve_precision(args: argparse.Namespace) -> None:
    """`--precision auto` made concrete for this machine. Why: on a CPU without bf16 matrix units
    (AVX2 only) autocast emulates bf16, and a step that took 1.2 s on an AVX-512 BF16 machine
    took 35 s; the run must not depend on which machine it happens to land on."""
    if args.precision == "auto":
        native = torch.cuda.is_bf16_supported() if args.device == "cuda" else bf16_matrix_units()
        args.precision = "bf16" if native else "fp32"


EPOCHS_HELP = "passes over the data (default: 1, or unbounded when --steps is given)"


def default_epochs(args: argparse.Namespace) -> None:
    """Without `--epochs`, one pass, unless `--steps` sets the length: then as many passes as those
    steps take. Why: the schedule is sized by `--steps`, and a run that stopped after one pass
    would stop in the middle of its decay, at a high rate (the tenth session's first leg did)."""
    if args.epochs is None:
        args.epochs = 1 if args.steps is None else math.inf


def _order(n: int, seed: int, *salt: int) -> list[int]:
    g = torch.Generator().manual_seed(hash((seed, *salt)) & 0x7FFFFFFF)
    return torch.randperm(n, generator=g).tolist()


def learning_rate(args: argparse.Namespace, step: int, total: int, seconds: float = 0.0) -> float:
    """Linear warmup over `--warmup` of the steps, then cosine down to 10% of `--lr`.

    With `--minutes`, the decay follows whichever is further along, the steps or the clock
    (`seconds` trained so far), so a run that the clock stops (a GPU lease, a session's end) still
    ends at the low rate instead of being cut at a high one."""
    warm = max(1, int(args.warmup * total))
    if step < warm:
        return args.lr * (step + 1) / warm
    t = (step - warm) / max(1, total - warm)
    minutes = getattr(args, "minutes", None)
    if minutes:
        t = max(t, seconds / (minutes * 60))
    t = min(1.0, t)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def build_spec(args: argparse.Namespace, target: TargetModel) -> DFlashSpec:
    """The drafter's shape: target-sized hidden/heads (it shares embedding and head), own depth."""
    cfg = target.config
    heads = int(cfg.num_attention_heads)
    layer_ids = tuple(args.target_layer_ids or default_target_layers(target.num_layers, args.feature_layers))
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    theta = float(rope.pop("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    return DFlashSpec(
        hidden_size=target.hidden_size, num_layers=args.layers, num_heads=heads,
        num_kv_heads=int(getattr(cfg, "num_key_value_heads", heads) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or target.hidden_size // heads),
        intermediate_size=args.intermediate_size or int(cfg.intermediate_size), vocab_size=target.vocab_size,
        block_size=args.block_size, num_target_layers=target.num_layers, target_layer_ids=layer_ids,
        mask_token_id=args.mask_token_id if args.mask_token_id is not None else pick_mask_token(target.tokenizer),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 32768)),
    )


def save_checkpoint(out: Path, model: DFlashDrafter, opt: torch.optim.Optimizer, progress: Progress) -> None:
    """z-lab folder (fp32) + trainer state, swapped in atomically for the previous checkpoint."""
    tmp, final, old = out / f"{CHECKPOINT}.tmp", out / CHECKPOINT, out / f"{CHECKPOINT}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    save_drafter(model, tmp, dtype=torch.float32)
    torch.save({"optimizer": opt.state_dict(), "progress": asdict(progress)}, tmp / TRAINER_STATE)
    if final.exists():
        final.replace(old)
    tmp.replace(final)
    shutil.rmtree(old, ignore_errors=True)


def init_or_resume(args, target: TargetModel, out: Path) -> tuple[DFlashDrafter, torch.optim.Optimizer, Progress]:
    """A fresh drafter (random, from the target's top layers, or from `--init-from` a drafter
    folder, which may be shallower: it grows, see `grow_from`, or trained at another block size),
    or the last checkpoint in `out` (whose shape must match the arguments)."""
    spec = build_spec(args, target)
    ckpt = out / CHECKPOINT
    resuming = (ckpt / TRAINER_STATE).is_file()
    source = ckpt if resuming else args.init_from
    draft_ids = None
    if source is not None:
        draft_ids = read_draft_ids(Path(source), read_config(source), target.vocab_size)
    elif args.draft_vocab:
        draft_ids = frequent_tokens(shard_paths(args.data, args.hold_out), args.draft_vocab, target.vocab_size)
    model = new_drafter(spec, target, draft_ids).float()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    if source is None:
        model.init_weights(torch.Generator().manual_seed(args.seed))
        _copy_final_norm(target, model)
        if args.init == "target":
            init_from_target(model, target)
        return model, opt, Progress()
    saved = spec_from_config(read_config(source))
    from safetensors.torch import load_file

    tensors = load_file(str(Path(source) / "model.safetensors"))
    if not resuming and can_grow(saved, spec):
        model.init_weights(torch.Generator().manual_seed(args.seed))
        grow_from(model, tensors, target, str(source))
        return model, opt, Progress()
    if not resuming:
        # The block size shapes no weight, only what is trained: a drafter may be retrained at another.
        saved = replace(saved, block_size=spec.block_size)
    if saved != spec:
        raise SpecFlashError(f"{source} holds a drafter of another shape ({saved}); pass matching options or another --name")
    load_state(model, tensors, str(source))
    if not resuming:
        return model, opt, Progress()
    state = torch.load(ckpt / TRAINER_STATE, map_location=target.device, weights_only=True)
    opt.load_state_dict(state["optimizer"])
    return model, opt, Progress(**state["progress"])


def _copy_final_norm(target: TargetModel, model: DFlashDrafter) -> None:
    """Start the drafter's final norm at the target's: both feed the same LM head, and unit
    weights can give logits far too large (initial loss ~75 instead of ~ln V on SmolLM2)."""
    decoder = target.model.get_decoder() if hasattr(target.model, "get_decoder") else None
    norm = getattr(decoder, "norm", None)
    weight = getattr(norm, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.shape == model.norm.weight.shape:
        with torch.no_grad():
            model.norm.weight.copy_(weight.float())


def _step(args, model, opt, batch, weights, progress: Progress, total: int, vocab=None, head_logits=None) -> dict:
    """One optimizer step over a few sequences (each its own forward; losses summed, normalised).
    With `head_logits` (soft labels), each sequence's features end with the target's last layer."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + progress.step)
    stats = []
    device_type = next(model.parameters()).device.type
    for seq, feats in batch:
        anchors = sample_anchors(seq, args.anchors, g)
        if len(anchors) == 0:
            continue
        teacher = None
        if head_logits is not None:
            width = model.spec.hidden_size
            feats, teacher = feats[:, :-width], Teacher(feats[:, -width:], head_logits, args.soft_labels)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            stats.append(sequence_loss(model, seq, feats, anchors, weights, vocab, teacher, args.tau_weight))
    total_w = sum(s.weight for s in stats)
    if total_w == 0:
        return {}
    loss = sum(s.loss for s in stats) / total_w
    for group in opt.param_groups:
        group["lr"] = learning_rate(args, progress.step, total, progress.seconds)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    blocks = sum(s.blocks for s in stats)
    return {"loss": float(loss.detach()), "acc1": sum(s.slot1_correct for s in stats) / blocks,
            "tau": 1 + sum(s.accepted for s in stats) / blocks}


def _total_steps(args: argparse.Namespace) -> int:
    """`--steps`, or enough steps for `--epochs` passes over every sample."""
    samples = sum(len(s["ids"]) for _, s in training_entries(args))
    return args.steps or max(1, args.epochs * math.ceil(samples / args.seqs_per_step))


@dataclass
class TrainLoop:
    """A training run's state while it goes. The DFlash and DFlash 2 trainers share this loop
    (shard order, resumable progress, logging, checkpoints) and differ only in `step`, one
    optimiser step on a batch of (sequence, features) that returns its stats (or None), and
    `postfix`, the stats the progress bar shows."""

    args: argparse.Namespace
    target: TargetModel
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    progress: Progress
    out: Path
    total: int
    feature_cache: Path | None
    bar: tqdm
    step: Callable[[list], dict | None]
    postfix: Callable[[dict], dict[str, str]]
    teacher_layer: int | None = None  # also read this target layer's outputs (soft labels)
    validate: Callable[[], dict] | None = None  # held-out figures, logged at the start, the end and
    validate_every: int = 0  # every this many steps
    clock: float = 0.0  # perf_counter at start minus seconds already trained
    last_save: int = 0

    def __post_init__(self) -> None:
        self.clock = time.perf_counter() - self.progress.seconds
        self.last_save = self.progress.step

    def finished(self) -> bool:
        p, minutes = self.progress, self.args.minutes
        return p.step >= self.total or p.epoch >= self.args.epochs or bool(minutes and p.seconds > minutes * 60)

    def run(self) -> None:
        """Epochs over the shards until finished; a new epoch sees every shard finished so far
        (data may still grow while training runs)."""
        p = self.progress
        if p.step == 0:
            self._validate()
        while not self.finished():
            if not p.shards:
                shards = training_shards(self.args)
                p.shards = [str(shards[i]) for i in _order(len(shards), self.args.seed, p.epoch)]
            while p.shard_pos < len(p.shards) and not self.finished():
                self._train_shard(Path(p.shards[p.shard_pos]))
            if p.shard_pos >= len(p.shards):
                p.epoch, p.shard_pos, p.shards = p.epoch + 1, 0, []
        self.bar.close()
        if self.validate_every and p.step % self.validate_every:
            self._validate()  # the figure of the weights the run ends with
        save_checkpoint(self.out, self.model, self.opt, p)

    def _train_shard(self, shard: Path) -> None:
        """Steps over the remaining sequences of one shard, in a seeded order."""
        args, p = self.args, self.progress
        samples = read_shard(shard)
        layers = tuple(self.model.spec.target_layer_ids) + (() if self.teacher_layer is None else (self.teacher_layer,))
        feats = shard_features(self.target, samples, shard, layers, self.feature_cache)
        within = _order(len(samples), args.seed, p.epoch, p.shard_pos)
        while p.sample_pos < len(samples) and not self.finished():
            idx = within[p.sample_pos : p.sample_pos + args.seqs_per_step]
            batch = [(make_sequence(samples[i].token_ids, samples[i].prompt_len, samples[i].labels),
                      feats[i].to(self.target.device, torch.float32)) for i in idx]
            stats = self.step(batch)
            p.sample_pos, p.step = p.sample_pos + len(idx), p.step + 1
            p.tokens += sum(len(samples[i].token_ids) for i in idx)
            p.seconds = time.perf_counter() - self.clock
            self.bar.update(1)
            if stats:
                self.bar.set_postfix(**self.postfix(stats))
                if p.step % args.log_every == 0:
                    with (self.out / "log.jsonl").open("a", encoding="utf-8") as f:
                        row = {k: v for k, v in asdict(p).items() if k != "shards"}
                        f.write(json.dumps({**row, **stats}) + "\n")
            if self.validate_every and p.step % self.validate_every == 0:
                self._validate()
            if p.step - self.last_save >= args.save_every:
                save_checkpoint(self.out, self.model, self.opt, p)
                self.last_save = p.step
        if p.sample_pos >= len(samples):
            p.shard_pos, p.sample_pos = p.shard_pos + 1, 0

    def _validate(self) -> None:
        """One row of held-out figures in the log (its own clock time is not training time)."""
        if self.validate is None:
            return
        started = time.perf_counter()
        row = {"step": self.progress.step, "tokens": self.progress.tokens, "seconds": self.progress.seconds,
               **self.validate()}
        with (self.out / "log.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        self.clock += time.perf_counter() - started


def train(args: argparse.Namespace) -> Progress | str:
    """Run (or resume) training until `--epochs`/`--steps` or `--minutes` are used up (with
    `--features-only`: fill the feature cache and say how much it computed)."""
    out = Path(args.out or Path(platformdirs.user_cache_dir("specflash")) / "train" / f"dflash-{args.name}")
    out.mkdir(parents=True, exist_ok=True)
    if args.init_from and not args.hold_out:  # what the starting drafter never saw, this one must not see either
        args.hold_out = recorded_hold_out(args.init_from)
    target = load_training_target(args.model, args.device)
    model, opt, progress = init_or_resume(args, target, out)
    total = _total_steps(args)
    cache = None if args.no_feature_cache else Path(args.feature_cache or out.parent / "features")
    vocab = None
    if args.head_vocab:
        if model.draft_ids is not None:
            raise SpecFlashError("--head-vocab restricts the training softmax of a full-vocabulary drafter; this one "
                                 "has a draft vocabulary already (--draft-vocab or the checkpoint's d2t)")
        vocab = frequent_tokens(shard_paths(args.data, args.hold_out), args.head_vocab, target.vocab_size)
    weights = loss_weights(args.block_size, args.gamma)
    soft = args.soft_labels > 0
    if args.features_only:
        shards = training_shards(args)
        layers = tuple(model.spec.target_layer_ids) + ((target.num_layers - 1,) if soft else ())
        done = warm_cache(target, [shards[i] for i in _order(len(shards), args.seed, 0)], layers, cache)
        return f"computed the features of {done} of {len(shards)} shard(s) into {cache}"
    validate = None
    if args.validate_every:
        held = held_out_blocks(target, args.data + args.rehearse, args.hold_out, model.spec.target_layer_ids, cache,
                               args.validate_samples, args.anchors, args.seed)
        validate = partial(held_out_acceptance, model, held, weights, args.precision == "bf16")
        if args.validate_prompts:
            prompts = PromptValidation(model, target, out, args.validate_prompts, args.validate_prompts_per_domain,
                                       recipe=lambda: _recipe(args, progress))
            validate = partial(_merged, validate, prompts)
    TrainLoop(
        args, target, model, opt, progress, out, total, cache,
        tqdm(total=total, initial=progress.step, unit="step", desc=f"dflash-{args.name}"),
        step=lambda batch: _step(args, model, opt, batch, weights, progress, total, vocab,
                                 target.head_logits if soft else None),
        postfix=lambda s: {"loss": f"{s['loss']:.3f}", "acc1": f"{s['acc1']:.2f}", "tau": f"{s['tau']:.2f}"},
        teacher_layer=target.num_layers - 1 if soft else None, validate=validate, validate_every=args.validate_every,
    ).run()
    save_drafter(model, out / "export", dtype=torch.float16, extra=_recipe(args, progress))
    if args.export:
        shutil.copytree(out / "export", args.export, dirs_exist_ok=True)
    return progress


def _merged(*checks: Callable[[], dict]) -> dict:
    return {k: v for check in checks for k, v in check().items()}


def _recipe(args: argparse.Namespace, progress: Progress) -> dict:
    """How the drafter was trained, stored in its config.json (ignored by loaders)."""
    keep = ("lr", "gamma", "anchors", "seqs_per_step", "warmup", "clip", "seed", "init", "draft_vocab", "soft_labels", "tau_weight")
    if args.init_from:  # the starting folder fixed the initialisation and the draft vocabulary
        keep = tuple(k for k in keep if k not in ("init", "draft_vocab")) + ("init_from",)
    return {"specflash_training": {**{k: _portable(getattr(args, k)) for k in keep},
                                   "data": [Path(d).name for d in args.data],
                                   "rehearse": [Path(d).name for d in args.rehearse],
                                   "rehearse_shards": args.rehearse_shards,
                                   "held_out": list(args.hold_out),
                                   "steps": progress.step, "tokens": progress.tokens,
                                   "minutes": round(progress.seconds / 60, 1)}}


def _portable(value):
    """Paths as their folder name: a shipped config must not record this machine's layout."""
    return Path(value).name if isinstance(value, Path) else value


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def adopt_shape(args: argparse.Namespace) -> None:
    """Shape options not given take the `--init-from` drafter's (depth, block size, feature
    layers, MLP width, mask token), then the defaults. Why: continuing a drafter is the common
    case, and its shape is in its config; a flag that must repeat it broke the GPU recipe when the
    shipped drafter grew a layer. A flag given still wins (`--layers` above its depth grows it)."""
    if args.init_from:
        saved = spec_from_config(read_config(args.init_from))
        args.layers = args.layers if args.layers is not None else saved.num_layers
        args.block_size = args.block_size if args.block_size is not None else saved.block_size
        if args.feature_layers is None and args.target_layer_ids is None:
            args.target_layer_ids = list(saved.target_layer_ids)
        args.intermediate_size = args.intermediate_size or saved.intermediate_size
        args.mask_token_id = args.mask_token_id if args.mask_token_id is not None else saved.mask_token_id
    args.layers = args.layers if args.layers is not None else 1
    args.block_size = args.block_size if args.block_size is not None else 8
    args.feature_layers = args.feature_layers if args.feature_layers is not None else 3


def parse_args(argv: Seq[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.dflash", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder of the target")
    p.add_argument("--data", required=True, type=lambda s: [Path(x) for x in s.split(",") if x],
                   help="comma list of data folders (python -m specflash.training.data)")
    add_hold_out_arg(p)
    add_rehearse_args(p)
    p.add_argument("--name", default="run", help="run name: the cache folder is train/dflash-NAME")
    p.add_argument("--out", type=Path, default=None, help="run folder (default: per-user cache)")
    p.add_argument("--export", type=Path, default=None, help="also copy the final fp16 drafter here")
    p.add_argument("--layers", type=int, default=None, help="draft decoder layers (default: the --init-from "
                   "drafter's, else 1; more than it has grows it)")
    p.add_argument("--block-size", type=int, default=None, help="default: the --init-from drafter's, else 8")
    p.add_argument("--feature-layers", type=int, default=None,
                   help="how many target layers feed the drafter (default: the --init-from drafter's layers, else 3)")
    p.add_argument("--target-layer-ids", type=_ints, default=None, help="explicit comma list (overrides the count)")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    p.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's mask or an unused special")
    p.add_argument("--gamma", type=float, default=None, help="loss decay exp(-(k-1)/gamma); default block_size/2")
    p.add_argument("--head-vocab", type=int, default=0,
                   help="train the softmax over the K most frequent target tokens + batch labels (0 = all, the "
                        "default). A CPU shortcut with a trap: the other logits are never trained, and the drafter "
                        "may draft an untrained token everywhere at inference; finish with full-vocabulary steps")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="a reduced draft vocabulary: the N tokens the target emits most often in the data, stored "
                        "as d2t.safetensors; drafting computes only those rows of the LM head (0 = full vocabulary)")
    p.add_argument("--init", choices=("random", "target"), default="random",
                   help="start the draft layers from the target's layers after the deepest feature layer")
    p.add_argument("--init-from", type=Path, default=None,
                   help="start from this drafter folder's weights (and d2t), with a fresh optimizer and schedule; a "
                        "shallower drafter grows to --layers, its new layers starting as the identity")
    p.add_argument("--soft-labels", type=float, default=0.0, metavar="W",
                   help="weight w of the target's full distribution as a label (0 = hard labels only, the default; "
                        "1 = soft only): slot loss (1 - w) CE(label) + w CE(target distribution), read from the "
                        "target's last layer (stored in harvested shards, computed otherwise)")
    p.add_argument("--tau-weight", type=float, default=0.0, metavar="W",
                   help="share of the slot weights given to the expected-acceptance weights (dflash_objective."
                        "acceptance_weights; 0 = the decay exp(-(k-1)/gamma) alone, the default)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=float, default=0.04, help="fraction of steps")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--seqs-per-step", type=int, default=4)
    p.add_argument("--epochs", type=int, default=None, help=EPOCHS_HELP)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: the epochs)")
    p.add_argument("--minutes", type=float, default=None, help="stop (with a checkpoint) after this much training")
    p.add_argument("--validate-every", type=int, default=0, metavar="N",
                   help="log held-out acceptance (val_tau, val_acc1, val_loss) on fixed blocks of the --hold-out "
                        "shards at the start and every N steps (0 = never, the default)")
    p.add_argument("--validate-samples", type=int, default=64, help="held-out sequences scored by --validate-every")
    p.add_argument("--validate-prompts", choices=("dev", "tuning"), default=None,
                   help="at each --validate-every check also decode these prompts with the drafter as it is (gate "
                        "off, T = 0; logged as prompts_tau), keeping the best weights so far in the run's "
                        "best-prompts/ folder: the checkpoint to choose, where the held-out blocks can mislead")
    p.add_argument("--validate-prompts-per-domain", type=int, default=8, metavar="N",
                   help="prompts per domain for --validate-prompts")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--feature-cache", type=Path, default=None, help="default: train/features next to the run")
    p.add_argument("--no-feature-cache", action="store_true")
    p.add_argument("--features-only", action="store_true",
                   help="only compute the run's missing feature files, in its first epoch's shard order, and exit: "
                        "started beside the run (same arguments, another --name), a worker on another core keeps "
                        "ahead of it; workers skip shards another one is computing")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    add_precision_arg(p)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    adopt_shape(args)
    default_epochs(args)
    resolve_precision(args)
    for flag in ("layers", "feature_layers", "anchors", "seqs_per_step", "epochs", "save_every", "log_every",
                 "validate_samples", "validate_prompts_per_domain", "rehearse_shards"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.block_size < 2:
        p.error("--block-size must be at least 2")
    if args.validate_every < 0:
        p.error("--validate-every must be 0 (never) or a number of steps")
    if args.validate_prompts and not args.validate_every:
        p.error("--validate-prompts scores at the --validate-every checks: give --validate-every N too")
    if not 0 <= args.soft_labels <= 1:
        p.error("--soft-labels must be between 0 and 1")
    if not 0 <= args.tau_weight <= 1:
        p.error("--tau-weight must be between 0 and 1")
    if args.features_only and args.no_feature_cache:
        p.error("--features-only fills the feature cache; it cannot run with --no-feature-cache")
    args.gamma = args.gamma or args.block_size / 2
    return args


def main(argv: Seq[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    return run_script(parse_args(argv), train, lambda p: p if isinstance(p, str) else
                      f"trained {p.step} steps, {p.tokens} tokens, {p.seconds / 60:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
