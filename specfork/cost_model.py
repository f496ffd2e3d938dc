"""What one target forward costs as a function of the verify tree's size, timed on this machine.

Speculation pays only when (1 + expected accepted tokens) / (draft time + verify time) beats
one token per plain decode step, so the adaptive controller needs the verify time of every tree
size it might choose. On a CPU it is far from linear (a 13-row forward can cost about what one
row costs, or twice that, depending on the matmul kernels), so it is measured, not assumed: once
per model and process, chain trees of a few sizes over a short prefix, the fastest of a few
repetitions each, cached on the `Model`. A running request refines it with what its own steps
measure, as two additive terms:
- `offset`, learnt from plain decode steps: the prefix-length share of a step, which grows as
  the request does (reset per request);
- `extra`, learnt from steps that verified a tree: what such a step costs beyond a decode step
  of the same rows, that the timed forwards leave out (building the token tree, the verifier,
  freeing the rejected forks, adopting the kept one). Beside a fast low-bit target's short
  decode step it can turn a tree that looked worth its rows into a loss; it is a property of
  the machine and the drafter mix, so it carries over from request to request.
"""
from __future__ import annotations

import time
from bisect import bisect_left

import torch

from specfork.attention import AttnMeta
from specfork.kv_tree import KVTree

SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)     # tree rows timed (root included)
PREFIX = 128                                     # prefix tokens under the timed trees


class CostModel:
    """`seconds(rows)`: one verify forward of a `rows`-row tree (the root included; 1 row is a
    plain decode step), interpolated between timed sizes, plus the online offset."""

    def __init__(self, table: dict[int, float], rate: float = 0.2):
        self.sizes = sorted(table)
        self.table = dict(table)
        self.rate = rate                          # EMA weight of one measured step
        self.offset = 0.0                         # this request's share on every step
        self.extra = 0.0                          # a tree step's own bookkeeping

    def base(self, rows: float) -> float:
        s, t = self.sizes, self.table
        if rows <= s[0]:
            return t[s[0]]
        j = min(bisect_left(s, rows), len(s) - 1)  # beyond the largest: the last slope
        a, b = s[j - 1], s[j]
        return t[a] + (t[b] - t[a]) * (rows - a) / (b - a)

    def seconds(self, rows: float, tree: bool | None = None) -> float:
        """A step of `rows` rows; `tree`: it verifies a draft (default: rows > 1)."""
        tree = rows > 1 if tree is None else tree
        return max(1e-6, self.base(rows) + self.offset + (self.extra if tree else 0.0))

    def observe(self, rows: int, seconds: float, tree: bool | None = None) -> None:
        """A step of `rows` rows took `seconds` (verify forward and its bookkeeping, drafting
        not included); `tree` as in `seconds`."""
        tree = rows > 1 if tree is None else tree
        err = seconds - self.seconds(rows, tree)
        if tree:
            self.extra += self.rate * err
        else:
            self.offset += self.rate * err

    def reset(self) -> None:
        """A new request: its prefix starts short again (a tree step's extra stays)."""
        self.offset = 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def calibrate(model, kv: KVTree, max_rows: int = SIZES[-1], reps: int = 3) -> dict[int, float]:
    """Seconds per forward of a chain tree of each size up to `max_rows` (and at least 2) over a
    `PREFIX`-token prefix in `kv` (released after); the fastest of `reps` after one warm-up."""
    dev = model.device
    room = kv.pool.num_blocks * kv.pool.block_size
    prefix = max(1, min(PREFIX, room // 4))
    sizes = [n for n in SIZES if n <= max(2, max_rows) and prefix + n <= room // 2] or [1, 2]
    B = kv.new_branch()
    table = {}
    try:
        slots = kv.append(B, prefix)
        model.forward(torch.zeros(prefix, dtype=torch.long, device=dev),
                      torch.arange(prefix, device=dev), kv.pool,
                      AttnMeta.prefill(model, slots[:0], slots),
                      logits_idx=slice(prefix - 1, prefix))
        for n in sizes:
            toks = torch.ones(n, dtype=torch.long, device=dev)
            pos = torch.arange(prefix, prefix + n, device=dev)
            mask = torch.ones(n, n, dtype=torch.bool).tril()
            best = float("inf")
            for r in range(reps + 1):
                F = kv.fork(B)
                try:
                    _sync(dev)
                    t0 = time.perf_counter()
                    meta = AttnMeta.tree(model, kv.slots(B), mask, kv.append(F, n),
                                         torch.arange(n))
                    model.forward(toks, pos, kv.pool, meta).float().argmax(-1).tolist()
                    _sync(dev)
                    if r:
                        best = min(best, time.perf_counter() - t0)
                finally:
                    kv.release(F)
            table[n] = best
    finally:
        kv.release(B)
    return table


def for_model(model, kv: KVTree, max_rows: int) -> CostModel:
    """The model's cost table, timed at first use in this process and kept on the model (a
    decoder wanting larger trees than timed so far times the rest)."""
    table = getattr(model, "_verify_cost", None)
    if table is None or max(table) < min(max_rows, SIZES[-1]):
        table = {**(table or {}), **calibrate(model, kv, max_rows)}
        model._verify_cost = table
    return CostModel(table)
