"""The engine: what every decoding loop over one target shares (the model, its tokenizer, one
KV tree, the EOS set), the checks a request passes before it touches the KV tree, and the one
loop of speculative decoding: `step` runs one target forward over every running request
(continuous batching, in the spirit of nano-vllm's `LLMEngine`).

`SpecDecoder`, beam search, sessions and MCTS all run on an `Engine`, so none of them borrows
another's internals, and each rule (chat template, token-id range, context limit, EOS, pool
size) is written once. `SpecDecoder.generate` is one request through `step`; a server, many.

A step: waiting requests join while there is room (a prompt whose start is in the prefix cache
forks that branch instead of prefilling it); each running request plans its rows (a prompt
chunk, one decode token, or its verify tree: `specfork/request.py`); all rows run as one
forward under a block-diagonal `BatchMeta`; each request commits its own. Speculation is
planned per request against the rest of the batch (`DraftController.plan(ctx)`): as the batch
grows, a tree's rows add more to the step's time than its tokens are worth, and drafting
switches off, from measured step costs; `SpecGate` (`specfork/spec_gate.py`) decides from
measured steps whether a batch of that size speculates at all.
"""
from __future__ import annotations

import threading
import time

import torch

from specfork.attention import BatchMeta
from specfork.errors import SpecforkError
from specfork.kv_tree import KVTree, blocks_for
from specfork.model import Model
from specfork.prefix_cache import PrefixCache
from specfork.request import FINISHED, RUNNING, Request
from specfork.scheduler import MAX_BATCH, PREFILL_TOKENS, Scheduler
from specfork.spec_gate import SpecGate

DEFAULT_KV_TOKENS = 8192           # KV pool size when none is given (capped at the context)
SHARE_MIN = 32                     # prompt tokens shared with one being prefilled: worth a wait


def check_prompt(prompt) -> None:
    """A prompt must hold something: empty or whitespace-only text, or no token ids, is an error."""
    if (isinstance(prompt, str) and not prompt.strip()) or len(prompt) == 0:
        raise SpecforkError("the prompt is empty")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecforkError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")


def eos_ids(model: Model, tokenizer=None, given: list[int] | None = None) -> set[int]:
    """EOS ids: those given, else the generation config's (one id or a list, as Llama 3 has),
    else the tokenizer's; empty when none is known."""
    eos = model.hf.generation_config.eos_token_id if given is None else given
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))


class Engine:
    """One target, its tokenizer and one KV tree, shared by every loop that decodes on them.

    `forks`/`fork_tokens` reserve pool room beyond `max_kv_tokens` for that many live forks of
    a request's branch, each appending up to `fork_tokens` (draft paths under verification)."""

    def __init__(self, model: Model, tokenizer=None, max_kv_tokens: int | None = None,
                 block_size: int | None = None, eos_token_ids: list[int] | None = None,
                 forks: int = 0, fork_tokens: int = 0):
        self.model, self.tokenizer = model, tokenizer
        self.context_len = model.max_positions
        self.max_kv_tokens = max_kv_tokens or min(self.context_len, DEFAULT_KV_TOKENS)
        bs = block_size or model.block_size
        self.kv = KVTree(model.make_pool(
            num_blocks=blocks_for(self.max_kv_tokens, bs, forks, fork_tokens), block_size=bs))
        self.eos = eos_ids(model, tokenizer, eos_token_ids)
        self.capture = None             # target features the requests' drafters read
        self.scheduler = Scheduler()
        self.cache: PrefixCache | None = None
        self.gate = SpecGate()          # does the batch speculate at all (measured per size)
        self.lock = threading.Lock()    # guards the inbox: other threads add and cancel
        self.inbox: list[Request] = []
        self.cancels: list[Request] = []
        self.counters = dict(steps=0, emitted=0, prompt_tokens=0, cached_tokens=0,
                             preemptions=0, draft_proposed=0, draft_accepted=0, busy_s=0.0)

    def configure(self, max_batch: int = MAX_BATCH, prefill_tokens: int = PREFILL_TOKENS,
                  prefix_cache: bool = False) -> None:
        """Serving settings: requests per forward, prompt tokens per step while others decode,
        and whether finished requests' branches stay as a prefix cache."""
        if max_batch < 1 or prefill_tokens < 1:
            raise SpecforkError("max_batch and prefill_tokens must be >= 1")
        self.scheduler.max_batch, self.scheduler.prefill_tokens = max_batch, prefill_tokens
        if prefix_cache and self.cache is None:
            self.cache = PrefixCache(self.kv)
        elif not prefix_cache and self.cache is not None:
            self.cache.clear()
            self.cache = None

    @property
    def pool(self):
        return self.kv.pool

    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        """Token ids of a prompt: text through the chat template (unless `raw` or the tokenizer
        has none), ids as given; both checked."""
        check_prompt(prompt)
        if not isinstance(prompt, str) or self.tokenizer is None:
            ids = [int(t) for t in prompt]
        elif not raw and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        check_prompt(ids)
        check_token_ids(ids, self.model.vocab_size)
        return list(ids)

    def check_length(self, prompt_len: int, max_new_tokens: int) -> None:
        """The prompt and every new token must fit the model's positions and the KV pool."""
        limit = min(self.context_len, self.max_kv_tokens)
        if prompt_len + max_new_tokens > limit:
            raise SpecforkError(f"prompt of {prompt_len} tokens + {max_new_tokens} new tokens "
                                f"exceeds the context of {limit} tokens")

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer else ""

    # -- the loop -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request (any thread); it joins the batch at a coming step."""
        self.check_length(len(req.prompt), req.max_new)
        with self.lock:
            self.inbox.append(req)

    def cancel(self, req: Request) -> None:
        """Cancel a request (any thread): at the next step it stops and frees its branches."""
        with self.lock:
            self.cancels.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.inbox or self.cancels or len(self.scheduler))

    def run(self, reqs: list[Request]) -> None:
        """Queue `reqs` and step until they are all finished (their siblings too)."""
        for r in reqs:
            self.add(r)
        every = [s for r in reqs for s in [r] + r.siblings]
        try:
            while not all(r.done for r in every):
                self.step()
        except BaseException:
            for r in every:                 # a failure (or Ctrl-C) frees what they hold
                if not r.done:
                    self.scheduler.remove(r)
                    r.finish_reason = r.finish_reason or "abort"
                    self._finish(r)
            raise

    def step(self) -> list[Request]:
        """One forward over every running request; returns the requests finished by it."""
        with self.lock:
            inbox, self.inbox = self.inbox, []
            cancels, self.cancels = self.cancels, []
        for r in inbox:
            self.scheduler.add(r)
        done = []
        for r in cancels:
            if not r.done:
                self.scheduler.remove(r)
                r.finish_reason = r.finish_reason or "abort"
                self._finish(r)
                done.append(r)
        sch = self.scheduler
        sch.admit(self._place)
        if not sch.running:
            return done
        t0 = time.perf_counter()
        decoding, chunks = self._make_room()
        drafting = any(r.num_paths for r in decoding)
        spec = drafting and self.gate.allow(len(decoding))
        parts = []
        try:
            self._plan(decoding, chunks, parts, spec)
            logits, feats, sizes = self._forward(parts)
        except BaseException:
            for r, p in parts:
                r.cancel_rows(self.kv, p)
            raise
        rows_total = sum(sizes)
        step_s = time.perf_counter() - t0
        li = a = 0
        c = self.counters
        emitted = c["emitted"]
        for (r, p), n in zip(parts, sizes):
            lg = logits[li:li + len(p.logits)]
            li += len(p.logits)
            f = None if feats is None else feats[a:a + n]
            a += n
            lead = p.kind == "prefill" and not r.prefilling and not r.out and (
                r.siblings or self.cache is not None)
            new = r.commit(self.kv, p, lg, f, rows_total, step_s)
            c["emitted"] += len(new)
            if p.tree is not None and len(p.tree) > 1:
                c["draft_proposed"] += len(p.tree) - 1
                c["draft_accepted"] += len(new) - 1
            if lead:
                done += self._fork_siblings(r, p, lg, f, rows_total, step_s)
            if r.finish_reason is not None:
                sch.remove(r)
                self._finish(r)
                done.append(r)
        c["steps"] += 1
        c["busy_s"] += time.perf_counter() - t0
        if drafting and not chunks:
            self.gate.record(len(decoding), spec, c["emitted"] - emitted,
                             time.perf_counter() - t0)
        return done

    def fail_running(self, error: str) -> None:
        """A step failed (not the requests' fault: they passed their checks): end every
        running request with `error` and free what it holds; waiting ones go on."""
        for r in list(self.scheduler.running):
            self.scheduler.remove(r)
            r.finish_reason, r.error = "error", error
            self._finish(r)

    # -- pieces of a step -----------------------------------------------------------------------
    def _place(self, req: Request) -> bool:
        """Give a waiting request its branch (a fork of the prefix cache where its prompt's
        start is cached) if the pool has room for the rest of its prompt; False: not now."""
        br, m = (None, 0)
        if self.cache is not None:
            if self._shares_prefill(req):
                return False
            br, m = self.cache.fork(req.tokens, req.target - (0 if req.out else 1))
        need = self._blocks(req.target - m) + 2 + self._watermark()
        while len(self.pool.free) < need:
            if self.cache is None or not self.cache.evict():
                break
        if len(self.pool.free) < need and self.scheduler.running:
            if br is not None:
                self.kv.release(br)
            return False
        req.branch = br if br is not None else self.kv.new_branch()
        req.cached_tokens = m
        req.status = RUNNING
        self.counters["prompt_tokens"] += len(req.prompt) if not req.preempted else 0
        self.counters["cached_tokens"] += m
        req.start_drafters()
        return True

    def _shares_prefill(self, req: Request) -> bool:
        """A running request is prefilling a prompt that starts as `req`'s does (by more than
        the cache already holds): `req` waits for it to be cached rather than prefill the same
        tokens beside it (in-batch prefix sharing, as SGLang's scheduler does)."""
        have = self.cache.match(req.tokens)[0] if len(self.cache) else 0
        for r in self.scheduler.running:
            if r.prefilling and r is not req:
                n = 0
                for a, b in zip(req.tokens, r.prompt):
                    if a != b:
                        break
                    n += 1
                if n - have >= SHARE_MIN:
                    return True
        return False

    def _blocks(self, tokens: int) -> int:
        """Blocks that `tokens` new tokens of one branch take, a partial last one included."""
        return -(-tokens // self.pool.block_size) + (self.pool.block_size > 1)

    def _watermark(self) -> int:
        """Blocks kept free at admission for the running requests' next tokens (1%)."""
        return self.pool.num_blocks // 100 + 2 * len(self.scheduler.running)

    def _make_room(self):
        """This step's (decoding, prefill chunks), after evicting cached prefixes and then
        preempting the newest requests until every chunk and decode token has a block."""
        sch, bs = self.scheduler, self.pool.block_size
        while True:
            decoding, chunks = sch.plan()
            need = sum(self._blocks(n) for _, n in chunks) + 2 * len(decoding)
            if len(self.pool.free) >= need:
                return decoding, chunks
            if self.cache is not None and self.cache.evict():
                continue
            if len(sch.running) == 1:
                if chunks and len(self.pool.free) >= 2:      # prefill what fits
                    return decoding, [(chunks[0][0], (len(self.pool.free) - 1) * bs)]
                return decoding, chunks                      # the pool error says why
            self._preempt(sch.victim())

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it waits again and is recomputed from its tokens."""
        self.scheduler.requeue(req)
        req.stop_drafters()
        self.kv.release(req.branch)
        req.branch = None
        req.preempted += 1
        self.counters["preemptions"] += 1

    def _plan(self, decoding: list[Request], chunks: list, parts: list, spec: bool) -> None:
        """Each request's rows into `parts`: prefill chunks first, then decoding requests, each
        speculating (where `spec`: the gate lets the batch) as its controller plans against
        the rest of the step."""
        for r, n in chunks:
            parts.append((r, r.plan_prefill(self.model, self.kv, n)))
        reserve = 2 * len(decoding)
        rows = sum(p.tokens.numel() for _, p in parts) + len(decoding)
        toks, secs = float(len(decoding)), 0.0
        for r in decoding:
            reserve -= 2
            rows -= 1
            toks -= 1
            if spec and r.num_paths:
                paths, props, dsecs, depths = r.propose((toks, rows, secs))
                p = r.plan_tree(self.model, self.kv, paths, depths, props, dsecs,
                                room=len(self.pool.free) - reserve)
                secs += sum(dsecs)
                toks += 1 + (r.controller.predicted if r.controller is not None else 0.0)
            else:
                p = r.plan_decode(self.model, self.kv)
                toks += 1
            rows += p.tokens.numel()
            parts.append((r, p))

    def _forward(self, parts: list):
        """One target forward over every part's rows -> (logits of the rows read, features or
        None, rows per part)."""
        sizes = [p.tokens.numel() for _, p in parts]
        idx, a = [], 0
        for (_, p), n in zip(parts, sizes):
            idx += [a + i for i in p.logits]
            a += n
        capture = self.capture if any(r.capture for r, _ in parts) else None
        dev = self.model.device
        if len(parts) == 1:          # one request (a lone generate): no gathers to build
            p = parts[0][1]
            tokens, positions, meta = p.tokens, p.positions, p.meta
        else:
            tokens = torch.cat([p.tokens for _, p in parts])
            positions = torch.cat([p.positions for _, p in parts])
            meta = BatchMeta([p.meta for _, p in parts], sizes)
        # rows read in one run (a decode step, a whole tree, a prompt's last row): a view
        run = bool(idx) and idx == list(range(idx[0], idx[0] + len(idx)))
        out = self.model.forward(tokens, positions, self.pool, meta,
                                 logits_idx=slice(idx[0], idx[0] + len(idx)) if run else
                                 torch.tensor(idx, dtype=torch.long, device=dev),
                                 capture=capture)
        logits, feats = out if capture else (out, None)
        return logits, feats, sizes

    def _fork_siblings(self, lead: Request, rows, logits, feats, step_rows, step_s) -> list:
        """The lead's prompt is prefilled: the lead and its siblings (n > 1) each continue on a
        CoW fork of it, so the prompt is stored once, and with the prefix cache on the prompt
        branch is cached now, for requests that start the same way while this one decodes.
        Siblings draw their first token from the same logits with their own generators.
        Returns the siblings already finished."""
        P = lead.branch
        lead.branch = self.kv.fork(P)
        done = []
        for sib in lead.siblings:
            sib.branch = self.kv.fork(P)
            sib.status = RUNNING
            sib.start_drafters()
            self.scheduler.running.append(sib)
            self.counters["emitted"] += len(sib.commit(self.kv, rows, logits, feats, step_rows,
                                                       step_s))
            if sib.finish_reason is not None:
                self.scheduler.remove(sib)
                self._finish(sib)
                done.append(sib)
        if self.cache is not None:
            self.cache.insert(lead.prompt, P)
        else:
            self.kv.release(P)
        return done

    def _finish(self, req: Request) -> None:
        """A finished (or cancelled, or failed) request frees its drafters' state; its branch
        goes to the prefix cache (when on) or is released."""
        req.stop_drafters()
        if req.release_drafters is not None:
            req.release_drafters()
            req.release_drafters = None
        if req.branch is not None:
            n = req.branch.length
            if self.cache is not None and n > 0 and req.finish_reason != "error":
                self.cache.insert(req.tokens[:n], req.branch)
            else:
                self.kv.release(req.branch)
            req.branch = None
        for sib in req.siblings:             # a lead that ends before its prompt is prefilled
            if sib.status != RUNNING and not sib.done:
                sib.finish_reason = req.finish_reason
                sib.error = req.error
                self._finish(sib)
        req.status = FINISHED
        if req.on_done is not None:
            req.on_done(req)
