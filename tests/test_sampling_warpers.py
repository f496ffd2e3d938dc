import torch
from hypothesis import given, settings, strategies as st
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from specfork.sampling import probs_from_logits, sample


def hf_probs(logits, temperature, top_k, top_p):
    """What `generate(do_sample=True)` samples from: its warpers in its order, then softmax."""
    s = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        s = TopKLogitsWarper(top_k)(None, s)
    if top_p is not None and top_p < 1.0:
        s = TopPLogitsWarper(top_p)(None, s)
    return s.softmax(-1)


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), V=st.integers(1, 64), ties=st.booleans(),
       temperature=st.sampled_from([0.3, 0.7, 1.0, 1.5]),
       top_k=st.one_of(st.none(), st.integers(0, 70)),        # 0: no top-k, as in HF
       top_p=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_matches_hf_warpers(seed, V, ties, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, V, generator=g) * 4
    if ties:  # coarse logits: many exact ties at the top-k / top-p boundaries
        logits = logits.round()
    ref = hf_probs(logits, temperature, top_k, top_p)
    out = probs_from_logits(logits, temperature, top_k, top_p)
    assert out.dtype == torch.float32 and out.shape == (3, V)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert torch.equal(probs_from_logits(logits[1], temperature, top_k, top_p), out[1])  # 1-D


def test_top_k_keeps_ties_and_top_p_keeps_the_best():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 3.0]])
    assert (probs_from_logits(logits, 1.0, top_k=2) > 0).tolist() == [[True, False, True, False,
                                                                       True]]
    one = probs_from_logits(torch.tensor([[5.0, 1.0, 0.0]]), 1.0, top_p=1e-6)
    assert one.tolist() == [[1.0, 0.0, 0.0]]
    # tail mass exactly 1 - top_p is dropped (HF's `<=`): 3 of 4 equal tokens survive
    flat = torch.zeros(1, 4)
    assert torch.equal(probs_from_logits(flat, 1.0, top_p=0.75), hf_probs(flat, 1.0, None, 0.75))
    assert (probs_from_logits(flat, 1.0, top_p=0.75) > 0).sum() == 3


def test_temperature_zero_is_first_argmax():
    p = probs_from_logits(torch.tensor([[1.0, 4.0, 4.0], [9.0, 0.0, 9.0]]), 0.0, top_k=1)
    assert p.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_tiny_temperature_is_the_argmax_not_nan():
    """logits / 1e-45 overflows; the softmax is taken after shifting by the max instead."""
    logits = torch.tensor([[-3.0, -1.0, -2.0], [2.0, 5.0, 1.0]])
    assert probs_from_logits(logits, 1e-45).tolist() == [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]]
    assert torch.equal(probs_from_logits(logits, 0.5), (logits / 0.5).softmax(-1))


def test_sample_follows_probs_and_generator():
    p = torch.tensor([0.0, 0.25, 0.0, 0.75])
    draws = [sample(p, torch.Generator().manual_seed(s)) for s in range(400)]
    assert set(draws) == {1, 3} and 240 < draws.count(3) < 360
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert [sample(p, g1) for _ in range(20)] == [sample(p, g2) for _ in range(20)]
