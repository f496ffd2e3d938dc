"""The fused small ops of a decoder layer (`specfork/kernels/layer_ops.cpp`): each equals the
torch ops it replaces to float32 rounding, gives a row the same bits in any call, and runs in
the Model exactly where specfork's low-bit kernels do."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from specfork.model import apply_rope, rms_norm
from specfork.weights import native

pytestmark = pytest.mark.skipif(not native(), reason="the fused ops need AVX-512")


def _rows_alone(fn, x):
    return torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])


def test_rms_norm():
    g = torch.Generator().manual_seed(0)
    for H in (576, 100):                              # a masked tail too
        x, w = torch.randn(7, H, generator=g) * 3, torch.randn(H, generator=g)
        got = torch.ops.specfork.rms_norm(x, w, 1e-5)
        torch.testing.assert_close(got, rms_norm(x, w, 1e-5), atol=1e-5, rtol=1e-5)
        assert torch.equal(got, _rows_alone(lambda r: torch.ops.specfork.rms_norm(r, w, 1e-5), x))


def test_rope_in_place_on_q_and_k_only():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from specfork.model import rope_tables
    g = torch.Generator().manual_seed(1)
    T, H, KVH, D = 5, 9, 3, 64
    rot = LlamaRotaryEmbedding(LlamaConfig(hidden_size=H * D, num_attention_heads=H,
                                           max_position_embeddings=4096))
    cos, sin = rope_tables(rot, torch.zeros(1), torch.tensor([0, 3, 17, 400, 4000]))
    qkv = torch.randn(T, (H + 2 * KVH) * D, generator=g)
    want = apply_rope(qkv[:, :(H + KVH) * D].reshape(T, H + KVH, D), cos, sin)
    got = qkv.clone()
    torch.ops.specfork.rope_(got, cos, sin, H + KVH, D)
    torch.testing.assert_close(got[:, :(H + KVH) * D].view(T, H + KVH, D), want, atol=1e-5,
                               rtol=1e-5)
    assert torch.equal(got[:, (H + KVH) * D:], qkv[:, (H + KVH) * D:])       # v untouched
    one = qkv[2:3].clone()
    torch.ops.specfork.rope_(one, cos[2:3], sin[2:3], H + KVH, D)
    assert torch.equal(one, got[2:3])


def test_silu_mul():
    g = torch.Generator().manual_seed(2)
    gu = torch.randn(6, 2 * 1544, generator=g) * 6        # a masked tail; big arguments
    gu[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 0.0])
    got = torch.ops.specfork.silu_mul(gu)
    a, u = gu.chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(a) * u, atol=1e-6, rtol=1e-5)
    assert torch.isfinite(got).all()
    assert torch.equal(got, _rows_alone(torch.ops.specfork.silu_mul, gu))


@pytest.mark.parametrize("fmt,hidden,fused", [("int4", 128, True), ("int8", 128, True),
                                              ("bfloat16", 128, True), ("int4", 64, False),
                                              ("float32", 128, False)])
def test_where_the_model_fuses(fmt, hidden, fused):
    """Only under specfork's low-bit kernels (int4, int8, bf16) with a head size of a multiple
    of 32; float32 keeps torch's ops (HF's bits)."""
    assert tiny_model(fmt, hidden=hidden).fused_ops == fused
