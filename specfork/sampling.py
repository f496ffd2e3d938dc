"""Target warping and sampling, bit-for-bit the Hugging Face way.

Speculative sampling is lossless only relative to *one* distribution; drafters that sample and
the verifier must both warp with this function so that p and q live under the same warping,
and so that a speculative run samples from exactly what `model.generate(do_sample=True)` would.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from specfork.errors import SpecforkError
from specfork.types import SamplingParams


def check_sampling(max_new_tokens: int, temperature: float, top_p=None, top_k=None,
                   seed: int | None = None) -> None:
    """The request's generation settings, checked once for every entry point. `top_k` None or 0
    and `top_p` None or 1.0 disable that filter, as in Hugging Face `generate`."""
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise SpecforkError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
        raise SpecforkError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise SpecforkError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
        raise SpecforkError(f"top_k must be an integer >= 0 (0: no top-k), got {top_k}")
    if seed is not None and not -2 ** 63 <= seed < 2 ** 64:        # what torch accepts
        raise SpecforkError(f"seed must be in [-2**63, 2**64), got {seed}")


def sampling_params(temperature: float = 0.0, top_p: float | None = None,
                    top_k: int | None = None, seed: int | None = None,
                    generator: torch.Generator | None = None) -> SamplingParams:
    """A request's SamplingParams; `seed` makes a CPU generator (a given `generator` wins)."""
    if generator is None and seed is not None:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    return SamplingParams(temperature=float(temperature), top_k=top_k or None, top_p=top_p,
                          generator=generator)


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


def argmax(logits: torch.Tensor) -> torch.Tensor | np.ndarray:
    """Index of the first maximum along the last axis (torch's tie rule). A CPU float32 row
    goes through numpy: torch's CPU argmax over a 49K vocabulary takes ~0.1 ms, about 1% of a
    low-bit decode step, numpy's a tenth of that."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1)
    return logits.argmax(-1)


def pick(logits: torch.Tensor, sp: SamplingParams) -> int:
    """The next token from one position's logits `[V]`: argmax when greedy, else a draw from the
    warped distribution (the one rule of every loop that emits a token without a verifier)."""
    if sp.greedy:
        return int(argmax(logits))
    return sample(probs_from_logits(logits.float(), sp.temperature, sp.top_k, sp.top_p),
                  sp.generator)
