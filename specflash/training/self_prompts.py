"""Requests written by the target itself (Magpie-style): the chat template up to the start of a
user turn, plus a short opening, and the model completes the user message.

Why: the requests a drafter is judged on are short hand-written ones, and only the few train
prompts look like them; templated tasks over local text are many but all alike. An instruct
model has learnt what users ask, so sampling its user turn gives as many varied, natural requests
as the harvest can answer, with no data set to download. The openings steer them towards the
four domains (and one slot in five is left free), or, with a harvest's `--self-prompt-domains`, to
the ones named (where a drafter is weakest). The target then answers each one greedily, as for
every other source, so the labels are still its own greedy tokens.

Slot `i` of the list is decided by the seed alone (its opening, and the sampler's generator for
its batch), so a rerun on the same torch build writes the same requests; a slot whose message
does not end within the token cap, or is too short, is dropped. The list is kept as JSON lines in
the harvest folder and grows batch by batch, so an interrupted run resumes.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import SpecFlashError
from ..kv import new_cache
from .sources import Job

SOURCE = "self-prompts"
OPENINGS: dict[str, tuple[str, ...]] = {
    "math": ("What is", "Calculate", "Solve", "How many", "If", "A store", "Find", "Explain how to compute"),
    "code": ("Write a Python function that", "How do I", "Write a function", "Explain", "What is the difference between",
             "Write a program", "Fix", "Write a SQL query"),
    "writing": ("Write a short poem about", "Write a story", "Write an email", "Describe", "Give me", "Write a",
                "Tell me", "Can you"),
    "rewrite": ("Rewrite this sentence", "Summarize the following", "Paraphrase", "Make this more formal:",
                "Fix the grammar", "Shorten this", "Translate", "Rewrite the following"),
    "chat": ("",),  # left free: whatever the model thinks users ask
}
_SENTINEL = "\x00user message\x00"
BATCH = 64
MIN_WORDS = 4


def user_turn_frame(tokenizer) -> tuple[str, str]:
    """(text before a user message, text after it) in the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecFlashError(f"source {SOURCE} needs a chat model: the tokenizer has no chat template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=True,
                                         tokenize=False)
    before, sep, after = text.partition(_SENTINEL)
    if not sep:
        raise SpecFlashError("the chat template does not place the user message verbatim")
    return before, after


def check_domains(domains: Sequence[str]) -> list[str]:
    """The opening domains named, each known and none twice (a harvest's `--self-prompt-domains`)."""
    unknown = [d for d in domains if d not in OPENINGS]
    if unknown or not domains or len(set(domains)) != len(domains):
        raise SpecFlashError(f"self-prompt domains {list(domains)}: name each of {', '.join(OPENINGS)} at most once, "
                             "at least one")
    return list(domains)


def slot_openings(n: int, seed: int, domains: Sequence[str] | None = None) -> list[tuple[str, str]]:
    """(domain, opening) of slots 0..n-1, cycling over `domains` (default: all of them); a subset
    steers a harvest towards the domains a drafter is weakest on."""
    rng = random.Random(f"{SOURCE}|{seed}")
    domains = list(OPENINGS) if domains is None else check_domains(domains)
    return [(domains[i % len(domains)], rng.choice(OPENINGS[domains[i % len(domains)]])) for i in range(n)]


@torch.inference_mode()
def sample_user_turns(model, tokenizer, openings: Sequence[str], generator: torch.Generator,
                      temperature: float, max_tokens: int) -> list[str | None]:
    """Each opening continued as a user message; None where it did not end within `max_tokens`."""
    before, after = user_turn_frame(tokenizer)
    end = tokenizer(after, add_special_tokens=False)["input_ids"][0]  # the token that closes the turn
    prompts = [tokenizer(before + o, add_special_tokens=False)["input_ids"] for o in openings]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    written: list[list[int]] = [[] for _ in prompts]
    ended = [False] * len(prompts)
    cache = new_cache(model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    step_ids = ids
    for _ in range(max_tokens):
        out = model(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                    logits_to_keep=1)
        probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]
        for r, token in enumerate(nxt.tolist()):
            if not ended[r]:
                if token == end:
                    ended[r] = True
                else:
                    written[r].append(token)
        if all(ended):
            break
        mask = torch.cat([mask, mask.new_ones(len(prompts), 1)], dim=-1)
        positions = positions[:, -1:] + 1
        step_ids = nxt[:, None]
    return [(o + tokenizer.decode(w)).strip() if done else None for o, w, done in zip(openings, written, ended)]


def self_prompt_jobs(model, tokenizer, n: int, seed: int, path: Path, temperature: float = 1.0,
                     max_tokens: int = 64, progress=None, domains: Sequence[str] | None = None) -> list[Job]:
    """The kept requests among slots 0..n-1, writing the missing batches of slots to `path`."""
    slots = slot_openings(n, seed, domains)
    lines = path.read_text().splitlines() if path.is_file() else []
    done = len(lines) - len(lines) % BATCH  # a batch cut short by an interrupt is redone
    messages: list[str | None] = [json.loads(line)["text"] for line in lines[:done]]
    with path.open("w") as f:
        f.writelines(line + "\n" for line in lines[:done])
        for start in range(done, n, BATCH):
            batch = slots[start : start + BATCH]
            key = hashlib.sha1(f"{SOURCE}|{seed}|{start}".encode()).hexdigest()
            generator = torch.Generator(model.device).manual_seed(int(key[:12], 16))
            texts = sample_user_turns(model, tokenizer, [o for _, o in batch], generator, temperature, max_tokens)
            f.writelines(json.dumps({"slot": start + i, "text": t}) + "\n" for i, t in enumerate(texts))
            f.flush()
            messages.extend(texts)
            if progress is not None:
                progress(len(batch))
    jobs, seen = [], set()
    for i, ((domain, opening), text) in enumerate(zip(slots, messages[:n])):
        if text is None or len(text.split()) < len(opening.split()) + MIN_WORDS or text in seen:
            continue
        seen.add(text)
        jobs.append(Job(f"self-{i:05d}", domain, SOURCE, text))
    return jobs
