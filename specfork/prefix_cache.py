"""Prefix cache: finished requests' branches stay in the KV tree, found by token prefix.

A token trie (radix-style, as SGLang's RadixAttention) maps every cached sequence's tokens to
the branch holding their K/V. A new prompt walks the trie as far as it matches and forks the
branch found there at that depth: O(1) in the matched length, no K/V copied, and the shared
blocks are stored once however many requests fork them. Entries are evicted least recently
used when the pool needs room; releasing one frees only the blocks no live branch still reads.
"""
from __future__ import annotations

import itertools


class _Node:
    __slots__ = ("children", "entries")

    def __init__(self):
        self.children: dict[int, _Node] = {}
        self.entries: set[int] = set()         # ids of the entries whose tokens pass here


class PrefixCache:
    """Cached (tokens, branch) pairs of one `KVTree`; `max_entries` bounds the bookkeeping."""

    def __init__(self, kv, max_entries: int = 256):
        self.kv, self.max_entries = kv, max_entries
        self.root = _Node()
        self.entries: dict[int, tuple[list[int], object]] = {}   # id -> (tokens, branch)
        self.used: dict[int, int] = {}                            # id -> last use (a clock)
        self._clock = itertools.count()
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def cached_tokens(self) -> int:
        return sum(len(t) for t, _ in self.entries.values())

    def match(self, tokens: list[int]) -> tuple[int, object | None]:
        """(matched length, the branch holding those tokens) for the longest cached prefix of
        `tokens`; (0, None) when nothing matches. Marks the entry used."""
        node, depth = self.root, 0
        for t in tokens:
            nxt = node.children.get(t)
            if nxt is None or not nxt.entries:
                break
            node, depth = nxt, depth + 1
        if depth == 0:
            return 0, None
        eid = max(node.entries, key=lambda e: self.used[e])
        self.used[eid] = next(self._clock)
        return depth, self.entries[eid][1]

    def fork(self, tokens: list[int], limit: int):
        """A new branch holding the longest cached prefix of `tokens` (at most `limit` tokens),
        and its length; (None, 0) on a miss. Under a KV window, a match whose window's float16
        shadows were already given back (a point well before the entry's end) is a miss."""
        m, br = self.match(tokens[:limit])
        if br is None or not self.kv.window_ready(br, m):
            return None, 0
        return self.kv.fork(br, at=m), m

    def insert(self, tokens: list[int], branch) -> bool:
        """Keep `branch` (holding the K/V of `tokens`, the caller's handle passes to the cache)
        as an entry. A sequence already covered by an entry is not kept twice (the branch is
        released); entries the new one extends are dropped. False when not kept."""
        node = self.root
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                break
        else:
            if node.entries:                              # an entry covers all of tokens
                self.kv.release(branch)
                return False
        eid = next(self._ids)
        self.entries[eid] = (list(tokens), branch)
        self.used[eid] = next(self._clock)
        node = self.root
        for t in tokens:                      # no throwaway node per shared token (setdefault)
            nxt = node.children.get(t)
            if nxt is None:
                nxt = node.children[t] = _Node()
            node = nxt
            node.entries.add(eid)
        # entries that end on the new path are prefixes of it: the new one serves them all
        for other in [e for e in node_path_entries(self.root, tokens) if e != eid]:
            if len(self.entries[other][0]) <= len(tokens) and \
                    self.entries[other][0] == tokens[:len(self.entries[other][0])]:
                self.drop(other)
        while len(self.entries) > self.max_entries:
            self.evict()
        return True

    def drop(self, eid: int) -> None:
        """Forget one entry and release its branch."""
        tokens, branch = self.entries.pop(eid)
        self.used.pop(eid)
        node, path = self.root, []
        for t in tokens:
            child = node.children[t]
            path.append((node, t, child))
            node = child
        for parent, t, child in path:
            child.entries.discard(eid)
        for parent, t, child in reversed(path):           # prune the nodes nobody passes
            if not child.entries and not child.children:
                del parent.children[t]
        self.kv.release(branch)

    def evict(self) -> bool:
        """Drop the least recently used entry; False when the cache is empty."""
        if not self.entries:
            return False
        self.drop(min(self.used, key=self.used.get))
        return True

    def clear(self) -> None:
        while self.evict():
            pass


def node_path_entries(root: _Node, tokens: list[int]) -> set[int]:
    """Entries passing through any node on `tokens`' path."""
    out, node = set(), root
    for t in tokens:
        node = node.children.get(t)
        if node is None:
            break
        out |= node.entries
    return out
