"""Whether a batch speculates at all, learned from measured steps (vLLM's
`speculative_disable_by_batch_size`, but measured rather than set).

Each request's `DraftController` plans its own tree against the rest of the batch, from cost
tables and acceptance estimates; what those miss in a batch (each tree's own attention and
fork bookkeeping, drafters warming up, probes) only the steps themselves show. So per batch
size bucket (decoding requests: 2-3, 4-7, 8-15, 16-31, 32+) the gate keeps the tokens per
second of steps run with speculation and of steps run without, and lets the batch speculate
while that arm is ahead. The arm behind still runs one step in `EXPLORE`, so a change in the
text (a phase that repeats itself) is noticed. A lone request is never gated: its controller
weighs its own plans against plain decoding already.
"""
from __future__ import annotations

EXPLORE = 16            # one step in this many runs the arm that is behind
MIN_STEPS = 4           # steps each arm runs in a bucket before the gate compares them
DECAY = 0.8             # weight of the past per new step in an arm's rate


def bucket(decoding: int) -> int:
    """2-3 -> 1, 4-7 -> 2, 8-15 -> 3, ...; 0 for a lone request."""
    return 0 if decoding < 2 else min(5, decoding.bit_length() - 1)


class SpecGate:
    def __init__(self):
        # bucket -> {True/False: [steps, decayed tokens, decayed seconds]}
        self.arms: dict[int, dict[bool, list[float]]] = {}
        self.count: dict[int, int] = {}

    def allow(self, decoding: int) -> bool:
        """Speculate this step (with `decoding` requests decoding)?"""
        b = bucket(decoding)
        if b == 0:
            return True
        arms = self.arms.setdefault(b, {True: [0, 0.0, 0.0], False: [0, 0.0, 0.0]})
        n = self.count[b] = self.count.get(b, 0) + 1
        if arms[True][0] < MIN_STEPS or arms[False][0] < MIN_STEPS:
            return arms[True][0] <= arms[False][0]
        best = self.rate(b, True) >= self.rate(b, False)
        return best if n % EXPLORE else not best

    def record(self, decoding: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step without prefill rows: how many tokens it emitted in how long."""
        b = bucket(decoding)
        if b == 0 or b not in self.arms or seconds <= 0:
            return
        a = self.arms[b][speculated]
        a[0] += 1
        a[1] = DECAY * a[1] + tokens
        a[2] = DECAY * a[2] + seconds

    def rate(self, b: int, speculated: bool) -> float:
        _, t, s = self.arms[b][speculated]
        return t / s if s else 0.0

    def stats(self) -> dict:
        return {f"{2 ** b}+": {"steps_spec": a[True][0], "steps_plain": a[False][0],
                               "tok_s_spec": round(self.rate(b, True), 1),
                               "tok_s_plain": round(self.rate(b, False), 1)}
                for b, a in sorted(self.arms.items())}
