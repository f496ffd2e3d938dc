"""Weight formats (specfork/weights.py): what each kernel multiplies by, the model's logits
under each format against float32, speculation under a format token-identical to plain
decoding under the same format, and one-line errors."""
from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from conftest import tiny_model, tree_and_steps
from specfork.errors import SpecforkError
from specfork.weights import (GROUP, QuantLinear, check_weights, dequantize, holds, native,
                              pack_q4, quantize_activations, quantize_int4, quantize_int8,
                              quantize_q4, quantize_q8, resolve, unpack_q4)

LOW = ("bfloat16", "int8", "int4")


def _ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What a weight-only int4/int8 kernel computes: `w` times the activations (bf16 in torch's
    kernels, 8-bit codes per group of 32 in ours, as llama.cpp's), in fp32."""
    return (quantize_activations(x).float() if native() else x.bfloat16().float()) @ w.t()


def _exact(x: torch.Tensor, lin: QuantLinear) -> torch.Tensor:
    """Our int4/int8 kernel's product in float64: the weights it holds times the activations it
    quantized (both exactly as the kernel takes them)."""
    return (quantize_activations(x) @ dequantize(lin).double().t()).float()


needs_native = pytest.mark.skipif(not native(), reason="specfork's low-bit kernels need AVX-512")


@needs_native
def test_our_int4_kernel_finds_a_q4_1_grid_exactly_and_multiplies_by_it():
    """Q4_1 blocks (w = q * d + m, d and m float16 as GGUF stores them) are held exactly, and
    the product is the one of those weights with the activations quantized to 8 bits per 32
    (llama.cpp's arithmetic), to float32 rounding."""
    g = torch.Generator().manual_seed(11)
    N, K = 48, 6 * GROUP
    q = torch.randint(0, 16, (N, K // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(N, K // GROUP, 1, generator=g) * 0.1 + 0.01).half().float()
    m = (torch.randn(N, K // GROUP, 1, generator=g) * 0.1).half().float()
    w = torch.addcmul(m, q.float(), d).view(N, K)
    q2, sz = quantize_q4(w)
    assert torch.equal(q2.view_as(q), q.to(torch.uint8)) and sz.dtype == torch.float16
    assert all(torch.equal(a, b) for a, b in zip(unpack_q4(*pack_q4(q2, sz)), (q2, sz)))
    lin = QuantLinear(w, None, "int4")
    assert lin.bits == 4 and lin.w.shape == (N, K // 2)
    assert (dequantize(lin) - w).abs().max() < 1e-7
    x = torch.randn(5, K, generator=g)
    x[1] = 0                                     # an all-zero group quantizes to zeros
    torch.testing.assert_close(lin(x), _exact(x, lin), atol=1e-5, rtol=1e-5)
    # ... which is the weights' product to about 1% of its scale
    torch.testing.assert_close(lin(x), x @ w.t(), atol=0.02 * (x @ w.t()).abs().max(), rtol=0)


@needs_native
def test_our_int8_kernel_finds_a_q8_0_grid_exactly():
    """Q8_0 blocks (w = q * d, d float16 as GGUF stores it) are held exactly: the embedded
    target's output layer under int4 and int8 is the file's own."""
    g = torch.Generator().manual_seed(13)
    N, K = 32, 5 * GROUP
    q = torch.randint(-127, 128, (N, K // GROUP, GROUP), generator=g)
    q[..., 0] = 127
    d = (torch.rand(N, K // GROUP, 1, generator=g) * 0.01 + 1e-3).half().float()
    w = (q * d).view(N, K)
    q2, d2 = quantize_q8(w)
    assert torch.equal(q2.view_as(q), q.to(torch.int8)) and d2.dtype == torch.float16
    lin = QuantLinear(w, None, "int8")
    assert lin.bits == 8 and torch.equal(dequantize(lin), w)
    x = torch.randn(3, K, generator=g)
    torch.testing.assert_close(lin(x), _exact(x, lin), atol=1e-5, rtol=1e-5)


@needs_native
@pytest.mark.parametrize("fmt", ("bfloat16", "int8", "int4"))
def test_our_kernel_gives_a_row_the_same_bits_in_any_call(fmt):
    """Whatever the row count (1..19: every tile shape and tail), the row's place, the
    thread count, or a fused residual and bias: a row gets the same bits."""
    g = torch.Generator().manual_seed(12)
    w, b = torch.randn(80, 4 * GROUP, generator=g) * 0.05, torch.randn(80, generator=g)
    lin = QuantLinear(w, b, fmt)
    x, res = torch.randn(19, 4 * GROUP, generator=g), torch.randn(19, 80, generator=g)
    one = torch.cat([lin(x[i:i + 1]) for i in range(19)])
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for T in (1, 2, 3, 4, 5, 7, 8, 13, 19):
                assert torch.equal(lin(x[:T]), one[:T]), (n, T)
            assert torch.equal(lin.add_to(res, x), one + res)
    finally:
        torch.set_num_threads(threads)
    want = (x.double() @ dequantize(lin).double().t()).float() if fmt == "bfloat16" else \
        _exact(x, lin)
    torch.testing.assert_close(one, want + b, atol=1e-5, rtol=1e-5)


def test_int8_kernel_multiplies_by_the_dequantized_weights():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(96, 64, generator=g), torch.randn(5, 64, generator=g)
    lin = QuantLinear(w, None, "int8")
    q, s = quantize_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.bfloat16 and q.abs().max() == 127
    deq = dequantize(lin)
    assert (deq - w).abs().max() <= s.float().max() / 2 + 1e-6      # half a step at most
    torch.testing.assert_close(lin(x), _ref(x, deq), atol=0.05, rtol=0.01)   # bf16 output


def test_int4_recovers_a_q4_1_grid_exactly():
    """Weights that are already Q4_1 blocks (w = q * d + m, every block spanning 0..15) whose
    scale d and offset m + 8d are bf16 values are held exactly: quantizing finds their grid and
    the kernel's product equals the weights'."""
    g = torch.Generator().manual_seed(1)
    N, K = 64, 4 * GROUP
    q = torch.randint(0, 16, (N, K // GROUP, GROUP), generator=g)
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(N, K // GROUP, 1, generator=g) * 0.1 + 0.01).bfloat16().float()
    z = (torch.randn(N, K // GROUP, 1, generator=g) * 0.1).bfloat16().float()
    w = (q * d + (z - 8 * d)).view(N, K)
    q2, sz = quantize_int4(w)
    s, z = sz[..., 0].float().t(), sz[..., 1].float().t()            # [N, K/g]
    deq = ((q2.view(N, K // GROUP, GROUP) - 8) * s[..., None] + z[..., None]).view(N, K)
    assert sz.shape == (K // GROUP, N, 2) and q2.min() >= 0 and q2.max() <= 15
    assert (deq - w).abs().max() < 1e-6
    x = torch.randn(3, K, generator=g)
    torch.testing.assert_close(QuantLinear(w, None, "int4")(x), _ref(x, w), atol=0.05,
                               rtol=0.01)


@pytest.mark.parametrize("fmt", LOW)
def test_one_row_equals_its_row_in_a_batch(fmt):
    """A verify tree's rows get exactly what one-row decode steps would (greedy speculation
    under a format is then token-identical to plain decoding under it)."""
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(208, 128, generator=g), torch.randn(9, 128, generator=g)
    lin = QuantLinear(w, torch.randn(208, generator=g), fmt)
    many = lin(x)
    assert all(torch.equal(many[i:i + 1], lin(x[i:i + 1])) for i in range(9))
    assert torch.equal(lin.add_to(x[:, :1].expand(9, 208).contiguous(), x), many + x[:, :1])
    # the embedded target's down projection, 24 rows (packed bf16 on an AMD EPYC parted from
    # one-row calls from 21 rows on when called with all rows at once)
    lin = QuantLinear(torch.randn(576, 1536, generator=g) * 0.05, None, fmt)
    x = torch.randn(24, 1536, generator=g)
    many = lin(x)
    assert all(torch.equal(many[i:i + 1], lin(x[i:i + 1])) for i in range(24))


def _tiny_model(weights="float32", hidden=64):
    return tiny_model(weights, hidden=hidden)


def test_auto_is_int4_only_where_it_holds_the_weights_exactly():
    """`auto` picks int4 only for weights on Q4_1 grids with an output layer on a Q8_0 one (a
    model read from such a GGUF), where it multiplies by the very same values: one weight off
    its grid, or random weights (the tiny model), keep float32."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 128, generator=g)
    q, sz = quantize_q4(w)
    grid4 = (q.double().view(64, -1, GROUP) * sz[..., :1].double()
             + sz[..., 1:].double()).float().flatten(1)
    q8, d = quantize_q8(w)
    grid8 = (q8.float().view(64, -1, GROUP) * d.float()[..., None]).flatten(1)
    assert holds(grid4, "int4") and holds(grid8, "int8")
    assert not holds(w, "int4") and not holds(w, "int8")
    off = grid4.clone()
    off[5, 7] = torch.nextafter(off[5, 7], torch.tensor(1e9))
    assert not holds(off, "int4")
    cpu = torch.device("cpu")
    assert resolve("auto", cpu, [grid4, grid4[:32]], grid8) == ("int4" if native() else
                                                                 "float32")
    for mats, head in (([grid4, off], grid8), ([grid4], w), ([grid4], None)):
        assert resolve("auto", cpu, mats, head) == "float32"
    assert resolve("auto", cpu) == "float32" and resolve("int8", cpu) == "int8"
    assert _tiny_model("auto").weights == "float32"


def test_auto_kv_is_float16_under_low_bit_weights_on_a_cpu():
    """`--kv-cache auto` stores float16 K/V under low-bit weights where the slot op reads it
    (half the bytes a decode step reads), the model's float32 under float32 weights; a format
    asked for by name is kept."""
    from specfork.kv_quant import resolve_kv
    from specfork.kernels import slot_attention as slot_op
    half = "float16" if slot_op.available(16) else "auto"
    assert _tiny_model("int4").kv_cache == half
    assert resolve_kv("auto", True, torch.float32, "cpu", 64) == half
    assert _tiny_model("int4").make_pool(num_blocks=4).bytes_per_token == (
        2 * 2 * 2 * 16 * (2 if half == "float16" else 4))
    m = _tiny_model()
    assert m.kv_cache == "auto" and m.kv_codecs is None
    assert tiny_model("int4", kv_cache="float32").kv_codecs is None
    assert resolve_kv("turbo4", True, torch.float32, "cpu", 64) == "turbo4"
    assert resolve_kv("auto", True, torch.float32, "cuda", 64) == "auto"
    assert resolve_kv("auto", True, torch.bfloat16, "cpu", 64) == "auto"


@pytest.mark.parametrize("fmt", LOW)
def test_model_under_a_format(fmt):
    """Logits near float32's; every matmul in the format (int4: the output layer int8); n-gram
    speculation gives exactly plain decoding's tokens under the same format; nothing leaks."""
    from specfork.attention import AttnMeta
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    from specfork.kv_tree import KVTree
    ref, m = _tiny_model(), _tiny_model(fmt)
    assert m.weights == fmt and m.packed_bytes() == 0
    assert {x.fmt for x in m.linears()[1:]} == {fmt}
    assert m.lm_head.fmt == ("int8" if fmt == "int4" else fmt)
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(3))

    def logits(model):
        pool = model.make_pool(num_blocks=64)
        kv = KVTree(pool)
        b = kv.new_branch()
        s = kv.append(b, 40)
        return model.forward(ids, torch.arange(40), pool, AttnMeta.prefill(model, s[:0], s))

    a, b = logits(ref), logits(m)
    assert a.dtype == b.dtype == torch.float32
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1).min()
    assert cos > {"bfloat16": 0.9995, "int8": 0.999, "int4": 0.97}[fmt], cos
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    plain = SpecDecoder(m, None, eos_token_ids=[], max_kv_tokens=128)
    spec = SpecDecoder(m, None, [NgramDrafter()], num_paths=2, draft_len=3, eos_token_ids=[],
                       max_kv_tokens=128)
    want = plain.generate(prompt, max_new_tokens=24).token_ids
    got = spec.generate(prompt, max_new_tokens=24)
    assert got.token_ids == want and got.stats["tree_steps"] > 0
    assert got.stats["kv_blocks_leaked"] == 0


@pytest.mark.parametrize("fmt", LOW)
def test_verify_rows_equal_decode_steps_bit_for_bit(fmt):
    """Under a low-bit format a verify tree (two branches over a 300-token prefix; head size
    64) gives each row exactly the logits the decode step at its position gives: the same keys
    in the same order through the same op. (Through the masked bmm's instead, int4's rows part
    from the decode steps' by a bf16 step here.)"""
    m = _tiny_model(fmt, hidden=256)
    assert m.rows_exact and not _tiny_model().rows_exact
    tree, steps, _, _ = tree_and_steps(m)
    assert all(torch.equal(tree[i], steps[i][0]) for i in range(3))


@pytest.mark.parametrize("fmt", LOW)
def test_a_prompt_gives_the_same_bits_however_it_is_cut(fmt):
    """Under a low-bit format a prompt's rows attend row by row as decode steps would, so its
    last row's logits and every K/V row are the same whether the prompt is prefilled whole, in
    two chunks, or as a prefix (say, from the prefix cache) plus one decode step. (Through the
    causal SDPA, int4's 8-bit activations turned the paths' last-bit differences into logits
    0.8 apart on the embedded target.)"""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    m = _tiny_model(fmt, hidden=256)
    ids = torch.randint(0, 96, (90,), generator=torch.Generator().manual_seed(5))
    outs = []
    for cuts in ((90,), (37, 53), (89, 1)):
        pool = m.make_pool(num_blocks=100)
        kv = KVTree(pool)
        B, at = kv.new_branch(), 0
        for n in cuts:
            prefix, write = kv.slots(B), kv.append(B, n)
            lg = m.forward(ids[at:at + n], torch.arange(at, at + n), pool,
                           AttnMeta.prefill(m, prefix, write), logits_idx=slice(n - 1, n))
            at += n
        s = kv.slots(B)
        outs.append((lg, pool.k[:, s].clone(), pool.v[:, s].clone()))
    for lg, k, v in outs[1:]:
        assert torch.equal(lg, outs[0][0]) and torch.equal(k, outs[0][1])
        assert torch.equal(v, outs[0][2])


def test_bad_formats_are_one_line_errors():
    with pytest.raises(SpecforkError, match="unknown format 'int3'"):
        check_weights("int3", "cpu")
    with pytest.raises(SpecforkError, match="run on a CPU"):
        check_weights("int8", "cuda")
    assert resolve("auto", torch.device("cpu")) == "float32"
    with pytest.raises(SpecforkError, match="does not fit the kernel"):
        QuantLinear(torch.randn(16, 40), None, "int4")
    p = subprocess.run([sys.executable, "-m", "specfork.cli", "generate", "--weights", "int3",
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "int3" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("fmt,max_ppl_ratio", [("bfloat16", 1.01), ("int8", 1.01),
                                               ("int4", 1.03)])
def test_embedded_target_perplexity_and_speculation(fmt, max_ppl_ratio):
    """The embedded target under each format: perplexity on held-out text (stdlib pydoc, no
    benchmark) within the issue's bound of float32's (int8 1%, int4 3%; bf16 as int8), top-1
    agreement with float32 over 90%, and `--drafts 3` greedy output token-identical to plain
    decoding under the same format (verify trees attend row by row as decode steps do)."""
    import pydoc
    from specfork.attention import AttnMeta
    from specfork.decoder import SpecDecoder
    from specfork.drafters.registry import make_drafters
    from specfork.kv_tree import KVTree
    from specfork.loader import load_hf
    from specfork.model import Model
    hf, tok = load_hf("smollm2-135m")
    text = pydoc.render_doc(__import__("textwrap"), renderer=pydoc.plaintext)
    ids = torch.tensor(tok(text)["input_ids"][:512])

    def logits(model):
        pool = model.make_pool(num_blocks=len(ids) + 8)
        kv = KVTree(pool)
        s = kv.append(kv.new_branch(), len(ids))
        return model.forward(ids, torch.arange(len(ids)), pool,
                             AttnMeta.prefill(model, s[:0], s))

    def nll(lg):
        return torch.nn.functional.cross_entropy(lg[:-1], ids[1:]).item()

    ref = logits(Model(hf))
    m = Model(hf, weights=fmt)
    low = logits(m)
    assert math.exp(nll(low) - nll(ref)) < max_ppl_ratio
    if fmt == "int4" and native():     # the GGUF's own Q4_1 / Q8_0 weights: `auto` takes int4
        assert Model(hf, weights="auto").weights == "int4"
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    plain = SpecDecoder(m, tok)
    spec = SpecDecoder(m, tok, make_drafters(None, "smollm2-135m", m, 3), num_paths=3,
                       adaptive=False)
    for text in ("Write a Python function that returns the n-th Fibonacci number.",
                 "def moving_average(xs, k):\n    \"\"\"Mean of each window of k items.\"\"\"\n"):
        p = plain.encode(text, raw=text.startswith("def"))
        want = plain.generate(p, max_new_tokens=48).token_ids
        got = spec.generate(p, max_new_tokens=48)
        assert got.stats["tree_steps"] > 0 and got.stats["kv_blocks_leaked"] == 0
        assert got.token_ids == want
