"""Monte Carlo tree search over a target model's continuations, on KV-tree forks.

Every tree node is a `Session` context forked from its parent (O(1), the prefix shared); a
node's children are its top-B next tokens (B = branching), computed together in one forward; a
new child is valued by a greedy rollout to the depth limit (all B rollouts in one forward per
token, on forks released right after); value = mean target log-prob of the path + rollout.
Selection is PUCT with the target's probabilities as priors; the answer is the most-visited
path. The search ignores EOS: a path is `depth` tokens of the target's continuation.

    s = Session.from_decoder(dec)
    root = s.start("Write a haiku about forks.")
    res = mcts(s, root, branching=4, depth=12, simulations=40)
    s.release(root)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specfork.errors import SpecforkError
from specfork.session import Handle, Session


@dataclass
class MCTSResult:
    best_tokens: list[int]          # the most-visited path below the root, root to leaf
    best_mean_logprob: float        # mean target log-prob of best_tokens
    nodes: int                      # tree nodes at the end, root included
    expanded: list[list[int]]       # each expanded node's tokens below the root, in order
    forks: int                      # session forks the search made (rollout forks included)
    forwards: int                   # target forwards the search ran
    kv_peak_bytes: int              # pool peak during the search (root's blocks included)
    kv_peak_blocks: int
    kv_blocks_leaked: int           # blocks still held after the search beyond the root's


class Node:
    __slots__ = ("h", "depth", "logps", "prior", "children", "n", "w")

    def __init__(self, h: Handle, depth: int, logps: list[float], prior: float):
        self.h, self.depth, self.logps, self.prior = h, depth, logps, prior
        self.children: list[Node] = []
        self.n, self.w = 0, 0.0                     # visits, total value


def puct(parent: Node, c_puct: float) -> Node:
    """The child maximising mean value + c_puct * prior * sqrt(N_parent) / (1 + N_child)."""
    sq = math.sqrt(parent.n)
    return max(parent.children, key=lambda k: (k.w / k.n if k.n else 0.0)
               + c_puct * k.prior * sq / (1 + k.n))


def expand(sess: Session, node: Node, branching: int) -> list[Node]:
    """B children of `node`: one fork each, their tokens computed in one forward."""
    lp = torch.log_softmax(sess.logits(node.h).float(), -1)
    top = torch.topk(lp, branching)
    kids = []
    for t, l in zip(top.indices.tolist(), top.values.tolist()):
        h = sess.extend(sess.fork(node.h), [t])
        kids.append(Node(h, node.depth + 1, node.logps + [l], math.exp(l)))
    sess.flush([k.h for k in kids])
    node.children = kids
    return kids


def rollout_values(sess: Session, nodes: list[Node], depth: int) -> list[float]:
    """Mean log-prob of each node's path plus its greedy rollout to `depth` tokens, all nodes'
    rollouts in one forward per token; the rollout forks are released before returning."""
    lps = [list(n.logps) for n in nodes]
    live = [i for i, n in enumerate(nodes) if n.depth < depth]
    forks = {i: sess.fork(nodes[i].h) for i in live}
    try:
        while live:
            sess.flush([forks[i] for i in live])
            for i in live:
                lp = torch.log_softmax(forks[i].logits.float(), -1)
                t = int(lp.argmax())
                lps[i].append(float(lp[t]))
                sess.extend(forks[i], [t])
            live = [i for i in live if len(lps[i]) < depth]
    finally:
        for f in forks.values():
            sess.release(f)
    return [sum(x) / len(x) for x in lps]


def _release_tree(sess: Session, root: Node) -> int:
    """Release every node's context but the root's; returns the number of nodes."""
    nodes, stack = 0, [root]
    while stack:
        n = stack.pop()
        nodes += 1
        stack += n.children
        if n is not root:
            sess.release(n.h)
    return nodes


def mcts(sess: Session, root: Handle, branching: int = 4, depth: int = 12,
         simulations: int = 40, c_puct: float = 1.0) -> MCTSResult:
    """Search the continuations of context `root` (which stays the caller's, unchanged).
    Every context the search forks is released before it returns, also on error. The pool's
    peak counter is reset once the root is computed, so `kv_peak_bytes` is this search's."""
    if branching < 1 or depth < 1 or simulations < 1 or not c_puct >= 0:
        raise SpecforkError(f"mcts needs branching, depth, simulations >= 1 and c_puct >= 0, "
                            f"got {branching}, {depth}, {simulations}, {c_puct}")
    if branching > sess.model.vocab_size:
        raise SpecforkError(f"branching {branching} exceeds the vocabulary "
                            f"({sess.model.vocab_size})")
    sess.logits(root)                               # the root's pending tokens, before the peak
    base = len(root.tokens)
    used0, forks0, fw0 = sess.pool.used_blocks, sess.forks, sess.forwards
    sess.pool.reset_peak()
    top = Node(root, 0, [], 1.0)
    expanded: list[list[int]] = []
    try:
        for _ in range(simulations):
            path, node = [top], top
            while node.children:
                node = puct(node, c_puct)
                path.append(node)
            if node.depth < depth:
                kids = expand(sess, node, branching)
                vals = rollout_values(sess, kids, depth)
                for k, v in zip(kids, vals):
                    k.n, k.w = 1, v
                value = max(vals)
                expanded.append(node.h.tokens[base:])
            else:                                   # a leaf at the depth limit: its own value
                value = sum(node.logps) / len(node.logps)
            for p in path:
                p.n += 1
                p.w += value
        leaf = top
        while leaf.children:
            leaf = max(leaf.children, key=lambda k: k.n)
        best, mean = leaf.h.tokens[base:], sum(leaf.logps) / len(leaf.logps)
    finally:
        nodes = _release_tree(sess, top)
    return MCTSResult(best_tokens=best, best_mean_logprob=mean, nodes=nodes, expanded=expanded,
                      forks=sess.forks - forks0, forwards=sess.forwards - fw0,
                      kv_peak_bytes=sess.pool.peak_bytes, kv_peak_blocks=sess.pool.peak_blocks,
                      kv_blocks_leaked=sess.pool.used_blocks - used0)
