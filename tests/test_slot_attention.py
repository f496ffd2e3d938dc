"""The compiled CPU slot-attention op (specfork/kernels/slot_attention.cpp): each row over its
own slots equals torch's softmax attention over the gathered K/V, a row's bits do not depend on
what else shares the call, and the engine runs a batch of decoding requests through one call
per layer with the tokens each request emits alone."""
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

from conftest import tiny_model
from specfork.kernels import slot_attention as op

pytestmark = pytest.mark.skipif(not op.available(), reason="no C++ toolchain for the slot op")


@st.composite
def _case(draw):
    kvh, g = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d = draw(st.sampled_from([16, 32, 64, 128, 24]))      # 24: the scalar fallback
    lens = draw(st.lists(st.integers(1, 90), min_size=1, max_size=5))
    return kvh, g, d, lens, draw(st.integers(0, 2 ** 16))


@settings(max_examples=60, deadline=None)
@given(_case())
def test_rows_equal_torch_attention_and_each_alone(case):
    kvh, g, d, lens, seed = case
    gen = torch.Generator().manual_seed(seed)
    S = 200
    k, v = torch.randn(S, kvh, d, generator=gen), torch.randn(S, kvh, d, generator=gen)
    q = torch.randn(len(lens), kvh * g, d, generator=gen) * 3      # peaked softmaxes too
    lists = [torch.randint(0, S, (n,), generator=gen) for n in lens]
    idx, offs = torch.cat(lists), torch.tensor([0] + lens).cumsum(0)
    out = op.slot_attention(q, k, v, idx, offs, d ** -0.5)
    torch.testing.assert_close(out, op.slot_attention_ref(q, k, v, idx, offs, d ** -0.5),
                               atol=2e-5, rtol=2e-5)
    for r, ix in enumerate(lists):
        alone = op.slot_attention(q[r:r + 1], k, v, ix, torch.tensor([0, ix.numel()]),
                                  d ** -0.5)
        assert torch.equal(alone[0], out[r])


@settings(max_examples=40, deadline=None)
@given(_case())
def test_float16_pools_give_the_float32_ops_bits_over_them_widened(case):
    """A float16 pool (`--kv-cache float16`) is read as stored and widened exactly: the op
    over it equals, bit for bit, the op over the same values held as float32."""
    kvh, g, d, lens, seed = case
    gen = torch.Generator().manual_seed(seed)
    S = 200
    k = torch.randn(S, kvh, d, generator=gen).half()
    v = torch.randn(S, kvh, d, generator=gen).half()
    q = torch.randn(len(lens), kvh * g, d, generator=gen) * 3
    idx = torch.cat([torch.randint(0, S, (n,), generator=gen) for n in lens])
    offs = torch.tensor([0] + lens).cumsum(0)
    got = op.slot_attention(q, k, v, idx, offs, d ** -0.5)
    assert torch.equal(got, op.slot_attention(q, k.float(), v.float(), idx, offs, d ** -0.5))


@settings(max_examples=40, deadline=None)
@given(_case(), st.sampled_from([4.0, 3.5, 3.0, 2.5]))
def test_code_rows_equal_torch_attention_over_their_decode(case, rate):
    """`code_attention` over TurboQuant rows (keys and values at their own rates, as
    `split_rate` stores them) equals torch's attention over the rows decoded by the codec's
    own `decode`, and each row computes the same bits alone."""
    from specfork.kv_quant import TurboCodec, split_rate
    kvh, g, d, lens, seed = case
    if d % 16 or d < 32:
        d = 64
    kc, vc = (TurboCodec(d, r, seed=seed + i) for i, r in enumerate(split_rate(rate)))
    gen = torch.Generator().manual_seed(seed)
    S = 200
    k = kc.encode(torch.randn(S, kvh, d, generator=gen) * 4)
    v = vc.encode(torch.randn(S, kvh, d, generator=gen))
    q = torch.randn(len(lens), kvh * g, d, generator=gen) * 3
    lists = [torch.randint(0, S, (n,), generator=gen) for n in lens]
    idx, offs = torch.cat(lists), torch.tensor([0] + lens).cumsum(0)
    progs = (*kc.cpu_program(), *vc.cpu_program())
    out = op.code_attention(q, k, v, idx, offs, d ** -0.5, *progs)
    want = op.slot_attention_ref(q, kc.decode(k), vc.decode(v), idx, offs, d ** -0.5)
    torch.testing.assert_close(out, want, atol=5e-5, rtol=5e-5)
    for r, ix in enumerate(lists):
        alone = op.code_attention(q[r:r + 1], k, v, ix, torch.tensor([0, ix.numel()]),
                                  d ** -0.5, *progs)
        assert torch.equal(alone[0], out[r])


@st.composite
def _shared_case(draw):
    """Rows that share one list: a prompt chunk's causal rows, or tree rows over one prefix
    each followed by its own ancestors' slots (offs [R, 4])."""
    kvh, g = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    d = draw(st.sampled_from([16, 64, 128, 24]))
    L, T = draw(st.integers(0, 70)), draw(st.integers(1, 12))
    return kvh, g, d, L, T, draw(st.booleans()), draw(st.integers(0, 2 ** 16))


def _shared_rows(L, T, causal, gen, S=200):
    """(idx, offs [T, 4], per-row lists) for causal prompt rows or tree rows over L slots."""
    pre = torch.randint(0, S, (L,), generator=gen)
    if causal:
        w = torch.randint(0, S, (T,), generator=gen)
        offs = torch.tensor([[0, L + i + 1, 0, 0] for i in range(T)])
        return torch.cat((pre, w)), offs, [torch.cat((pre, w[:i + 1])) for i in range(T)]
    tails = [torch.randint(0, S, (int(n),), generator=gen)
             for n in torch.randint(0 if L else 1, 6, (T,), generator=gen)]
    ends = L + torch.tensor([t.numel() for t in tails]).cumsum(0)
    offs = torch.stack((torch.zeros(T, dtype=torch.long), torch.full((T,), L),
                        ends - torch.tensor([t.numel() for t in tails]), ends), dim=1)
    return torch.cat([pre] + tails), offs, [torch.cat((pre, t)) for t in tails]


def _check_rows(q, k, v, idx, offs, lists, d):
    """The op's rows equal torch's attention within rounding, and each row's bits are those it
    computes alone over its own list."""
    out = op.slot_attention(q, k, v, idx, offs, d ** -0.5)
    torch.testing.assert_close(out, op.slot_attention_ref(q, k.float(), v.float(), idx, offs,
                                                          d ** -0.5), atol=2e-5, rtol=2e-5)
    for r, ix in enumerate(lists):
        alone = op.slot_attention(q[r:r + 1], k, v, ix, torch.tensor([0, ix.numel()]),
                                  d ** -0.5)
        assert torch.equal(alone[0], out[r])


@settings(max_examples=60, deadline=None)
@given(_shared_case(), st.booleans())
def test_rows_sharing_one_list_compute_each_rows_own_bits(case, half):
    """Rows that read stretches of one list (offs [R, 4]; from 9 rows with 16 slots each they
    score it through one transposed copy of its keys) give, bit for bit, what each row gives
    alone over its own list, and torch's attention within rounding."""
    kvh, g, d, L, T, causal, seed = case
    gen = torch.Generator().manual_seed(seed)
    S = 200
    k, v = torch.randn(S, kvh, d, generator=gen), torch.randn(S, kvh, d, generator=gen)
    if half:
        k, v = k.half(), v.half()
    q = torch.randn(T, kvh * g, d, generator=gen) * 3
    idx, offs, lists = _shared_rows(L, T, causal, gen, S)
    _check_rows(q, k, v, idx, offs, lists, d)
    if d % 16 == 0:           # TurboQuant rows: the same two stretches, joined per row
        from specfork.kv_quant import TurboCodec
        kc, vc = TurboCodec(d, 4, seed=seed), TurboCodec(d, 4, seed=seed + 1)
        kq, vq = kc.encode(k.float()), vc.encode(v.float())
        progs = (*kc.cpu_program(), *vc.cpu_program())
        got = op.code_attention(q, kq, vq, idx, offs, d ** -0.5, *progs)
        want = op.code_attention(q, kq, vq, torch.cat(lists),
                                 torch.tensor([0] + [x.numel() for x in lists]).cumsum(0),
                                 d ** -0.5, *progs)
        assert torch.equal(got, want)


def test_bad_calls_are_errors_not_crashes():
    k = v = torch.zeros(4, 1, 16)
    q = torch.zeros(2, 1, 16)
    with pytest.raises(RuntimeError, match="at least one slot"):
        op.slot_attention(q, k, v, torch.tensor([0]), torch.tensor([0, 1, 1]), 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        op.slot_attention(q.double(), k.double(), v.double(), torch.tensor([0, 1]),
                          torch.tensor([0, 1, 2]), 1.0)
    with pytest.raises(RuntimeError, match="within idx"):          # a stretch past idx
        op.slot_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([[0, 1, 0, 0],
                                                                      [0, 1, 1, 3]]), 1.0)
    with pytest.raises(RuntimeError, match=r"\[R\+1\] or \[R, 4\]"):
        op.slot_attention(q, k, v, torch.tensor([0, 1]), torch.tensor([[0, 1], [0, 2]]), 1.0)


def test_batch_of_decoding_requests_takes_one_call_per_layer(monkeypatch):
    """Four requests decoding together: every decode step's attention is one op call per
    layer for the whole batch, and each request emits what it emits alone (the Python layer
    loop, where this op is called from Python; tests/test_layer_stack.py covers the compiled
    loop)."""
    from specfork.decoder import SpecDecoder
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    m = tiny_model()
    assert op.available(m.head_dim)
    dec = SpecDecoder(m, None, eos_token_ids=[], max_kv_tokens=512)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (9 + 4 * i,), generator=g).tolist() for i in range(4)]
    alone = [dec.generate(p, max_new_tokens=16).token_ids for p in prompts]
    rows = []
    call = op.slot_attention
    monkeypatch.setattr(op, "slot_attention", lambda q, *a: rows.append(q.shape[0])
                        or call(q, *a))
    reqs = [dec.request(p, 16)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert rows.count(4) >= 2 * 10          # >= 10 steps with all four rows, 2 layers each
    assert dec.pool.used_blocks == 0


def test_switched_off_by_the_environment():
    """SPECFORK_SLOT_ATTENTION=0 keeps the torch paths (and decoding still works)."""
    code = ("from specfork.kernels import slot_attention as op\n"
            "from conftest import tiny_model\n"
            "from specfork.decoder import SpecDecoder\n"
            "assert not op.available()\n"
            "d = SpecDecoder(tiny_model(), None, eos_token_ids=[], max_kv_tokens=64)\n"
            "print(len(d.generate([1, 2, 3], max_new_tokens=5).token_ids))\n")
    env = dict(os.environ, SPECFORK_SLOT_ATTENTION="0",
               PYTHONPATH=os.pathsep.join([os.path.dirname(__file__),
                                           os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "5"


@settings(max_examples=12, deadline=None)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([64, 128]),
       st.lists(st.integers(1, 1300), min_size=1, max_size=3), st.integers(0, 2), st.booleans(),
       st.integers(0, 2 ** 16))
def test_long_rows_are_split_in_chunks_and_keep_their_own_bits(kvh, g, d, lens, tree, half, seed):
    """Lists past one softmax chunk (512 keys) are scored and summed chunk by chunk over both
    threads and joined: still torch's attention within rounding, and a row's bits still its
    own whether it runs alone, in a batch, or as a tree row over a shared prefix (offs [R, 4])
    or a prompt chunk's causal row."""
    gen = torch.Generator().manual_seed(seed)
    S = 1400
    k, v = torch.randn(S, kvh, d, generator=gen), torch.randn(S, kvh, d, generator=gen)
    if half:
        k, v = k.half(), v.half()
    if tree:                  # rows over one long prefix, then their own ancestors
        idx, offs, lists = _shared_rows(lens[0], 10, tree == 2, gen, S)   # 9+: shared copy
    else:
        lists = [torch.randint(0, S, (n,), generator=gen) for n in lens]
        idx, offs = torch.cat(lists), torch.tensor([0] + lens).cumsum(0)
    q = torch.randn(len(lists), kvh * g, d, generator=gen) * 3
    _check_rows(q, k, v, idx, offs, lists, d)
