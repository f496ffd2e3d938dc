"""Branching sessions for agents: a context is a KV-tree branch; fork() is O(1) and shares the
prefix blocks, generate() runs on any branch, release() frees what no other branch reads.

`forward_branches` is the batched primitive shared with beam search and MCTS: several branches
take new tokens in one forward. One token each (a beam-search step) on a CPU with the slot op:
every row reads its own branch's slots in place (the start they share listed once), as its lone
decode step would; otherwise the union of their prefixes is gathered once (a block that several
branches read is gathered once, not once per branch) under a per-row mask.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specfork.engine import Engine, check_token_ids
from specfork.errors import SpecforkError
from specfork.kv_tree import Branch, BranchReleased, KVTree
from specfork.attention import AttnMeta, causal_mask, uses_slot_op
from specfork.model import Model
from specfork.sampling import check_sampling, pick, sampling_params


def gather_prefix(kv: KVTree, branches: list[Branch]) -> tuple[torch.Tensor, torch.Tensor]:
    """Unique slots `[L]` of all `branches` and `[B, L]` which of them branch b reads."""
    per = [kv.slots(b) for b in branches]
    rows = torch.repeat_interleave(torch.arange(len(per)), torch.tensor([p.numel() for p in per]))
    uniq, inv = torch.unique(torch.cat(per), return_inverse=True)
    mask = torch.zeros(len(per), uniq.numel(), dtype=torch.bool)
    mask[rows, inv] = True
    return uniq, mask


def forward_branches(model: Model, kv: KVTree, branches: list[Branch],
                     feeds: list[list[int]]) -> torch.Tensor:
    """Append `feeds[i]` (>= 1 token) to `branches[i]`, all in one forward; returns the logits of
    each branch's last fed token `[B, V]`. One branch takes exactly SpecDecoder's path (full
    prefix, no prefix mask), so a lone branch decodes bit-for-bit as `SpecDecoder.generate`."""
    dev = model.device
    lens = [len(f) for f in feeds]
    if not branches or min(lens) < 1:
        raise ValueError("forward_branches needs at least one token per branch")
    positions = torch.cat([torch.arange(b.length, b.length + n) for b, n in zip(branches, lens)])
    tokens = torch.tensor([t for f in feeds for t in f])
    T = tokens.numel()
    last = torch.tensor(lens).cumsum(0) - 1
    # one token per branch (beam search): each row over its own slot list through the slot op
    lists = [kv.slots(b) for b in branches] if (
        len(branches) > 1 and T == len(branches) and uses_slot_op(model)) else None
    if lists is None and len(branches) > 1 and kv.pool.sk is not None:
        # a KV window reads through slot lists only: one forward per branch, all or nothing
        start = [b.length for b in branches]
        try:
            return torch.cat([forward_branches(model, kv, [b], [f])
                              for b, f in zip(branches, feeds)])
        except BaseException:
            for b, n0 in zip(branches, start):
                if b.length > n0:
                    kv.truncate(b, n0)
            raise
    if len(branches) == 1:
        prefix, pmask = kv.slots(branches[0]), None
    elif lists is None:
        prefix, pmask = gather_prefix(kv, branches)
        if T != len(branches):
            pmask = pmask.repeat_interleave(torch.tensor(lens), dim=0)
    write, start = [], [b.length for b in branches]
    try:
        for b, n in zip(branches, lens):
            write.append(kv.append(b, n))
    except Exception:                           # all or nothing: undo the appends that worked
        for b, n0 in zip(branches, start):
            if b.length > n0:
                kv.truncate(b, n0)
        raise
    write = torch.cat(write)
    idx = slice(T - 1, T) if len(branches) == 1 else last.to(dev)
    try:
        if len(branches) == 1:                   # a causal chain after the branch's prefix
            meta = AttnMeta.prefill(model, prefix, write)
        elif lists is not None:
            meta = AttnMeta.lists(model, lists, write)
        else:                                    # block-diagonal causal: own feed only
            seg = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
            tree = (None if T == len(branches)  # one token each: it sees itself
                    else (seg[:, None] == seg[None, :]) & causal_mask(T))
            meta = AttnMeta.branches(model, prefix, write, pmask, tree)
        return model.forward(tokens.to(dev), positions.to(dev), kv.pool, meta, logits_idx=idx)
    except BaseException:                       # no half-written tokens stay in the branches
        for b, n0 in zip(branches, start):
            kv.truncate(b, n0)
        raise


def copy_branch(kv: KVTree, src: Branch) -> Branch:
    """A root branch holding a full copy of `src`'s K/V: the fork of a cache without sharing."""
    pool = kv.pool
    dst = kv.new_branch()
    try:
        to = kv.append(dst, src.length).to(pool.k.device)
    except Exception:
        kv.release(dst)
        raise
    pool.copy_slots(kv.slots(src).to(pool.k.device), to)
    return dst


@dataclass
class Handle:
    """One context: `tokens` is everything in it; the last `pending` of them are not yet in the
    branch's K/V (they go in with the next forward); `logits` predict the token after `tokens`."""
    branch: Branch
    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class Session:
    """Contexts that fork, grow and die independently over one KV tree.

    `full_copy=True` turns every fork into a whole-cache copy (the design without a KV tree),
    for measuring what sharing saves; everything else is identical.
    """

    def __init__(self, engine: Engine, full_copy: bool = False):
        self.engine = engine
        self.model, self.tokenizer, self.kv = engine.model, engine.tokenizer, engine.kv
        self.pool, self.eos = engine.pool, engine.eos
        self.full_copy = full_copy
        self.forks = 0
        self.fork_ns: list[int] = []            # wall time of every fork, for latency stats
        self.forwards = 0

    @classmethod
    def from_decoder(cls, dec, **kw) -> "Session":
        """A session on a SpecDecoder's engine: its model, tokenizer, KV tree and EOS set."""
        return cls(dec.engine, **kw)

    # -- contexts -------------------------------------------------------------------------------
    def start(self, prompt: str | list[int], raw: bool = False) -> Handle:
        """A new root context (computed lazily, at the first fork or generate)."""
        ids = self.engine.encode(prompt, raw)
        return Handle(self.kv.new_branch(), list(ids), list(ids))

    def extend(self, h: Handle, tokens: str | list[int]) -> Handle:
        """Append tokens (a tool result, a user turn) to a context, lazily."""
        self._live(h)
        ids = self.tokenizer(tokens, add_special_tokens=False)["input_ids"] \
            if isinstance(tokens, str) else [int(t) for t in tokens]
        check_token_ids(ids, self.model.vocab_size)
        if ids:
            h.tokens += ids
            h.pending += ids
            h.logits = None
        return h

    def fork(self, h: Handle) -> Handle:
        """A new context equal to `h`. Pending tokens are computed first, so the shared part
        is computed and stored once. O(1) in the context length (unless full_copy)."""
        self._live(h)
        self.flush([h])
        t0 = time.perf_counter_ns()
        br = copy_branch(self.kv, h.branch) if self.full_copy else self.kv.fork(h.branch)
        self.fork_ns.append(time.perf_counter_ns() - t0)
        self.forks += 1
        return Handle(br, list(h.tokens), [], h.logits)

    def release(self, h: Handle) -> None:
        self._live(h)
        self.kv.release(h.branch)
        h.logits = None

    @staticmethod
    def _live(h: Handle) -> None:
        if not h.branch.held:
            raise BranchReleased("this context was released")

    def flush(self, handles: list[Handle]) -> None:
        """Compute the pending tokens of every handle that has some, in one forward."""
        for h in handles:
            self._live(h)
        todo = [h for h in handles if h.pending]
        if not todo:
            return
        logits = forward_branches(self.model, self.kv, [h.branch for h in todo],
                                  [h.pending for h in todo])
        self.forwards += 1
        for h, lg in zip(todo, logits):
            h.pending, h.logits = [], lg

    def logits(self, h: Handle) -> torch.Tensor:
        """Next-token logits `[V]` of a context."""
        self.flush([h])
        if h.logits is None:
            raise SpecforkError("an empty context has no next-token distribution")
        return h.logits

    # -- generation -----------------------------------------------------------------------------
    def generate(self, h: Handle, max_new_tokens: int = 128, temperature: float = 0.0,
                 top_p: float | None = None, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> list[int]:
        """Decode on one branch; the new tokens join the context. Greedy output equals
        `SpecDecoder.generate` on the same token ids."""
        return self.generate_many([h], max_new_tokens, temperature, top_p, top_k, generator)[0]

    def generate_many(self, handles: list[Handle], max_new_tokens: int = 128,
                      temperature: float = 0.0, top_p: float | None = None,
                      top_k: int | None = None,
                      generator: torch.Generator | None = None) -> list[list[int]]:
        """Decode on several branches at once: one forward per step for all unfinished ones."""
        check_sampling(max_new_tokens, temperature, top_p, top_k)
        if len({id(h.branch) for h in handles}) != len(handles):
            raise ValueError("generate_many needs distinct handles")
        sp = sampling_params(temperature, top_p, top_k, generator=generator)
        out: list[list[int]] = [[] for _ in handles]
        live = list(range(len(handles)))
        while live:
            self.flush([handles[i] for i in live])
            nxt = []
            for i in live:
                h = handles[i]
                t = pick(h.logits, sp)
                out[i].append(t)
                self.extend(h, [t])
                if t not in self.eos and len(out[i]) < max_new_tokens:
                    nxt.append(i)
            live = nxt
        return out

    def stats(self) -> dict:
        return self.kv.stats()
