"""A datastore of the target's own answers, looked up like prompt lookup looks up the context.

Why: a small target answers similar requests in similar words ("Once upon a time, in a small
village, there lived", "Here is a Python function that"), so the continuation that followed the
context's tail in its earlier answers to other requests is often what it says next, where the
drafter, reading this context only, is unsure. On the dev prompts, at the steps a chain-drafting
`dflash` drafted, the datastore's continuation matched 0.66-0.78 tokens per step (math, code,
writing) beside the drafter's 0.76-0.86, and the better of the two 1.15-1.19
(scripts/datastore_oracle.py): the two fail on different steps, so a tree that holds both gets
most of the sum (retrieval drafting as in REST, He et al. 2023, here as one more branch of the
drafter's tree: lookup_graft.py).

The store is built from the harvested answers (`training/harvest.py`: the target's greedy
answers to the train split and to requests made from local text, never the held-out or dev
prompts), each with the last `_PROMPT_TAIL` tokens of its prompt before it so that an answer's
first tokens can match after the chat template's. It indexes every position by the tokens before
it, most recent first, so the positions whose preceding n tokens equal the context's last n form
one range of the sorted index, and each longer match narrows the range of the shorter one.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from ..errors import CheckpointError

_SEP = -1  # between sequences: no context token equals it, so no match crosses one
_PROMPT_TAIL = 8  # prompt tokens kept before each answer
_VOTERS = 64  # occurrences a continuation is voted from, at most


class Datastore:
    """Token sequences indexed by their preceding tokens, up to `depth` of them."""

    def __init__(self, sequences: Sequence[Sequence[int]], depth: int = 8,
                 tokenizers: frozenset[str] = frozenset()) -> None:
        """`tokenizers`: the fingerprints (models/tokenizer_id.py) its harvests recorded, if any."""
        self.tokenizers = tokenizers
        parts = [np.asarray(seq, dtype=np.int32) for seq in sequences if len(seq)]
        sep = np.array([_SEP], dtype=np.int32)
        corpus = np.concatenate([x for part in parts for x in (part, sep)]) if parts else sep
        self.depth = depth
        # corpus behind `depth` separators, so position p's j-th preceding token is padded[p + depth - j]
        self.padded = np.concatenate([np.full(depth, _SEP, dtype=np.int32), corpus])
        n = len(corpus)
        before = [self.padded[depth - j : depth - j + n] for j in range(depth, 0, -1)]  # last key sorts first
        order = np.lexsort(before)
        self.order = order[corpus[order] != _SEP].astype(np.int32)  # a position indexed has a token to propose
        # each indexed position's first and second preceding tokens, in index order: the two
        # widest ranges are searched without gathering (a common token's range is most of the store)
        self.columns = [self.padded[self.order + depth - j] for j in (1, 2)]
        self.tokens = n - len(parts)
        self.largest_id = int(corpus.max())

    def __len__(self) -> int:
        return self.tokens

    def match(self, context: Sequence[int], k: int, max_ngram: int, min_ngram: int = 1) -> tuple[list[int], int]:
        """The continuation (at most k tokens) after the longest n-gram, n in [min_ngram,
        max_ngram], that ends the context and occurs in the store, voted token by token over
        its occurrences (the most common next token, then the most common among the
        occurrences that agreed, ...); ([], 0) when none occurs."""
        lo, hi, found = 0, len(self.order), None
        for j in range(1, min(max_ngram, self.depth, len(context)) + 1):
            if j <= len(self.columns):
                column = self.columns[j - 1][lo:hi]
            else:
                column = self.padded[self.order[lo:hi] + self.depth - j]
            key = np.int32(context[-j])  # the column's own type: another would cast the whole column
            a, b = np.searchsorted(column, key, "left"), np.searchsorted(column, key, "right")
            if a == b:
                break
            lo, hi = lo + int(a), lo + int(b)
            if j >= min_ngram:
                found = (j, lo, hi)
        if found is None or k <= 0:
            return [], 0
        ngram, lo, hi = found
        if hi - lo <= _VOTERS:
            picks = self.order[lo:hi]
        else:  # evenly over the range
            picks = self.order[np.linspace(lo, hi - 1, _VOTERS).astype(np.int64)]
        at = np.minimum(self.depth + picks[:, None] + np.arange(k)[None], len(self.padded) - 1)  # the last is a separator
        return vote(self.padded[at], k), ngram

    @classmethod
    def from_harvests(cls, folder: Path | str, depth: int = 8) -> Datastore:
        """The greedy answers of every harvest folder under `folder` (a folder of them, or one),
        each after its prompt's last tokens; sampled answers (a manifest with a temperature) are
        left out, since at T = 0 the target says what it said greedily."""
        return _harvest_store(str(Path(folder).resolve()), depth)


def vote(windows: np.ndarray, k: int) -> list[int]:
    """Token by token, the most common next token among the rows that agreed so far (ties: the
    smallest id); stops at a separator or when no row is left. `windows` [m, >= k]."""
    out: list[int] = []
    alive = windows
    for t in range(min(k, windows.shape[1])):
        column = alive[:, t]
        column = column[column != _SEP]
        if not len(column):
            break
        values, counts = np.unique(column, return_counts=True)
        token = int(values[counts.argmax()])
        out.append(token)
        alive = alive[alive[:, t] == token]
    return out


@lru_cache(maxsize=4)  # about 16 bytes a token each; a bench comparing three stores had rebuilt one every request
def _harvest_store(folder: str, depth: int) -> Datastore:
    root = Path(folder)
    manifests = sorted(root.glob("*/manifest.json")) or sorted(root.glob("manifest.json"))
    if not manifests:
        raise CheckpointError(f"no harvest folders (with a manifest.json) under {root} for the datastore")
    sequences: list[np.ndarray] = []
    tokenizers: set[str] = set()
    for manifest in manifests:
        settings = json.loads(manifest.read_text())
        if settings.get("temperature"):
            continue
        if settings.get("tokenizer"):
            tokenizers.add(settings["tokenizer"])
        for shard in sorted(manifest.parent.glob("shard-*.safetensors")):
            if shard.name.endswith(".features.safetensors"):
                continue
            t = load_file(str(shard))
            tokens, offsets, prompt_lens = t["tokens"], t["offsets"], t["prompt_lens"]
            for a, b, prompt in zip(offsets[:-1], offsets[1:], prompt_lens):
                start = a + prompt
                sequences.append(tokens[max(a, start - _PROMPT_TAIL) : b])
    return Datastore(sequences, depth, frozenset(tokenizers))
