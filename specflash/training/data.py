"""Training data for drafters: the target model's own outputs, written as token-id shards.

A drafter is scored by how often the *target* agrees with it, so it should learn the target's
greedy behaviour, not human text. Two modes make that data:

* `generate` (default): the target answers user messages greedily (through its chat template):
  the train split of the project prompts, questions about stdlib code, Shakespeare passages to
  rewrite, and synthetic arithmetic. Each sample is prompt + response; `prompt_len` marks where
  the loss starts.
* `teacher-forced`: one forward pass over raw text windows records the target's argmax at each
  position (`labels`); about 10x cheaper than generating, at the price of off-policy context.

Held-out prompts are never read here: only `training_prompts()`. Shards are written atomically
and listed in manifest.json, so an interrupted run resumes where it stopped.

    python -m specflash.training.data --model PATH [--mode teacher-forced] [--out DIR] ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specflash.errors import ModelNotFoundError, SpecFlashError
from specflash.models.acquire import default_cache_dir
from specflash.models.loading import load_causal_lm
from specflash.models.target import TargetModel
from specflash.prompts import training_prompts
from specflash.training import sources
from specflash.training.sources import Job

MODES: tuple[str, ...] = ("generate", "teacher-forced")
SOURCES: tuple[str, ...] = ("prompts", "stdlib", "shakespeare", "arithmetic")
WINDOW_SOURCES: tuple[str, ...] = tuple(sources.WINDOW_DOMAINS)
FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Sample:
    """One training sequence. Loss positions are `prompt_len:`; in teacher-forced mode
    `labels[i]` is the target's argmax after `token_ids[: i + 1]` and `prompt_len` is 0."""

    token_ids: list[int]
    prompt_len: int
    domain: str
    source: str
    sample_id: str
    labels: list[int] | None = None


# ---- shards ----------------------------------------------------------------------------------


def write_shard(path: Path, samples: Sequence[Sample], mode: str) -> None:
    """Concatenated int32 ids + offsets (+ labels), strings in the header; tmp file + os.replace."""
    tensors = {
        "tokens": torch.tensor([t for s in samples for t in s.token_ids], dtype=torch.int32),
        "offsets": torch.tensor([0] + [len(s.token_ids) for s in samples], dtype=torch.int64).cumsum(0),
        "prompt_lens": torch.tensor([s.prompt_len for s in samples], dtype=torch.int32),
    }
    if mode == "teacher-forced":
        if any(s.labels is None or len(s.labels) != len(s.token_ids) for s in samples):
            raise ValueError("teacher-forced samples need one label per token")
        tensors["labels"] = torch.tensor([t for s in samples for t in s.labels or ()], dtype=torch.int32)
    meta = {
        "format": str(FORMAT),
        "mode": mode,
        "ids": json.dumps([s.sample_id for s in samples]),
        "domains": json.dumps([s.domain for s in samples]),
        "sources": json.dumps([s.source for s in samples]),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    os.replace(tmp, path)


def read_shard(path: Path) -> list[Sample]:
    """The samples of one shard, in the order they were written."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    if meta.get("format") != str(FORMAT):
        raise SpecFlashError(f"{path}: shard format {meta.get('format')!r}, expected {FORMAT}")
    t = load_file(str(path))
    bounds = t["offsets"].tolist()
    tokens, labels = t["tokens"].tolist(), t["labels"].tolist() if "labels" in t else None
    return [
        Sample(
            token_ids=tokens[a:b],
            prompt_len=int(pl),
            domain=dom,
            source=src,
            sample_id=sid,
            labels=labels[a:b] if labels is not None else None,
        )
        for a, b, pl, dom, src, sid in zip(
            bounds[:-1], bounds[1:], t["prompt_lens"].tolist(),
            json.loads(meta["domains"]), json.loads(meta["sources"]), json.loads(meta["ids"]),
        )
    ]


def read_manifest(out: Path) -> dict | None:
    path = out / MANIFEST
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def write_manifest(out: Path, manifest: dict) -> None:
    tmp = out / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(tmp, out / MANIFEST)


def append_shard(out: Path, manifest: dict, samples: Sequence[Sample], mode: str) -> Path:
    """Write the next shard of a data folder, then list it in the manifest (in that order, so a
    listed shard is always complete)."""
    path = out / f"shard-{len(manifest['shards']):05d}.safetensors"
    write_shard(path, samples, mode)
    manifest["shards"].append({"file": path.name, "ids": [s.sample_id for s in samples],
                               "tokens": sum(len(s.token_ids) for s in samples)})
    write_manifest(out, manifest)
    return path


def shard_entries(data_dirs: Sequence[Path], hold_out: Sequence[str] = ()) -> list[tuple[Path, dict]]:
    """(folder, manifest entry) of every finished shard, in manifest order, but those whose file
    name is in `hold_out`."""
    entries = []
    for d in map(Path, data_dirs):
        manifest = read_manifest(d)
        if manifest is None:
            raise SpecFlashError(f"{d} has no {MANIFEST}; make data with python -m specflash.training.data")
        entries += [(d, s) for s in manifest["shards"] if s["file"] not in hold_out]
    return entries


def load_shards(directory: Path | str) -> list[Sample]:
    """Every finished sample in a data folder, shard by shard as the manifest lists them."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise SpecFlashError(f"{directory} has no {MANIFEST}; make data with python -m specflash.training.data")
    return [s for shard in manifest["shards"] for s in read_shard(directory / shard["file"])]


# ---- jobs ------------------------------------------------------------------------------------


def build_jobs(mode: str, names: Sequence[str], seed: int, per_source: int, window: int, cache: Path) -> list[Job]:
    """All jobs of the chosen sources, interleaved round-robin so any prefix mixes domains."""
    lists = []
    for name in names:
        if mode == "generate" and name == "prompts":
            lists.append([Job(p.id, p.domain, "prompts", p.text) for p in training_prompts()])
        elif mode == "generate" and name == "stdlib":
            lists.append(sources.stdlib_jobs(per_source, seed))
        elif mode == "generate" and name == "shakespeare":
            lists.append(sources.shakespeare_jobs(per_source, seed, cache))
        elif mode == "generate":
            lists.append(sources.arithmetic_jobs(per_source, seed))
        elif name in WINDOW_SOURCES:
            lists.append(sources.window_jobs(per_source, seed, name, window * 8, cache))
        else:
            raise SpecFlashError(f"source {name!r} has no text windows; teacher-forced mode uses "
                                 f"{', '.join(WINDOW_SOURCES)}")
    longest = max((len(jobs) for jobs in lists), default=0)
    return [jobs[i] for i in range(longest) for jobs in lists if i < len(jobs)]


# ---- the target ------------------------------------------------------------------------------


def encode_prompt(tokenizer, text: str) -> list[int]:
    """A user message as the target sees it: through its chat template when it has one."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": text}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())


@torch.inference_mode()
def generate_batch(model, tokenizer, jobs: Sequence[Job], max_new_tokens: int) -> list[Sample]:
    """Greedy answers for a batch of messages, left-padded; responses end at (and keep) EOS."""
    prompts = [encode_prompt(tokenizer, job.text) for job in jobs]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(_eos_ids(model, tokenizer))
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)  # [B, W]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad)  # [B, W + new]
    eos, samples = _eos_ids(model, tokenizer), []
    for job, prompt, row in zip(jobs, prompts, out[:, width:].tolist()):
        stop = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        samples.append(Sample(prompt + row[:stop], len(prompt), job.domain, job.source, job.sample_id))
    return samples


@torch.inference_mode()
def teacher_forced_batch(model, tokenizer, jobs: Sequence[Job], window: int) -> list[Sample]:
    """The target's argmax at every position of up to `window` tokens of each text, one forward."""
    texts = [tokenizer(job.text, add_special_tokens=False)["input_ids"][:window] for job in jobs]
    width = max(map(len, texts))
    # right padding: under a causal mask, pads after a row's end cannot change its logits
    ids = torch.tensor([t + [0] * (width - len(t)) for t in texts], device=model.device)  # [B, W]
    mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in texts], device=model.device)
    argmax = model(input_ids=ids, attention_mask=mask).logits.argmax(-1).tolist()  # [B, W]
    return [
        Sample(t, 0, job.domain, job.source, job.sample_id, labels=row[: len(t)])
        for job, t, row in zip(jobs, texts, argmax)
    ]


def load_target(path: Path, device: str, dtype: torch.dtype):
    """A local Hugging Face folder as (model in eval mode, tokenizer)."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    return load_causal_lm(str(path.resolve()), device, dtype)  # absolute: never read as a preset name


def load_training_target(path: Path, device: str) -> TargetModel:
    """The fp32 target the trainers and their checks read features and labels from, named by its
    absolute folder so that a drafter's recorded target never depends on the working directory.
    Its linear layers take the row kernels measured for it (models/row_kernels.py), as the
    engine's do: a teacher-forced forward over a harvested sequence ran 427 -> 875 tokens/s on
    the packed kernel (SmolLM2-135M, one thread, features equal to 3e-7)."""
    model, tokenizer = load_target(Path(path), device, torch.float32)
    target = TargetModel(model, tokenizer, name=str(Path(path).resolve()))
    target.tune_row_kernels(default_cache_dir())
    return target


# ---- the run ---------------------------------------------------------------------------------


def default_out(model_path: Path, mode: str) -> Path:
    """A per-user cache folder outside the repo, one per model and mode."""
    return Path(platformdirs.user_cache_dir("specflash")) / "data" / model_path.resolve().name / mode


def _settings(args: argparse.Namespace) -> dict:
    """What must match for an existing folder to be resumed rather than mixed with other data."""
    length = {"max_new_tokens": args.max_new_tokens} if args.mode == "generate" else {"window": args.window}
    return {"format": FORMAT, "model": args.model.resolve().name, "mode": args.mode, "seed": args.seed, **length}


def _start_manifest(out: Path, settings: dict) -> dict:
    manifest = read_manifest(out) or {**settings, "shards": []}
    differ = {k: (manifest.get(k), v) for k, v in settings.items() if manifest.get(k) != v}
    if differ:
        raise SpecFlashError(f"{out} holds data made with other settings {differ}; pass another --out")
    return manifest


def _chunks(items: list[Job], size: int) -> list[list[Job]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def run(args: argparse.Namespace) -> int:
    """Make the missing samples shard by shard; returns how many were made this time."""
    out = args.out or default_out(args.model, args.mode)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _start_manifest(out, _settings(args))
    cache = Path(platformdirs.user_cache_dir("specflash")) / "corpora"
    jobs = build_jobs(args.mode, args.sources, args.seed, args.per_source, args.window, cache)
    done = {sid for shard in manifest["shards"] for sid in shard["ids"]}
    todo = [job for job in jobs[: args.limit] if job.sample_id not in done]
    if not todo:
        return 0
    model, tokenizer = load_target(args.model, args.device, getattr(torch, args.dtype))
    bar = tqdm(total=len(todo), unit="sample", desc=f"{args.mode} {args.model.name}")
    n_tokens, start = 0, time.perf_counter()
    for shard_jobs in _chunks(todo, args.shard_size):
        samples: list[Sample] = []
        for batch in _chunks(shard_jobs, args.batch_size):
            if args.mode == "generate":
                made = generate_batch(model, tokenizer, batch, args.max_new_tokens)
                n_tokens += sum(len(s.token_ids) - s.prompt_len for s in made)
            else:
                made = teacher_forced_batch(model, tokenizer, batch, args.window)
                n_tokens += sum(len(s.token_ids) for s in made)
            samples += made
            bar.update(len(made))
            bar.set_postfix(tok_s=f"{n_tokens / (time.perf_counter() - start):.1f}")
        append_shard(out, manifest, samples, args.mode)
    bar.close()
    return len(todo)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.data", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="local Hugging Face folder of the target")
    p.add_argument("--mode", choices=MODES, default="generate")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: a per-user cache)")
    p.add_argument("--sources", default=None, type=lambda s: [x for x in s.split(",") if x],
                   help=f"comma list of {', '.join(SOURCES)} (default: all that the mode can use)")
    p.add_argument("--per-source", type=int, default=1000, help="samples per local-text source")
    p.add_argument("--limit", type=int, default=None, help="make at most N samples in total")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--window", type=int, default=256, help="tokens per text window (teacher-forced)")
    p.add_argument("--shard-size", type=int, default=128, help="samples per shard")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    allowed = SOURCES if args.mode == "generate" else WINDOW_SOURCES
    args.sources = list(allowed) if args.sources is None else args.sources
    unknown = [s for s in args.sources if s not in allowed]
    if unknown:
        p.error(f"source(s) {', '.join(unknown)} not usable in {args.mode} mode; choose from {', '.join(allowed)}")
    for flag in ("per_source", "batch_size", "max_new_tokens", "window", "shard_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: exit 0 on success, 2 with a one-line message on bad input."""
    try:
        made = run(parse_args(argv))
    except SpecFlashError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"made {made} samples", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
