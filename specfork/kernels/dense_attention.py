"""Attention without the cascade, for the steps where one plain op is cheapest: a decode step
(one query, two bmm's), new tokens that each see their own subset of a short prefix (two bmm's
under an additive mask), and a prefill over an empty prefix (fused causal SDPA).

Shapes as in `tree_attention.py`: q `[T, H, D]`, K/V `[*, KVH, D]`; query head h reads kv head
h // G, G = H // KVH. The first two fold the G heads of a kv head into rows (no K/V repeat).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .tree_attention import _group_rows, _ungroup_rows


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     k2: torch.Tensor | None = None, v2: torch.Tensor | None = None):
    """One query `[1, H, D]` over keys/values `[L, KVH, D]` (and, if given, `k2`/`v2`
    `[L2, KVH, D]` after them) -> `[1, H, D]`; the G query heads of a kv head are rows of one
    bmm (GQA without repeating K/V). Two segments let the long one be a view of the pool (one
    run of slots) and only the short rest be gathered."""
    KVH, D = k.shape[1:]
    qg = _group_rows(q, KVH)
    s = torch.bmm(qg, k.permute(1, 2, 0))                                # [KVH, G, L]
    if k2 is not None:
        s = torch.cat((s, torch.bmm(qg, k2.permute(1, 2, 0))), dim=-1)  # [KVH, G, L + L2]
    p = torch.softmax(s.mul_(scale), dim=-1, dtype=torch.float32).to(v.dtype)
    if k2 is None:
        return torch.bmm(p, v.transpose(0, 1)).view(1, -1, D)
    L = k.shape[0]
    o = torch.bmm(p[..., :L], v.transpose(0, 1))
    return o.baddbmm_(p[..., L:], v2.transpose(0, 1)).view(1, -1, D)


def masked_attention(q, k_prefix, v_prefix, k_new, v_new, bias, scale):
    """Queries that each see their own subset of a shared prefix (beams, draft paths over a KV
    tree): q `[T, H, D]`, prefix K/V `[L, KVH, D]`, new K/V `[T, KVH, D]`, bias `[T*G, L+T]`
    (0 / -inf, row t*G+g = head g of token t's kv group). Two bmm's with the G heads of a kv
    head as rows (no K/V repeat, no SDPA mask path)."""
    KVH = k_new.shape[1]
    k = torch.cat([k_prefix, k_new]).permute(1, 2, 0)                 # [KVH, D, L+T]
    v = torch.cat([v_prefix, v_new]).transpose(0, 1)                  # [KVH, L+T, D]
    s = torch.baddbmm(bias, _group_rows(q, KVH), k, alpha=scale)      # [KVH, T*G, L+T]
    p = torch.softmax(s, dim=-1, dtype=torch.float32)
    return _ungroup_rows(torch.bmm(p.to(v.dtype), v), q.shape[0])


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Prefill over an empty prefix: q `[T, H, D]`, k/v `[T, KVH, D]` -> `[T, H, D]` through
    4-D `is_causal` SDPA, which the fused kernels (flash, memory-efficient) take, so no T x T
    score matrix is materialised (a 3-D input with a dense mask falls to the math kernel: 2 GiB
    per layer for a 4k prompt on Llama-3-8B). K/V are repeated per query head: `enable_gqa`
    would rule out the memory-efficient kernel (fp32 on CUDA), and the copy is T*H*D."""
    G = q.shape[1] // k.shape[1]
    qh = q.transpose(0, 1)[None]                                      # [1, H, T, D]
    kh = k.transpose(0, 1).repeat_interleave(G, dim=0)[None]
    vh = v.transpose(0, 1).repeat_interleave(G, dim=0)[None]
    o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
    return o[0].transpose(0, 1)
