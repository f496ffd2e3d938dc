"""Token tree: the drafters' paths merged into one trie for a single target forward.

Node 0 is `root`, the last emitted token (it has no K/V yet, so it is verified too). Shared
prefixes are stored once, so the target scores each distinct continuation once, but every path
keeps its own *proposal* at every step: sampled paths are the independent draws that lossless
multi-draft verification consumes one by one, even where two of them picked the same token.
Nodes are numbered in creation order, so a parent always precedes its children.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.types import DraftPath

Proposal = tuple[int, "torch.Tensor | None", str]   # (child node, q row [V] or None, drafter)


@dataclass
class TokenTree:
    tokens: torch.Tensor                      # [T] long
    parent: torch.Tensor                      # [T] long, root = -1
    depth: torch.Tensor                       # [T] long, root = 0
    children: list[list[int]]                 # per node, in creation order
    proposals: list[list[Proposal]]           # per node, one entry per path through u -> child
    node_drafters: list[set[str]]             # who proposed each node (root: nobody)
    child_of: list[dict[int, int]]            # per node: token -> child node

    @staticmethod
    def build(root: int, paths: list[DraftPath], budget: int) -> TokenTree:
        """Merge `paths` in order; stop adding anything once `budget` non-root nodes exist.

        The cut goes at the first step that finds the budget full, whether or not that step
        would have reused an existing node: a step is kept or dropped by what came before it,
        never by its own token, which keeps the proposals that survive unbiased samples.
        """
        tokens, parent, depth = [root], [-1], [0]
        children: list[list[int]] = [[]]
        proposals: list[list[Proposal]] = [[]]
        drafters: list[set[str]] = [set()]
        child_of: list[dict[int, int]] = [{}]
        for path in paths:
            if path.q is not None and path.q.shape[0] < len(path.tokens):
                raise ValueError(f"DraftPath from {path.drafter!r}: q has {path.q.shape[0]} rows "
                                 f"for {len(path.tokens)} tokens")
            u = 0
            for i, tok in enumerate(path.tokens):
                if len(tokens) - 1 >= budget:
                    break
                tok = int(tok)
                c = child_of[u].get(tok)
                if c is None:
                    c = len(tokens)
                    tokens.append(tok)
                    parent.append(u)
                    depth.append(depth[u] + 1)
                    children.append([])
                    proposals.append([])
                    drafters.append(set())
                    child_of.append({})
                    children[u].append(c)
                    child_of[u][tok] = c
                proposals[u].append((c, None if path.q is None else path.q[i], path.drafter))
                drafters[c].add(path.drafter)
                u = c
        return TokenTree(torch.tensor(tokens, dtype=torch.long),
                         torch.tensor(parent, dtype=torch.long),
                         torch.tensor(depth, dtype=torch.long),
                         children, proposals, drafters, child_of)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def ancestor_mask(self) -> torch.Tensor:
        """`[T, T]` bool, True where j is i or an ancestor of i: one scatter per tree level."""
        T = len(self)
        mask = torch.eye(T, dtype=torch.bool)
        rows = torch.arange(T)
        anc = self.parent.clone()
        while True:
            live = anc >= 0
            if not bool(live.any()):
                return mask
            mask[rows[live], anc[live]] = True
            anc = torch.where(live, self.parent[anc.clamp(min=0)], anc)

    def positions(self, n: int) -> torch.Tensor:
        """`[T]` absolute positions: root sits right after the n committed tokens."""
        return n + self.depth

    def path_to(self, node: int) -> list[int]:
        """Node indices root .. node."""
        parent = self.parent.tolist()
        out = [node]
        while parent[out[-1]] >= 0:
            out.append(parent[out[-1]])
        return out[::-1]

    def leaf_paths(self) -> list[list[int]]:
        """One root -> leaf node list per leaf, leaves in creation order."""
        return [self.path_to(u) for u, ch in enumerate(self.children) if not ch]
