"""KV tree with real tensors: paths read like a linear cache, CoW isolates writers, accounting.
Every test runs on a float pool and on a TurboQuant pool (uint8 codes + norms per slot)."""
import pytest
import torch

from specfork.kv_quant import layer_codecs
from specfork.kv_tree import BlockPool, BranchReleased, KVTree, PoolExhausted

L, H, D, BS = 3, 2, 16, 16
CODECS = None                      # per layer (key, value) codecs of the pool under test


@pytest.fixture(autouse=True, params=["float32", "turbo3.5"])
def pool_format(request, monkeypatch):
    monkeypatch.setitem(globals(), "CODECS", layer_codecs(request.param, L, D, torch.float32))
    return request.param


def make(num_blocks: int = 64) -> tuple[BlockPool, KVTree]:
    pool = BlockPool(L, H, D, block_size=BS, num_blocks=num_blocks, codecs=CODECS)
    return pool, KVTree(pool)


def rand(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V `[L, n, H, row]` as the pool stores them (floats, or their TurboQuant rows)."""
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(L, n, H, D, generator=g), torch.randn(L, n, H, D, generator=g)
    if CODECS is None:
        return k, v
    return (torch.stack([c.encode(x) for (c, _), x in zip(CODECS, k)]),
            torch.stack([c.encode(x) for (_, c), x in zip(CODECS, v)]))


def put(tree: KVTree, br, k: torch.Tensor, v: torch.Tensor) -> None:
    """Append `k, v [L, n, H, D]` to `br` the way a model's forward writes them."""
    slots = tree.append(br, k.shape[1])
    for layer in range(L):
        kf, vf = tree.pool.layer_slots(layer)
        kf[slots], vf[slots] = k[layer], v[layer]


def read(tree: KVTree, br) -> tuple[torch.Tensor, torch.Tensor]:
    """The branch's whole path gathered through its block table: `[L, len, H, D]` each."""
    table = torch.tensor(tree.block_table(br), dtype=torch.long)
    n = len(br)
    k = tree.pool.k[:, table].flatten(1, 2)[:, :n]
    v = tree.pool.v[:, table].flatten(1, 2)[:, :n]
    assert torch.equal(k, torch.stack([tree.pool.layer_slots(i)[0][tree.slots(br)]
                                       for i in range(L)]))
    return k, v


def assert_reads(tree: KVTree, br, k: torch.Tensor, v: torch.Tensor) -> None:
    rk, rv = read(tree, br)
    assert len(br) == k.shape[1] and torch.equal(rk, k) and torch.equal(rv, v)


def snapshot(pool: BlockPool, *branches) -> tuple:
    return (list(pool.refcount), list(pool.free), pool.peak_blocks, pool.k.clone(),
            pool.v.clone(), [(b.length, b.base, list(b.blocks), set(b.children)) for b in branches])


def same(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def test_forks_read_like_a_linear_cache():
    pool, tree = make()
    K, V = rand(100, 0)
    root = tree.new_branch()
    put(tree, root, K[:, :37], V[:, :37])
    kids = {}
    for i, at in enumerate([37, 32, 20, 0]):        # end (mid-block), boundary, below end, empty
        c = tree.fork(root, at)
        ck, cv = rand(9 + i, 10 + i)
        put(tree, c, ck, cv)
        kids[at] = (c, torch.cat([K[:, :at], ck], 1), torch.cat([V[:, :at], cv], 1))
    put(tree, root, K[:, 37:60], V[:, 37:60])       # the parent keeps decoding
    assert_reads(tree, root, K[:, :60], V[:, :60])
    for c, ck, cv in kids.values():
        assert_reads(tree, c, ck, cv)
    c20, ck, cv = kids[20]
    g = tree.fork(c20, 5)                            # below c20's own tokens: hangs off root
    assert g.parent is root
    assert_reads(tree, g, K[:, :5], V[:, :5])

    # a deep chain read through its path equals one linear cache of the same tokens
    lin_k, lin_v, b = K[:, :60], V[:, :60], root
    for depth in range(40):
        b = tree.fork(b)
        ck, cv = rand(3, 100 + depth)
        put(tree, b, ck, cv)
        lin_k, lin_v = torch.cat([lin_k, ck], 1), torch.cat([lin_v, cv], 1)
    truncated = tree.fork(b, 40)                     # an ancestor's tokens, mid-block
    assert_reads(tree, b, lin_k, lin_v)
    assert_reads(tree, truncated, lin_k[:, :40], lin_v[:, :40])


def test_cow_copies_exactly_one_block_in_every_layer():
    pool, tree = make()
    K, V = rand(21, 1)
    p = tree.new_branch()
    put(tree, p, K, V)                               # block 1 holds 5 tokens
    c1, c2 = tree.fork(p), tree.fork(p)
    partial = p.blocks[1]
    assert pool.refcount[partial] == 3 and pool.used_blocks == 2

    k1, v1 = rand(3, 2)
    put(tree, c1, k1, v1)                            # fits the partial block: one copy, no more
    assert pool.used_blocks == 3 and pool.refcount[partial] == 2
    copy = tree.block_table(c1)[1]
    assert copy != partial
    assert torch.equal(pool.k[:, copy, :5], pool.k[:, partial, :5])   # all layers copied
    assert torch.equal(pool.v[:, copy, :5], pool.v[:, partial, :5])
    assert_reads(tree, c1, torch.cat([K, k1], 1), torch.cat([V, v1], 1))
    assert_reads(tree, p, K, V)
    assert_reads(tree, c2, K, V)

    k2, v2 = rand(20, 3)
    put(tree, c2, k2, v2)                            # copy + one fresh block
    assert pool.used_blocks == 5 and pool.refcount[partial] == 1
    kp, vp = rand(4, 4)
    put(tree, p, kp, vp)                             # nobody shares it any more: written in place
    assert pool.used_blocks == 5 and tree.block_table(p)[1] == partial
    assert_reads(tree, p, torch.cat([K, kp], 1), torch.cat([V, vp], 1))
    assert_reads(tree, c1, torch.cat([K, k1], 1), torch.cat([V, v1], 1))
    assert_reads(tree, c2, torch.cat([K, k2], 1), torch.cat([V, v2], 1))


def test_truncate_rules_and_reuse():
    pool, tree = make()
    K, V = rand(60, 5)
    p = tree.new_branch()
    put(tree, p, K[:, :40], V[:, :40])
    c = tree.fork(p, 24)
    put(tree, c, K[:, 24:30], V[:, 24:30])
    with pytest.raises(ValueError, match="fork point"):
        tree.truncate(p, 23)                         # c reads p's first 24 tokens
    with pytest.raises(ValueError, match="parent"):
        tree.truncate(c, 20)
    with pytest.raises(ValueError):
        tree.truncate(p, 41)
    tree.truncate(p, 24)                             # down to the fork point is fine
    assert pool.used_blocks == 3                     # p: blocks 0, 1; c: its copy of block 1
    tree.truncate(c, 24)
    assert pool.used_blocks == 3 and len(c) == 24    # c keeps its copy (it holds 8 of p's)
    put(tree, p, K[:, 24:50], V[:, 24:50])
    assert_reads(tree, p, K[:, :50], V[:, :50])
    assert_reads(tree, c, K[:, :24], V[:, :24])
    tree.release(c)
    tree.truncate(p, 0)
    assert pool.used_blocks == 0 and tree.block_table(p) == []


def test_release_keeps_ancestors_frees_own_blocks_and_splices():
    pool, tree = make()
    K, V = rand(64, 6)
    root = tree.new_branch()
    put(tree, root, K, V)                            # 4 blocks
    a, b = tree.fork(root, 16), tree.fork(root, 20)
    tree.release(root)                               # blocks past the last fork point go now
    assert pool.used_blocks == 2 and tree.stats()["live_branches"] == 2
    assert_reads(tree, a, K[:, :16], V[:, :16])
    assert_reads(tree, b, K[:, :20], V[:, :20])
    tree.release(b)                                  # root is left with one child: spliced out
    assert a.parent is None and a.base == 0 and pool.used_blocks == 1
    assert_reads(tree, a, K[:, :16], V[:, :16])

    tip, chain_k, chain_v = a, [K[:, :16]], [V[:, :16]]
    for i in range(200):                             # decode-style chain: fork, extend, drop old
        nxt = tree.fork(tip)
        k, v = rand(1, 1000 + i)
        put(tree, nxt, k, v)
        tree.release(tip)
        tip = nxt
        chain_k.append(k)
        chain_v.append(v)
        assert tip.parent is None                    # depth stays bounded
    assert_reads(tree, tip, torch.cat(chain_k, 1), torch.cat(chain_v, 1))
    assert pool.used_blocks == -(-216 // BS)
    with pytest.raises(BranchReleased):
        tree.fork(a)
    with pytest.raises(BranchReleased):
        tree.release(a)
    with pytest.raises(BranchReleased):
        tree.block_table(a)                          # storage gone with the splice
    tree.release(tip)
    assert pool.used_blocks == 0 and pool.refcount == [0] * pool.num_blocks


def test_adopt_commits_a_draft_at_the_cost_of_its_blocks():
    pool, tree = make()
    K, V = rand(60, 7)
    p = tree.new_branch()
    put(tree, p, K[:, :21], V[:, :21])
    d = tree.fork(p)
    put(tree, d, K[:, 21:51], V[:, 21:51])
    other = tree.fork(p, 10)
    with pytest.raises(ValueError):
        tree.adopt(p, d)                             # p has two children
    tree.release(other)
    with pytest.raises(ValueError):
        tree.adopt(d, p)
    tree.adopt(p, d)
    assert_reads(tree, p, K[:, :51], V[:, :51])
    assert pool.used_blocks == 4 and tree.stats()["live_branches"] == 1
    with pytest.raises(BranchReleased):
        tree.append(d, 1)
    e = tree.fork(p, 40)                             # not at p's end
    with pytest.raises(ValueError):
        tree.adopt(p, e)
    tree.release(e)
    tree.release(p)
    assert pool.used_blocks == 0


def test_exhaustion_raises_and_leaves_everything_unchanged():
    pool, tree = make(num_blocks=4)
    K, V = rand(64, 8)
    p = tree.new_branch()
    put(tree, p, K[:, :21], V[:, :21])               # 2 blocks, the second partial
    c = tree.fork(p)
    q = tree.new_branch()
    put(tree, q, K[:, :16], V[:, :16])               # 1 free block left
    before = snapshot(pool, p, c, q)
    with pytest.raises(PoolExhausted, match="exhausted"):
        tree.append(c, 12)                           # CoW copy + 1 new block: needs 2
    assert same(before, snapshot(pool, p, c, q))
    with pytest.raises(PoolExhausted):
        tree.append(q, 17)                           # 2 new blocks
    assert same(before, snapshot(pool, p, c, q))
    assert issubclass(PoolExhausted, RuntimeError)
    put(tree, c, K[:, 21:24], V[:, 21:24])           # 1 block (the copy) still fits
    assert pool.used_blocks == 4
    assert_reads(tree, c, K[:, :24], V[:, :24])
    assert_reads(tree, p, K[:, :21], V[:, :21])
    for b in (p, c, q):
        tree.release(b)
    assert pool.used_blocks == 0 and sorted(pool.free) == [0, 1, 2, 3]


def test_pool_sizing_dtype_and_accounting():
    if CODECS is None:
        per_block, row, dtype = 2 * L * BS * H * D * 2, D, torch.bfloat16        # bf16
    else:                          # turbo3.5 at D = 16: keys 64 bits, values 48 (8 + 6 bytes)
        per_block, row, dtype = L * BS * H * (8 + 6), 8, torch.uint8
    pool = BlockPool(L, H, D, block_size=BS, max_bytes=10 * per_block + 5, dtype=torch.bfloat16,
                     codecs=CODECS)
    assert pool.num_blocks == 10 and pool.block_bytes == per_block
    assert pool.block_bytes == (pool.k.nbytes + pool.v.nbytes) // 10
    assert pool.k.shape == (L, 10, BS, H, row) and pool.k.dtype == dtype
    assert pool.v.shape == (L, 10, BS, H, D if CODECS is None else 6)
    with pytest.raises(ValueError):
        BlockPool(L, H, D, block_size=BS, max_bytes=per_block - 1)
    with pytest.raises(ValueError):
        BlockPool(L, H, D)

    tree = KVTree(pool)
    p = tree.new_branch()
    tree.append(p, 40)                               # 3 blocks
    a, b = tree.fork(p), tree.fork(p, 16)
    tree.append(a, 5)                                # CoW of block 2 -> 4 blocks
    s = tree.stats()
    assert s["used_blocks"] == 4 and s["bytes_in_use"] == 4 * per_block
    assert s["shared_blocks"] == 2                   # blocks 0 (p, a, b) and 1 (p, a)
    assert s["unique_blocks"] == 2                   # p's block 2 and a's copy of it
    tree.release(p)
    tree.release(a)
    s = tree.stats()
    assert s["used_blocks"] == 1 and s["unique_blocks"] == 1 and s["shared_blocks"] == 0
    tree.release(b)
    s = tree.stats()
    assert s["used_blocks"] == 0 and s["bytes_in_use"] == 0 and s["live_branches"] == 0
    assert s["peak_bytes"] == 4 * per_block
