"""Draft trees: the shape every method's proposal takes, and the masks and positions it implies.

A draft is a list of nodes (token, parent); the root (parent ROOT = -1) is the last committed
token, which is fed first. A chain is the special case parents = [-1, 0, 1, ...]. Nodes are
stored parent-before-child, so one pass in index order visits every ancestor first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from .trace import ROOT


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError("tokens and parents differ in length")
        for i, parent in enumerate(self.parents):
            if not (parent == ROOT or 0 <= parent < i):
                raise ValueError(f"node {i} has parent {parent}; parents must come before children")

    @classmethod
    def chain(cls, tokens: list[int]) -> "DraftTree":
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == i - 1 for i, parent in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node: children of the root have depth 1."""
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent == ROOT else depth[parent] + 1)
        return depth

    def children(self, node: int) -> list[int]:
        """Children of `node` (ROOT for the root) in insertion order."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]

    def follow(self, tokens: list[int]) -> list[int]:
        """The nodes of the longest path from the root whose tokens begin `tokens`."""
        path, node = [], ROOT
        for token in tokens:
            node = next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents))
                         if p == node and t == token), None)
            if node is None:
                break
            path.append(node)
        return path

    def with_chain(self, tokens: list[int]) -> tuple["DraftTree", int]:
        """This tree with the chain `tokens` from the root added as a path, and how many of them
        it already held: the chain follows existing nodes while their tokens agree and the rest
        become new nodes after all of this tree's, so every old node keeps its index."""
        held = self.follow(tokens)
        tail = tokens[len(held):]
        start = held[-1] if held else ROOT
        parents = [start, *range(len(self), len(self) + len(tail) - 1)] if tail else []
        return DraftTree((*self.tokens, *tail), (*self.parents, *parents)), len(held)

    def ancestor_mask(self) -> torch.Tensor:
        """[n+1, n+1] bool: row i may attend to column j (the root is row/column 0, nodes 1..n):
        each node sees the root, its ancestors and itself."""
        n = len(self)
        allow = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        allow[:, 0] = True
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                allow[i + 1] = allow[parent + 1]
            allow[i + 1, i + 1] = True
        return allow

    def position_ids(self, root_position: int) -> list[int]:
        """Absolute positions: the root at `root_position`, each node at root + depth."""
        return [root_position] + [root_position + d for d in self.depths()]


def additive_mask(
    allow: torch.Tensor,
    prefix_len: int,
    dtype: torch.dtype,
    positions: list[int] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """[T, T] bool tree mask -> [1, 1, T, prefix_len + T] additive float mask (0 = visible).

    Float, not bool: eager attention adds the mask to the scores, so a bool mask is silently wrong
    there while SDPA accepts both. With a sliding `window`, a row at position p also loses every
    key at position p - window or earlier (the model's own windowed masks use the same rule), so
    each node sees the last `window` positions of its own path: prefix entry j sits at position j,
    fed rows at `positions`.
    """
    t = allow.shape[0]
    full = torch.ones(t, prefix_len + t, dtype=torch.bool)
    full[:, prefix_len:] = allow
    if window is not None:
        if positions is None:
            raise ValueError("a windowed tree mask needs the rows' positions")
        query = torch.tensor(positions)
        key = torch.cat([torch.arange(prefix_len), query])
        full &= key[None, :] > query[:, None] - window
    mask = torch.zeros(1, 1, t, prefix_len + t, dtype=dtype)
    return mask.masked_fill(~full, torch.finfo(dtype).min)


# A node's successor: (its probability given the node, a tie-break key unique among successors,
# its token, what `successors` needs to list its own successors in turn).
Successor = tuple[float, Any, int, Any]


def best_first_tree(successors: Callable[[int, Any], Iterable[Successor]], nodes: int) -> tuple[DraftTree, list[float]]:
    """The `nodes` most probable paths of the tree `successors` describes, as a draft tree, and
    each node's probability given its parent. `successors(node, payload)` lists a node's
    children (first the root's: ROOT, None); a path's probability is the product along it, and
    equal ones go to the smaller tie-break key, so payloads are never compared. Best-first, so a
    path enters only after its parent and every kept path's prefix is kept; a node's successors
    are asked for only while the budget has room (each call may cost a model step). Why one
    builder: every drafter that proposes a tree (DFlash's slots, DFlash 2's lattice, DeLS's
    fusion) keeps its most probable paths this way, and differs only in how it scores a child."""
    heap: list[tuple[float, Any, int, int, float, Any]] = []

    def push(node: int, payload: Any, neg: float) -> None:
        for p, tie, token, child in successors(node, payload):
            heapq.heappush(heap, (neg * p, tie, token, node, p, child))

    push(ROOT, None, -1.0)
    tokens, parents, q = [], [], []
    while heap and len(tokens) < nodes:
        neg, _, token, parent, p, payload = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        q.append(p)
        if len(tokens) < nodes:
            push(len(tokens) - 1, payload, neg)
    return DraftTree(tuple(tokens), tuple(parents)), q
