"""TurboQuant KV formats (specfork/kv_quant.py): codebook distortion inside the paper's bounds,
the prod variant's unbiased inner products, bit packing, bytes per token, the model's forward
reading every K/V through the stored form (trees bit for bit as decode steps), speculation and
beam search on a compressed pool, `score`, and one-line errors."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import fork_and_copy_continue, spec_and_beams, tiny_model, tree_and_steps
from specfork.errors import SpecforkError
from specfork.kv_quant import (TurboCodec, layer_codecs, lloyd_max, pack_bits,
                               parse_kv_format, rotation, unpack_bits)

UPPER = math.sqrt(3) * math.pi / 2          # D_mse <= UPPER * 4^-b for unit vectors (paper)


def _unit(n: int, d: int, seed: int) -> torch.Tensor:
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return x / x.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_codebook_distortion_within_the_papers_bounds(d, bits):
    """Rotate unit vectors, round each coordinate to the b-bit Lloyd-Max codebook: the mean
    squared error lies between the lower bound 4^-b and the upper sqrt(3) pi / 2 * 4^-b, and
    matches the codebook's own expected distortion."""
    c, per_coord = lloyd_max(d, bits)
    assert c.numel() == 2 ** bits and torch.equal(c, -c.flip(0))      # symmetric, ascending
    u = _unit(4000, d, bits)
    y = u @ rotation(d, 7).t()
    q = c[torch.bucketize(y, (c[1:] + c[:-1]) / 2)]
    mse = (y - q).pow(2).sum(-1).mean().item()
    assert 4.0 ** -bits < mse < UPPER * 4.0 ** -bits
    assert mse == pytest.approx(per_coord * d, rel=0.05)


@pytest.mark.parametrize("d", [64, 100])
def test_rotation_is_orthogonal(d):
    R = rotation(d, 3)
    torch.testing.assert_close(R @ R.t(), torch.eye(d), atol=1e-5, rtol=0)
    assert not torch.equal(R, rotation(d, 4))


@pytest.mark.parametrize("rate", [4.0, 3.5, 3.0, 2.5])
def test_codec_round_trip_distortion_and_bytes(rate):
    """Stored bytes are exactly rate * D / 8 (norm included); decoding and rotating back gives
    a relative error inside the upper bound of the lower of the two bit widths used."""
    c = TurboCodec(64, rate, seed=1)
    assert c.nbytes * 8 == rate * 64
    x = torch.randn(3000, 2, 64, generator=torch.Generator().manual_seed(2)) * 5
    rows = c.encode(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3000, 2, c.nbytes)
    back = c.decode(rows) @ c.R                                       # model space
    err = ((back - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
    low = min(b for _, _, b in c.groups)
    assert 4.0 ** -(low + 1) < err < UPPER * 4.0 ** -low
    q = torch.randn(3000, 2, 64)                                      # attention's shortcut
    torch.testing.assert_close((c.rotate_query(q) * c.decode(rows)).sum(-1),
                               (q * back).sum(-1), atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("rate", [4.5, 3.0, 2.0])
def test_compiled_encoder_matches_torch_and_ignores_the_row_count(rate):
    """The CPU encoder (kernels/code_encode.cpp) stores what the torch steps store (codes of
    all but boundary ties equal, decode exact to its own rows), and a row's bytes do not
    depend on how many rows share the call: a verify tree codes what a decode step would."""
    from specfork.kernels import slot_attention as slot_op
    if not slot_op.available():
        pytest.skip("no C++ toolchain for the CPU ops")
    c = TurboCodec(64, rate, seed=5)
    # a seeded centre: boundary ties vary with it (0-3 rows of these 2100 over 12 centres)
    c.set_center(torch.randn(3, 64, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(700, 3, 64, generator=torch.Generator().manual_seed(2)) * 5
    assert c._op_encodes(x)
    rows, dec = c.encode_decode(x)
    ref_rows = c._encode(x)[0]
    assert (rows == ref_rows).all(-1).float().mean() > 0.999
    assert torch.equal(c.decode(rows), dec)
    for i in (0, 17, 699):
        alone, _ = c.encode_decode(x[i:i + 1])
        assert torch.equal(alone[0], rows[i])


def test_prod_inner_products_are_unbiased_and_mse_ones_are_not():
    """TurboQuant-prod: over 10^4 pairs (q = x + noise, so q . x is large) the mean error of
    q . x_hat is within 4 standard errors of 0. The plain MSE decode |x| * c shrinks toward 0:
    the same test finds its bias (so the test can fail)."""
    n, d = 10_000, 64
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 1, d, generator=g)
    q = x + torch.randn(n, 1, d, generator=g)
    true = (q * x).sum(-1)
    prod = TurboCodec(d, 3.5, seed=9, prod=True)
    err = (prod.rotate_query(q) * prod.decode(prod.encode(x))).sum(-1) - true
    assert abs(err.mean()) < 4 * err.std() / math.sqrt(n)
    c, _ = lloyd_max(d, 2)                      # the MSE stage at prod's own code bits
    R = rotation(d, 9)
    u = x[:, 0] / x[:, 0].norm(dim=-1, keepdim=True)
    mse_hat = x[:, 0].norm(dim=-1, keepdim=True) * c[torch.bucketize(u @ R.t(),
                                                                     (c[1:] + c[:-1]) / 2)]
    err = (q[:, 0] @ R.t() * mse_hat).sum(-1) - true[:, 0]
    assert err.mean() < -4 * err.std() / math.sqrt(n)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 8), n8=st.integers(1, 12), rows=st.integers(1, 5),
       seed=st.integers(0, 2 ** 16))
def test_bit_packing_round_trips(bits, n8, rows, seed):
    codes = torch.randint(0, 2 ** bits, (rows, 8 * n8), generator=torch.Generator().manual_seed(
        seed), dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, n8 * bits)
    assert torch.equal(unpack_bits(packed, bits, 8 * n8), codes)


def test_formats_and_one_line_errors():
    assert parse_kv_format("turbo3.5") == ("turbo", 3.5, False)
    assert parse_kv_format("turbo4-prod") == ("turbo", 4.0, True)
    assert layer_codecs("auto", 2, 64, torch.float32) is None
    assert layer_codecs("float32", 2, 64, torch.float32) is None
    (k, v), _ = layer_codecs("float16", 2, 64, torch.float32)
    assert k.encode(torch.ones(1, 1, 64)).dtype == torch.float16
    for bad in ("turbo7", "int4", "turbo3.25"):
        with pytest.raises(SpecforkError, match="unknown KV cache format"):
            parse_kv_format(bad)
    with pytest.raises(SpecforkError, match="does not fit head_dim 12"):
        layer_codecs("turbo3.5", 1, 12, torch.float32)


def _tiny_model(kv_cache="auto"):
    return tiny_model(kv_cache=kv_cache, hidden=128)            # head_dim 32


def test_pool_holds_codes_and_bytes_are_measured():
    """turbo3.5 at head_dim 32: keys at 4 bits (16 bytes a vector), values at 3 (12 bytes), per
    layer and kv head, measured from the pool's own tensors: 4.57x fewer than float16."""
    m = _tiny_model("turbo3.5")
    pool = m.make_pool(num_blocks=10)
    assert pool.k.dtype == pool.v.dtype == torch.uint8
    assert (pool.k.shape[-1], pool.v.shape[-1]) == (16, 12)
    assert pool.bytes_per_token == (pool.k.nbytes + pool.v.nbytes) // 10 == 2 * 2 * (16 + 12)
    f16 = _tiny_model("float16").make_pool(num_blocks=10)
    assert f16.bytes_per_token / pool.bytes_per_token == pytest.approx(128 / 28)


def _prefill(m, ids, pool=None):
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    pool = pool or m.make_pool(num_blocks=len(ids) + 40)
    kv = KVTree(pool)
    b = kv.new_branch()
    s = kv.append(b, len(ids))
    out = m.forward(ids, torch.arange(len(ids)), pool, AttnMeta.prefill(m, s[:0], s))
    return out, kv, b


@pytest.mark.parametrize("fmt", ["turbo4", "turbo2.5", "turbo3.5-prod", "float16"])
def test_every_read_goes_through_the_stored_form(fmt):
    """Layer 0 of a prefill equals the layer computed by hand from the stored rows decoded
    (its tokens read their own K/V as stored, not as computed), and prefilling in pieces (a
    chunk, a decode step, a chunk over the prefix's codes) gives the same logits and codes."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    from specfork.model import apply_rope, rms_norm
    import torch.nn.functional as F
    m = _tiny_model(fmt)
    T = 50
    ids = torch.randint(0, 96, (T,), generator=torch.Generator().manual_seed(1))
    pool = m.make_pool(num_blocks=T)
    kv = KVTree(pool)
    b = kv.new_branch()
    s = kv.append(b, T)
    whole, feats = m.forward(ids, torch.arange(T), pool, AttnMeta.prefill(m, s[:0], s),
                             capture=(1,))
    kc, vc = m.kv_codecs[0]
    kf, vf = pool.layer_slots(0)
    k, v = kc.decode(kf[s]), vc.decode(vf[s])                       # [T, 2, 32] as stored
    ly, x = m.layers[0], m.embed[ids]
    qkv = ly.qkv(rms_norm(x, ly.ln1, m.eps))
    cos, sin = m.rope(torch.arange(T))
    q = apply_rope(qkv[:, :128].view(T, 4, 32), cos, sin)
    exact_k = apply_rope(qkv[:, 128:192].view(T, 2, 32), cos, sin)
    assert torch.equal(kc.encode(exact_k), kf[s])                   # these keys' codes
    qr = (kc.rotate_query(q) if kc.rotated else q).view(T, 2, 2, 32)
    sc = torch.einsum("thgd,shd->hgts", qr, k) * m.scale
    sc = sc.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    o = torch.einsum("hgts,shd->thgd", sc.softmax(-1), v).reshape(T, 4, 32)
    o = vc.unrotate(o) if vc.rotated else o
    h = x + ly.o(o.reshape(T, 128))
    g, u = ly.gate_up(rms_norm(h, ly.ln2, m.eps)).chunk(2, dim=-1)
    torch.testing.assert_close(feats, h + ly.down(F.silu(g) * u), atol=1e-4, rtol=1e-4)
    if fmt != "float16":                 # the exact keys would have given another layer
        sc2 = torch.einsum("thgd,shd->hgts", q.view(T, 2, 2, 32), exact_k) * m.scale
        assert not torch.allclose(sc2 - sc2.amax(-1, keepdim=True),
                                  sc - sc.amax(-1, keepdim=True), atol=1e-3)
    pool2 = m.make_pool(num_blocks=T)
    kv2 = KVTree(pool2)
    b2 = kv2.new_branch()
    parts = []
    for a, e in ((0, 20), (20, 21), (21, T)):                  # prefill, decode, chunk
        meta = AttnMeta.prefill(m, kv2.slots(b2), kv2.append(b2, e - a))
        parts.append(m.forward(ids[a:e], torch.arange(a, e), pool2, meta))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-4, rtol=1e-4)
    k2, k1 = pool2.k[:, kv2.slots(b2)], pool.k[:, s]
    assert torch.equal(k2[0], k1[0])        # (layer 1's keys follow layer 0's attention path,
    #                                         whose last bits differ between the two splits)


def test_a_fork_attends_like_a_linear_cache_under_turbo():
    """Real tensors on a compressed pool: tokens decoded on a CoW fork of a prefix give the
    logits the same tokens give on one linear branch, and the fork's codes are the linear
    branch's codes."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    m = _tiny_model("turbo3")
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(2))
    pool = m.make_pool(num_blocks=100)
    kv = KVTree(pool)

    def step(b, a, e):
        meta = AttnMeta.prefill(m, kv.slots(b), kv.append(b, e - a))
        return m.forward(ids[a:e], torch.arange(a, e), pool, meta)

    lin = kv.new_branch()
    step(lin, 0, 30)
    lin_out = [step(lin, i, i + 1) for i in range(30, 40)]
    base = kv.new_branch()
    step(base, 0, 30)
    fork = kv.fork(base)
    fork_out = [step(fork, i, i + 1) for i in range(30, 40)]
    assert all(torch.equal(a, b) for a, b in zip(lin_out, fork_out))
    assert torch.equal(pool.k[:, kv.slots(lin)], pool.k[:, kv.slots(fork)])
    for b in (lin, fork, base):
        kv.release(b)
    assert pool.used_blocks == 0


@pytest.mark.parametrize("fmt", ["turbo3.5", "turbo2.5", "float16"])
def test_verify_rows_equal_decode_steps_bit_for_bit(fmt):
    """Under a stored KV format a verify tree over a 300-token prefix gives each row exactly
    the logits of the decode step at its position: the keys it writes get the same codes (or
    float16 values)."""
    m = _tiny_model(fmt)
    assert m.rows_exact and not _tiny_model().rows_exact
    tree, steps, tree_k, step_k = tree_and_steps(m)
    assert all(torch.equal(tree[i], steps[i][0]) for i in range(3))
    assert tree_k.dtype != torch.float32 and torch.equal(tree_k, step_k)


@pytest.mark.parametrize("fmt", ["turbo3.5", "float16"])
def test_speculation_and_beams_on_a_compressed_pool(fmt):
    """n-gram speculation gives plain decoding's tokens under the same KV format, beam search
    runs on it; nothing leaks."""
    want, got, spec, res, eng = spec_and_beams(_tiny_model(fmt))
    assert got.token_ids == want.token_ids and got.stats["tree_steps"] > 0
    assert got.stats["kv_blocks_leaked"] == 0
    assert got.stats["kv_bytes_per_token"] == spec.pool.bytes_per_token
    assert len(res.token_ids) == 8 and eng.pool.used_blocks == 0


def test_calibration_centres_keys_and_softmax_ignores_the_centre():
    """`calibrate_kv` sets each layer's key centre to the mean post-RoPE key (tokens 1..) of a
    float32 prefill of its text; attention over the centred codes equals attention over the
    codes plus the centre, i.e. the keys they stand for (every score moves by q . centre)."""
    m, ref = _tiny_model("turbo4"), _tiny_model()
    ids = list(range(3, 90))
    m.calibrate_kv(ids)
    _, kv, b = _prefill(ref, torch.tensor(ids))
    for i, (kc, vc) in enumerate(m.kv_codecs):
        want = kv.pool.layer_slots(i)[0][kv.slots(b)][1:].mean(0)
        torch.testing.assert_close(kc.center, want, atol=1e-5, rtol=1e-5)
        assert vc.center is None
    kc = m.kv_codecs[1][0]
    g = torch.Generator().manual_seed(3)
    keys, q = torch.randn(40, 2, 32, generator=g) + kc.center, torch.randn(1, 2, 32, generator=g)
    dec = kc.decode(kc.encode(keys))                                 # rotated, centred
    p_codes = (kc.rotate_query(q) * dec).sum(-1).softmax(0)
    p_keys = (q * (dec @ kc.R + kc.center)).sum(-1).softmax(0)
    torch.testing.assert_close(p_codes, p_keys, atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_embedded_target_under_turbo(smol):
    """The embedded target on turbo3.5: `--drafts 3` (n-gram, trained draft, EAGLE) greedy
    output token-identical to plain decoding under the same format; 4.57x fewer KV bytes per
    token than float16; `score` under float32 KV equals Hugging Face's per-token NLL."""
    from specfork.decoder import SpecDecoder
    hf, tok, _ = smol
    plain = SpecDecoder.from_pretrained(kv_cache="turbo3.5")
    spec = SpecDecoder.from_pretrained(kv_cache="turbo3.5", drafts=3, adaptive=False)
    for p in ("Write a haiku about the sea.", "def fib(n):"):
        a, b = plain.generate(p, max_new_tokens=40), spec.generate(p, max_new_tokens=40)
        assert a.token_ids == b.token_ids and b.stats["tree_steps"] > 0
        assert b.stats["kv_blocks_leaked"] == 0
    assert 23040 / a.stats["kv_bytes_per_token"] == pytest.approx(128 / 28)
    text = "The harbour was quiet. Boats came in one by one, low with the night's catch."
    ids = tok(text)["input_ids"]
    with torch.no_grad():
        lg = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.nn.functional.cross_entropy(lg, torch.tensor(ids[1:]), reduction="none")
    got = SpecDecoder.from_pretrained(weights="float32").score(text)
    assert got["tokens"] == ids
    torch.testing.assert_close(torch.tensor(got["nll"]), want, atol=2e-4, rtol=1e-4)
    assert got["ppl"] == pytest.approx(math.exp(want.mean().item()), rel=1e-4)
    t = plain.score(text)
    assert 1.0 < t["ppl"] / got["ppl"] < 1.5 and plain.pool.used_blocks == 0


def test_cli_kv_cache_and_score_errors_are_one_line():
    for argv in (["generate", "--kv-cache", "turbo9", "--prompt", "hi"],
                 ["score", "--kv-cache", "int4", "--prompt", "hi"],
                 ["score", "--prompt", "   "]):
        p = subprocess.run([sys.executable, "-m", "specfork.cli", *argv], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert "Traceback" not in p.stderr


def test_sessions_fork_and_full_copy_agree_on_codes():
    """Sessions on a compressed pool: a CoW fork and a full copy of a context (its code rows
    copied as they are) continue with the same tokens; nothing leaks."""
    outs, clean = fork_and_copy_continue(_tiny_model("turbo3"))
    assert outs[0] == outs[1] and clean
