"""SpecDecoder: drafters -> token tree -> one target forward (tree attention) -> verifier ->
KV-tree commit/free. With no drafter it is plain sequential decoding on the same KV tree.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from specfork import cost_model
from specfork.adaptive import DraftController
from specfork.attention import AttnMeta
from specfork.drafters.base import Drafter
from specfork.drafters.registry import DRAFT_LEN, check_drafting
from specfork.engine import Engine
from specfork.errors import SpecforkError
from specfork.kv_quant import calibration_ids, parse_kv_format
from specfork.kv_tree import KVTree
from specfork.model import Model
from specfork.sampling import check_sampling, pick, sampling_params
from specfork.token_tree import TokenTree
from specfork.types import DraftPath, GenerateOutput, SamplingParams
from specfork.verifiers.greedy import verify_greedy
from specfork.verifiers.sampling import verify_sampling
from specfork.weights import check_weights

SCORE_CHUNK = 512              # tokens per prefill chunk of `score`


class SpecDecoder:
    """Speculative decoding with any mix of drafters over one target model, on an `Engine`
    (model, tokenizer, KV tree, EOS) that beam search and sessions can share."""

    def __init__(self, model: Model, tokenizer, drafters: list[Drafter] | None = None,
                 num_paths: int = 0, draft_len: int = DRAFT_LEN, tree_budget: int | None = None,
                 max_kv_tokens: int | None = None, block_size: int | None = None,
                 eos_token_ids: list[int] | None = None, adaptive: bool = False):
        """`adaptive`: each step, choose which drafters draft and how deep from measured costs
        and acceptance, down to plain decoding (specfork.adaptive); off: every drafter drafts
        its full budget every step."""
        check_drafting(num_paths, draft_len)
        self.drafters = list(drafters or [])
        self.num_paths = num_paths if self.drafters else 0
        self.draft_len = draft_len
        # tree drafters (EAGLE) bring their own node budget; path drafters share num_paths
        trees = [d for d in self.drafters if getattr(d, "tree_tokens", 0)] if self.num_paths else []
        tree_nodes = sum(d.tree_tokens for d in trees)
        deepest = max([draft_len] + [d.depth for d in trees])
        self.tree_budget = tree_budget or max(1, self.num_paths) * draft_len + tree_nodes
        # target features the drafters read (layer indices; L = the final norm's output)
        self.capture = tuple(sorted({i for d in self.drafters
                                     for i in (getattr(d, "features", None) or ())})) or None
        # each feature drafter's columns of the captured [k, len(capture) * hidden] rows (None:
        # all of them, in order), built once on the model's device
        self.feature_cols = {}
        if self.capture:
            H = model.embed.shape[1]
            for d in self.drafters:
                want = getattr(d, "features", None)
                if want:
                    cols = [c for i in want for c in range(self.capture.index(i) * H,
                                                           (self.capture.index(i) + 1) * H)]
                    same = cols == list(range(len(self.capture) * H))
                    self.feature_cols[id(d)] = None if same else torch.tensor(
                        cols, device=model.device)
        # room for every verify fork: one per draft path or tree leaf (+1), each up to the
        # deepest draft + 1 tokens
        self.engine = Engine(model, tokenizer, max_kv_tokens, block_size, eos_token_ids,
                             forks=self.num_paths + tree_nodes + 1, fork_tokens=deepest + 1)
        self.model, self.tokenizer, self.kv = model, tokenizer, self.engine.kv
        self.pool, self.eos = self.kv.pool, self.engine.eos
        self.controller = None
        if adaptive and self.num_paths:        # times the verify forward once per model
            self.controller = DraftController(
                self.drafters, draft_len,
                cost_model.for_model(model, self.kv, self.tree_budget + 1))

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", drafts: int = 0,
                        drafter: str | None = None, draft_len: int = DRAFT_LEN,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        min_conf: float | None = None, draft_vocab: int | None = None,
                        tree_topk: int | None = None, tree_depth: int | None = None,
                        draft_tokens: int | None = None, adaptive: bool = True,
                        weights: str = "auto", kv_cache: str = "auto",
                        **kw) -> "SpecDecoder":
        """`tree_topk`, `tree_depth`, `draft_tokens`: the EAGLE draft tree's shape (None: the
        tuned defaults). `adaptive` (on by default here): see `SpecDecoder`. `weights`: the
        target's weight format (`specfork/weights.py`: auto, float32, bfloat16, int8, int4).
        `kv_cache`: the target's KV format (`specfork/kv_quant.py`: auto, float32, bfloat16,
        float16, turbo4, turbo3.5, turbo3, turbo2.5)."""
        from specfork.drafters import eagle
        from specfork.drafters.registry import make_drafters
        from specfork.loader import check_device, load_hf
        tree = eagle.tree_shape(tree_topk, tree_depth, draft_tokens)
        check_drafting(drafts, draft_len, drafter, target, min_conf, draft_vocab, tree)
        check_device(device)                               # all before any weights load
        check_weights(weights, device)
        parse_kv_format(kv_cache)
        hf, tok = load_hf(target, dtype=dtype, device=device)
        model = Model(hf, weights=weights, kv_cache=kv_cache)
        model.calibrate_kv(calibration_ids(tok))
        drafters = (make_drafters(drafter, target, model, drafts, min_conf, draft_vocab,
                                  draft_len=draft_len, tree=tree,
                                  max_kv_tokens=kw.get("max_kv_tokens"))
                    if drafts > 0 else [])
        return cls(model, tok, drafters, num_paths=drafts, draft_len=draft_len,
                   adaptive=adaptive, **kw)

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        return self.engine.encode(prompt, raw)

    @torch.inference_mode()
    def score(self, text: str | list[int], chunk: int = SCORE_CHUNK) -> dict:
        """Per-token negative log-likelihoods of a text as is (no chat template) under the
        target and its KV format, like vLLM's prompt logprobs: one prefill, in chunks of
        `chunk` tokens that read the earlier ones through the KV pool (and only `chunk` rows of
        logits at a time). {"tokens": ids, "nll": [len - 1] for tokens 1.., "ppl"}."""
        ids = self.encode(text, raw=True)
        if len(ids) < 2:
            raise SpecforkError("scoring needs at least two tokens")
        self.engine.check_length(len(ids), 0)
        m, kv, dev = self.model, self.kv, self.model.device
        B = kv.new_branch()
        nll = []
        try:
            for a in range(0, len(ids), chunk):
                x = ids[a:a + chunk]
                meta = AttnMeta.prefill(m, kv.slots(B), kv.append(B, len(x)))
                logits = m.forward(torch.tensor(x, device=dev),
                                   torch.arange(a, a + len(x), device=dev), self.pool, meta,
                                   logits_idx=slice(None))
                nxt = torch.tensor(ids[a + 1:a + 1 + len(x)], device=dev)
                lp = torch.log_softmax(logits[:len(nxt)].float(), dim=-1)
                nll.append(-lp.gather(1, nxt[:, None])[:, 0])
        finally:
            kv.release(B)
        nll = torch.cat(nll)
        return {"tokens": ids, "nll": nll.tolist(), "ppl": float(nll.mean().exp())}

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, raw: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerateOutput:
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed)
        prompt_ids = self.encode(prompt, raw)
        self.engine.check_length(len(prompt_ids), max_new_tokens)
        sp = sampling_params(temperature, top_p, top_k, seed)
        st = _Stats(self.drafters)
        if self.controller is not None:
            self.controller.begin()
        self.pool.reset_peak()
        t0 = time.perf_counter()
        branch = self.kv.new_branch()
        try:
            for d in self.drafters:
                d.begin(prompt_ids)
            out = self._run(branch, prompt_ids, max_new_tokens, sp, st, on_tokens)
        finally:
            self.kv.release(branch)
            for d in self.drafters:
                d.end()
        wall = time.perf_counter() - t0
        stats = st.finish(len(out), wall, self.pool, self.kv)
        if self.controller is not None:
            stats["adaptive"] = self.controller.stats([d.name for d in self.drafters])
        return GenerateOutput(self.engine.decode(out), out, prompt_ids, stats)

    def _run(self, B, prompt_ids, max_new, sp, st, on_tokens) -> list[int]:
        m, kv = self.model, self.kv
        P = len(prompt_ids)
        dev = m.device
        ids = torch.tensor(prompt_ids, device=dev)
        slots = kv.append(B, P)
        logits = m.forward(ids, torch.arange(P, device=dev), self.pool,
                           AttnMeta.prefill(m, slots[:0], slots), logits_idx=slice(P - 1, P),
                           capture=self.capture if self.num_paths else None)
        st.forwards += 1
        if self.capture and self.num_paths:
            logits, feats = logits
        tok = pick(logits[0], sp)
        out = [tok]
        if self.capture and self.num_paths:
            self._hand_features(prompt_ids + out, feats)
        if on_tokens:
            on_tokens([tok])
        while len(out) < max_new and tok not in self.eos:
            if self.num_paths:
                new = self._spec_step(B, prompt_ids + out, sp, st)
            else:
                new = self._decode_step(B, tok, sp)
            st.forwards += 1
            new = new[:max_new - len(out)]
            for i, t in enumerate(new):
                if t in self.eos:
                    new = new[:i + 1]
                    break
            out += new
            tok = out[-1]
            if on_tokens:
                on_tokens(new)
        return out

    def _decode_step(self, B, tok: int, sp: SamplingParams) -> list[int]:
        """One token: the last emitted token's K/V go into B, its logits give the next."""
        m, kv = self.model, self.kv
        n = B.length
        meta = AttnMeta.prefill(m, kv.slots(B), kv.append(B, 1))
        logits = m.forward(torch.tensor([tok], device=m.device), torch.tensor([n], device=m.device),
                           self.pool, meta)
        return [pick(logits[0], sp)]

    def _hand_features(self, context: list[int], feats: torch.Tensor) -> None:
        """Give each drafter that reads target features the columns of its layers for the
        positions just verified (`feats [k, F]` at positions len(context)-1-k .. -2)."""
        for d in self.drafters:
            if id(d) in self.feature_cols:
                cols = self.feature_cols[id(d)]
                d.observe(context, feats if cols is None else feats.index_select(1, cols))

    def _propose(self, context: list[int], sp: SamplingParams, depths: list[int]):
        """Paths for the verify tree, and per drafter what it proposed (None: it did not draft)
        and the seconds it took. Path drafters with a depth share the path budget evenly (an
        unused share moves on); a tree drafter proposes its own tree (its own node budget). A
        cheap drafter left out of the plan still drafts, to be scored in the shadow."""
        paths: list[DraftPath] = []
        props: list[list[list[int]] | None] = [None] * len(self.drafters)
        secs = [0.0] * len(self.drafters)
        ctl = self.controller
        path_idx = [i for i, d in enumerate(self.drafters) if not getattr(d, "tree_tokens", 0)]
        left, k = self.num_paths, sum(1 for i in path_idx if depths[i])
        for i, d in enumerate(self.drafters):
            tree = bool(getattr(d, "tree_tokens", 0))
            shadow = not depths[i] and ctl is not None and ctl.cheap(i)
            if not depths[i] and not shadow:
                continue
            if tree:
                share, length = 0, 0
            elif shadow:
                share, length = -(-self.num_paths // max(1, len(path_idx))), self.draft_len
            else:
                share, length = -(-left // k), self.draft_len if ctl is None or ctl.cheap(i) \
                    else depths[i]
                k -= 1
            t0 = time.perf_counter()
            got = d.propose(context, share, length, sp) if (share or tree) else []
            secs[i] = time.perf_counter() - t0
            if not tree:
                got = got[:share]
            props[i] = [p.tokens for p in got]
            if depths[i]:
                if not tree:
                    left -= len(got)
                    if length > depths[i]:            # drafted deeper for its score only
                        got = [DraftPath(p.tokens[:depths[i]], None if p.q is None
                                         else p.q[:depths[i]], p.drafter, p.meta) for p in got]
                paths += got
        return paths, props, secs

    def _verify(self, tree: TokenTree, n: int, meta: AttnMeta, sp: SamplingParams):
        """One target forward over `tree` after `n` tokens -> (accepted node path, the next
        token, the captured features or None)."""
        m = self.model
        logits = m.forward(tree.tokens.to(m.device), tree.positions(n).to(m.device), self.pool,
                           meta, capture=self.capture)
        feats = None
        if self.capture:
            logits, feats = logits
        if sp.greedy:
            return (*verify_greedy(tree, logits), feats)
        return (*verify_sampling(tree, logits, sp), feats)

    def _spec_step(self, B, context: list[int], sp: SamplingParams, st: "_Stats") -> list[int]:
        """Draft, verify every path in one forward, commit the accepted fork, free the rest."""
        m, kv = self.model, self.kv
        n = B.length
        ctl = self.controller
        depths = ctl.plan() if ctl is not None else [self.draft_len] * len(self.drafters)
        paths, props, secs = self._propose(context, sp, depths)
        t_verify = time.perf_counter()
        tree = TokenTree.build(context[-1], paths, self.tree_budget)
        if len(tree) == 1:              # nothing drafted: a plain decode step, straight into B
            meta = AttnMeta.prefill(m, kv.slots(B), kv.append(B, 1))
            path, nxt, feats = self._verify(tree, n, meta, sp)
        else:
            leaves = tree.leaf_paths()                   # node lists root..leaf
            forks = []                                   # one CoW fork of B per draft path
            try:                                         # a failure (or Ctrl-C) frees them
                writes = []
                for p in leaves:
                    forks.append(kv.fork(B))
                    writes.append(kv.append(forks[-1], len(p)))
                meta = AttnMeta.tree(m, kv.slots(B), tree.ancestor_mask(), torch.cat(writes),
                                     torch.tensor([i for p in leaves for i in p]))
                path, nxt, feats = self._verify(tree, n, meta, sp)
            except BaseException:
                for f in forks:
                    kv.release(f)
                raise
            keep = next(i for i, p in enumerate(leaves) if p[:len(path)] == path)
            for i, f in enumerate(forks):
                if i != keep:
                    kv.release(f)
            kv.truncate(forks[keep], n + len(path))
            kv.adopt(B, forks[keep])
        st.record(tree, path)
        emitted = [int(tree.tokens[i]) for i in path[1:]] + [nxt]
        t_verify = time.perf_counter() - t_verify
        for i, d in enumerate(self.drafters):
            if not getattr(d, "features", None):
                t0 = time.perf_counter()
                d.observe(context + emitted)
                secs[i] += time.perf_counter() - t0
        if self.capture:
            t0 = time.perf_counter()
            self._hand_features(context + emitted, feats[torch.tensor(path, device=feats.device)])
            t_feat = time.perf_counter() - t0
            for i, d in enumerate(self.drafters):
                if getattr(d, "features", None):
                    secs[i] += t_feat
        if ctl is not None:
            ctl.update(depths, props, secs, emitted, len(tree.tokens), t_verify)
        return emitted


class _Stats:
    def __init__(self, drafters):
        self.forwards = 0
        self.proposed = {d.name: 0 for d in drafters}
        self.accepted = {d.name: 0 for d in drafters}
        self.steps = 0
        self.tree_steps = 0             # steps that verified a draft (the rest: a decode step)
        self.tree_nodes = 0
        self.accepted_nodes = 0

    def record(self, tree: TokenTree, path: list[int]) -> None:
        self.steps += 1
        self.tree_steps += len(tree.tokens) > 1
        self.tree_nodes += len(tree.tokens) - 1
        self.accepted_nodes += len(path) - 1
        for u in range(1, len(tree.tokens)):
            for name in tree.node_drafters[u]:
                self.proposed[name] = self.proposed.get(name, 0) + 1
        for u in path[1:]:
            for name in tree.node_drafters[u]:
                self.accepted[name] = self.accepted.get(name, 0) + 1

    def finish(self, new_tokens: int, wall: float, pool, kv: KVTree) -> dict:
        return {
            "new_tokens": new_tokens,
            "target_forwards": self.forwards,
            "mean_accepted": new_tokens / max(1, self.forwards),
            "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
            "wall_s": wall,
            "kv_peak_bytes": pool.peak_bytes,
            "kv_bytes_per_token": pool.bytes_per_token,
            "kv_blocks_leaked": pool.used_blocks,
            "spec_steps": self.steps,
            "tree_steps": self.tree_steps,
            "draft_tokens_proposed": self.tree_nodes,
            "draft_tokens_accepted": self.accepted_nodes,
            "acceptance_rate": self.accepted_nodes / self.tree_nodes if self.tree_nodes else 0.0,
            "per_drafter": {k: {"proposed": self.proposed[k], "accepted": self.accepted.get(k, 0)}
                            for k in self.proposed},
        }
