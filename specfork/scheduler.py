"""Which requests run in the next forward, and how much of each prompt.

Requests queue in arrival order (`waiting`) and join the running batch between steps while the
batch has a place and the pool has room for their prompt. Each step every running request that
is decoding adds its rows (one, or its verify tree); prompts that are still prefilling share a
token budget (`prefill_tokens`) in admission order, so a long prompt is prefilled in chunks and
the requests already decoding keep moving. When the pool runs short the most recently admitted
request is preempted: its blocks are freed and it waits again at the head of the queue, to be
recomputed from its tokens when room returns (vLLM's recompute preemption).
"""
from __future__ import annotations

from collections import deque

PREFILL_TOKENS = 256        # prompt tokens per step while other requests decode
MAX_BATCH = 32


class Scheduler:
    def __init__(self, max_batch: int = MAX_BATCH, prefill_tokens: int = PREFILL_TOKENS):
        self.max_batch, self.prefill_tokens = max_batch, prefill_tokens
        self.waiting: deque = deque()
        self.running: list = []

    def __len__(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req) -> None:
        self.waiting.append(req)

    def admit(self, place) -> list:
        """Move waiting requests into the batch, in order, while `place(req)` finds them room
        (it sets up their branch); the first that does not fit waits, and so do those after it
        (first come, first served)."""
        got = []
        while self.waiting and len(self.running) < self.max_batch:
            req = self.waiting[0]
            if not place(req):
                break
            self.waiting.popleft()
            self.running.append(req)
            got.append(req)
        return got

    def plan(self) -> tuple[list, list[tuple[object, int]]]:
        """(requests decoding this step, [(request, prompt tokens) prefilling this step]). The
        prefill budget is unlimited while nobody decodes: a lone prompt is prefilled whole."""
        decoding = [r for r in self.running if not r.prefilling]
        budget = self.prefill_tokens if decoding else None
        chunks = []
        for r in self.running:
            if not r.prefilling:
                continue
            left = r.target - r.branch.length
            take = left if budget is None else min(left, budget)
            if take <= 0:
                break
            chunks.append((r, take))
            if budget is not None:
                budget -= take
        return decoding, chunks

    def victim(self, keep=None):
        """The request to preempt for room: the most recently admitted one (not `keep`)."""
        for r in reversed(self.running):
            if r is not keep:
                return r
        return None

    def requeue(self, req) -> None:
        """`req` was preempted: it waits at the head of the queue."""
        self.running.remove(req)
        self.waiting.appendleft(req)

    def remove(self, req) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
