"""One request on the engine: its tokens, its branch of the KV tree, its drafters, and the two
halves of each of its steps around the shared target forward.

`plan_*` says which rows the request adds to the step's forward (tokens, positions, the
`AttnMeta` of its own prefix and tree) and reserves their KV slots; `commit` reads its rows'
logits (and features), verifies, keeps the accepted fork and frees the rest. The engine runs
every running request's plan, one forward over all their rows, then every commit, so a
request computes what it would compute alone (`specfork/attention.py`, `BatchMeta`).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specfork.attention import AttnMeta
from specfork.sampling import pick
from specfork.token_tree import TokenTree
from specfork.types import DraftPath, SamplingParams
from specfork.verifiers.greedy import verify_greedy
from specfork.verifiers.sampling import verify_sampling

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"
_ids = itertools.count()


@dataclass
class StepRows:
    """What a request adds to one forward: `tokens [T]` at `positions [T]` under `meta`;
    `logits` its rows whose logits it reads (indices into its T rows)."""
    tokens: torch.Tensor
    positions: torch.Tensor
    meta: AttnMeta
    logits: list[int]
    kind: str                                  # "prefill" | "decode" | "tree"
    tree: TokenTree | None = None
    leaves: list = field(default_factory=list)
    forks: list = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    props: list = field(default_factory=list)
    secs: list[float] = field(default_factory=list)


class Request:
    """`prompt` token ids, up to `max_new` new tokens under `sp`. `drafters` (with their
    `controller`, None: draft every step) are this request's own instances; `on_tokens` gets
    every batch of emitted tokens as it is emitted."""

    def __init__(self, prompt: list[int], max_new: int, sp: SamplingParams, eos: set[int],
                 drafters: list | None = None, controller=None, num_paths: int = 0,
                 draft_len: int = 4, tree_budget: int = 1, capture=None,
                 feature_cols: dict | None = None,
                 on_tokens: Callable[[list[int]], None] | None = None,
                 stats=None, logprobs: int | None = None):
        """`logprobs`: keep each emitted token's log-probability under the target (and that
        many most likely alternatives) in `token_logprobs`; None: keep none."""
        self.id = next(_ids)
        self.prompt, self.max_new, self.sp, self.eos = list(prompt), max_new, sp, eos
        self.drafters = list(drafters or [])
        self.controller = controller
        self.num_paths = num_paths if self.drafters else 0
        self.draft_len, self.tree_budget = draft_len, tree_budget
        self.capture = capture if self.num_paths else None
        self.feature_cols = feature_cols or {}
        self.on_tokens = on_tokens
        self.out: list[int] = []
        self.status = WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.branch = None
        self.cached_tokens = 0                    # prompt tokens forked from the prefix cache
        self.preempted = 0
        self.stats = stats
        self.begun = False
        self.logprobs = logprobs
        self.token_logprobs: list[tuple[float, list[tuple[int, float]]]] = []
        self.siblings: list[Request] = []         # n > 1: forks of this prompt, started by
        #                                           the engine once it is prefilled
        self.release_drafters: Callable[[], None] | None = None   # hands the drafters back
        self.on_done: Callable[["Request"], None] | None = None

    # -- state --------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.out

    @property
    def target(self) -> int:
        """Tokens whose K/V the branch must hold before decoding: the prompt, and after a
        preemption everything emitted but the last token (which the next step writes)."""
        return len(self.prompt) if not self.out else len(self.prompt) + len(self.out) - 1

    @property
    def prefilling(self) -> bool:
        return self.branch is None or self.branch.length < self.target

    @property
    def done(self) -> bool:
        return self.status == FINISHED

    def start_drafters(self) -> None:
        if not self.begun:
            for d in self.drafters:
                d.begin(self.prompt)
            if self.controller is not None:
                self.controller.begin()
            self.begun = True

    def stop_drafters(self) -> None:
        if self.begun:
            for d in self.drafters:
                d.end()
            self.begun = False

    # -- plans ----------------------------------------------------------------------------------
    def plan_prefill(self, model, kv, chunk: int) -> StepRows:
        """The next prompt chunk (at most `chunk` tokens) into the branch; its last row's
        logits are read when it completes the prompt of a request with nothing emitted."""
        n = self.branch.length
        ids = self.tokens[n:min(self.target, n + chunk)]
        prefix = kv.slots(self.branch)
        write = kv.append(self.branch, len(ids))
        dev = model.device
        last = self.branch.length == self.target and not self.out
        return StepRows(torch.tensor(ids, device=dev), torch.arange(n, n + len(ids), device=dev),
                        AttnMeta.prefill(model, prefix, write),
                        [len(ids) - 1] if last else [], "prefill")

    def plan_decode(self, model, kv) -> StepRows:
        """One token: the last emitted one's K/V go into the branch, its logits give the next."""
        n = self.branch.length
        dev = model.device
        meta = AttnMeta.prefill(model, kv.slots(self.branch), kv.append(self.branch, 1))
        return StepRows(torch.tensor([self.out[-1]], device=dev), torch.tensor([n], device=dev),
                        meta, [0], "decode")

    def plan_tree(self, model, kv, paths: list[DraftPath], depths, props, secs,
                  room: int | None = None) -> StepRows:
        """A verify tree of `paths` after the context: one CoW fork of the branch per path
        (a failure, such as a full pool, frees them). With fewer than the tree's slots (plus
        a CoW copy per fork) `room` blocks free, the step verifies nothing: a decode step."""
        if not paths:                  # speculation off this step: a decode step, no tree
            rows = self.plan_decode(model, kv)
            rows.depths, rows.props, rows.secs = depths, props, secs
            return rows
        B, n, dev = self.branch, self.branch.length, model.device
        tree = TokenTree.build(self.out[-1], paths, self.tree_budget)
        leaves = tree.leaf_paths() if len(tree) > 1 else []
        if room is not None and sum(len(p) + 1 for p in leaves) > room:
            tree, leaves = TokenTree.build(self.out[-1], [], self.tree_budget), []
        if len(tree) == 1:
            rows = self.plan_decode(model, kv)
            rows.tree, rows.depths, rows.props, rows.secs = tree, depths, props, secs
            return rows
        forks = []
        try:
            writes = []
            for p in leaves:
                forks.append(kv.fork(B))
                writes.append(kv.append(forks[-1], len(p)))
            meta = AttnMeta.tree(model, kv.slots(B), tree.ancestor_mask(), torch.cat(writes),
                                 torch.tensor([i for p in leaves for i in p]))
        except BaseException:
            for f in forks:
                kv.release(f)
            raise
        return StepRows(tree.tokens.to(dev), tree.positions(n).to(dev), meta,
                        list(range(len(tree))), "tree", tree, leaves, forks, depths, props,
                        secs)

    def cancel_rows(self, kv, rows: StepRows) -> None:
        """Undo a plan that will not run (its forks; a decode's or prefill's slot)."""
        for f in rows.forks:
            kv.release(f)
        if not rows.forks:
            kv.truncate(self.branch, self.branch.length - rows.tokens.numel())

    # -- drafting -------------------------------------------------------------------------------
    def propose(self, ctx=None) -> tuple[list[DraftPath], list, list[float], list[int]]:
        """Paths for the verify tree (see `_propose`), planned by the controller under the batch
        context `ctx` (what the step's other rows cost and yield)."""
        ctl = self.controller
        if ctl is not None:     # what each drafter must read before drafting, tokens to go
            ctl.lags = [d.unread(self.tokens) if hasattr(d, "unread") else 0
                        for d in self.drafters]
            ctl.left = self.max_new - len(self.out)
        depths = (ctl.plan(ctx) if ctl is not None else [self.draft_len] * len(self.drafters))
        paths, props, secs = self._propose(self.tokens, self.sp, depths)
        return paths, props, secs, depths

    def _propose(self, context: list[int], sp: SamplingParams, depths: list[int]):
        """Paths for the verify tree, and per drafter what it proposed (None: it did not draft)
        and the seconds it took. Path drafters with a depth share the path budget (the
        controller's, at most `num_paths`) evenly (an unused share moves on); a tree drafter
        proposes its own tree (its own node budget). A cheap drafter left out of the plan still
        drafts, to be scored in the shadow."""
        paths: list[DraftPath] = []
        props: list[list[list[int]] | None] = [None] * len(self.drafters)
        secs = [0.0] * len(self.drafters)
        ctl = self.controller
        path_idx = [i for i, d in enumerate(self.drafters) if not getattr(d, "tree_tokens", 0)]
        budget = self.num_paths if ctl is None else min(self.num_paths, ctl.budget)
        left, k = budget, sum(1 for i in path_idx if depths[i])
        asked = [0] * len(self.drafters)
        for i, d in enumerate(self.drafters):
            tree = bool(getattr(d, "tree_tokens", 0))
            shadow = not depths[i] and ctl is not None and ctl.cheap(i)
            if not depths[i] and not shadow:
                continue
            # a cheap drafter drafts as wide and deep as allowed and is scored on all of it
            # (the controller learns what a wider or deeper tree would have caught); the
            # tree gets its planned share and depth
            cheap = ctl is not None and ctl.cheap(i)
            if tree:
                share, length = 0, 0
            elif shadow:
                share, length = 0, self.draft_len
            else:
                share, length = -(-left // k), self.draft_len if ctl is None or cheap \
                    else depths[i]
                k -= 1
            ask = self.num_paths if cheap and (share or shadow) else share
            asked[i] = ask
            t0 = time.perf_counter()
            got = d.propose(context, ask, length, sp) if (ask or tree) else []
            secs[i] = time.perf_counter() - t0
            read = getattr(d, "last_read", None) if (ask or tree) else None
            if ctl is not None and read is not None and ctl.read(i, *read):
                secs[i] -= read[1]            # a long catch-up read is costed on its own
            if not tree:
                got = got[:ask]
            props[i] = [p.tokens for p in got]
            if depths[i]:
                if not tree:
                    got = got[:share]
                    left -= len(got)
                    if length > depths[i]:            # drafted deeper for its score only
                        got = [DraftPath(p.tokens[:depths[i]], None if p.q is None
                                         else p.q[:depths[i]], p.drafter, p.meta) for p in got]
                paths += got
        if ctl is not None:
            ctl.asked = asked
        return paths, props, secs

    # -- commit ---------------------------------------------------------------------------------
    def commit(self, kv, rows: StepRows, logits: torch.Tensor, feats: torch.Tensor | None,
               step_rows: int, step_s: float) -> list[int]:
        """This request's rows' logits `[len(rows.logits), V]` (and features `[T, F]`) -> the
        tokens it emits this step (maybe none: a prefill chunk before the prompt's end)."""
        t_commit = time.perf_counter()
        if rows.kind == "prefill":
            b = self.branch.length
            new = [pick(logits[-1], self.sp)] if b >= self.target and not self.out else []
            if feats is not None:              # rows up to b - 1: their successors are known
                self._hand_features((self.tokens + new)[:b + 1], feats)
            return self._emit(new, logits[-1:]) if new else []
        if rows.kind == "decode" and not rows.depths:         # plain decoding
            new = [pick(logits[0], self.sp)]
            if feats is not None:
                self._hand_features(self.tokens + new, feats)
            return self._emit(new, logits[:1])
        tree = rows.tree                       # None: a drafting request's off step
        if tree is None or len(tree) == 1:
            path, nxt = [0], pick(logits[0], self.sp)
        elif self.sp.greedy:
            path, nxt = verify_greedy(tree, logits)
        else:
            path, nxt = verify_sampling(tree, logits, self.sp)
        if rows.forks:
            keep = next(i for i, p in enumerate(rows.leaves) if p[:len(path)] == path)
            for i, f in enumerate(rows.forks):
                if i != keep:
                    kv.release(f)
            n = self.branch.length
            kv.truncate(rows.forks[keep], n + len(path))
            kv.adopt(self.branch, rows.forks[keep])
        if self.stats is not None:
            self.stats.record(tree, path)
        emitted = [int(tree.tokens[i]) for i in path[1:]] + [nxt] if tree is not None else [nxt]
        context = self.tokens
        secs = rows.secs
        for i, d in enumerate(self.drafters):
            if not getattr(d, "features", None):
                t0 = time.perf_counter()
                d.observe(context + emitted)
                secs[i] += time.perf_counter() - t0
        if feats is not None:
            t0 = time.perf_counter()
            self._hand_features(context + emitted, feats[torch.tensor(path, device=feats.device)])
            t_feat = time.perf_counter() - t0
            for i, d in enumerate(self.drafters):
                if getattr(d, "features", None):
                    secs[i] += t_feat
        if self.controller is not None:
            # the step's cost as the controller weighs it: planning, forward and this commit
            # (verify, free, adopt), less the drafting it costs per drafter
            spent = step_s + (time.perf_counter() - t_commit) - sum(secs)
            self.controller.update(rows.depths, rows.props, secs, emitted, step_rows, spent,
                                   tree is not None and len(tree) > 1)
        return self._emit(emitted, logits, path)

    def _hand_features(self, context: list[int], feats: torch.Tensor) -> None:
        """Give each drafter that reads target features the columns of its layers for the
        positions just computed (`feats [k, F]` at positions len(context)-1-k .. -2)."""
        for d in self.drafters:
            if id(d) in self.feature_cols:
                cols = self.feature_cols[id(d)]
                d.observe(context, feats if cols is None else feats.index_select(1, cols))

    def _emit(self, new: list[int], logits: torch.Tensor, rows: list[int] | None = None
              ) -> list[int]:
        """Append `new` (token i drawn from `logits[rows[i]]`; rows None: `logits[i]`), cut at
        max_new and at the first EOS; finishes the request there."""
        new = new[:self.max_new - len(self.out)]
        for i, t in enumerate(new):
            if t in self.eos:
                new = new[:i + 1]
                self.finish_reason = "stop"
                break
        if self.logprobs is not None and new:
            if rows is not None:           # gathered only here: most requests want none
                logits = logits[torch.tensor(rows[:len(new)], device=logits.device)]
            lp = torch.log_softmax(logits[:len(new)].float(), dim=-1)
            top = lp.topk(self.logprobs, dim=-1) if self.logprobs else None
            for i, t in enumerate(new):
                alts = [] if top is None else list(zip(top.indices[i].tolist(),
                                                       top.values[i].tolist()))
                self.token_logprobs.append((float(lp[i, t]), alts))
        self.out += new
        if self.finish_reason is None and len(self.out) >= self.max_new:
            self.finish_reason = "length"
        if self.on_tokens and new:
            self.on_tokens(new)
        return new
