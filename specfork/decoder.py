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
from specfork.kv_quant import calibration_ids, check_window_flags, parse_kv_format
from specfork.kv_tree import KVTree
from specfork.model import Model
from specfork.request import Request
from specfork.scheduler import MAX_BATCH, PREFILL_TOKENS
from specfork.sampling import check_sampling, sampling_params
from specfork.token_tree import TokenTree
from specfork.types import GenerateOutput
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
        self.model = model
        # room for every verify fork: one per draft path or tree leaf (+1), each up to the
        # deepest draft + 1 tokens
        self.engine = Engine(model, tokenizer, max_kv_tokens, block_size, eos_token_ids,
                             forks=self.num_paths + tree_nodes + 1, fork_tokens=deepest + 1)
        self.model, self.tokenizer, self.kv = model, tokenizer, self.engine.kv
        self.pool, self.eos = self.kv.pool, self.engine.eos
        self.engine.capture = self.capture if self.num_paths else None
        self.feature_cols = self._feature_cols(self.drafters)
        self.controller = None
        if adaptive and self.num_paths:        # times the verify forward once per model
            self.controller = DraftController(
                self.drafters, draft_len,
                cost_model.for_model(model, self.kv, self.tree_budget + 1),
                num_paths=self.num_paths)
        self.warm_start = False          # `serving`: adaptive drafting warm-starts requests
        # drafter sets free for the next request: the decoder's own first (`_acquire_drafters`)
        self._free_sets = [(self.drafters, self.controller)] if self.num_paths else []

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", drafts: int = 0,
                        drafter: str | None = None, draft_len: int = DRAFT_LEN,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        min_conf: float | None = None, draft_vocab: int | None = None,
                        tree_topk: int | None = None, tree_depth: int | None = None,
                        draft_tokens: int | None = None, adaptive: bool = True,
                        weights: str = "auto", kv_cache: str = "auto", kv_window: int = 0,
                        tensor_parallel: int = 1, **kw) -> "SpecDecoder":
        """`tree_topk`, `tree_depth`, `draft_tokens`: the EAGLE draft tree's shape (None: the
        tuned defaults). `adaptive` (on by default here): see `SpecDecoder`. `weights`: the
        target's weight format (`specfork/weights.py`: auto, float32, bfloat16, int8, int4;
        auto is int4 where it holds the weights exactly, as for the embedded target, with 8-bit
        activations as llama.cpp).
        `kv_cache`: the target's KV format (`specfork/kv_quant.py`: auto, float32, bfloat16,
        float16, turbo4, turbo3.5, turbo3, turbo2.5). `kv_window`: with a turbo format, each
        token reads its last `kv_window` keys and values, and the first token's, at float16
        instead of through their codes (`BlockPool`; results/kv_window_study.md: most of the
        formats' perplexity loss). `tensor_parallel`: shard the target over
        that many ranks (`specfork/parallel.py`; drafters stay on this process, rank 0)."""
        from specfork.drafters import eagle
        from specfork.drafters.registry import make_drafters
        from specfork.loader import check_device, load_hf
        tree = eagle.tree_shape(tree_topk, tree_depth, draft_tokens)
        check_drafting(drafts, draft_len, drafter, target, min_conf, draft_vocab, tree)
        check_device(device)                               # all before any weights load
        check_weights(weights, device)
        parse_kv_format(kv_cache)
        check_window_flags(kv_window, kv_cache, tensor_parallel)
        if tensor_parallel != 1:
            from specfork import parallel
            model, tok = parallel.start(tensor_parallel, dict(
                target=target, dtype=dtype, device=device, weights=weights, kv_cache=kv_cache))
        else:
            hf, tok = load_hf(target, dtype=dtype, device=device)
            model = Model(hf, weights=weights, kv_cache=kv_cache, kv_window=kv_window)
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

    # -- requests -------------------------------------------------------------------------------
    def _acquire_drafters(self):
        """A drafter set of its own for one request (with its controller): the decoder's own
        first, then spare ones (`spawn`: the same weights, their own KV trees) as concurrent
        requests need them; `release` hands it back."""
        if not self.num_paths:
            return [], None, {}, lambda: None
        if self._free_sets:
            ds, ctl = self._free_sets.pop()
        else:
            ds = [d.spawn() for d in self.drafters]
            ctl = None
            if self.controller is not None:
                ctl = DraftController(ds, self.draft_len, cost_model.CostModel(
                    self.controller.cost.table), num_paths=self.num_paths)
                if self.warm_start:          # a new concurrent request starts from what the
                    ctl.inherit(self.controller)   # first set measured, not from the prior
        if ctl is not None:
            ctl.warm_start = self.warm_start
        cols = self._feature_cols(ds)
        return ds, ctl, cols, lambda: self._free_sets.append((ds, ctl))

    def serving(self, max_batch: int = MAX_BATCH, prefill_tokens: int = PREFILL_TOKENS,
                prefix_cache: bool = True) -> "SpecDecoder":
        """Set up for many requests (a server): the engine's batch and prefill settings and its
        prefix cache, and adaptive drafting that starts each request from what the previous
        one on the same drafters measured (`DraftController.warm_start`)."""
        self.engine.configure(max_batch, prefill_tokens, prefix_cache)
        self.warm_start = True
        return self

    def _feature_cols(self, drafters) -> dict:
        """Per feature drafter, its columns of the captured [k, len(capture) * hidden] rows
        (None: all of them, in order), on the model's device."""
        cols = {}
        if self.capture:
            H = self.model.embed.shape[1]
            for d in drafters:
                want = getattr(d, "features", None)
                if want:
                    c = [j for i in want for j in range(self.capture.index(i) * H,
                                                        (self.capture.index(i) + 1) * H)]
                    same = c == list(range(len(self.capture) * H))
                    cols[id(d)] = None if same else torch.tensor(c, device=self.model.device)
        return cols

    def request(self, prompt_ids: list[int], max_new_tokens: int = 128,
                temperature: float = 0.0, top_p: float | None = None, top_k: int | None = None,
                seed: int | None = None, n: int = 1,
                on_tokens: Callable[[int, list[int]], None] | None = None,
                logprobs: int | None = None) -> list[Request]:
        """`n` engine requests for one prompt (checked ids): the first prefills it, the others
        fork it (`Engine.add` the first only). Choice i draws with seed + i where a seed is
        given. `on_tokens(i, new)` gets each choice's emitted tokens as they come."""
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed)
        if not isinstance(n, int) or n < 1:
            raise SpecforkError(f"n must be a positive integer, got {n}")
        self.engine.check_length(len(prompt_ids), max_new_tokens)
        reqs = []
        for i in range(n):
            sp = sampling_params(temperature, top_p, top_k, None if seed is None else seed + i)
            ds, ctl, cols, give_back = self._acquire_drafters()
            cb = None if on_tokens is None else (lambda new, i=i: on_tokens(i, new))
            r = Request(prompt_ids, max_new_tokens, sp, self.eos, ds, ctl, self.num_paths,
                        self.draft_len, self.tree_budget, self.capture, cols, cb,
                        stats=_Stats(ds), logprobs=logprobs)
            r.release_drafters = give_back
            reqs.append(r)
        reqs[0].siblings = reqs[1:]
        return reqs

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, raw: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerateOutput:
        """One request through the engine's loop (`Engine.step`), alone."""
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed)
        prompt_ids = self.encode(prompt, raw)
        (req,) = self.request(prompt_ids, max_new_tokens, temperature, top_p, top_k, seed,
                              on_tokens=None if on_tokens is None else
                              (lambda i, new: on_tokens(new)))
        self.pool.reset_peak()
        forwards = self.engine.counters["steps"]
        t0 = time.perf_counter()
        self.engine.run([req])
        wall = time.perf_counter() - t0
        req.stats.forwards = self.engine.counters["steps"] - forwards
        stats = req.stats.finish(len(req.out), wall, self.pool, self.kv)
        if req.controller is not None:
            stats["adaptive"] = req.controller.stats([d.name for d in req.drafters])
        return GenerateOutput(self.engine.decode(req.out), req.out, prompt_ids, stats)


class _Stats:
    def __init__(self, drafters):
        self.forwards = 0
        self.proposed = {d.name: 0 for d in drafters}
        self.accepted = {d.name: 0 for d in drafters}
        self.steps = 0
        self.tree_steps = 0             # steps that verified a draft (the rest: a decode step)
        self.tree_nodes = 0
        self.accepted_nodes = 0

    def record(self, tree: TokenTree | None, path: list[int]) -> None:
        """A drafting request's step: `tree` verified (None: an off step, no tree), `path`
        the nodes accepted."""
        self.steps += 1
        if tree is None:
            return
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
