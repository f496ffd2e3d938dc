"""A KV window over TurboQuant codes (`--kv-window`): a query reads its last `window` keys and
values, and the first token's, from float16 shadows instead of their codes. The slot op against
a row-by-row reference, shadows' lifetime in the pool (allocated with blocks, copied on write,
given back when no window reads them, counted in the bytes), verify rows equal to decode steps
bit for bit, forks, speculation, beams, the embedded target's perplexity, one-line errors."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import fork_and_copy_continue, spec_and_beams, tiny_model, tree_and_steps
from specfork.errors import SpecforkError
from specfork.kernels import slot_attention as slot_op
from specfork.kv_quant import TurboCodec

pytestmark = pytest.mark.skipif(not slot_op.available(32), reason="the CPU slot op is not built")


def _window_ref(q, kc, vc, k_rows, v_rows, k16, v16, shadow_of, bs, idx, offs, scale, window,
                sink):
    """Row by row in torch: slot j of a row's n is read from its shadow if j >= n - window or
    j < sink, else decoded from its codes."""
    out = []
    G = q.shape[1] // k_rows.shape[1]
    for r, ix in enumerate(slot_op.row_slots(idx, offs)):
        n = ix.numel()
        f16 = (torch.arange(n) >= n - window) | (torch.arange(n) < sink)
        sh = shadow_of[ix // bs].long() * bs + ix % bs
        k = torch.where(f16[:, None, None], k16[sh.clamp_min(0)].float(), kc.decode(k_rows[ix]))
        v = torch.where(f16[:, None, None], v16[sh.clamp_min(0)].float(), vc.decode(v_rows[ix]))
        k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
        s = torch.einsum("hd,nhd->hn", q[r], k) * scale
        out.append(torch.einsum("hn,nhd->hd", s.softmax(-1), v))
    return torch.stack(out)


def _coded(S=48, KVH=2, D=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    kc, vc = TurboCodec(D, 3.5, 1), TurboCodec(D, 3.0, 2)
    kc.set_center(torch.randn(KVH, D, generator=g) * 0.5)
    k, v = torch.randn(S, KVH, D, generator=g), torch.randn(S, KVH, D, generator=g)
    k16 = (kc.prepare(k) @ kc.RT).half()
    v16 = (vc.prepare(v) @ vc.RT).half()
    return kc, vc, kc.encode(k), vc.encode(v), k16, v16


@pytest.mark.parametrize("window,sink", [(0, 1), (5, 0), (5, 1), (100, 0)])
def test_slot_op_reads_window_and_sink_from_shadows(window, sink):
    """The op against the reference on rows of different lengths (one list, two stretches),
    with shadows in permuted blocks; window 0 sink 0 is the code-only op."""
    bs, S = 4, 48
    kc, vc, k_rows, v_rows, k16, v16 = _coded(S)
    perm = torch.randperm(S // bs, generator=torch.Generator().manual_seed(1)).int()
    shadow_of = perm                              # block b's shadow rows: block perm[b]
    k16s, v16s = torch.empty_like(k16), torch.empty_like(v16)
    for b in range(S // bs):
        p = int(perm[b])
        k16s[p * bs:(p + 1) * bs], v16s[p * bs:(p + 1) * bs] = (k16[b * bs:(b + 1) * bs],
                                                                v16[b * bs:(b + 1) * bs])
    idx = torch.randperm(S, generator=torch.Generator().manual_seed(2))
    offs = torch.tensor([[0, 30, 30, 30], [0, 20, 40, 44], [0, 3, 3, 3]])
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(3))
    qr = kc.rotate_query(q)
    got = slot_op.code_attention(qr, k_rows, v_rows, idx, offs, 0.2, *kc.cpu_program(),
                                 *vc.cpu_program(),
                                 window=(k16s, v16s, shadow_of, bs, window, sink))
    want = _window_ref(qr, kc, vc, k_rows, v_rows, k16s, v16s, shadow_of, bs, idx, offs, 0.2,
                       window, sink)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    plain = slot_op.code_attention(qr, k_rows, v_rows, idx, offs, 0.2, *kc.cpu_program(),
                                   *vc.cpu_program())
    assert not torch.allclose(got, plain, atol=1e-4)          # the window changed what is read


def test_a_missing_shadow_is_an_error_not_a_silent_read():
    kc, vc, k_rows, v_rows, k16, v16 = _coded(16)
    shadow_of = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    idx, offs = torch.arange(16), torch.tensor([0, 16])
    q = torch.randn(1, 4, 32)
    with pytest.raises(RuntimeError, match="no float16 shadow"):
        slot_op.code_attention(q, k_rows, v_rows, idx, offs, 0.2, *kc.cpu_program(),
                               *vc.cpu_program(), window=(k16, v16, shadow_of, 4, 3, 0))


def _prefill(m, pool, kv, b, ids, at=0):
    from specfork.attention import AttnMeta
    meta = AttnMeta.prefill(m, kv.slots(b), kv.append(b, len(ids)))
    return m.forward(torch.tensor(ids), torch.arange(at, at + len(ids)), pool, meta)


def test_shadows_live_with_their_blocks_and_are_counted(monkeypatch):
    """Every appended block gets a shadow until the forward that writes it; after a prompt
    chunk's forward, and whenever they run out, the shadows no open branch's window or sink
    reads are given back (the window of written tokens: a chunk appended and cut back unrun
    leaves the one before it readable); a CoW copy carries its source's; releasing the
    branches gives back the rest; the bytes count them."""
    from specfork import kv_tree
    from specfork.kv_tree import KVTree
    monkeypatch.setattr(kv_tree, "SHADOW_SLACK", 0)
    monkeypatch.setattr(kv_tree, "SHADOW_START", 16)
    m = tiny_model(kv_cache="turbo3", hidden=128, kv_window=6)
    pool = m.make_pool(num_blocks=64, block_size=4)
    kv = KVTree(pool)
    assert pool.window == 6 and pool.sink == 1 and pool.sk.shape[1] == 16
    b = kv.new_branch()
    kv.append(b, 38)                                           # 38 tokens: 10 blocks
    table = kv.block_table(b)
    assert all(pool.shadow_of[x] >= 0 for x in table) and pool.shadows_in_use == 10
    assert pool.bytes_in_use == 10 * pool.block_bytes + 10 * pool.shadow_block_bytes
    kv.truncate(b, 0)
    _prefill(m, pool, kv, b, list(range(1, 39)))               # written: the window stays
    table = kv.block_table(b)
    need = {table[0], *table[(38 - 6) // 4:]}                  # sink block, last 6 tokens
    assert {x for x in table if pool.shadow_of[x] >= 0} == need
    assert pool.bytes_in_use == 10 * pool.block_bytes + 3 * pool.shadow_block_bytes
    f = kv.fork(b)                                             # shares the partial last block
    _prefill(m, pool, kv, f, [5], at=38)
    assert kv.block_table(f)[-1] != table[-1] and pool.shadow_of[kv.block_table(f)[-1]] >= 0
    torch.testing.assert_close(pool.sk[:, int(pool.shadow_of[kv.block_table(f)[-1]]), :2],
                               pool.sk[:, int(pool.shadow_of[table[-1]]), :2], atol=0, rtol=0)
    c = kv.new_branch()
    _prefill(m, pool, kv, c, list(range(2, 38)))               # 9 blocks
    fb, cb = kv.block_table(f), kv.block_table(c)
    need |= {fb[0], *fb[(39 - 6) // 4:], cb[0], *cb[(36 - 6) // 4:]}
    shadowed = {x for x in range(pool.num_blocks) if pool.shadow_of[x] >= 0}
    assert shadowed == need and pool.sk.shape[1] == 16
    d = kv.new_branch()
    kv.append(d, 60)                                 # 15 blocks: more than are free, so a
    assert pool.sk.shape[1] == 16 + 15 - (16 - len(need))      # sweep, then the store grows
    kv.release(d)
    assert not kv.window_ready(b, 20) and kv.window_ready(b, 38)
    kv.append(b, 30)                                 # a prompt chunk planned, not run: a sweep
    pool.sweep_shadows()                             # keeps the window of b's written tokens
    kv.truncate(b, 38)
    assert kv.window_ready(b, 38)
    _prefill(m, pool, kv, b, [9], at=38)
    for x in (b, f, c):
        kv.release(x)
    assert pool.used_blocks == 0 and pool.shadows_in_use == 0 and pool.bytes_in_use == 0


def test_verify_rows_equal_decode_steps_bit_for_bit_under_a_window():
    """A verify tree whose rows straddle the window's edge over a 300-token prefix: each row
    reads what the decode step at its position reads (the rule is positional)."""
    m = tiny_model(kv_cache="turbo3.5", hidden=128, kv_window=8)
    tree, steps, tree_k, step_k = tree_and_steps(m)
    assert all(torch.equal(tree[i], steps[i][0]) for i in range(3))
    assert torch.equal(tree_k, step_k)


def test_a_window_reads_closer_to_float32_and_a_fork_attends_like_a_linear_cache():
    """Real tensors: a window as long as the text makes every read a float16 one (logits
    within float16's error of float32 K/V, far closer than the codes alone); tokens decoded on
    a CoW fork give the logits of one linear branch."""
    from specfork.kv_tree import KVTree
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    outs = {}
    for name, fmt, w in (("f32", "float32", 0), ("codes", "turbo2.5", 0),
                         ("window", "turbo2.5", 64)):
        m = tiny_model(kv_cache=fmt, hidden=128, kv_window=w)
        pool = m.make_pool(num_blocks=40, block_size=4)
        kv = KVTree(pool)
        b = kv.new_branch()
        outs[name] = _prefill(m, pool, kv, b, ids)
        kv.release(b)
    err = {k: (outs[k] - outs["f32"]).abs().max().item() for k in ("codes", "window")}
    assert err["window"] < 1e-2 < err["codes"] and err["window"] * 5 < err["codes"]
    m = tiny_model(kv_cache="turbo3", hidden=128, kv_window=5)
    pool = m.make_pool(num_blocks=60, block_size=4)
    kv = KVTree(pool)
    lin = kv.new_branch()
    _prefill(m, pool, kv, lin, ids[:30])
    lin_out = [_prefill(m, pool, kv, lin, [t], at=30 + i) for i, t in enumerate(ids[30:])]
    base = kv.new_branch()
    _prefill(m, pool, kv, base, ids[:30])
    fork = kv.fork(base)
    fork_out = [_prefill(m, pool, kv, fork, [t], at=30 + i) for i, t in enumerate(ids[30:])]
    assert all(torch.equal(a, b) for a, b in zip(lin_out, fork_out))
    for x in (lin, fork, base):
        kv.release(x)
    assert pool.used_blocks == 0 and pool.shadows_in_use == 0


def test_speculation_and_beams_under_a_window():
    """n-gram speculation gives plain decoding's tokens under the same format and window;
    beam search runs; nothing leaks, shadows included."""
    want, got, spec, res, eng = spec_and_beams(tiny_model(kv_cache="turbo3.5", hidden=128,
                                                          kv_window=6))
    assert got.token_ids == want.token_ids and got.stats["tree_steps"] > 0
    assert got.stats["kv_blocks_leaked"] == 0 and spec.pool.shadows_in_use == 0
    assert len(res.token_ids) == 8 and eng.pool.used_blocks == 0
    assert eng.pool.shadows_in_use == 0


def test_window_errors_are_one_line():
    with pytest.raises(SpecforkError, match="TurboQuant"):
        tiny_model(kv_cache="float16", kv_window=8)
    with pytest.raises(SpecforkError, match=">= 0"):
        tiny_model(kv_cache="turbo3", hidden=128, kv_window=-1)
    for argv in (["generate", "--kv-window", "8", "--prompt", "hi"],
                 ["score", "--kv-cache", "turbo3", "--kv-window", "-2", "--prompt", "hi"],
                 ["generate", "--kv-cache", "turbo3.5-prod", "--kv-window", "8", "--prompt",
                  "hi"]):
        p = subprocess.run([sys.executable, "-m", "specfork.cli", *argv], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "kv-window" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_embedded_target_window_closes_most_of_the_perplexity_gap(smol):
    """The embedded target on turbo3.5: with a 32-token window a held-out text's perplexity
    is much closer to float32 K/V's than without; `--drafts 3` stays token-identical to
    plain decoding under the window."""
    import pydoc

    from specfork.decoder import SpecDecoder
    _, tok, _ = smol
    ids = tok(pydoc.render_doc(pydoc.TextDoc, renderer=pydoc.plaintext))["input_ids"][:400]
    ref = SpecDecoder.from_pretrained(weights="float32", kv_cache="float32").score(ids)["ppl"]
    codes = SpecDecoder.from_pretrained(weights="float32", kv_cache="turbo3.5")
    win = SpecDecoder.from_pretrained(weights="float32", kv_cache="turbo3.5", kv_window=32)
    gap = {k: d.score(ids)["ppl"] / ref - 1 for k, d in (("codes", codes), ("win", win))}
    assert 0 <= gap["win"] < gap["codes"] / 2, gap
    spec = SpecDecoder.from_pretrained(kv_cache="turbo3.5", kv_window=32, drafts=3,
                                       adaptive=False)
    plain = SpecDecoder(spec.model, spec.tokenizer)
    a = plain.generate("Write a haiku about the sea.", max_new_tokens=40)
    b = spec.generate("Write a haiku about the sea.", max_new_tokens=40)
    assert a.token_ids == b.token_ids and b.stats["tree_steps"] > 0
    assert b.stats["kv_blocks_leaked"] == 0 and spec.pool.shadows_in_use == 0


def test_sessions_under_a_window_fork_copy_and_feed_several_branches():
    """Sessions on a windowed pool: a CoW fork and a full copy of a context (codes and
    shadow rows copied) continue with the same tokens; several branches fed several tokens
    each in one call give the logits of one call per branch; nothing leaks."""
    from specfork.kv_tree import KVTree
    from specfork.session import forward_branches
    m = tiny_model(kv_cache="turbo3", hidden=128, kv_window=5)
    outs, clean = fork_and_copy_continue(m)
    assert outs[0] == outs[1] and clean
    pool = m.make_pool(num_blocks=80, block_size=4)
    kv = KVTree(pool)
    feeds = [[7, 8, 9], [10, 11, 12]]
    got, want = [], []
    for together in (True, False):
        b = kv.new_branch()
        forward_branches(m, kv, [b], [list(range(1, 20))])
        c = kv.fork(b)
        if together:
            got = forward_branches(m, kv, [b, c], feeds)
        else:
            want = torch.cat([forward_branches(m, kv, [x], [f]) for x, f in zip((b, c), feeds)])
        kv.release(b), kv.release(c)
    assert torch.equal(got, want) and pool.used_blocks == 0


def test_engine_batches_and_prefix_cache_under_a_window(monkeypatch):
    """Requests batched in one loop (prompts in chunks while others decode, n-gram trees)
    emit what each emits alone. With the prefix cache, a request continuing a cached
    conversation forks it (its window lies at the entry's end, where the shadows stay); one
    that shares only an early part of it is prefilled anew (that window's shadows were given
    back after the prompt's forward); both emit what they emit without the cache; nothing
    leaks."""
    from specfork import kv_tree
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    monkeypatch.setattr(kv_tree, "SHADOW_SLACK", 0)
    m = tiny_model(kv_cache="turbo3", hidden=128, kv_window=6)
    dec = SpecDecoder(m, None, [NgramDrafter()], num_paths=2, eos_token_ids=[])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (40 + 7 * i,), generator=g).tolist() for i in range(5)]
    prompts = [p + p[:6] for p in prompts]
    alone = [dec.generate(p, max_new_tokens=16).token_ids for p in prompts]
    reqs = [dec.request(p, 16)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert dec.pool.used_blocks == 0 and dec.pool.shadows_in_use == 0
    more, late = prompts[4] + alone[4] + [1, 2, 3], prompts[4][:30] + [77, 78]
    want = [dec.generate(p, max_new_tokens=16).token_ids for p in (more, late)]
    dec.engine.configure(prefix_cache=True)
    dec.engine.run([dec.request(prompts[4], 16)[0]])
    b = dec.request(more, 16)[0]
    dec.engine.run([b])
    assert b.cached_tokens == len(prompts[4]) + 15 and b.out == want[0]
    d = dec.request(late, 16)[0]
    dec.engine.run([d])
    assert d.cached_tokens == 0 and d.out == want[1]
    dec.engine.configure(prefix_cache=False)
    assert dec.pool.used_blocks == 0 and dec.pool.shadows_in_use == 0
