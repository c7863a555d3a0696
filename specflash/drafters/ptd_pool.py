"""PTD's n-gram pool: where guess trees come from.

A dict `key token -> trie of continuations seen after that token`, kept in process (the
reference runs it in a separate server over shared memory; that is engineering, not the method).
It is fed from the prompt, the committed text, the target's predictions at the draft tree and at
the guess tree just verified, and each step hands back the trie under the last committed token,
cut to a node budget, as the guess tree the target verifies. Each key's trie is bounded: when it
grows past `max_nodes`, its oldest first-level branch is evicted (FIFO, as in the reference).
Within a trie, children are kept most-recent-last, so the newest evidence is retrieved first.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..tree import DraftTree


@dataclass
class TrieNode:
    children: dict[int, "TrieNode"] = field(default_factory=dict)

    def size(self) -> int:
        """Nodes below this one."""
        return sum(1 + child.size() for child in self.children.values())


class NGramPool:
    """Continuations after each token, as bounded tries."""

    def __init__(self, max_nodes: int, max_depth: int) -> None:
        self.max_nodes = max_nodes
        self.max_depth = max_depth
        self.tries: dict[int, TrieNode] = {}
        self._sizes: dict[int, int] = {}

    def __contains__(self, key: int) -> bool:
        return key in self.tries

    def add(self, key: int, continuation: list[int]) -> None:
        """Record that `continuation` followed `key` (cut to max_depth); refreshes its recency."""
        seq = continuation[: self.max_depth]
        if not seq:
            return
        trie = self.tries.setdefault(key, TrieNode())
        node, added = trie, 0
        for token in seq:
            child = node.children.pop(token, None)
            if child is None:
                child, added = TrieNode(), added + 1
            node.children[token] = child  # re-inserted: now the most recent
            node = child
        self._sizes[key] = self._sizes.get(key, 0) + added
        self._evict(key)

    def _evict(self, key: int) -> None:
        trie = self.tries[key]
        while self._sizes[key] > self.max_nodes and len(trie.children) > 1:
            oldest = next(iter(trie.children))
            self._sizes[key] -= 1 + trie.children.pop(oldest).size()

    def add_text(self, tokens: list[int], starts: range | None = None) -> None:
        """Every n-gram of `tokens` (n up to max_depth + 1) whose key is at one of `starts`."""
        for i in starts if starts is not None else range(len(tokens) - 1):
            if 0 <= i < len(tokens) - 1:
                self.add(tokens[i], tokens[i + 1 : i + 1 + self.max_depth])

    def add_tree(self, key: int, tokens: list[int], parents: list[int], tails: dict[int, int]) -> None:
        """Every root-to-leaf path of a tree hung under `key` (parents: -1 = child of key), each
        extended by `tails[node]` (the target's prediction after the node) where given."""
        has_child = set(parents)
        for leaf in range(len(tokens)):
            if leaf in has_child and leaf not in tails:
                continue
            path, node = [], leaf
            while node != -1:
                path.append(tokens[node])
                node = parents[node]
            path.reverse()
            if leaf in tails:
                path.append(tails[leaf])
            self.add(key, path)

    def guess(self, key: int, budget: int, max_depth: int) -> DraftTree:
        """The trie under `key` as a draft tree of at most `budget` nodes and `max_depth` levels.

        Depth-first, most recent child first: the freshest continuation comes whole before any
        alternative, which is what a greedy walk can use; parents always precede children.
        """
        trie = self.tries.get(key)
        tokens: list[int] = []
        parents: list[int] = []
        if trie is None or budget <= 0 or max_depth <= 0:
            return DraftTree((), ())
        stack = [(child_token, child, -1, 1) for child_token, child in trie.children.items()]
        while stack and len(tokens) < budget:
            token, node, parent, depth = stack.pop()
            tokens.append(token)
            parents.append(parent)
            if depth < max_depth:
                me = len(tokens) - 1
                stack.extend((t, c, me, depth + 1) for t, c in node.children.items())
        return DraftTree(tuple(tokens), tuple(parents))

    def first_continuation(self, key: int, limit: int) -> list[int]:
        """The most recent chain of up to `limit` tokens seen after `key`."""
        node, out = self.tries.get(key), []
        while node is not None and node.children and len(out) < limit:
            token = next(reversed(node.children))
            out.append(token)
            node = node.children[token]
        return out
