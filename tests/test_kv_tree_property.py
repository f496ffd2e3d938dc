"""Stateful property test of the KV tree against a linear model.

Every live handle keeps a python list of its token values. After every step, each handle's K/V
read through its path must equal that list, pool refcounts must equal the references held by the
live tree, and the free list must hold exactly the unreferenced blocks. The model also tracks,
for every pair of handles, how many leading tokens they share by lineage; that is what decides
which truncates must fail and which suffixes a handle may rewrite in place.
"""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from specfork.kv_quant import layer_codecs
from specfork.kv_tree import BlockPool, KVTree, PoolExhausted

LAYERS, BS, NUM_BLOCKS, MAX_HANDLES = 2, 4, 16, 8
EXAMPLES, STEPS = 200, 75          # >= 10^4 operations in all (checked below)
pick = st.integers(0, 63)


CODECS = None     # a TurboQuant pool: slots hold uint8 rows (turbo4 at D = 16: keys 9 bytes,
                  # values 7), here filled with the bytes of two floats, zero-padded or cut


def kv(vals: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token values -> K, V `[layers, n, 1 head, row]`, distinct per layer and channel: two
    floats, or on a TurboQuant pool the 8 bytes of those floats as its uint8 rows (keys: one
    zero byte more; values: the last byte cut, the first float still whole)."""
    t = torch.tensor(vals, dtype=torch.float32).reshape(-1)
    k = torch.stack([torch.stack([t + l, t + l + 0.5], -1) for l in range(LAYERS)])
    k, v = k[:, :, None, :], -k[:, :, None, :]
    if CODECS is not None:
        k, v = k.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8)
        k = torch.cat((k, torch.zeros_like(k[..., :1])), -1)
        v = v[..., :-1]
    return k, v


def make_pool() -> BlockPool:
    if CODECS is None:
        return BlockPool(LAYERS, 1, 2, block_size=BS, num_blocks=NUM_BLOCKS)
    pool = BlockPool(LAYERS, 1, 16, block_size=BS, num_blocks=NUM_BLOCKS, codecs=CODECS)
    assert (pool.k.shape[-1], pool.v.shape[-1]) == (9, 7) and pool.k.dtype == torch.uint8
    return pool


class Handle:
    def __init__(self, br, toks: list[float], fork_at: int):
        self.br, self.toks = br, toks
        self.fork_at = fork_at     # >= the branch's base: truncating down to here is always legal


class KVTreeMachine(RuleBasedStateMachine):
    ops = 0

    def __init__(self):
        super().__init__()
        self.pool = make_pool()
        self.tree = KVTree(self.pool)
        self.live: list[Handle] = []
        self.shared: dict[tuple[int, int], int] = {}   # lineage-shared prefix of two handles
        self.val = 0.0

    # -- model helpers ------------------------------------------------------------------------
    def sh(self, a: Handle, b: Handle) -> int:
        return self.shared[(id(a), id(b)) if id(a) < id(b) else (id(b), id(a))]

    def set_sh(self, a: Handle, b: Handle, n: int) -> None:
        self.shared[(id(a), id(b)) if id(a) < id(b) else (id(b), id(a))] = n

    def max_shared(self, h: Handle) -> int:
        return max((self.sh(h, g) for g in self.live if g is not h), default=0)

    def add(self, h: Handle, parent: Handle | None, at: int) -> None:
        """A new handle sharing its first `at` tokens with `parent` (and what parent shares)."""
        for g in self.live:
            self.set_sh(h, g, at if g is parent else min(at, self.sh(parent, g)) if parent else 0)
        self.live.append(h)

    def drop(self, h: Handle) -> None:
        self.live.remove(h)
        self.shared = {k: v for k, v in self.shared.items() if id(h) not in k}

    def fresh(self, n: int) -> list[float]:
        out = [self.val + i for i in range(n)]
        self.val += n
        return out

    def write(self, slots: torch.Tensor, vals: list[float]) -> None:
        k, v = kv(vals)
        for layer in range(LAYERS):
            kf, vf = self.pool.layer_slots(layer)
            kf[slots], vf[slots] = k[layer], v[layer]

    def assert_private(self, h: Handle, slots: torch.Tensor) -> None:
        """Slots about to be written must not be readable by any other live handle."""
        mine = set(slots.tolist())
        assert len(mine) == slots.numel()
        for g in self.live:
            if g is not h:
                assert not mine & set(self.tree.slots(g.br).tolist())

    def h(self, i: int) -> Handle:
        KVTreeMachine.ops += 1
        return self.live[i % len(self.live)]

    # -- rules --------------------------------------------------------------------------------
    @precondition(lambda self: len(self.live) < MAX_HANDLES)
    @rule()
    def new_branch(self):
        KVTreeMachine.ops += 1
        self.add(Handle(self.tree.new_branch(), [], 0), None, 0)

    @precondition(lambda self: 0 < len(self.live) < MAX_HANDLES)
    @rule(i=pick, at=st.none() | st.integers(0, 40))
    def fork(self, i, at):
        p = self.h(i)
        c = self.tree.fork(p.br, None if at is None else min(at, len(p.toks)))
        at = len(p.toks) if at is None else min(at, len(p.toks))
        self.add(Handle(c, p.toks[:at], at), p, at)

    @precondition(lambda self: self.live)
    @rule(i=pick, n=st.integers(0, 9))
    def append(self, i, n):
        h = self.h(i)
        pos, used, free = len(h.toks), self.pool.used_blocks, len(self.pool.free)
        new = -(-(pos + n) // BS) - (-(-pos // BS))
        before = (list(self.pool.refcount), list(self.pool.free), self.pool.peak_blocks,
                  self.pool.k.clone(), self.pool.v.clone(), h.br.length, list(h.br.blocks))
        try:
            slots = self.tree.append(h.br, n)
        except PoolExhausted:
            assert free < new + (pos % BS != 0)
            after = (self.pool.refcount, self.pool.free, self.pool.peak_blocks, self.pool.k,
                     self.pool.v, h.br.length, h.br.blocks)
            for x, y in zip(before, after):
                assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            return
        assert free >= new and self.pool.used_blocks - used in (new, new + 1)  # +1: one CoW
        assert slots.dtype == torch.long and slots.tolist() == self.tree.slots(h.br, pos).tolist()
        self.assert_private(h, slots)
        assert not set(slots.tolist()) & set(self.tree.slots(h.br, 0, pos).tolist())
        vals = self.fresh(n)
        self.write(slots, vals)
        h.toks += vals

    @precondition(lambda self: self.live)
    @rule(i=pick, k=st.integers(1, 6))
    def rewrite(self, i, k):
        """Overwrite the handle's newest tokens that no other handle shares."""
        h = self.h(i)
        start = max(self.max_shared(h), len(h.toks) - k)
        if start < len(h.toks):
            slots = self.tree.slots(h.br, start)
            self.assert_private(h, slots)
            vals = self.fresh(len(h.toks) - start)
            self.write(slots, vals)
            h.toks[start:] = vals

    @precondition(lambda self: self.live)
    @rule(i=pick, n=st.integers(0, 40))
    def truncate(self, i, n):
        h = self.h(i)
        n = min(n, len(h.toks))
        lo = self.max_shared(h)                # below: tokens another handle reads
        try:
            self.tree.truncate(h.br, n)
        except ValueError:
            assert n < max(lo, h.fork_at)
            return
        assert n >= lo
        del h.toks[n:]

    @precondition(lambda self: self.live)
    @rule(i=pick)
    def release(self, i):
        h = self.h(i)
        self.tree.release(h.br)
        self.drop(h)
        b = h.br
        if b.alive and len(b.children) > 1:    # kept for its children: nothing past their forks
            assert len(b.blocks) == -(-max(c.base for c in b.children) // BS) - b.base // BS

    @precondition(lambda self: 0 < len(self.live) < MAX_HANDLES)
    @rule(i=pick, n=st.integers(0, 9))
    def commit(self, i, n):
        """The speculative-decoding pattern: fork at the end, extend, adopt."""
        p = self.h(i)
        sole = not p.br.children               # then p's only child will be the new fork
        c = Handle(self.tree.fork(p.br), list(p.toks), len(p.toks))
        self.add(c, p, len(p.toks))
        try:
            slots = self.tree.append(c.br, n)
        except PoolExhausted:
            return                             # c stays a live handle
        vals = self.fresh(n)
        self.write(slots, vals)
        c.toks += vals
        self.adopt_pair(p, c, must=sole)

    @precondition(lambda self: self.live)
    @rule(i=pick, j=pick)
    def adopt(self, i, j):
        self.adopt_pair(self.h(i), self.h(j), must=False)

    def adopt_pair(self, p: Handle, c: Handle, must: bool) -> None:
        used = self.pool.used_blocks
        try:
            self.tree.adopt(p.br, c.br)
        except ValueError:
            assert not must
            return
        assert p is not c and self.sh(p, c) == len(p.toks) <= len(c.toks)
        # the child's blocks move over; at most p's partial last block goes (if c copied it)
        assert used - self.pool.used_blocks in (0, int(len(p.toks) % BS != 0))
        for g in self.live:
            if g is not p and g is not c:
                self.set_sh(p, g, self.sh(c, g))
        p.toks = c.toks
        self.drop(c)

    # -- invariants ---------------------------------------------------------------------------
    @invariant()
    def refcounts_exact(self):
        nodes, seen = [], set()
        for h in self.live:
            b = h.br
            while b is not None and id(b) not in seen:
                seen.add(id(b))
                nodes.append(b)
                b = b.parent
        expected = [0] * NUM_BLOCKS
        for b in nodes:
            assert b.alive and len(b.blocks) == -(-b.length // BS) - b.base // BS
            assert b.held or len(b.children) >= 2        # handle-less chains are spliced out
            for c in b.children:
                assert c.parent is b and b.base <= c.base <= b.length
            for blk in b.blocks:
                expected[blk] += 1
        assert self.pool.refcount == expected
        assert sorted(self.pool.free) == [b for b in range(NUM_BLOCKS) if expected[b] == 0]
        assert self.tree.live_branches == len(self.live)
        assert self.pool.peak_blocks >= self.pool.used_blocks

    @invariant()
    def contents_match_model(self):
        readers = [0] * NUM_BLOCKS
        for h in self.live:
            assert len(h.br) == len(h.toks)
            slots = self.tree.slots(h.br)
            k, v = kv(h.toks)
            kf = self.pool.k.view((LAYERS, -1) + k.shape[2:])[:, slots]
            vf = self.pool.v.view((LAYERS, -1) + v.shape[2:])[:, slots]
            assert torch.equal(kf, k) and torch.equal(vf, v)
            for blk in self.tree.block_table(h.br):
                readers[blk] += 1
        s = self.tree.stats()
        assert s["used_blocks"] == self.pool.used_blocks
        assert s["unique_blocks"] == readers.count(1)
        assert s["shared_blocks"] == NUM_BLOCKS - readers.count(0) - readers.count(1)

    def teardown(self):
        for h in list(self.live):
            self.tree.release(h.br)
            self.drop(h)
        assert self.pool.used_blocks == 0 and self.tree.stats()["used_blocks"] == 0
        assert self.pool.refcount == [0] * NUM_BLOCKS and len(set(self.pool.free)) == NUM_BLOCKS


@pytest.mark.parametrize("bs,num_blocks,fmt", [(4, 16, "float32"), (1, 64, "float32"),
                                               (4, 16, "turbo4")])    # 64 tokens each
def test_kv_tree_state_machine(monkeypatch, bs, num_blocks, fmt):
    monkeypatch.setitem(globals(), "BS", bs)
    monkeypatch.setitem(globals(), "NUM_BLOCKS", num_blocks)
    monkeypatch.setitem(globals(), "CODECS", layer_codecs(fmt, LAYERS, 16, torch.float32))
    KVTreeMachine.ops = 0
    run_state_machine_as_test(KVTreeMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
        suppress_health_check=list(HealthCheck)))
    assert KVTreeMachine.ops >= 10_000, KVTreeMachine.ops
