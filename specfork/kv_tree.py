"""KV tree: a refcounted block pool whose branches form a tree.

A branch sees the first `base` tokens of its parent (recursively) plus its own tokens.
Forking is metadata only (one object, no per-block work); the only data ever copied is a
shared, partially filled block at the moment someone writes into it (copy-on-write).
Ancestors stay alive while any descendant lives; releasing a branch frees its own blocks.
"""
from __future__ import annotations

import math

import torch


SHADOW_SLACK = 64        # tokens of shadows a fork keeps past its window: MAX_DRAFT_LEN (see
                         # KVTree._shadows_needed)
SHADOW_START = 4         # shadow blocks to start with: one branch's window of 32 and its sink;
                         # the store sweeps whenever it runs out, so the shadows in use stay near
                         # what open windows need, and grows only beyond that


class PoolExhausted(RuntimeError):
    """Not enough free blocks; the pool and every branch are left unchanged."""


class BranchReleased(RuntimeError):
    """An operation on a branch that was already released."""


def blocks_for(tokens: int, block_size: int, forks: int = 0, fork_tokens: int = 0) -> int:
    """Blocks a pool needs for one branch of up to `tokens` tokens plus `forks` live forks of it
    that each append up to `fork_tokens`: a fork's first write may copy the shared partial tail
    block once (CoW), then fills blocks of its own. The one pool-sizing rule of the engine, the
    model drafters and the sessions."""
    return -(-tokens // block_size) + forks * (1 + -(-fork_tokens // block_size))


SORTED_ALLOC = 64                  # allocations this large take the lowest free ids, ascending


class BlockPool:
    """Per-layer K/V storage `[layers, num_blocks, block_size, kv_heads, head_dim]` + refcounts."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, block_size: int = 16,
                 num_blocks: int | None = None, max_bytes: int | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 codecs: list | None = None, window: int = 0, sink: int = 0):
        """`codecs`: per layer (key codec, value codec) of a stored format other than `dtype`
        (`specfork/kv_quant.py`): slots then hold the codec's rows (TurboQuant: uint8 codes
        with their norms) and every read decodes them. None: plain `dtype` K/V.
        `window`, `sink` (TurboQuant codes only): a query reads its last `window` keys and
        values, and the first `sink`, from float16 shadow rows instead of their codes
        (`shadow_alloc`; kernels/code_attention.cpp)."""
        self.codecs = codecs
        if (window or sink) and (codecs is None or not codecs[0][0].rotated):
            raise ValueError("a KV window needs a TurboQuant format")
        if window < 0 or sink < 0:
            raise ValueError("KV window and sink are token counts >= 0")
        self.window, self.sink = window, sink
        rows = [((head_dim,), dtype)] * 2 if codecs is None else [
            (c.row, c.store_dtype) for c in codecs[0]]                 # keys, values
        slot_bytes = num_layers * kv_heads * sum(
            math.prod(r) * torch.empty((), dtype=d).element_size() for r, d in rows)
        self.block_bytes = block_size * slot_bytes
        if num_blocks is None:
            if max_bytes is None:
                raise ValueError("BlockPool needs num_blocks or max_bytes")
            num_blocks = max_bytes // self.block_bytes
        if num_blocks <= 0:
            raise ValueError(f"BlockPool: a budget of {num_blocks} blocks holds nothing")
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        shape = (num_layers, num_blocks, block_size, kv_heads)
        self.k, self.v = (torch.zeros(shape + r, dtype=d, device=device) for r, d in rows)
        # the bytes a block really takes, measured from the tensors allocated
        self.block_bytes = (self.k.nbytes + self.v.nbytes) // num_blocks
        self.refcount = [0] * num_blocks
        self.free = list(range(num_blocks - 1, -1, -1))  # stack: low ids first
        self.peak_blocks = 0
        # float16 shadows of the blocks a window reads (centred and rotated like the codes):
        # sk/sv `[layers, capacity, block_size, kv_heads, head_dim]`, shadow_of[block] its row
        # block there or -1. Blocks get one when allocated; `shadow_sweep` (the KVTree's)
        # names the blocks some branch's window or sink may still read, and the others give
        # theirs back after a prompt chunk's forward and when the shadows run out, before the
        # shadow store grows.
        self.shadow_of = torch.full((num_blocks if (window or sink) else 0,), -1,
                                    dtype=torch.int32)
        self.shadow_free: list[int] = []
        self.shadow_sweep = None
        self.fresh: set[int] = set()     # blocks given shadows since the last forward wrote
        self.sk = self.sv = None
        self.peak_shadows = 0
        if window or sink:
            self._grow_shadows(SHADOW_START)
        # tensor parallelism: called as mirror(method name, *args) before a method that moves
        # K/V data runs, so every rank's pool applies it too (specfork/parallel.py)
        self.mirror = None

    # -- allocation ---------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise PoolExhausted(f"KV pool exhausted: need {n} blocks, {len(self.free)} free "
                                f"of {self.num_blocks}")
        if n >= SORTED_ALLOC:          # a prompt: the lowest free ids in order, so its slots are
            self.free.sort(reverse=True)   # one run the attention reads in place, not gathered
        out = [self.free.pop() for _ in range(n)]
        for b in out:
            self.refcount[b] = 1
        self.peak_blocks = max(self.peak_blocks, self.used_blocks)
        return out

    def incref(self, b: int) -> None:
        self.refcount[b] += 1

    def decref(self, b: int) -> None:
        rc = self.refcount[b] - 1
        if rc < 0:
            raise AssertionError(f"double free of block {b}")
        self.refcount[b] = rc
        if rc == 0:
            self.free.append(b)
            if self.sk is not None and self.shadow_of[b] >= 0:
                self.shadow_free.append(int(self.shadow_of[b]))
                self.shadow_of[b] = -1

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block in every layer (the only data copy the tree ever makes)."""
        if self.mirror is not None:
            self.mirror("copy_block", src, dst)
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])
        if self.sk is not None and self.shadow_of[src] >= 0:
            self.shadow_alloc([dst])
            a, b = int(self.shadow_of[src]), int(self.shadow_of[dst])
            self.sk[:, b].copy_(self.sk[:, a])
            self.sv[:, b].copy_(self.sv[:, a])

    # -- float16 shadows (a KV window) --------------------------------------------------------
    def shadow_alloc(self, blocks: list[int]) -> None:
        """Give each of `blocks` a shadow block (those without one)."""
        if self.sk is None:
            return
        need = [b for b in blocks if self.shadow_of[b] < 0]
        if len(need) > len(self.shadow_free):
            self.sweep_shadows()
        if len(need) > len(self.shadow_free):      # what is missing, or a quarter more
            self._grow_shadows(max(len(need) - len(self.shadow_free), self.sk.shape[1] // 4))
        for b in need:
            self.shadow_of[b] = self.shadow_free.pop()
        self.fresh.update(need)
        self.peak_shadows = max(self.peak_shadows, self.shadows_in_use)

    def sweep_shadows(self) -> None:
        """Give back the shadows of blocks no open branch's window or sink reads (the tree's
        `shadow_sweep`), but not those of blocks allocated since the last forward."""
        if self.shadow_sweep is None:
            return
        keep = self.shadow_sweep() | self.fresh
        for b in torch.nonzero(self.shadow_of >= 0).flatten().tolist():
            if b not in keep:
                self.shadow_free.append(int(self.shadow_of[b]))
                self.shadow_of[b] = -1

    def _grow_shadows(self, n: int) -> None:
        L, KVH, D, bs = self.num_layers, self.kv_heads, self.head_dim, self.block_size
        more = torch.zeros((2, L, n, bs, KVH, D), dtype=torch.float16, device=self.k.device)
        have = 0 if self.sk is None else self.sk.shape[1]
        self.sk = more[0] if self.sk is None else torch.cat((self.sk, more[0]), 1)
        self.sv = more[1] if self.sv is None else torch.cat((self.sv, more[1]), 1)
        self.shadow_free.extend(range(have + n - 1, have - 1, -1))

    def shadow_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """Shadow rows of `slots` (each block must have a shadow)."""
        sh = self.shadow_of[(slots // self.block_size).cpu()].long()
        if bool((sh < 0).any()):
            raise AssertionError("KV window: a written block has no float16 shadow")
        return (sh * self.block_size + slots.cpu() % self.block_size).to(slots.device)

    def layer_shadows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's shadow rows `[capacity * block_size, kv_heads, head_dim]` float16."""
        shape = (-1, self.kv_heads, self.head_dim)
        return self.sk[layer].view(shape), self.sv[layer].view(shape)

    @property
    def shadows_in_use(self) -> int:
        return 0 if self.sk is None else self.sk.shape[1] - len(self.shadow_free)

    @property
    def shadow_block_bytes(self) -> int:
        return 0 if self.sk is None else 2 * self.sk[:, 0].nbytes

    def copy_slots(self, frm: torch.Tensor, to: torch.Tensor) -> None:
        """Slots `frm` to slots `to` in every layer, stored rows as they are (codes stay
        codes): the naive baselines' full copy of a cache, never the tree's own."""
        if self.mirror is not None:
            self.mirror("copy_slots", frm, to)
        for t in (self.k, self.v):
            flat = t.view((self.num_layers, -1) + tuple(t.shape[3:]))
            flat[:, to] = flat[:, frm]
        if self.sk is not None:         # shadow rows too, where the source still has them
            self.shadow_alloc(sorted(set((to // self.block_size).tolist())))
            has = self.shadow_of[(frm // self.block_size).cpu()] >= 0
            a, b = self.shadow_slots(frm[has]), self.shadow_slots(to[has])
            for t in (self.sk, self.sv):
                flat = t.view(self.num_layers, -1, self.kv_heads, self.head_dim)
                flat[:, b] = flat[:, a]

    # -- views and accounting -----------------------------------------------------------------
    def layer_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer as flat slot arrays `[num_blocks * block_size, kv_heads, *row]`
        (row: `[head_dim]`, or a codec's stored row)."""
        return (self.k[layer].view((-1, self.kv_heads) + tuple(self.k.shape[4:])),
                self.v[layer].view((-1, self.kv_heads) + tuple(self.v.shape[4:])))

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def shared_blocks(self) -> int:
        return sum(1 for r in self.refcount if r > 1)

    @property
    def bytes_in_use(self) -> int:
        """Bytes of the blocks in use, and of their float16 shadows (a KV window)."""
        return self.used_blocks * self.block_bytes + self.shadows_in_use * self.shadow_block_bytes

    @property
    def peak_bytes(self) -> int:
        return self.peak_blocks * self.block_bytes + self.peak_shadows * self.shadow_block_bytes

    def reset_peak(self) -> None:
        self.peak_blocks = self.used_blocks
        self.peak_shadows = self.shadows_in_use


class Branch:
    """One node of the KV tree. `blocks[i]` holds logical block `base // block_size + i`."""

    __slots__ = ("parent", "base", "length", "blocks", "children", "alive", "held", "__weakref__")

    def __init__(self, parent: Branch | None, base: int, blocks: list[int]):
        self.parent = parent
        self.base = base          # tokens seen through the parent
        self.length = base        # tokens seen in all (parent's + own)
        self.blocks = blocks      # own (possibly shared, partial first) blocks
        self.children: set[Branch] = set()
        self.alive = True         # storage still held (by a handle or by descendants)
        self.held = True          # the caller's handle is still open

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"Branch(base={self.base}, length={self.length}, blocks={self.blocks})"


class KVTree:
    """Branches over one BlockPool: fork, append (CoW), truncate, release, block tables."""

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.bs = pool.block_size
        self.live_branches = 0
        self._roots: set[Branch] = set()    # trees in this pool, for whole-tree accounting
        if pool.sk is not None:
            pool.shadow_sweep = self._shadows_needed

    # -- structure ----------------------------------------------------------------------------
    def new_branch(self) -> Branch:
        self.live_branches += 1
        br = Branch(None, 0, [])
        self._roots.add(br)
        return br

    def fork(self, br: Branch, at: int | None = None) -> Branch:
        """A child that sees `br`'s first `at` tokens (default all). No block is touched except
        one incref of a shared partial block, so forking at `br`'s own tokens (the default) costs
        the same at any depth and prefix length. Below them the child hangs off the ancestor
        that owns token `at`: one step up per tree level, never a per-block loop."""
        if not br.held:
            raise BranchReleased("operation on a released branch")
        owner = br
        if at is None:
            at = br.length
        elif not 0 <= at <= br.length:
            raise ValueError(f"fork point {at} outside branch of length {br.length}")
        else:
            while at < owner.base:
                owner = owner.parent
        bs = self.bs
        if at % bs:
            blk = owner.blocks[at // bs - owner.base // bs]
            self.pool.refcount[blk] += 1
            child = Branch(owner, at, [blk])
        else:
            child = Branch(owner, at, [])
        owner.children.add(child)
        self.live_branches += 1
        return child

    def append(self, br: Branch, n: int) -> torch.Tensor:
        """Reserve slots for `n` new tokens; returns their flat slot ids `[n]` (int64).
        Copies the last block first if it is shared and partially filled."""
        self._check(br)
        if n < 0:
            raise ValueError("append of a negative token count")
        bs, pool = self.bs, self.pool
        pos, end = br.length, br.length + n
        first = br.base // bs
        cow = pos % bs != 0 and n > 0 and pool.refcount[br.blocks[pos // bs - first]] > 1
        new = -(-end // bs) - (-(-pos // bs))
        if new + cow > len(pool.free):
            raise PoolExhausted(f"KV pool exhausted: need {new + cow} blocks, "
                                f"{len(pool.free)} free of {pool.num_blocks}")
        if cow:
            i = pos // bs - first
            old = br.blocks[i]
            (dst,) = pool.alloc(1)
            pool.copy_block(old, dst)
            pool.decref(old)
            br.blocks[i] = dst
        if new:
            got = pool.alloc(new)
            br.blocks.extend(got)
            pool.shadow_alloc(got)       # before the length moves: a sweep in it keeps the
        br.length = end                  # window of the tokens before these
        return self._slots(br, pos, end)

    def truncate(self, br: Branch, n: int) -> None:
        """Keep the first `n` tokens. Forbidden below a live child's fork point."""
        self._check(br)
        if not 0 <= n <= br.length:
            raise ValueError(f"truncate to {n} outside branch of length {br.length}")
        if n < br.base:
            raise ValueError(f"truncate to {n} would cut into the parent's {br.base} tokens")
        for c in br.children:
            if c.base > n:
                raise ValueError(f"truncate to {n} below a live child's fork point {c.base}")
        self._cut(br, n)

    def release(self, br: Branch) -> None:
        """Close the caller's handle. Storage goes once no descendant needs it; a handle-less
        branch left with a single child is spliced out so depth stays bounded."""
        self._check(br)
        br.held = False
        self.live_branches -= 1
        self._collect(br)

    def adopt(self, br: Branch, child: Branch) -> None:
        """Commit: `br` takes over `child` (forked at br's end, br's only child): br grows by the
        child's tokens. Costs the child's own blocks only; the child handle is closed."""
        self._check(br), self._check(child)
        if child.parent is not br or child.base != br.length or len(br.children) != 1:
            raise ValueError("adopt needs the only child, forked at the parent's end")
        if br.length % self.bs:               # child holds its own ref (or CoW copy) of it
            self.pool.decref(br.blocks.pop())
        br.blocks.extend(child.blocks)
        br.length = child.length
        br.children = child.children
        for c in br.children:
            c.parent = br
        child.blocks, child.children = [], set()
        child.alive = child.held = False
        self.live_branches -= 1

    # -- reading ------------------------------------------------------------------------------
    def block_table(self, br: Branch) -> list[int]:
        """Physical block of every logical block on the root-to-branch path."""
        self._check_alive(br)
        chain = []
        b = br
        while b is not None:
            chain.append(b)
            b = b.parent
        table: list[int] = []
        for b in reversed(chain):
            del table[b.base // self.bs:]
            table.extend(b.blocks)
        del table[-(-br.length // self.bs):]
        return table

    def slots(self, br: Branch, start: int = 0, end: int | None = None) -> torch.Tensor:
        """Flat slot ids `[end - start]` of the branch's tokens (for gathers and writes)."""
        end = br.length if end is None else end
        if not 0 <= start <= end <= br.length:
            raise ValueError(f"slots [{start}, {end}) outside branch of length {br.length}")
        table = self.block_table(br)
        if self.bs == 1:                                 # a block is a slot
            return torch.tensor(table[start:end], dtype=torch.long)
        table = torch.tensor(table, dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.bs] * self.bs + pos % self.bs

    def _slots(self, br: Branch, start: int, end: int) -> torch.Tensor:
        """Slots of positions [start, end) among `br`'s own blocks (only those are converted)."""
        bs, first = self.bs, br.base // self.bs
        if bs == 1:                                      # a block is a slot
            return torch.tensor(br.blocks[start - first:end - first], dtype=torch.long)
        lo = start // bs - first
        own = torch.tensor(br.blocks[lo:-(-end // bs) - first], dtype=torch.long)
        pos = torch.arange(start, end)
        return own[pos // bs - first - lo] * bs + pos % bs

    def _shadows_needed(self) -> set[int]:
        """Blocks whose float16 shadows a window may still read: per open branch, the block of
        its first token (the sink) and those of its last `window` written tokens (blocks not
        written yet, `pool.fresh`, do not count as written: a prompt chunk that is cancelled
        cuts back to them), and for a fork SHADOW_SLACK tokens more (a verify tree's kept
        fork is cut back to its accepted path, at most a draft's length)."""
        pool, keep = self.pool, set()
        todo = list(self._roots)
        while todo:
            b = todo.pop()
            todo.extend(b.children)
            if not b.held or not b.alive:
                continue
            table = self.block_table(b)
            i = len(table)
            while i and table[i - 1] in pool.fresh:
                i -= 1
            written = min(b.length, i * self.bs)
            slack = SHADOW_SLACK if b.parent is not None else 0
            keep.update(table[max(0, written - pool.window - slack) // self.bs:])
            if pool.sink and table:
                keep.update(table[:-(-pool.sink // self.bs)])
        return keep

    def window_ready(self, br: Branch, at: int) -> bool:
        """Whether a fork of `br` at `at` finds the float16 shadows its window reads (always
        without a window)."""
        pool = self.pool
        if pool.sk is None or at == 0:
            return True
        table = self.block_table(br)[:-(-at // self.bs)]
        need = table[max(0, at - pool.window) // self.bs:]
        if pool.sink:
            need += table[:-(-pool.sink // self.bs)]
        return all(pool.shadow_of[b] >= 0 for b in need)

    # -- internals ----------------------------------------------------------------------------
    def _check(self, br: Branch) -> None:
        if not br.held:
            raise BranchReleased("operation on a released branch")

    def _check_alive(self, br: Branch) -> None:
        if not br.alive:
            raise BranchReleased("branch storage was already freed")

    def _cut(self, b: Branch, n: int) -> None:
        keep = -(-n // self.bs) - b.base // self.bs   # a shared partial first block stays
        for blk in b.blocks[keep:]:
            self.pool.decref(blk)
        del b.blocks[keep:]
        b.length = n

    def _collect(self, b: Branch | None) -> None:
        while b is not None and not b.held:
            if len(b.children) > 1:                  # no reader past the last fork point left
                self._cut(b, max(c.base for c in b.children))
                return
            parent = b.parent
            if not b.children:                       # free: its own blocks only
                for blk in b.blocks:
                    self.pool.decref(blk)
                b.blocks = []
                b.alive = False
                if parent is not None:
                    parent.children.discard(b)
                else:
                    self._roots.discard(b)
            else:                                    # splice the single child into b's place
                (c,) = b.children
                keep = c.base // self.bs - b.base // self.bs
                for blk in b.blocks[keep:]:
                    self.pool.decref(blk)
                c.blocks = b.blocks[:keep] + c.blocks
                c.base, c.parent = b.base, parent
                if parent is not None:
                    parent.children.discard(b)
                    parent.children.add(c)
                else:
                    self._roots.discard(b)
                    self._roots.add(c)
                b.blocks, b.children, b.alive = [], set(), False
            b = parent

    # -- accounting ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Pool usage, and how many blocks one live handle reads (unique) or several do (shared:
        a prefix block read through parent links counts, not just refcount > 1). Walks every
        tree, so it is for accounting, not for the decode loop. Leak check: once every branch
        is released, used_blocks is 0."""
        p, bs = self.pool, self.bs
        readers = [0] * p.num_blocks
        stack = [(r, []) for r in self._roots]
        while stack:
            b, table = stack.pop()
            table = table[:b.base // bs] + b.blocks
            if b.held:
                for blk in table:
                    readers[blk] += 1
            stack.extend((c, table) for c in b.children)
        return {"used_blocks": p.used_blocks, "unique_blocks": readers.count(1),
                "shared_blocks": p.num_blocks - readers.count(0) - readers.count(1),
                "bytes_in_use": p.bytes_in_use, "peak_bytes": p.peak_bytes,
                "live_branches": self.live_branches}
