"""Adaptive drafting: each step, which drafters draft and how deep, chosen to maximise expected
tokens per second from what this request has measured so far; speculation off when nothing pays.

A plan gives each drafter a depth (0: it does not draft this step). Its value:

    rate(plan) = (1 + kappa * E[accepted]) / (draft seconds + verify seconds(tree rows))

- E[accepted] = sum over depths k of P(some drafter in the plan has its k-th token accepted),
  taking drafters as independent, each one's chance the product of its per-depth acceptance
  rates; `kappa` (measured over the request: accepted / predicted) corrects that guess.
- Acceptance rates are decayed counts (`decay` per step), so they follow the text: a copying
  phase lifts n-gram lookup, free prose drops it.
- Draft seconds are each drafter's measured propose + observe time; verify seconds come from the
  `CostModel` (timed tree sizes plus the request's own offset). Tree rows are each drafter's
  measured paths (or nodes) per depth times the depth.
- The empty plan is plain decoding: one token for a one-row forward.
- The path budget (how many paths the chosen path drafters share, 1 .. `num_paths`) is planned
  too, with acceptance kept per width (the best of a drafter's first w paths): where each row
  costs a real share of a decode step (fp32 on a 2-core CPU) a second and third path rarely
  earn their rows, and where rows are nearly free (a GPU, AMX bf16) they may.

Drafters that cost next to nothing (n-gram lookup: `cheap`) draft every step even when they are
not verified, and are scored against the tokens the target emitted ("shadow" scoring), so they
come back as soon as the text starts to repeat. A costly drafter left out of the plan for `probe`
steps drafts (and is verified) on the next one, so its estimate cannot go stale for ever; each
probe after which it is still not worth its cost doubles that wait (up to `PROBE_MAX` steps),
so a drafter that never pays (a slow draft beside a fast low-bit target) costs ever less.
"""
from __future__ import annotations

import copy
from itertools import combinations

PRIOR = (1.0, 1.0)               # Beta prior of each depth's acceptance (accepted, rejected)
DECAY = 0.9                      # weight of past observations per new one
PROBE = 8                        # steps a costly drafter may stay out before it is tried again
PROBE_MAX = 128                  # the longest wait, after probes that did not pay
KAPPA = (0.1, 2.0)               # bounds of the realised / predicted acceptance correction
CHEAP = 0.02                     # drafting under this share of a plain step: always shadowed
READ_MIN = 16                    # a drafter's catch-up read this long is costed on its own


def matched(paths: list[list[int]], emitted: list[int]) -> tuple[int, int]:
    """(longest common prefix of any path with the emitted tokens, longest path)."""
    best = 0
    for p in paths:
        m = 0
        for a, b in zip(p, emitted):
            if a != b:
                break
            m += 1
        best = max(best, m)
    return best, max((len(p) for p in paths), default=0)


class _Track:
    """One drafter's measured behaviour within a request. A path drafter's acceptance is kept
    per width w (its first w paths: the best match among them), for w up to the path budget,
    so the controller can weigh a narrower tree (fewer rows) against a wider one."""

    def __init__(self, depth: int, tree: bool, widths: int = 1):
        self.max_depth, self.tree = depth, tree
        self.widths = 1 if tree else max(1, widths)
        # [w][k]: at width w (1-based), depth k (index 0 unused)
        self.acc = [[PRIOR[0]] * (depth + 1) for _ in range(self.widths + 1)]
        self.rej = [[PRIOR[1]] * (depth + 1) for _ in range(self.widths + 1)]
        self.hit = 1.0                            # P(it proposes anything)
        self.width = [float(w) for w in range(self.widths + 1)]   # [w]: rows per depth when
        #                                           asked for w paths (a tree: nodes per depth)
        self.seconds = 0.0                        # propose + observe per step (path
        #                                           drafters: per depth drafted)
        self.timed = False
        self.idle = 0                             # steps since it last drafted verified
        self.gap = 0                              # steps it may stay out (set by the controller)
        self.probed = False                       # it drafts this step only as a probe
        self.read_rate = 0.0                      # seconds per token of a long catch-up read
        self.read_timed = False

    def read_cost(self, tokens: int) -> float | None:
        """Seconds its catch-up read of `tokens` costs before it drafts (a model draft that
        has not seen the prompt, or has sat out some steps; short reads are part of a step's
        cost); None while no long read has been timed."""
        if tokens < READ_MIN:
            return 0.0
        return tokens * self.read_rate if self.read_timed else None

    def _w(self, share: int) -> int:
        return max(1, min(share, self.widths))

    def chance(self, depth: int, share: int = 1) -> list[float]:
        """P(its k-th token is accepted) for k = 1..depth, asked for `share` paths."""
        acc, rej = self.acc[self._w(share)], self.rej[self._w(share)]
        out, p = [], self.hit
        for k in range(1, min(depth, self.max_depth) + 1):
            p *= acc[k] / (acc[k] + rej[k])
            out.append(p)
        return out

    def rows(self, share: int = 1) -> float:
        """Tree rows per depth it adds when it proposes, asked for `share` paths."""
        return self.width[self._w(share)]

    def score(self, paths: list[list[int]], emitted: list[int], asked: int = 0) -> None:
        """`paths` (best first) against the `emitted` tokens; `asked`: the paths it was asked
        for (widths beyond it are not learnt from this step; 0: all)."""
        self.hit = DECAY * self.hit + (1 - DECAY) * (1.0 if paths else 0.0)
        if not paths:
            return
        top = self.widths if self.tree or not asked else min(self.widths, asked)
        for w in range(1, top + 1):
            m, longest = matched(paths if self.tree else paths[:w], emitted)
            if not self.tree:
                self.width[w] = DECAY * self.width[w] + (1 - DECAY) * min(w, len(paths))
            acc, rej = self.acc[w], self.rej[w]
            for k in range(1, min(m + 1, longest, len(emitted), self.max_depth) + 1):
                acc[k] = DECAY * acc[k] + (k <= m)
                rej[k] = DECAY * rej[k] + (k > m)

    def cost(self, depth: int) -> float:
        """Seconds a step at `depth` costs it (a model drafter runs one forward per depth)."""
        return self.seconds if self.tree else self.seconds * depth

    def time(self, seconds: float, paths: list[list[int]]) -> None:
        if not self.tree:
            seconds /= max([1] + [len(p) for p in paths])
        self.seconds = seconds if not self.timed else DECAY * self.seconds + (1 - DECAY) * seconds
        self.timed = True


def shares(budget: int, chosen: list[int]) -> dict[int, int]:
    """The path budget split over the chosen path drafters in order, as evenly as it goes
    (what `Request._propose` asks each for)."""
    out, left, k = {}, budget, len(chosen)
    for i in chosen:
        out[i] = -(-left // k)
        left -= out[i]
        k -= 1
    return out


class DraftController:
    """Per-request plans for `drafters` (path drafters up to `draft_len` deep and sharing up
    to `num_paths` paths; tree drafters, with `tree_tokens` and `depth`, on or off) under
    `cost` (a `CostModel`)."""

    def __init__(self, drafters: list, draft_len: int, cost, probe: int = PROBE,
                 num_paths: int = 1):
        self.drafters, self.draft_len, self.cost, self.probe = drafters, draft_len, cost, probe
        self.num_paths = max(1, num_paths)
        self.budget = self.num_paths              # the path budget of the last plan
        self.asked = [0] * len(drafters)          # paths each drafter was asked for (Request)
        self.lags = [0] * len(drafters)           # tokens each must read first (Request)
        self.left = 0                             # tokens the request may still emit
        # a new request starts from what the last one measured (acceptance, drafting cost,
        # probe gaps) instead of the prior: a server's requests are short and alike, and a
        # fresh prior would try every drafter (and prefill the draft) in each one
        self.warm_start = False
        self.tracks: list[_Track] = []
        self.begin()

    def begin(self) -> None:
        self.ctx = None                           # the last plan's batch context
        self.predicted = 0.0                      # the chosen plan's E[accepted]
        self.trace: list[list[int]] = []          # per step, each drafter's depth (0: off)
        self.budgets: list[int] = []              # per step, the path budget (0: no path)
        self.off_steps = self.probe_steps = 0
        if self.warm_start and self.tracks:
            for t in self.tracks:
                t.idle, t.probed = 0, False
            return
        self.tracks = [_Track(getattr(d, "depth", self.draft_len) if self._tree(d)
                              else self.draft_len, self._tree(d), self.num_paths)
                       for d in self.drafters]
        for d, t in zip(self.drafters, self.tracks):
            t.gap = self.probe
            if t.tree:
                t.width[1] = d.tree_tokens / max(1, d.depth)
        self.kappa = 1.0
        self.cost.reset()

    def inherit(self, other: "DraftController") -> None:
        """Start from a copy of what `other` (a controller of the same drafter kinds) has
        measured: acceptance, widths, drafting cost, kappa."""
        self.tracks = copy.deepcopy(other.tracks)
        self.kappa = other.kappa
        for t in self.tracks:
            t.idle, t.probed = 0, False

    @staticmethod
    def _tree(d) -> bool:
        return bool(getattr(d, "tree_tokens", 0))

    def read(self, i: int, tokens: int, seconds: float) -> bool:
        """Drafter i's catch-up read took `seconds` for `tokens`: learn its rate (True: long
        enough to be costed apart from the step's drafting)."""
        if tokens < READ_MIN:
            return False
        t = self.tracks[i]
        rate = seconds / tokens
        t.read_rate = rate if not t.read_timed else DECAY * t.read_rate + (1 - DECAY) * rate
        t.read_timed = True
        return True

    def cheap(self, i: int) -> bool:
        t = self.tracks[i]
        return t.timed and t.cost(self.draft_len) < CHEAP * self.cost.seconds(1)

    def _value(self, depths: list[int], ctx=None, share: dict | None = None
               ) -> tuple[float, float, float]:
        """(tokens per second, expected accepted, rows) of a plan (depth per drafter; `share`:
        the paths each chosen path drafter is asked for, default 1). `ctx`:
        (tokens, rows, draft seconds) of the other requests in the same forward (None: alone),
        so the value is the whole step's: its tokens are weighed against the batch's, and a
        tree costs what it adds to the batch's forward: the larger of what its rows add to
        the batch's matmuls and what it costs over a decode step alone (its own attention
        and bookkeeping, which do not shrink in a batch)."""
        ctx_tokens, ctx_rows, ctx_secs = ctx or (0, 0, 0.0)
        none_left = [1.0] * (self.draft_len + max((t.max_depth for t in self.tracks), default=0))
        rows, secs, reads = 1.0, 0.0, 0.0
        for i, (t, k) in enumerate(zip(self.tracks, depths)):
            if k:
                w = (share or {}).get(i, 1)
                for j, p in enumerate(t.chance(k, w)):
                    none_left[j] *= 1 - p
                rows += t.hit * t.rows(w) * min(k, t.max_depth)
                secs += t.cost(k)
                r = t.read_cost(self.lags[i])
                if r is None and ctx is not None and ctx[1]:
                    return 0.0, 0.0, rows    # an untimed read would stall the whole batch
                reads += r or 0.0
            elif self.cheap(i):
                secs += t.cost(self.draft_len)    # shadowed: it drafts anyway
        expected = sum(1 - x for x in none_left)
        # A catch-up read is paid once and then serves the request's later steps: alone, it
        # is spread over the steps left at this plan's pace (untimed: taken as free, as every
        # cost before its first measurement); in a batch every request waits on it now, and
        # the drafter rarely drafts on (it falls behind again), so it counts whole, and a
        # read of unknown cost is not risked
        if reads:
            secs += reads if ctx is not None and ctx[1] else \
                reads / max(1.0, self.left / (1 + self.kappa * expected))
        c = self.cost
        if ctx is None:
            verify = c.seconds(rows)
        else:
            verify = c.seconds(ctx_rows + 1) + max(c.seconds(ctx_rows + rows)
                                                  - c.seconds(ctx_rows + 1),
                                                  c.seconds(rows) - c.seconds(1))
        return (ctx_tokens + 1 + self.kappa * expected) / (ctx_secs + secs + verify), \
            expected, rows

    def plan(self, ctx=None) -> list[int]:
        """This step's depth per drafter (0: not verified this step); `ctx` as `_value`."""
        # a probe is forced only where the request has its step to itself: in a batch every
        # request would wait on it (a cold model draft first reads the whole context)
        alone = ctx is None or not ctx[1]
        forced = [i for i, t in enumerate(self.tracks)
                  if alone and not self.cheap(i) and t.idle >= t.gap]
        self.ctx = ctx
        best_depths, best_e, self.budget = self._best(forced, ctx)
        for i, t in enumerate(self.tracks):
            t.probed = i in forced
        self.predicted = best_e
        if forced:
            self.probe_steps += 1
        if not any(best_depths):
            self.off_steps += 1
        self.trace.append(best_depths)
        self.budgets.append(self.budget if any(d and not self.tracks[i].tree
                                               for i, d in enumerate(best_depths)) else 0)
        return best_depths

    def _best(self, forced: list[int], ctx=None) -> tuple[list[int], float, int]:
        """The plan of highest value that includes every drafter in `forced`: its depths,
        E[accepted] and path budget (how many paths the chosen path drafters share)."""
        n = len(self.drafters)
        best, best_depths, best_e, best_b = -1.0, [0] * n, 0.0, self.num_paths
        for r in range(0, n + 1):
            for chosen in combinations(range(n), r):
                if any(i not in chosen for i in forced):
                    continue
                on = [i for i in chosen if not self.tracks[i].tree]
                budgets = range(max(1, len(on)), max(len(on), self.num_paths) + 1) if on \
                    else [self.num_paths]
                for k in range(1, self.draft_len + 1) if chosen else [0]:
                    depths = [(self.tracks[i].max_depth if self.tracks[i].tree else k)
                              if i in chosen else 0 for i in range(n)]
                    for b in budgets:
                        v, e, _ = self._value(depths, ctx, shares(b, on))
                        if v > best:
                            best, best_depths, best_e, best_b = v, depths, e, b
                    if not on:
                        break                     # the depth loop changes nothing
        return best_depths, best_e, best_b

    def update(self, depths: list[int], proposals: list[list[list[int]] | None],
               seconds: list[float], emitted: list[int], rows: int, verify_s: float) -> None:
        """After a step: each drafter's paths (None: it did not draft), its seconds, the emitted
        tokens (accepted + the target's next), the tree's rows and the verify step's seconds."""
        for t, k, paths, s, asked in zip(self.tracks, depths, proposals, seconds, self.asked):
            t.idle = 0 if k else t.idle + 1
            if paths is not None:
                t.score(paths, emitted, asked)
                t.time(s, paths)
        self.cost.observe(rows, verify_s)
        probed = [i for i, t in enumerate(self.tracks) if t.probed]
        if probed:                          # with what the probe taught: still not worth it?
            free = self._best([], self.ctx)[0]        # in the batch it was probed in
            for i in probed:
                t = self.tracks[i]
                t.gap = self.probe if free[i] else min(PROBE_MAX, 2 * t.gap)
                t.probed = False
        if any(depths) and self.predicted > 0:
            ratio = (len(emitted) - 1) / self.predicted
            self.kappa = min(KAPPA[1], max(KAPPA[0], DECAY * self.kappa + (1 - DECAY) * ratio))

    def stats(self, names: list[str]) -> dict:
        return {"off_steps": self.off_steps, "probe_steps": self.probe_steps,
                "kappa": round(self.kappa, 3), "path_budget": self.budgets,
                "depth": {f"{i}:{nm}": [row[i] for row in self.trace]
                          for i, nm in enumerate(names)}}
