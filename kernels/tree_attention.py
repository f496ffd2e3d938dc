"""Tree attention: every tree token sees the committed prefix (paged) plus its own ancestors.

Shapes: q `[T, H, D]`; one layer's paged cache `[num_blocks, block_size, KVH, D]`; block table
`[>= ceil(prefix_len / block_size)]` int; the tree tokens' own k/v `[T, KVH, D]`; `tree_mask`
`[T, T]` bool, True where query i may see tree token j (its ancestors and itself).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_prefix(cache: torch.Tensor, block_table: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Paged `[num_blocks, bs, KVH, D]` -> contiguous `[prefix_len, KVH, D]`."""
    nb = -(-prefix_len // cache.shape[1])
    return cache[block_table[:nb].long()].flatten(0, 1)[:prefix_len]


def tree_attention_torch(q: torch.Tensor, k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                         k_tree: torch.Tensor, v_tree: torch.Tensor,
                         tree_mask: torch.Tensor | None, scale: float | None = None) -> torch.Tensor:
    """CPU path over a gathered prefix: one SDPA call, mask = [all prefix | ancestors].
    `tree_mask=None` means every tree token sees every other (a single token, or no tree)."""
    T, L = q.shape[0], k_prefix.shape[0]
    k = torch.cat([k_prefix, k_tree]).transpose(0, 1)        # [KVH, L+T, D]
    v = torch.cat([v_prefix, v_tree]).transpose(0, 1)
    mask = None
    if tree_mask is not None and T > 1:
        mask = torch.ones(T, L + T, dtype=torch.bool, device=q.device)
        mask[:, L:] = tree_mask
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[1] != k.shape[0])
    return out.transpose(0, 1)                                 # [T, H, D]


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   block_table: torch.Tensor, prefix_len: int, k_tree: torch.Tensor,
                   v_tree: torch.Tensor, tree_mask: torch.Tensor | None,
                   scale: float | None = None) -> torch.Tensor:
    """Paged tree attention; the torch path (gather + SDPA) on CPU."""
    k_prefix = gather_prefix(k_cache, block_table, prefix_len)
    v_prefix = gather_prefix(v_cache, block_table, prefix_len)
    return tree_attention_torch(q, k_prefix, v_prefix, k_tree, v_tree, tree_mask, scale)
