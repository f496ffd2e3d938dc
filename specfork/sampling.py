"""Target warping and sampling, bit-for-bit the Hugging Face way.

Speculative sampling is lossless only relative to *one* distribution; drafters that sample and
the verifier must both warp with this function so that p and q live under the same warping,
and so that a speculative run samples from exactly what `model.generate(do_sample=True)` would.
"""
from __future__ import annotations

import torch


def probs_from_logits(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                      top_p: float | None = None) -> torch.Tensor:
    """`[..., V]` logits -> `[..., V]` float32 probabilities.

    Order and ties as HF's TemperatureLogitsWarper -> TopKLogitsWarper -> TopPLogitsWarper with
    min_tokens_to_keep=1: top-k keeps every token tied with the k-th score; top-p drops the
    low-probability tail whose cumulative mass is <= 1 - top_p, always keeping the best token.
    `top_k` None/0 and `top_p` None/1.0 disable that warper (as HF's generation config does).
    `temperature == 0` is greedy: one-hot at the first argmax, the limit of temperature -> 0.
    """
    scores = logits.float()
    if temperature == 0.0:
        return torch.zeros_like(scores).scatter_(-1, scores.argmax(-1, keepdim=True), 1.0)
    if temperature != 1.0:
        t = scores / temperature
        if not bool(torch.isfinite(t).all()):        # a tiny temperature overflowed: shift
            t = (scores - scores.amax(-1, keepdim=True)) / temperature   # first (same softmax)
        scores = t
    if top_k:
        k = min(max(int(top_k), 1), scores.shape[-1])
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False                       # min_tokens_to_keep = 1
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """One token id from a `[V]` distribution (need not be normalized)."""
    if generator is not None and probs.device != generator.device:
        probs = probs.to(generator.device)          # a seeded CPU generator, a GPU model
    return int(torch.multinomial(probs, 1, generator=generator).item())
