"""The public API: load a target, then stream() or generate() with any method.

Everything here is a thin layer over the engine; it resolves names (presets, methods), encodes
the prompt, and packs the result into a RunRecord. Device and dtype default to CUDA/bf16 when a
GPU is present and CPU/fp32 otherwise, and can always be given explicitly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .config import SamplingConfig, config_to_dict
from .drafters import Drafter, build_drafter
from .engine import Decoding
from .errors import EmptyPromptError, SamplingConfigError
from .metrics import summarize
from .models.acquire import default_cache_dir
from .models.presets import default_drafter
from .models.target import TargetModel
from .trace import RunRecord, StepRecord

if TYPE_CHECKING:
    from .batch import BatchDrafter


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load(
    model: str = "smollm2-135m",
    device: str | None = None,
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
) -> TargetModel:
    """A target from a preset name, a local folder or a hub id (offline: from the local cache)."""
    from .models.loading import load_causal_lm

    device = device or default_device()
    hf_model, tokenizer = load_causal_lm(model, device=device, dtype=dtype or default_dtype(device), cache_dir=cache_dir)
    target = TargetModel(hf_model, tokenizer, name=model)
    target.tune_row_kernels(cache_dir or default_cache_dir())
    return target


def encode_prompt(target: TargetModel, prompt: str | list[int], raw: bool = False) -> list[int]:
    """Token ids of the prompt: through the chat template unless `raw` or the tokenizer has none."""
    if isinstance(prompt, list):
        ids = [int(t) for t in prompt]
    else:
        if not prompt.strip():
            raise EmptyPromptError("the prompt is empty: type some text")
        tok = target.tokenizer
        if tok is None:
            raise ValueError("this target has no tokenizer; pass token ids")
        if not raw and getattr(tok, "chat_template", None):
            messages = [{"role": "user", "content": prompt}]
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
        else:
            ids = tok(prompt).input_ids
    if not ids:
        raise EmptyPromptError("the prompt encodes to no tokens")
    return ids


def stream(
    target: TargetModel,
    prompt: str | list[int],
    method: str = "ar",
    max_new_tokens: int | None = 64,
    sampling: SamplingConfig | None = None,
    raw: bool = False,
    drafter: str | Drafter | None = None,
    options: dict[str, Any] | None = None,
    stop_on_eos: bool = True,
    cache_dir: Path | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> Decoding:
    """An iterable of StepRecords, one per target forward (the first is the prefill).

    `drafter` is a path/preset of the drafter model where the method needs one (default: the
    one the target's preset ships for this method, if any), or a ready Drafter; `options` are the
    method's knobs (e.g. {"k": 4}). Sampling is set either by the
    plain keywords `temperature`, `top_p`, `top_k`, `seed` (as transformers' generate takes
    them) or by a `sampling` SamplingConfig, not both; the default is greedy.
    """
    sampling = sampling_from(sampling, temperature, top_p, top_k, seed)
    ids = encode_prompt(target, prompt, raw)
    if isinstance(drafter, Drafter):
        built = drafter
    else:
        drafter = drafter or default_drafter(str(target.name), method, cache_dir)
        built = build_drafter(method, target, options, drafter, cache_dir=cache_dir)
    return Decoding(target, built, ids, sampling, max_new_tokens, stop_on_eos,
                    prompt_text=prompt if isinstance(prompt, str) else None)


def sampling_from(sampling: SamplingConfig | None, temperature: float | None = None, top_p: float | None = None,
                  top_k: int | None = None, seed: int | None = None) -> SamplingConfig:
    """One SamplingConfig from either a ready one or the plain keywords (unset ones keep their defaults)."""
    given = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed).items() if v is not None}
    if sampling is not None and given:
        raise SamplingConfigError(f"pass either sampling= or {', '.join(given)}=, not both")
    return sampling or SamplingConfig(**given)


def pack_run(decoding: Decoding, steps: list[StepRecord], method: str, finish_reason: str | None = None) -> RunRecord:
    """The RunRecord of the steps so far, with its metrics; a run stopped early (the app's Stop
    button) is packed the same way, with finish_reason "stopped"."""
    run = RunRecord(
        method=method,
        config=decoding.drafter.config_dict(),
        sampling=config_to_dict(decoding.sampling),
        model=decoding.target.name,
        device=str(decoding.target.device),
        prompt_ids=decoding.prompt_ids,
        steps=list(steps),
        output_ids=list(decoding.output),
        finish_reason=finish_reason or decoding.finish_reason or "stopped",
        prefill_time=steps[0].verify_time if steps else 0.0,
        prompt=decoding.prompt_text,
    )
    run.metrics = summarize(run)
    return run


def run_record(decoding: Decoding, method: str) -> RunRecord:
    """Drive a Decoding to the end and pack it into a RunRecord."""
    return pack_run(decoding, list(decoding), method)


def generate(target: TargetModel, prompt: str | list[int], method: str = "ar", **kwargs: Any) -> RunRecord:
    """Run to the end and return the RunRecord (same arguments as stream)."""
    return run_record(stream(target, prompt, method, **kwargs), method)


@dataclass
class BatchRun:
    """A batched run: one RunRecord per row (in prompt order) plus the batch's own figures:
    `wall` seconds end to end (prefill included), `new_tokens` over all rows, `throughput`
    = new_tokens / wall (tokens/s across the batch), `fed_tokens` per target forward (rows x
    positions, padding included; the first is the prefill)."""

    runs: list[RunRecord]
    wall: float
    new_tokens: int
    throughput: float
    fed_tokens: list[int]


def generate_batch(
    target: TargetModel,
    prompts: list[str | list[int]],
    method: str = "ar",
    max_new_tokens: int | None = 64,
    sampling: SamplingConfig | None = None,
    raw: bool = False,
    drafter: str | Drafter | BatchDrafter | None = None,
    options: dict[str, Any] | None = None,
    stop_on_eos: bool = True,
    cache_dir: Path | None = None,
    batch_cost: list[float] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
) -> BatchRun:
    """Decode every prompt at once with `method` (ar, dflash or adaflash); each row's output is
    what generate() gives for that prompt alone at temperature 0. Arguments as stream();
    `drafter` may also be a ready single-sequence Drafter (its network is shared) or a
    BatchDrafter; `batch_cost` overrides AdaFlash's verify-cost curve (default: measured at
    this batch size). Row b samples with seed sampling.seed + b. Sampling keywords as stream()."""
    from .batch import BatchDecoding, BatchDrafter, batch_drafter, build_batch_drafter  # loads the DFlash modules

    sampling = sampling_from(sampling, temperature, top_p, top_k, seed)
    ids = [encode_prompt(target, p, raw) for p in prompts]
    if isinstance(drafter, BatchDrafter):
        built = drafter
    elif isinstance(drafter, Drafter):
        built = batch_drafter(drafter, batch_cost)
    else:
        built = build_batch_drafter(method, target, options, drafter, batch=len(ids), cache_dir=cache_dir)
    decoding = BatchDecoding(target, built, ids, sampling, max_new_tokens, stop_on_eos)
    t0 = time.perf_counter()
    for _ in decoding:
        pass
    wall = time.perf_counter() - t0
    runs = []
    for row in decoding.rows:
        run = RunRecord(
            method=method, config=built.config_dict(), sampling=config_to_dict(sampling), model=target.name,
            device=str(target.device), prompt_ids=row.prompt, steps=row.steps, output_ids=row.output,
            finish_reason=row.finish_reason or "stopped", prefill_time=row.steps[0].verify_time,
        )
        run.metrics = summarize(run)
        runs.append(run)
    new_tokens = sum(len(r.output_ids) for r in runs)
    return BatchRun(runs, wall, new_tokens, new_tokens / wall if wall > 0 else 0.0, list(decoding.fed))
