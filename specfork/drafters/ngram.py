"""Prompt-lookup drafting: propose what followed earlier occurrences of the context's suffix.

Costs no model call, and wins where outputs copy the input (code edits, quoting, repetition).
An index n-gram -> end positions grows with the context, so each step is a few dict lookups
rather than a rescan of thousands of tokens. In a long document a short suffix occurs at many
sites; the sites of the longest indexed n-gram are ranked by how far the match really reaches
back (up to `max_match` tokens, as suffix-automaton drafters rank by match length), the most
recent first among equals: the site that agrees with the most context continues it best.
"""
from __future__ import annotations

from collections import defaultdict
from itertools import islice

from specfork.types import DraftPath, SamplingParams


class NgramDrafter:
    name = "ngram"
    flat_cost = True           # a lookup costs the same whatever depth it is asked for

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1, max_sites: int = 64,
                 max_match: int = 32):
        assert 1 <= min_ngram <= max_ngram
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_sites = max_sites  # match sites read per n-gram length, most recent first
        self.max_match = max(max_match, max_ngram)   # how far back a match is measured
        self.end()

    def spawn(self) -> "NgramDrafter":
        """A drafter of the same settings for another concurrent request."""
        return NgramDrafter(self.max_ngram, self.min_ngram, self.max_sites, self.max_match)

    def begin(self, prompt_ids: list[int]) -> None:
        self.end()
        self._sync(prompt_ids)

    def observe(self, context: list[int]) -> None:
        self._sync(context)

    def end(self) -> None:
        self._ctx: list[int] = []
        self._index: dict[tuple[int, ...], list[int]] = defaultdict(list)

    def _sync(self, context: list[int]) -> None:
        """Index the n-grams ending at each new position; a context that is not an extension of
        the indexed one (a new request without begin, a rollback) is indexed from scratch."""
        k = len(self._ctx)
        if len(context) < k or context[:k] != self._ctx:
            self.end()
            k = 0
        ctx = self._ctx
        ctx.extend(context[k:])
        for e in range(k + 1, len(ctx) + 1):
            for n in range(self.min_ngram, min(self.max_ngram, e) + 1):
                self._index[tuple(ctx[e - n:e])].append(e)

    def propose(self, context: list[int], num_paths: int, max_len: int,
                sampling: SamplingParams) -> list[DraftPath]:
        """Continuations after earlier occurrences of the suffix: longest n-gram first; within
        it, the sites whose match reaches furthest back first, then the most recent. A
        continuation that is a prefix of a chosen path is dropped, and one that extends a
        chosen path replaces it (the most recent match is often cut short by the end of the
        context), so paths never repeat each other."""
        self._sync(context)
        ctx, L = self._ctx, len(self._ctx)
        paths: list[DraftPath] = []
        if num_paths <= 0 or max_len <= 0:
            return paths
        for n in range(min(self.max_ngram, L), self.min_ngram - 1, -1):
            sites = self._index.get(tuple(ctx[L - n:]), [])
            ranked = sorted(((self._reach(e, n), e) for e in
                             islice(reversed(sites), 1, self.max_sites + 1)),   # not e == L
                            key=lambda me: (-me[0], -me[1]))
            for m, e in ranked:
                cont = ctx[e:e + max_len]
                for i, p in enumerate(paths):
                    if p.tokens[:len(cont)] == cont:
                        break
                    if cont[:len(p.tokens)] == p.tokens:
                        paths[i] = DraftPath(cont, None, self.name,
                                             {"ngram": n, "pos": e, "match": m})
                        break
                else:
                    paths.append(DraftPath(cont, None, self.name,
                                           {"ngram": n, "pos": e, "match": m}))
                    if len(paths) == num_paths:
                        return paths
        return paths

    def _reach(self, e: int, n: int) -> int:
        """Tokens before site `e` that equal the context's last ones (>= n: the n-gram)."""
        ctx, L, m = self._ctx, len(self._ctx), n
        while m < self.max_match and m < e and ctx[e - 1 - m] == ctx[L - 1 - m]:
            m += 1
        return m
