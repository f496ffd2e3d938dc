"""Branching sessions: forked contexts decode as independent runs would, and share the prefix."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specfork.decoder import SpecDecoder
from specfork.engine import Engine
from specfork.errors import SpecforkError
from specfork.kv_tree import BranchReleased, PoolExhausted
from specfork.model import Model
from specfork.session import Session

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.3)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return Model(AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval())


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _shared_prefix_blocks(s: Session, a, b) -> int:
    """Leading logical blocks that two contexts read from the same physical block."""
    ta, tb = s.kv.block_table(a.branch), s.kv.block_table(b.branch)
    return next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), min(len(ta), len(tb)))


def test_fork_is_metadata_and_release_frees(tiny):
    s = Session(Engine(tiny, eos_token_ids=[], max_kv_tokens=1024, block_size=16))
    root = s.start(_ids(40, 1))
    s.logits(root)                                   # prefill: 3 blocks (40 tokens)
    used = s.pool.used_blocks
    kids = [s.fork(root) for _ in range(8)]
    assert s.pool.used_blocks == used and s.forks == 8   # no block allocated, none copied
    for k in kids:
        s.extend(k, [7])
    s.flush(kids)                  # each kid writes its token into a CoW copy of block 3
    assert s.pool.used_blocks == used + 8
    for h in [root] + kids:
        s.release(h)
    assert s.pool.used_blocks == 0 and s.kv.live_branches == 0


def test_branches_equal_independent_runs_tiny(tiny):
    dec = SpecDecoder(tiny, None, eos_token_ids=[])
    s = Session.from_decoder(dec)
    prefix, tails = _ids(37, 2), [_ids(5, 3), _ids(9, 4)]
    root = s.start(prefix)
    branches = [s.extend(s.fork(root), t) for t in tails]
    s.release(root)
    got = [s.generate(b, max_new_tokens=20) for b in branches]
    for g, t in zip(got, tails):
        assert g == dec.generate(prefix + t, max_new_tokens=20).token_ids
    assert _shared_prefix_blocks(s, *branches) == 37 // dec.pool.block_size
    for b in branches:
        s.release(b)
    assert dec.pool.used_blocks == 0


def test_generate_many_is_one_forward_per_step(tiny):
    s = Session(Engine(tiny, eos_token_ids=[], max_kv_tokens=1024))
    root = s.start(_ids(30, 5))
    hs = [s.extend(s.fork(root), [t]) for t in (3, 4, 5)]
    alone = [s.fork(h) for h in hs]                  # flushed at fork: same contexts
    f0 = s.forwards
    together = s.generate_many(hs, max_new_tokens=12)
    assert s.forwards - f0 == 11                     # token 1 comes from the forks' logits
    assert together == [s.generate(h, max_new_tokens=12) for h in alone]


@pytest.mark.parametrize("bs", [16, 1])
def test_full_copy_same_tokens_more_memory(tiny, bs):
    out, peak = {}, {}
    for full in (False, True):
        s = Session(Engine(tiny, eos_token_ids=[], max_kv_tokens=2048, block_size=bs),
                    full_copy=full)
        root = s.start(_ids(64, 6))
        s.logits(root)
        s.pool.reset_peak()
        kids = [s.extend(s.fork(root), [t]) for t in range(4)]
        out[full] = s.generate_many(kids, max_new_tokens=8)
        peak[full] = s.pool.peak_bytes
        assert len(s.fork_ns) == 4
    assert out[True] == out[False]
    bb = s.pool.block_bytes
    if bs == 16:
        assert peak[False] == (4 + 4) * bb           # root's 4 blocks + one tail block per kid
        assert peak[True] == (4 + 4 * 5) * bb        # + a 5-block copy per kid
    else:                                            # each kid holds its token + 7 generated
        assert peak[False] == (64 + 4 * 8) * bb
        assert peak[True] == (64 + 4 * 72) * bb      # + a 72-token copy per kid


def test_session_errors(tiny):
    s = Session(Engine(tiny, eos_token_ids=[], max_kv_tokens=256))
    with pytest.raises(SpecforkError):
        s.start([])
    with pytest.raises(SpecforkError):
        s.generate(s.start([1, 2]), max_new_tokens=0)
    big = s.start([1] * 300)
    with pytest.raises(PoolExhausted):               # pool of 256 tokens; nothing half-done
        s.logits(big)
    assert s.pool.used_blocks == 0 and big.branch.length == 0 and len(big.pending) == 300
    h = s.start([1, 2])
    with pytest.raises(SpecforkError, match="outside the vocabulary"):
        s.extend(h, [3, 256])
    with pytest.raises(SpecforkError, match="temperature"):
        s.generate(h, max_new_tokens=2, temperature=-1.0)
    assert h.tokens == [1, 2] and h.pending == [1, 2]
    s.release(h)
    for op in (lambda: s.extend(h, [3]), lambda: s.fork(h), lambda: s.logits(h),
               lambda: s.release(h)):
        with pytest.raises(BranchReleased):
            op()


def test_failed_forward_leaves_the_context_as_it_was(tiny, monkeypatch):
    """A forward that fails (out of memory, Ctrl-C) writes nothing the branch keeps: the
    pending tokens are computed by the next call, which then equals a run that never failed."""
    s = Session(Engine(tiny, eos_token_ids=[], max_kv_tokens=256))
    ref = s.generate(s.start(_ids(12, 3)), max_new_tokens=5)
    h = s.start(_ids(12, 3))
    s.logits(h)
    s.extend(h, [9, 8])
    used, forward = s.pool.used_blocks, tiny.forward

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(tiny, "forward", boom)
    with pytest.raises(KeyboardInterrupt):
        s.logits(h)
    assert s.pool.used_blocks == used and h.branch.length == 12 and h.pending == [9, 8]
    monkeypatch.setattr(tiny, "forward", forward)
    h2 = s.start(_ids(12, 3))                        # the same calls, never failing
    s.logits(h2)
    s.extend(h2, [9, 8])
    assert torch.equal(s.logits(h), s.logits(h2))
    assert s.generate(s.start(_ids(12, 3)), max_new_tokens=5) == ref


@pytest.mark.slow
def test_embedded_branches_equal_independent_runs(smol, mt_prompts):
    """Two branches of one chat prompt (greedy; sampled with its own seed), and two branches
    that each got a different tool result, equal independent SpecDecoder runs; while all
    five contexts live, the prompt's blocks are stored once."""
    _, tok, model = smol
    dec = SpecDecoder(model, tok)
    s = Session.from_decoder(dec)
    ids = dec.encode(mt_prompts[0]["text"])
    tails = [tok("Sure! ", add_special_tokens=False)["input_ids"],
             tok("Tool result: 42.\n", add_special_tokens=False)["input_ids"]]
    root = s.start(ids)
    a, b = s.fork(root), s.fork(root)
    c, d = (s.extend(s.fork(root), t) for t in tails)
    got = [s.generate(a, 24), s.generate(b, 24, temperature=0.7,
                                         generator=torch.Generator().manual_seed(3)),
           s.generate(c, 24), s.generate(d, 24)]
    ref = [dec.generate(ids, 24), dec.generate(ids, 24, temperature=0.7, seed=3),
           dec.generate(ids + tails[0], 24), dec.generate(ids + tails[1], 24)]
    assert got == [r.token_ids for r in ref]
    full = len(ids) // s.pool.block_size       # prompt blocks every branch shares
    tables = [s.kv.block_table(h.branch) for h in (root, a, b, c, d)]
    assert full >= 3 and all(t[:full] == tables[0][:full] for t in tables)
    assert s.pool.used_blocks == len(set().union(*tables))       # nothing but these tables
    assert s.pool.used_blocks == sum(map(len, tables)) - 4 * full
    for h in (root, a, b, c, d):
        s.release(h)
    assert dec.pool.used_blocks == 0


@pytest.mark.parametrize("bs", [1, 16])
def test_one_token_per_branch_rows_equal_each_branch_alone(tiny, bs, monkeypatch):
    """Beam search's step: branches that share a prompt and part of their tokens, one new token
    each, in one forward. Through the slot op (each row over its own slot list, the shared start
    listed once) each branch's logits equal its lone forward (SpecDecoder's decode path) bit for
    bit; on the gathered-prefix path (no slot op here) to float32 rounding."""
    from specfork import attention
    from specfork.kv_tree import KVTree
    from specfork.session import forward_branches
    kv = KVTree(tiny.make_pool(num_blocks=256 // bs + 32, block_size=bs))
    root = kv.new_branch()
    forward_branches(tiny, kv, [root], [_ids(21, 7)])
    mid = kv.fork(root)
    forward_branches(tiny, kv, [mid], [[5, 6, 7]])          # a start two branches share
    branches = [kv.fork(root), kv.fork(mid), kv.fork(mid), kv.fork(root)]
    for b, t in zip(branches, ([1, 2], [8], [9, 4, 4], [3])):
        forward_branches(tiny, kv, [b], [t])
    alone = [kv.fork(b) for b in branches]
    took = []
    lists = attention.AttnMeta.lists.__func__
    monkeypatch.setattr(attention.AttnMeta, "lists",
                        classmethod(lambda cls, *a: took.append(1) or lists(cls, *a)))

    def check(branches, copies, feeds):
        together = forward_branches(tiny, kv, branches, feeds)
        for i, (a, f) in enumerate(zip(copies, feeds)):
            one = forward_branches(tiny, kv, [a], [f])[0]
            assert (torch.equal(together[i], one) if took else
                    torch.allclose(together[i], one, atol=1e-4)), i

    check(branches, alone, [[11], [12], [13], [11]])
    assert bool(took) == attention.uses_slot_op(tiny)
    # branches with no start in common (agents' unrelated contexts): nothing listed once
    other = kv.new_branch()
    forward_branches(tiny, kv, [other], [_ids(9, 8)])
    pair, copies = [branches[0], other], [kv.fork(branches[0]), kv.fork(other)]
    check(pair, copies, [[4], [5]])
    for b in [root, mid, other] + branches + alone + copies:
        kv.release(b)
    assert kv.pool.used_blocks == 0
