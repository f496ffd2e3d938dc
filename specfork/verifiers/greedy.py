"""Greedy verification: accept the longest tree path the target's argmax agrees with."""
from __future__ import annotations

import torch

from specfork.sampling import argmax
from specfork.token_tree import TokenTree


def verify_greedy(tree: TokenTree, logits: torch.Tensor) -> tuple[list[int], int]:
    """`logits [T, V]` -> (accepted node path root .. deepest, next token).

    Ties break as `torch.argmax` does (first maximum), the same token HF greedy search emits,
    so a greedy speculative run reproduces `generate(do_sample=False)` token for token.
    """
    best = argmax(logits).tolist()                  # [T]: one sync, then plain python
    path = [0]
    while (c := tree.child_of[path[-1]].get(best[path[-1]])) is not None:
        path.append(c)
    return path, best[path[-1]]
