"""Lossless multi-draft speculative sampling (SpecInfer's multi-step speculative sampling).

At node u the target distribution p is tried against u's proposals in order: proposal x ~ q is
accepted with probability min(1, p(x)/q(x)); on rejection p becomes normalize(max(0, p - q)).
Step by step, P(emit y) = min(p(y), q(y)) + P(reject) * residual(y) = p(y), so whatever the
drafters propose, the emitted token is distributed exactly as p -- provided each sampled
proposal is a fresh draw from its q given the prefix (independent of the other proposals at u),
which is what i.i.d. sampled paths give. Deterministic proposals (q=None) are one-hot q.
"""
from __future__ import annotations

import torch

from specfork.types import SamplingParams
from specfork.sampling import probs_from_logits, sample
from specfork.token_tree import TokenTree
from specfork.verifiers.greedy import verify_greedy


def residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor | None:
    """normalize(max(0, p - q)) after proposal x ~ q was rejected; None when no mass is left."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q.to(p.device, p.dtype)).clamp_(min=0.0)
    mass = r.sum()
    return r / mass if float(mass) > 0.0 else None


def verify_sampling(tree: TokenTree, logits: torch.Tensor,
                    params: SamplingParams) -> tuple[list[int], int]:
    """`logits [T, V]` -> (accepted node path root .. deepest, next token ~ target).

    Every random number comes from `params.generator`, so a seeded step is reproducible.
    """
    if params.greedy:
        return verify_greedy(tree, logits)
    gen = params.generator
    dev = gen.device if gen is not None else logits.device
    tokens = tree.tokens.tolist()
    path = [0]
    while True:
        u = path[-1]
        p = probs_from_logits(logits[u], params.temperature, params.top_k, params.top_p)
        for c, q, _ in tree.proposals[u]:
            x = tokens[c]
            qx = 1.0 if q is None else float(q[x])
            if qx <= 0.0:
                # x ~ q with q(x) = 0 cannot happen; the drafter's q is not what it sampled
                # from. Skipping the entry leaves p untouched, which stays exact for the rest.
                continue
            if float(torch.rand((), generator=gen, device=dev)) * qx < float(p[x]):
                path.append(c)
                break
            r = residual(p, q, x)
            # No mass left means p <= q everywhere, i.e. p == q: that rejection had probability
            # 0 and only rounding got us here, so keeping p is as good as any choice.
            p = p if r is None else r
        else:
            return path, sample(p, gen)
