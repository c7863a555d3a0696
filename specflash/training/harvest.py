"""Drafter data at scale: the target answers many requests greedily, in large batches with its KV
cache, and the hidden features a DFlash drafter reads are captured during that same generation.

Why: a drafter learns to predict the *target*, so its data is the target's own greedy answers
(the `prompts-sampled` source draws several answers per train prompt at a temperature, for
variety; the `self-prompts` source's requests are written by the target itself, self_prompts.py),
and its inputs are the target's hidden states at every position. Capturing them while generating
(forward hooks on the chosen layers, at the prefill and at every decode step) saves the second
teacher-forced pass over each sequence that `dflash_features.py` would otherwise need.

Rows are left-padded prompts; rows that emitted EOS leave the batch (their cache rows are dropped)
once a quarter of the batch has finished, so long answers rarely pay for finished ones.
Labels are the float32 model's argmax. On a CPU the linear layers run on the packed kernel
(`--kernel packed`, the default where it builds: models/row_kernels.py), about twice as fast as
PyTorch's GEMM at these widths, whose products are the same bits for a row whatever rows share
the batch; attention over a row's left padding can still round differently from a batch-1 run,
so a near-tie can break differently there (rarer than with `--kernel stock`, PyTorch's GEMM: how
folders made before the twenty-fifth session were made, and what resumes them; the data card
gives the measured agreement). The job list (sources, order, ids) depends only on the seed and
the recipe; `--limit` grows a folder, and a rerun resumes at the first sample not yet written.

Each shard is a generate-mode shard of data.py plus `<shard>.features.safetensors`: float16
features [tokens - 1 per sample, n_layers * H] and the layer ids in its metadata.

    python -m specflash.training.harvest --model PATH [--layers 1,14,27,29] [--limit N] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import platformdirs
import torch
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import DynamicCache

from ..errors import SpecFlashError
from ..kv import is_recurrent, new_cache, select_batch_rows, stack_left_padded
from ..prompts import training_prompts
from . import self_prompts as self_prompt_source
from . import sources, task_sources
from ..models import packed_kernel, row_kernels
from ..models.acquire import default_cache_dir
from ..models.tokenizer_id import tokenizer_fingerprint
from .data import Sample, _eos_ids, _start_manifest, append_shard, encode_prompt, load_target
from .entry import run_script
from .sources import Job

RECIPE_SOURCES: tuple[str, ...] = ("prompts", "code-tasks", "writing-tasks", "rewrite-tasks", "stdlib",
                                   "shakespeare", "arithmetic")
SAMPLED_SOURCES: tuple[str, ...] = ("prompts-sampled",)  # answers drawn at --temperature, not greedy
FEATURES_SUFFIX = ".features.safetensors"
DEFAULT_PER_SOURCE = 2000
# the recipe's seeds of every harvest in data/harvests/ (docs/drafter-data.md); a harvest of another
# seed joins this list, so that the tuning requests stay outside all training data
HARVESTED_RECIPE_SEEDS = (0, 1, 2, 3)


def recipe_jobs(seed: int, per_source: int, names: Sequence[str], cache: Path,
                self_prompts: Callable[[], list[Job]] | None = None) -> list[Job]:
    """Every job of the recipe, interleaved round-robin across sources so any prefix mixes them.
    `self_prompts` makes the `self-prompts` source's requests (they need the target to write them)."""

    def no_target() -> list[Job]:
        raise SpecFlashError(f"source {self_prompt_source.SOURCE} is written by the target: only a harvest can make it")

    makers = {
        "prompts": lambda: [Job(p.id, p.domain, "prompts", p.text) for p in training_prompts()],
        "prompts-sampled": lambda: sampled_prompt_jobs(per_source),
        "code-tasks": lambda: task_sources.code_task_jobs(per_source, seed),
        "writing-tasks": lambda: task_sources.writing_task_jobs(per_source, seed),
        "rewrite-tasks": lambda: task_sources.rewrite_task_jobs(per_source, seed),
        "stdlib": lambda: sources.stdlib_jobs(per_source, seed),
        "shakespeare": lambda: sources.shakespeare_jobs(per_source, seed, cache),
        "arithmetic": lambda: sources.arithmetic_jobs(per_source, seed),
        self_prompt_source.SOURCE: self_prompts or no_target,
    }
    unknown = [n for n in names if n not in makers]
    if unknown:
        raise SpecFlashError(f"unknown source(s) {', '.join(unknown)}; choose from {', '.join(makers)}")
    lists = [makers[n]() for n in names]
    longest = max((len(jobs) for jobs in lists), default=0)
    return [jobs[i] for i in range(longest) for jobs in lists if i < len(jobs)]


def sampled_prompt_jobs(n: int) -> list[Job]:
    """`n` requests cycling over the train prompts (answer k of prompt p is `p~k`): sampled, each
    answer takes the conversation elsewhere, so the few hand-written prompts give many contexts.
    The labels stay the target's own tokens, and training on its samples fits the drafter to the
    target's distribution, whose argmax is the greedy answer."""
    prompts = training_prompts()
    return [Job(f"{p.id}~{i // len(prompts)}", p.domain, "prompts-sampled", p.text)
            for i, p in ((i, prompts[i % len(prompts)]) for i in range(n))]


def tuning_jobs(per_domain: int, cache: Path, seed: int = 1000, per_source: int = DEFAULT_PER_SOURCE) -> list[Job]:
    """Requests for tuning inference knobs (DeLS alpha/beta, gate settings) and choosing
    checkpoints that no harvest of the recipe holds: the templated and text sources drawn with
    another seed, minus every request of the recipe's harvested seeds. Tuning on the train prompts
    would favour whatever memorised them; tuning on the held-out prompts would tune to the
    benchmark. (Until the thirty-sixth session only seed 0 was left out, and 8, 9 and 7 of 68
    requests were in the seed 1, 2 and 3 harvests that the shipped drafters trained on.)"""
    names = [n for n in RECIPE_SOURCES if n != "prompts"]
    seen = harvested_requests(per_source, cache)
    fresh = [job for job in recipe_jobs(seed, 4 * per_domain, names, cache) if job.text not in seen]
    picked: dict[str, list[Job]] = {}
    for job in fresh:
        if len(picked.setdefault(job.domain, [])) < per_domain:
            picked[job.domain].append(job)
    return [job for jobs in picked.values() for job in jobs]


@functools.cache
def harvested_requests(per_source: int, cache: Path) -> frozenset[str]:
    """Every request text of the recipe's harvested seeds (its templated and text sources), built
    once per process: about 20 s on the 2-core CPU, which every tuning set (a bench, each drafter
    of an evaluation, each check of `--validate-prompts`) would otherwise pay again."""
    names = [n for n in RECIPE_SOURCES if n != "prompts"]
    return frozenset(job.text for s in HARVESTED_RECIPE_SEEDS for job in recipe_jobs(s, per_source, names, cache))


def features_path(shard: Path) -> Path:
    return shard.with_name(shard.name.removesuffix(".safetensors") + FEATURES_SUFFIX)


@dataclass
class _Rows:
    """The rows still generating: their index into the batch, answer so far, captured features."""

    index: list[int]
    answers: list[list[int]]
    features: list[list[torch.Tensor]]  # per row, chunks [t, n_layers*H] float16


class _Hooks:
    """Forward hooks that keep the latest output of each chosen decoder layer."""

    def __init__(self, layers: torch.nn.ModuleList, ids: Sequence[int]) -> None:
        self.ids, self.out = tuple(ids), {}
        self.handles = [layers[i].register_forward_hook(self._save(i)) for i in self.ids]

    def _save(self, i: int):
        def hook(_module, _inputs, output):
            self.out[i] = (output[0] if isinstance(output, tuple) else output).detach()
        return hook

    def take(self) -> torch.Tensor:
        """[B, T, n_layers*H] float16 of the last forward."""
        return torch.cat([self.out[i] for i in self.ids], dim=-1).to(torch.float16)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.inference_mode()
def generate_with_features(model, tokenizer, hooks: _Hooks, jobs: Sequence[Job], max_new_tokens: int,
                           temperature: float = 0.0, seed: int = 0) -> list[tuple[Sample, torch.Tensor]]:
    """Answers to a batch of requests with the hooked features of every fed position: per job
    (Sample of prompt + answer, features [len(tokens) - 1, n_layers*H]). Greedy, but jobs of a
    sampled source draw at `temperature`, from a generator seeded by `seed` and the batch's first
    job, so a rerun of the recipe draws the same answers."""
    prompts = [encode_prompt(tokenizer, job.text) for job in jobs]
    sampled = torch.tensor([job.source in SAMPLED_SOURCES for job in jobs], device=model.device)
    generator = None
    if bool(sampled.any()):
        if temperature <= 0:
            raise SpecFlashError(f"source(s) {', '.join(SAMPLED_SOURCES)} need a --temperature above 0")
        key = hashlib.sha1(f"{seed}|{jobs[0].sample_id}".encode()).hexdigest()
        generator = torch.Generator(model.device).manual_seed(int(key[:12], 16))

    def pick(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """Next token per row: argmax, or a draw at `temperature` on the sampled rows."""
        nxt = logits.argmax(-1)
        rows = sampled[index]
        if generator is not None and bool(rows.any()):
            probs = torch.softmax(logits[rows].float() / temperature, dim=-1)
            nxt[rows] = torch.multinomial(probs, 1, generator=generator)[:, 0]
        return nxt

    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    width, device = max(map(len, prompts)), model.device
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache, last_logits, prompt_feats = _prefill(model, hooks, prompts, mask, positions, pad)
    rows = _Rows(list(range(len(jobs))), [[] for _ in jobs], [[f] for f in prompt_feats])
    done: dict[int, tuple[list[int], list[torch.Tensor]]] = {}
    nxt = pick(last_logits, rows.index)  # [B]
    for step in range(max_new_tokens):
        for r, token in enumerate(nxt.tolist()):
            if rows.index[r] in done:
                continue  # finished: rides along until the next compaction
            rows.answers[r].append(token)
            if token in eos or step == max_new_tokens - 1:
                done[rows.index[r]] = (rows.answers[r], rows.features[r])
        keep = [r for r in range(len(rows.index)) if rows.index[r] not in done]
        if not keep:
            break
        if len(rows.index) - len(keep) >= max(1, len(rows.index) // 4):
            # finished rows leave the batch and its cache, a quarter at a time: each compaction
            # copies the whole cache, so doing it per finished row would cost more than it saves
            sel = torch.tensor(keep, device=device)
            select_batch_rows(cache, sel)
            mask, positions, nxt = mask[sel], positions[sel], nxt[sel]
            rows = _Rows([rows.index[r] for r in keep], [rows.answers[r] for r in keep], [rows.features[r] for r in keep])
        mask = torch.cat([mask, mask.new_ones(len(rows.index), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        out = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
        feats = hooks.take()  # [B', 1, F]
        for r, index in enumerate(rows.index):
            if index not in done:
                rows.features[r].append(feats[r])
        nxt = pick(out.logits[:, -1], rows.index)
    made = []
    for b, (job, prompt) in enumerate(zip(jobs, prompts)):
        answer, chunks = done[b]
        sample = Sample(prompt + answer, len(prompt), job.domain, job.source, job.sample_id)
        made.append((sample, torch.cat(chunks).cpu()))  # the last answer token was never fed
    return made


def _prefill(model, hooks: _Hooks, prompts: list[list[int]], mask: torch.Tensor, positions: torch.Tensor,
             pad: int) -> tuple[DynamicCache, torch.Tensor, list[torch.Tensor]]:
    """The batch's cache (prompts right-aligned in the mask's width), each prompt's last logits
    [B, V] and its features [len, F]. Attention-only targets prefill each prompt alone and stack
    the caches (stack_left_padded): the batch's prompts differ in length, and a left-padded
    prefill of 64 requests up to 440 tokens long took 62% of a harvest batch's time, most of it
    on padding. Targets with recurrent layers prefill the padded batch."""
    width = mask.shape[1]
    if is_recurrent(new_cache(model.config)):
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=mask.device)  # [B, W]
        cache = new_cache(model.config)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=1)
        feats = hooks.take()
        return cache, out.logits[:, -1], [feats[b, width - len(p):] for b, p in enumerate(prompts)]
    caches, logits, feats = [], [], []
    for p in prompts:
        caches.append(new_cache(model.config))
        out = model(input_ids=torch.tensor([p], device=mask.device), cache=caches[-1], use_cache=True, logits_to_keep=1)
        logits.append(out.logits[0, -1])
        feats.append(hooks.take()[0])
    return stack_left_padded(caches, width), torch.stack(logits), feats


def write_features(shard: Path, features: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> None:
    offsets = torch.tensor([0] + [len(f) for f in features], dtype=torch.int64).cumsum(0)
    path = features_path(shard)
    tmp = path.with_name(path.name + ".tmp")
    save_file({"features": torch.cat(list(features)).contiguous(), "offsets": offsets}, str(tmp),
              metadata={"layer_ids": json.dumps(list(layer_ids))})
    os.replace(tmp, path)


def default_out(model_path: Path, settings: dict) -> Path:
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:8]
    return Path(platformdirs.user_cache_dir("specflash")) / "data" / model_path.resolve().name / f"harvest-{key}"


def _settings(args: argparse.Namespace) -> dict:
    """What must match for a folder to be resumed rather than mixed with other data."""
    settings = {"format": 1, "model": args.model.resolve().name, "mode": "generate", "harvest": True,
                "seed": args.seed, "max_new_tokens": args.max_new_tokens, "layer_ids": list(args.layers),
                "sources": list(args.sources), "per_source": args.per_source}
    if set(args.sources) & set(SAMPLED_SOURCES):  # only then: greedy recipes keep their folder
        settings["temperature"] = args.temperature
    if args.kernel == "packed":  # only then: folders made with PyTorch's kernels keep their key
        settings["kernel"] = "packed"
    if args.self_prompt_domains is not None:  # only then: folders of every domain keep their key
        settings["self_prompt_domains"] = list(args.self_prompt_domains)
    return settings


def load_harvest_target(args: argparse.Namespace):
    """The float32 target, its linear layers on the kernel the recipe names (`--kernel`)."""
    model, tokenizer = load_target(args.model, args.device, torch.float32)
    if args.kernel == "packed":
        if not (row_kernels.applies(model) and row_kernels.packed_usable(model, None)):
            raise SpecFlashError("--kernel packed needs a CPU float32 target, a C++ compiler to build the packed "
                                 "kernel and memory for a second copy of the weights; pass --kernel stock")
        row_kernels.install(model, row_kernels.PACKED_EVERYWHERE)
    return model, tokenizer


def self_prompt_writer(model, tokenizer, count: int, seed: int, path: Path,
                       domains: Sequence[str] | None = None) -> Callable[[], list[Job]]:
    """What recipe_jobs calls for the `self-prompts` source's requests (written by the target,
    kept in `path`), with a progress bar; called only when the recipe reaches that source."""
    def write() -> list[Job]:
        with tqdm(total=count, unit="request", desc="self-prompts") as bar:
            return self_prompt_source.self_prompt_jobs(model, tokenizer, count, seed, path, progress=bar.update,
                                                      domains=domains)

    return write


def harvest(args: argparse.Namespace) -> dict:
    """Make the missing samples of the first `--limit` jobs, shard by shard."""
    settings = _settings(args)
    out = args.out or default_out(args.model, settings)
    out.mkdir(parents=True, exist_ok=True)
    manifest = _start_manifest(out, settings)
    report = {"out": str(out), "made": 0, "tokens": 0, "seconds": 0.0}
    if args.summary:
        print(summary(out))
        return report
    cache = Path(platformdirs.user_cache_dir("specflash")) / "corpora"
    model = tokenizer = write_prompts = None
    if self_prompt_source.SOURCE in args.sources:
        model, tokenizer = load_harvest_target(args)
        write_prompts = self_prompt_writer(model, tokenizer, args.per_source, args.seed, out / "self-prompts.jsonl",
                                           args.self_prompt_domains)
    jobs = recipe_jobs(args.seed, args.per_source, args.sources, cache, write_prompts)[: args.limit]
    done = {sid for shard in manifest["shards"] for sid in shard["ids"]}
    todo = [job for job in jobs if job.sample_id not in done]
    if not todo:
        return report
    if model is None:
        model, tokenizer = load_harvest_target(args)
    manifest["tokenizer"] = tokenizer_fingerprint(tokenizer)  # what the datastore checks its ids against
    bad = [i for i in args.layers if not 0 <= i < model.config.num_hidden_layers]
    if bad:
        raise SpecFlashError(f"--layers {bad} out of range: the target has {model.config.num_hidden_layers} layers")
    hooks = _Hooks(model.get_decoder().layers, args.layers)
    bar = tqdm(total=len(todo), unit="sample", desc=f"harvest {args.model.name}")
    start = time.perf_counter()
    for i in range(0, len(todo), args.shard_size):
        shard_jobs = todo[i : i + args.shard_size]
        # similar prompt lengths share a batch (less padding); the shard keeps the recipe's order
        by_len = sorted(shard_jobs, key=lambda j: len(j.text))
        made: dict[str, tuple[Sample, torch.Tensor]] = {}
        for b in range(0, len(by_len), args.batch_size):
            for sample, feats in generate_with_features(model, tokenizer, hooks, by_len[b : b + args.batch_size],
                                                        args.max_new_tokens, args.temperature, args.seed):
                made[sample.sample_id] = (sample, feats)
                report["tokens"] += len(sample.token_ids) - sample.prompt_len
            bar.update(min(args.batch_size, len(by_len) - b))
            bar.set_postfix(tok_s=f"{report['tokens'] / (time.perf_counter() - start):.0f}")
        ordered = [made[j.sample_id] for j in shard_jobs]
        shard = out / f"shard-{len(manifest['shards']):05d}.safetensors"
        write_features(shard, [f for _, f in ordered], args.layers)  # before the manifest lists the shard
        append_shard(out, manifest, [s for s, _ in ordered], "generate")
        report["made"] += len(ordered)
    hooks.remove()
    bar.close()
    report["seconds"] = time.perf_counter() - start
    return report


def summary(out: Path) -> str:
    """A markdown table of what a harvest folder holds, per source (for the data card)."""
    from .data import load_shards, read_manifest

    cap = read_manifest(out)["max_new_tokens"]
    rows: dict[str, list[int]] = {}
    for s in load_shards(out):
        row = rows.setdefault(s.source, [0, 0, 0, 0])
        answer = len(s.token_ids) - s.prompt_len
        for i, value in enumerate((1, s.prompt_len, answer, answer < cap)):
            row[i] += int(value)
    lines = ["| source | samples | prompt tokens | answer tokens | answers that ended before the cap |",
             "|---|---|---|---|---|"]
    for source, (n, prompt, answer, ended) in rows.items():
        lines.append(f"| {source} | {n} | {prompt} | {answer} | {ended} |")
    total = [sum(r[i] for r in rows.values()) for i in range(4)]
    lines.append(f"| all | {total[0]} | {total[1]} | {total[2]} | {total[3]} |")
    return "\n".join(lines)


def _domains(text: str) -> list[str]:
    try:
        return self_prompt_source.check_domains([x.strip() for x in text.split(",") if x.strip()])
    except SpecFlashError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specflash.training.harvest", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="local Hugging Face folder of the target")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: per-user cache, keyed by recipe)")
    p.add_argument("--layers", type=_ints, default=[1, 14, 27, 29], help="decoder layers whose outputs are kept")
    p.add_argument("--sources", type=lambda s: [x for x in s.split(",") if x], default=list(RECIPE_SOURCES))
    p.add_argument("--per-source", type=int, default=DEFAULT_PER_SOURCE, help="jobs per templated or text source")
    p.add_argument("--limit", type=int, default=None, help="only the first N jobs of the recipe")
    p.add_argument("--max-new-tokens", type=int, default=192)
    p.add_argument("--temperature", type=float, default=0.7,
                   help=f"sampling temperature of the sampled sources ({', '.join(SAMPLED_SOURCES)}); others are greedy")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--kernel", choices=("packed", "stock"), default=None,
                   help="the linear layers' kernel, part of the recipe (default: packed on a CPU where it builds, "
                        "else stock); stock resumes folders made before the packed kernel")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--self-prompt-domains", type=_domains, default=None,
                   help=f"comma list of the self-prompts' opening domains (default all: {','.join(self_prompt_source.OPENINGS)})")
    p.add_argument("--summary", action="store_true", help="print what the folder holds, per source, and stop")
    args = p.parse_args(argv)
    for flag in ("per_source", "max_new_tokens", "batch_size", "shard_size"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if not args.layers:
        p.error("--layers needs at least one layer id")
    if args.kernel == "packed" and args.device != "cpu":
        p.error("--kernel packed runs on a CPU only")
    if args.kernel is None:  # the folder's key records which: the two write different near-ties
        args.kernel = "packed" if args.device == "cpu" and packed_kernel.load(default_cache_dir()) else "stock"
    return args


def main(argv: Sequence[str] | None = None) -> int:
    return run_script(parse_args(argv), harvest,
                      lambda r: f"made {r['made']} samples, {r['tokens']} answer tokens in {r['seconds']:.0f} s -> {r['out']}")


if __name__ == "__main__":
    raise SystemExit(main())
