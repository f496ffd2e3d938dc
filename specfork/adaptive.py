"""Adaptive drafting: each step, which drafters draft and how deep, chosen to maximise expected
tokens per second from what this request has measured so far; speculation off when nothing pays.

A plan gives each drafter a depth (0: it does not draft this step). Its value:

    rate(plan) = (1 + kappa * E[accepted]) / (draft seconds + verify seconds(tree rows))

- E[accepted] = sum over depths k of P(some drafter in the plan has its k-th token accepted),
  taking drafters as independent, each one's chance the product of its per-depth acceptance
  rates; `kappa` (measured over the request: accepted / predicted) corrects that guess.
- Acceptance rates are decayed counts (`decay` per step), so they follow the text: a copying
  phase lifts n-gram lookup, free prose drops it. Depth 1 starts from the prior; a deeper
  depth's rate (given the tokens before it accepted) leans on the depth above it until its own
  counts outweigh that, so a drafter measured right at depth 1 is tried deeper.
- Draft seconds are each drafter's measured propose + observe time; verify seconds come from the
  `CostModel` (timed tree sizes plus the request's own offset, and what a step that verifies a
  tree costs beyond its forward: building, verifying and freeing it). Tree rows are each
  drafter's measured paths (or nodes) per depth times the depth. What drafting costs carries
  over from one request to the next (it is the machine's); acceptance starts from the prior.
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
and the wait is at least long enough (even past `PROBE_MAX`) that what probes cost beyond
decode steps (a model draft's catch-up read, its forward, the tree's rows) stays under
`EXPLORE_AGAIN` of the time, so a drafter that never pays (a slow draft beside a fast low-bit
target) costs ever less. Its first probe in a request is instead due once it may take
`EXPLORE` of what the request has left: a prior-based plan keeps a model draft out from the
first step beside a fast target, and waiting on elapsed time (while the read it must catch up
grows with every step) never came due within a short request, so a text the draft predicts
well went unused. Both shares are 3%: later probes still bring the trained draft back (on
tune_drafting's prompts, 2 of 16 beside the int4 target, 13 of 38 at float32), and half the
share for them would cut their number and those returns with it (results/probe_outcomes_*.md,
eval/probe_outcomes.py). Between probes such a drafter is not weighed at all: its estimates
do not move while it does not draft.

Planning itself must be cheap next to a decode step (a few ms on a 2-core CPU with int4 weights):
the depths of the path drafters are walked in one pass per drafter set and path budget, and
after an off step in which no shadow drafter would have had a token accepted (every plan's
value only fell) the search is skipped, up to `REPLAN` steps in a row.
"""
from __future__ import annotations

import copy
import math
from itertools import combinations

PRIOR = (1.0, 1.0)               # Beta prior of depth 1's acceptance (accepted, rejected)
LEAN = sum(PRIOR)                # weight of the depth above in a deeper depth's rate
DECAY = 0.9                      # weight of past observations per new one
PROBE = 8                        # steps a costly drafter may stay out before it is tried again
PROBE_MAX = 128                  # the longest wait, after probes that did not pay
EXPLORE = 0.03                   # the most of a request's time its first probe may take
EXPLORE_AGAIN = 0.03             # ... and later probes of a drafter that did not pay
REPLAN = 8                       # quiet steps off in a row before the plan is searched anyway
KAPPA = (0.1, 2.0)               # bounds of the realised / predicted acceptance correction
CHEAP = 0.02                     # drafting under this share of a plain step: always shadowed
SPIKE = 4.0                      # one timing counts for at most this times the estimate
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

    def __init__(self, depth: int, tree: bool, widths: int = 1, flat: bool = False):
        self.max_depth, self.tree = depth, tree
        self.flat = tree or flat                  # its cost does not grow with depth
        self.widths = 1 if tree else max(1, widths)
        # [w][k]: at width w (1-based), depth k (index 0 unused); the prior is in the counts
        # at depth 1 only (deeper depths lean on the depth above them: `chance`)
        self.acc = [[0.0, PRIOR[0]] + [0.0] * (depth - 1) for _ in range(self.widths + 1)]
        self.rej = [[0.0, PRIOR[1]] + [0.0] * (depth - 1) for _ in range(self.widths + 1)]
        self.hit = 1.0                            # P(it proposes anything)
        self.width = [float(w) for w in range(self.widths + 1)]   # [w]: rows per depth when
        #                                           asked for w paths (a tree: nodes per depth)
        self.seconds = 0.0                        # propose + observe per step (path
        #                                           drafters: per depth drafted)
        self.timed = False
        self.idle = 0                             # steps since it last drafted verified
        self.gap = 0                              # steps it may stay out (set by the controller)
        self.probed = False                       # it drafts this step only as a probe
        self.live = True                          # a costly drafter: in the last plan (or
        #                                           its last probe paid); else only its
        #                                           probes weigh it again (its estimates do
        #                                           not move while it does not draft)
        self.measured = False                     # it has drafted (verified) in this request:
        #                                           its acceptance is its own, not the prior
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
        out, p, rate = [], self.hit, 0.0
        for k in range(1, min(depth, self.max_depth) + 1):
            # P(k-th accepted | the k-1 before it were): depth 1 from its counts (with the
            # prior), a deeper one shrunk towards the depth above it rather than towards the
            # prior. A drafter drafts deeper only where its deeper tokens look worth their cost,
            # so those counts come slowly; a draft whose first token is right 9 times in 10
            # rarely drops to a coin toss on its second (measured: it rises)
            w = 0.0 if k == 1 else LEAN
            rate = (acc[k] + w * rate) / (acc[k] + rej[k] + w)
            p *= rate
            out.append(p)
        return out

    def rows(self, share: int = 1) -> float:
        """Tree rows per depth it adds when it proposes, asked for `share` paths."""
        return self.width[self._w(share)]

    def score(self, paths: list[list[int]], emitted: list[int], asked: int = 0) -> int:
        """`paths` (best first) against the `emitted` tokens; `asked`: the paths it was asked
        for (widths beyond it are not learnt from this step; 0: all). Returns the tokens its
        widest scored tree would have had accepted."""
        self.hit = DECAY * self.hit + (1 - DECAY) * (1.0 if paths else 0.0)
        if not paths:
            return 0
        top = self.widths if self.tree or not asked else min(self.widths, asked)
        for w in range(1, top + 1):
            m, longest = matched(paths if self.tree else paths[:w], emitted)
            if not self.tree:
                self.width[w] = DECAY * self.width[w] + (1 - DECAY) * min(w, len(paths))
            acc, rej = self.acc[w], self.rej[w]
            for k in range(1, min(m + 1, longest, len(emitted), self.max_depth) + 1):
                acc[k] = DECAY * acc[k] + (k <= m)
                rej[k] = DECAY * rej[k] + (k > m)
        return m

    def cost(self, depth: int) -> float:
        """Seconds a step at `depth` costs it (a model drafter runs one forward per depth; a
        lookup or a tree costs the same at any depth)."""
        return self.seconds if self.flat else self.seconds * depth

    def time(self, seconds: float, paths: list[list[int]]) -> None:
        if not self.flat:
            seconds /= max([1] + [len(p) for p in paths])
        if self.timed:         # one slow call (a GC pause, another tenant) moves the estimate
            #                    by a bounded step: a cheap drafter that looked costly once
            #                    would leave the shadow and never be timed again
            seconds = min(seconds, SPIKE * self.seconds)
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
        self.read_s = 0.0                         # catch-up reads in this step (costed apart)
        self.quiet = False                        # the last step was off and taught nothing
        self.quiet_run = 0                        # good: plans skipped in a row
        self.predicted = 0.0                      # the chosen plan's E[accepted]
        self.trace: list[list[int]] = []          # per step, each drafter's depth (0: off)
        self.budgets: list[int] = []              # per step, the path budget (0: no path)
        self.off_steps = self.probe_steps = 0
        self.probes: list[tuple[int, int, bool, bool]] = []   # (step, drafter, its first
        #                                           verified draft in the request, kept after)
        if self.warm_start and self.tracks:
            for t in self.tracks:
                t.idle, t.probed = 0, False
            return
        old = self.tracks
        self.tracks = [_Track(getattr(d, "depth", self.draft_len) if self._tree(d)
                              else self.draft_len, self._tree(d), self.num_paths,
                              getattr(d, "flat_cost", False))
                       for d in self.drafters]
        for d, t in zip(self.drafters, self.tracks):
            t.gap = self.probe
            if t.tree:
                t.width[1] = d.tree_tokens / max(1, d.depth)
        for t, o in zip(self.tracks, old):   # what drafting costs is the machine's, not the
            t.seconds, t.timed = o.seconds, o.timed          # text's: it carries over
            t.read_rate, t.read_timed = o.read_rate, o.read_timed
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
        self.read_s += seconds
        rate = seconds / tokens
        t.read_rate = rate if not t.read_timed else DECAY * t.read_rate + (1 - DECAY) * rate
        t.read_timed = True
        return True

    def cheap(self, i: int) -> bool:
        t = self.tracks[i]
        return t.timed and t.cost(self.draft_len) < CHEAP * self.cost.seconds(1)

    def _snapshot(self) -> list[tuple]:
        """Per drafter, what every plan of one step reads: (per width w: P(k-th token
        accepted) for every depth and rows per depth; seconds per drafted depth, or per step
        for a tree; whether it is shadowed; its catch-up read's cost)."""
        out = []
        for i, t in enumerate(self.tracks):
            deep = t.max_depth
            per_w = [None] + [(t.chance(deep, w), t.hit * t.rows(w))
                              for w in range(1, t.widths + 1)]
            out.append((per_w, t.widths, t.cost(1), t.tree, self.cheap(i),
                        t.cost(self.draft_len), t.read_cost(self.lags[i])))
        return out

    def plan(self, ctx=None) -> list[int]:
        """This step's depth per drafter (0: not verified this step); `ctx` as in `_best`."""
        # a probe is forced only where the request has its step to itself: in a batch every
        # request would wait on it (a cold model draft first reads the whole context)
        alone = ctx is None or not ctx[1]
        self.read_s = 0.0
        forced = [i for i, t in enumerate(self.tracks)
                  if alone and not self.cheap(i) and self._due(i)]
        self.ctx = ctx
        # Off after a step that taught nothing good (no shadow drafter would have had a
        # token accepted): every plan's expected gain only fell, so off stays best and the
        # search (a tenth of a ms, a few % of a fast low-bit step) is skipped, up to REPLAN
        # steps in a row, where the request has the step to itself (in a batch the others'
        # rows change what a tree costs)
        if alone and not forced and self.quiet and self.quiet_run < REPLAN:
            self.quiet_run += 1
            best_depths, best_e = [0] * len(self.drafters), 0.0
        else:
            self.quiet_run = 0
            best_depths, best_e, self.budget = self._best(forced, ctx)
            for i, t in enumerate(self.tracks):
                t.live = bool(best_depths[i])
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

    def _due(self, i: int) -> bool:
        """Drafter i is due a probe: out for its gap, and for long enough that what the probe
        will cost beyond a decode step (its catch-up read, one drafted depth, a two-row
        tree) is at most EXPLORE_AGAIN of the time since (its first probe in a request: at
        most EXPLORE of what the request has left)."""
        t = self.tracks[i]
        if t.idle < t.gap:
            return False
        step = self.cost.seconds(1, False)
        over = (t.read_cost(self.lags[i]) or 0.0) + t.cost(1) + self.cost.seconds(2, True) - step
        if not t.measured and over <= EXPLORE * self.left * step:
            return True           # its first probe in this request: EXPLORE of what is left
        return t.idle * EXPLORE_AGAIN * step >= over

    def _best(self, forced: list[int], ctx=None) -> tuple[list[int], float, int]:
        """The plan of highest value that includes every drafter in `forced`: its depths,
        E[accepted] and path budget (how many paths the chosen path drafters share).

        A plan's value is its tokens per second. `ctx`: (tokens, rows, draft seconds) of the
        other requests in the same forward (None: alone), so the value is the whole step's:
        its tokens are weighed against the batch's, and a tree costs what it adds to the
        batch's forward: the larger of what its rows add to the batch's matmuls and what it
        costs over a decode step alone (its own attention and bookkeeping, which do not
        shrink in a batch). For each set of drafters and path budget, the depths of the path
        drafters are walked in one pass (each depth adds its term to E[accepted])."""
        n = len(self.drafters)
        ctx_tokens, ctx_rows, ctx_secs = ctx or (0, 0, 0.0)
        batch = ctx is not None and bool(ctx[1])
        snap = self._snapshot()
        L = self.draft_len + max((t.max_depth for t in self.tracks), default=0)
        c, kappa = self.cost, self.kappa
        plain, one = c.seconds(ctx_rows + 1, False), c.seconds(1, False)

        def verify(rows: float, tree: bool) -> float:
            if not ctx_rows:                   # alone in the forward
                return c.seconds(rows, tree)
            return plain + max(c.seconds(ctx_rows + rows, tree) - plain,
                               c.seconds(rows, tree) - one)

        best, best_depths, best_e, best_b = -1.0, [0] * n, 0.0, self.num_paths
        weigh = [i for i, t in enumerate(self.tracks)
                 if t.live or t.probed or i in forced or snap[i][4]]
        for r in range(0, len(weigh) + 1):
            for chosen in combinations(weigh, r):
                if any(i not in chosen for i in forced):
                    continue
                on = [i for i in chosen if not self.tracks[i].tree]
                # what does not depend on the path drafters' depth: tree drafters, shadowed
                # drafters, catch-up reads
                none_tree, rows0, secs0, reads = [1.0] * L, 1.0, 0.0, 0.0
                stall = False
                for i, (per_w, widths, each, tree, shadow, full, read) in enumerate(snap):
                    if i not in chosen:
                        secs0 += full if shadow else 0.0      # shadowed: it drafts anyway
                        continue
                    # a read of unknown cost would stall the whole batch: not risked
                    stall |= read is None and batch
                    reads += read or 0.0
                    if tree:
                        chance, row = per_w[1]
                        for j, p in enumerate(chance):
                            none_tree[j] *= 1 - p
                        rows0 += row * len(chance)
                        secs0 += each
                if stall:
                    continue
                budgets = range(max(1, len(on)), max(len(on), self.num_paths) + 1) if on \
                    else [self.num_paths]
                depths = range(1, self.draft_len + 1) if on else [0]
                values = {}
                for b in budgets:
                    share = shares(b, on)
                    per = [snap[i][0][max(1, min(share[i], snap[i][1]))] for i in on]
                    row_k = sum(row for _, row in per)
                    each_k = sum(snap[i][2] for i in on)
                    expected = sum(1 - x for x in none_tree)
                    for k in depths:
                        if k:                     # the path drafters' k-th tokens
                            none = 1.0
                            for chance, _ in per:
                                none *= 1 - chance[k - 1]
                            expected += none_tree[k - 1] * (1 - none)
                        secs = secs0 + each_k * k
                        # A catch-up read is paid once and then serves the request's later
                        # steps: alone, it is spread over the steps left at this plan's pace
                        # (untimed: taken as free, as every cost before its first
                        # measurement); in a batch every request waits on it now, and the
                        # drafter rarely drafts on (it falls behind again): it counts whole
                        if reads:
                            secs += reads if batch else \
                                reads / max(1.0, self.left / (1 + kappa * expected))
                        v = (ctx_tokens + 1 + kappa * expected) / (
                            ctx_secs + secs + verify(rows0 + row_k * k, bool(chosen)))
                        values[k, b] = v, expected
                for k in depths:
                    for b in budgets:
                        v, e = values[k, b]
                        if v > best:
                            best, best_e, best_b = v, e, b
                            best_depths = [(self.tracks[i].max_depth if self.tracks[i].tree
                                            else k) if i in chosen else 0 for i in range(n)]
        return best_depths, best_e, best_b

    def update(self, depths: list[int], proposals: list[list[list[int]] | None],
               seconds: list[float], emitted: list[int], rows: int, verify_s: float,
               tree: bool | None = None) -> None:
        """After a step: each drafter's paths (None: it did not draft), its seconds, the emitted
        tokens (accepted + the target's next), the step's rows and its seconds without the
        drafting; `tree`: this request verified a draft (default: rows > 1)."""
        gained = False
        fresh = [not t.measured for t in self.tracks]
        for t, k, paths, s, asked in zip(self.tracks, depths, proposals, seconds, self.asked):
            t.idle = 0 if k else t.idle + 1
            t.measured |= bool(k) and paths is not None
            if paths is not None:
                gained |= t.score(paths, emitted, asked) > 0
                t.time(s, paths)
        self.quiet = not any(depths) and not gained
        self.cost.observe(rows, verify_s - self.read_s, tree)
        probed = [i for i, t in enumerate(self.tracks) if t.probed]
        if probed:                          # with what the probe taught: still not worth it?
            free = self._best([], self.ctx)[0]        # in the batch it was probed in
            # what the probe cost beyond a decode step (its drafting, catch-up read and rows)
            # buys a wait long enough that probing takes at most EXPLORE_AGAIN of the time
            step = self.cost.seconds(1, False)
            over = max(0.0, verify_s + sum(seconds) - step)
            for i in probed:
                t = self.tracks[i]
                t.gap = self.probe if free[i] else \
                    max(min(PROBE_MAX, 2 * t.gap), math.ceil(over / (EXPLORE_AGAIN * step)))
                t.probed, t.live = False, bool(free[i])
                self.probes.append((len(self.trace) - 1, i, fresh[i], t.live))
        if any(depths) and self.predicted > 0:
            ratio = (len(emitted) - 1) / self.predicted
            self.kappa = min(KAPPA[1], max(KAPPA[0], DECAY * self.kappa + (1 - DECAY) * ratio))

    def stats(self, names: list[str]) -> dict:
        return {"off_steps": self.off_steps, "probe_steps": self.probe_steps,
                "probes": [{"step": st, "drafter": names[i], "first": f, "kept": k}
                           for st, i, f, k in self.probes],
                "kappa": round(self.kappa, 3), "path_budget": self.budgets,
                "depth": {f"{i}:{nm}": [row[i] for row in self.trace]
                          for i, nm in enumerate(names)}}
