"""PTD's draft tree: noisy lookahead sub-trees the target grows one level per forward.

The tree has a virtual root (the last committed token, fed by the engine) whose children are a
window of sub-tree roots s_0..s_{W-1}. The sub-tree roots form a causal chain, a Jacobi-style
guess of the next W tokens: s_k sits at offset k + 1 from the root and sees s_0..s_{k-1}. A node
at depth d in sub-tree k sits at offset k + d and sees the roots of earlier sub-trees plus its own
ancestors in sub-tree k, so its position agrees with what it sees. These tokens are fed in the
verification forward as the engine's `Lookahead` (never verified, KV discarded); the target's
prediction at each of them is how the tree drafts.

After each forward: grow (each fed node adds its prediction as a child), re-anchor on the
committed tokens (`shift`), slide the window, prune depth ("go deeper": a too-deep sub-tree is
replaced by its oldest child's sub-tree), cap children, cap the token budget. Nodes carry ids so
the trace can say which survived, which were added and which were pruned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .base import Lookahead


@dataclass
class DraftNode:
    token: int
    uid: int
    children: list["DraftNode"] = field(default_factory=list)
    preds: list[int] = field(default_factory=list)  # the target's predictions at this node, last forward

    def depth(self) -> int:
        """Levels in this sub-tree, this node counting as 1."""
        return 1 + max((child.depth() for child in self.children), default=0)


@dataclass
class Flat:
    """The draft tree in feed order (each sub-tree depth-first, sub-trees oldest first)."""

    nodes: list[DraftNode]
    parents: list[int]  # index into nodes, -1 for a sub-tree root
    subtree: list[int]
    depth: list[int]  # 1 for a sub-tree root


class DraftForest:
    """The window of draft sub-trees and the operations of one progressive update."""

    def __init__(self) -> None:
        self.roots: list[DraftNode] = []
        self._uid = 0

    @classmethod
    def from_snapshot(cls, snapshot: dict[str, list[int]]) -> "DraftForest":
        """The forest a trace's `snapshot()` was taken of (same tokens, same feed order), for
        replaying a recorded step: e.g. its `lookahead()` mask. Predictions are not recorded."""
        forest, nodes = cls(), []
        for token, parent in zip(snapshot["tokens"], snapshot["parents"]):
            node = forest.new_node(token)
            (forest.roots if parent == -1 else nodes[parent].children).append(node)
            nodes.append(node)
        return forest

    def new_node(self, token: int) -> DraftNode:
        self._uid += 1
        return DraftNode(token, self._uid)

    def flat(self) -> Flat:
        out = Flat([], [], [], [])
        for k, root in enumerate(self.roots):
            stack = [(root, -1, 1)]
            while stack:
                node, parent, depth = stack.pop()
                out.nodes.append(node)
                out.parents.append(parent)
                out.subtree.append(k)
                out.depth.append(depth)
                me = len(out.nodes) - 1
                stack.extend((child, me, depth + 1) for child in reversed(node.children))
        return out

    def snapshot(self) -> dict[str, list[int]]:
        """Plain lists for the trace: tokens and parents in feed order (-1 = sub-tree root)."""
        flat = self.flat()
        return {"tokens": [n.token for n in flat.nodes], "parents": list(flat.parents)}

    def uids(self) -> list[int]:
        return [n.uid for n in self.flat().nodes]

    def lookahead(self, n_guess: int) -> Lookahead:
        """Tokens, offsets from the root, and visibility [A, 1 + n_guess + A]: the root, the roots of
        earlier sub-trees, the node's ancestors in its own sub-tree, itself; never the guess tree."""
        flat = self.flat()
        a = len(flat.nodes)
        allow = torch.zeros(a, 1 + n_guess + a, dtype=torch.bool)
        allow[:, 0] = True
        root_rows = [i for i, parent in enumerate(flat.parents) if parent == -1]
        for i, parent in enumerate(flat.parents):
            col = 1 + n_guess
            if parent == -1:
                allow[i, [col + r for r in root_rows[: flat.subtree[i]]]] = True
            else:
                allow[i] = allow[parent]
            allow[i, col + i] = True
        positions = [k + d for k, d in zip(flat.subtree, flat.depth)]
        return Lookahead([n.token for n in flat.nodes], positions, allow)

    def record(self, flat: Flat, preds: list[list[int]]) -> None:
        """Store the target's predictions at each fed node (rows in feed order)."""
        for node, pred in zip(flat.nodes, preds):
            node.preds = list(pred)

    def grow(self, flat: Flat, max_children: int, eos: frozenset[int]) -> None:
        """Each fed node adds its predictions as children (new tokens only, up to max_children);
        nothing grows after an EOS."""
        for node in flat.nodes:
            if node.token in eos:
                continue
            have = {child.token for child in node.children}
            for token in node.preds:
                if len(node.children) >= max_children:
                    break
                if token not in have:
                    node.children.append(self.new_node(token))
                    have.add(token)

    def shift(self, m: int) -> None:
        """Re-anchor after m tokens were committed: the root moved m positions on, so the first m
        sub-trees now stand at committed positions and are dropped; the others keep their
        absolute positions (offsets shrink by m)."""
        del self.roots[:m]

    def slide(self, window: int, anchor: int, guess_next: Callable[[int], int], eos: frozenset[int]) -> None:
        """Keep `window` sub-trees: drop the oldest beyond it; append new roots, each the target's
        prediction at the last root (or `guess_next` of it when it was never fed), continuing
        from `anchor` (the committed root) when the window is empty."""
        del self.roots[: max(0, len(self.roots) - window)]
        while len(self.roots) < window:
            last = self.roots[-1] if self.roots else None
            preds = [t for t in (last.preds if last else []) if t not in eos]
            token = preds[0] if preds else guess_next(last.token if last else anchor)
            self.roots.append(self.new_node(token))

    def prune_depth(self, max_depth: int, eos: frozenset[int]) -> None:
        """A sub-tree deeper than max_depth goes deeper: its oldest child becomes the sub-tree
        root (keeping its own sub-tree); it is dropped instead when that child is EOS or already a
        sub-tree root's token."""
        kept: list[DraftNode] = []
        for root in self.roots:
            while root is not None and root.depth() > max_depth:
                heir = root.children[0]
                taken = {r.token for r in self.roots if r is not root}
                root = None if heir.token in eos or heir.token in taken else heir
            if root is not None:
                kept.append(root)
        self.roots = kept

    def cap_children(self, max_children: int) -> None:
        """Remove the newest children beyond max_children, everywhere."""
        stack = list(self.roots)
        while stack:
            node = stack.pop()
            del node.children[max_children:]
            stack.extend(node.children)

    def cap_tokens(self, budget: int) -> None:
        """Keep at most `budget` nodes: sub-tree roots first (oldest first), then level by level,
        oldest child first; a kept node's parent is always kept."""
        del self.roots[budget:]
        kept = len(self.roots)
        level = list(self.roots)
        while level:
            nxt: list[DraftNode] = []
            for node in level:
                room = max(0, budget - kept)
                del node.children[room:]
                kept += len(node.children)
                nxt.extend(node.children)
            level = nxt

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf token path, each leaf extended by its first prediction, if any."""
        out: list[list[int]] = []
        stack = [(root, [root.token]) for root in self.roots]
        while stack:
            node, path = stack.pop()
            if not node.children:
                out.append(path + node.preds[:1])
            stack.extend((child, path + [child.token]) for child in node.children)
        return out
