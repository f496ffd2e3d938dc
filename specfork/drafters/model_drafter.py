"""A small causal LM as drafter, with its own KV tree.

Its committed branch C follows the request's context; every candidate path is a CoW fork of C,
and all paths extend in one batched forward per draft position (each query sees C plus its own
fork). A path stops growing once the draft itself is unsure of it (`min_conf`), so a weak draft
spends neither draft forwards nor verification rows on tokens that would almost surely be rejected.
After verification the fork holding the accepted tokens is adopted into C, the rest freed.

With `vocab` (token ids, e.g. the target's most frequent outputs) the draft's output layer keeps
only those rows plus every token of the request's context (FR-Spec's frequency-ranked head): a
small draft spends most of a step in its vocabulary-wide lm_head, and the target seldom emits a
token outside that set. The draft distribution q is then zero outside the set, still a valid
proposal for lossless speculative sampling.
"""
from __future__ import annotations

import time

import torch

from specfork.types import DraftPath, SamplingParams
from specfork.errors import SpecforkError
from specfork.kv_tree import KVTree, blocks_for
from specfork.attention import AttnMeta
from specfork.model import Linear, Model
from specfork.sampling import probs_from_logits

# A path stops after the token that takes its draft probability (the product over its tokens,
# each a softmax over the draft's output rows: its vocabulary head where it has one) below
# this. Chosen with eval/tune_drafting.py on six hand-written prompts (none from MT-bench or
# HumanEval); results/tune_drafting.json, default mix, 3 paths, 4 tokens: 0.3 runs at 1.20x our
# greedy, 0 at 0.91x (with the whole output layer: 1.11x against 0.74x); tau 1.88 against 2.10.
MIN_CONF = 0.3
# A long context is read as its first SINK tokens and its last WINDOW ones (StreamingLLM's
# attention sinks + recent window): a request's first draft would otherwise prefill the whole
# prompt through the draft, paid by every request of a batch that shares a long system prompt
# (the target's copy comes from the prefix cache, the draft's does not), and by every long
# document. Drafts only propose: what the draft reads changes acceptance, never the output.
SINK, WINDOW = 4, 256


class DraftHead:
    """Logits over a draft's head rows: its vocabulary's, then the request's extra ones."""
    __slots__ = ("static", "extra")

    def __init__(self, static, extra: Linear | None):
        self.static, self.extra = static, extra

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        y = self.static(x, bulk)
        return y if self.extra is None else torch.cat((y, self.extra(x, bulk)), dim=-1)

    @property
    def nbytes(self) -> int:
        """Weight bytes: the vocabulary's rows (shared by every request) and the extra ones."""
        return self.static.nbytes + (0 if self.extra is None else self.extra.nbytes)


def check_min_conf(min_conf: float) -> None:
    if not 0.0 <= min_conf <= 1.0:
        raise SpecforkError(f"min_conf must be in [0, 1], got {min_conf}")


class ModelDrafter:
    def __init__(self, model: Model, name: str = "model", max_kv_tokens: int = 8192,
                 max_paths: int = 8, max_len: int = 16, block_size: int | None = None,
                 min_conf: float = MIN_CONF, vocab: torch.Tensor | None = None,
                 _static: list | None = None):
        check_min_conf(min_conf)
        self.model, self.name = model, name
        self.min_conf = min_conf
        if vocab is not None:
            vocab = torch.as_tensor(vocab, dtype=torch.long).flatten().cpu()
            if vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= model.vocab_size:
                raise SpecforkError(f"draft vocab must be non-empty ids in [0, {model.vocab_size})")
            vocab = vocab.unique()            # a repeated row would count its token twice in q
        self.vocab = vocab                   # static head rows; None: the whole vocabulary
        self._static = _static or [None]     # their matmul, built once, shared by spawns
        if vocab is not None and self._static[0] is None:   # here, not in a request's first
            self._static[0] = model.head_rows(vocab)         # read, whose time is its rate
        self.head: DraftHead | None = None   # lm_head rows of head_ids (this request)
        self.head_ids: torch.Tensor | None = None
        self.extra_ids: torch.Tensor | None = None   # the request's own rows beyond vocab
        self.in_head: torch.Tensor | None = None   # [V] bool: which ids the head has
        block_size = block_size or model.block_size
        self._shape = (max_kv_tokens, max_paths, max_len, block_size)
        self.pool = model.make_pool(num_blocks=blocks_for(max_kv_tokens, block_size, max_paths,
                                                          max_len), block_size=block_size)
        self.kv = KVTree(self.pool)
        self.C = None
        self.skip = 0                        # context tokens C leaves out after its SINK first
        self.forks: list = []                # live draft forks of C, one per proposed path
        self.fork_tokens: list[list[int]] = []

    @classmethod
    def load(cls, name: str, target_model: Model | None = None, min_conf: float = MIN_CONF,
             max_paths: int = 8, max_len: int = 16) -> "ModelDrafter":
        from specfork.loader import load_hf, resolve
        if target_model is not None and resolve(name) == getattr(target_model.hf, "name_or_path",
                                                                 None):
            model = target_model                 # self-drafting: share the weights
        else:
            hf, _ = load_hf(name, dtype=target_model.dtype if target_model else None,
                            device=str(target_model.device) if target_model else None)
            model = Model(hf)
        if target_model is not None and model.vocab_size != target_model.vocab_size:
            raise SpecforkError(f"draft '{name}' has vocabulary {model.vocab_size}, the target "
                                f"{target_model.vocab_size}: a draft must share the tokenizer")
        return cls(model, name=f"model:{name}", min_conf=min_conf, max_paths=max_paths,
                   max_len=max_len)

    def spawn(self) -> "ModelDrafter":
        """A drafter for another concurrent request: the same weights and head rows, a KV
        tree of its own."""
        kv_tokens, paths, length, bs = self._shape
        return ModelDrafter(self.model, self.name, kv_tokens, paths, length, bs, self.min_conf,
                            self.vocab, self._static)

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> None:
        self.end()
        self.C = self.kv.new_branch()
        self.skip = 0
        self.last_read = (0, 0.0)            # the last propose's read: (tokens, seconds)
        if self.vocab is not None:            # the head itself is built on the first propose:
            self.in_head = torch.zeros(self.model.vocab_size, dtype=torch.bool)  # a request
            self.in_head[self.vocab] = True    # the controller never drafts with (a busy
            self.head_ids = self.vocab         # server) never pays for it
            self.extra_ids = self.vocab[:0]

    def end(self) -> None:
        self._drop_forks()
        if self.C is not None:
            self.kv.release(self.C)
            self.C = None
        self.head = self.head_ids = self.in_head = self.extra_ids = None

    def observe(self, context: list[int]) -> None:
        """Adopt the fork that holds the longest accepted prefix; free the others."""
        n = self.C.length
        new = context[n + self.skip:]
        best, best_j = None, 0
        for f, toks in zip(self.forks, self.fork_tokens):
            j = 0
            limit = min(len(new), f.length - n)          # K/V computed for these tokens
            while j < limit and toks[j] == new[j]:
                j += 1
            if j > best_j:
                best, best_j = f, j
        for f in self.forks:
            if f is not best:
                self.kv.release(f)
        self.forks, self.fork_tokens = [], []
        if best is not None:
            self.kv.truncate(best, n + best_j)
            self.kv.adopt(self.C, best)

    def unread(self, context: list[int]) -> int:
        """Tokens of `context` the next `propose` reads before it drafts (all of a long prompt
        it has never seen: its first SINK and last WINDOW; after a gap, what came since)."""
        n = self.C.length if self.C is not None else 0
        if n == 0:
            return min(len(context), SINK + WINDOW)
        return max(0, len(context) - n - self.skip)

    @torch.inference_mode()
    def propose(self, context: list[int], num_paths: int, max_len: int,
                sp: SamplingParams) -> list[DraftPath]:
        """Top-k (greedy) or k sampled first tokens, then one token per path and position.
        A path stops growing once the product of its tokens' draft probabilities falls below
        `min_conf` (its last, unlikely token is still proposed: verifying it costs one tree
        row, drafting past it a draft forward that would rarely pay); in greedy mode a branch
        other than the first whose first token is already below it is not proposed at all."""
        m, kv, dev = self.model, self.kv, self.model.device
        self._drop_forks()
        n = self.C.length
        if n == 0 and len(context) > SINK + WINDOW:            # first read of a long context
            self.skip = len(context) - SINK - WINDOW
            unread = context[:SINK] + context[SINK + self.skip:]
        else:
            if n + self.skip >= len(context):    # never expected: the context only grows
                kv.truncate(self.C, len(context) - self.skip - 1)
                n = self.C.length
            unread = context[n + self.skip:]
        t_read = time.perf_counter()
        if self.in_head is not None:           # tokens the draft has not read yet (first
            self._extend_head(unread if self.head is not None else context)   # call: all)
        feed = torch.tensor(unread, device=dev)
        prefix = kv.slots(self.C)
        slots = kv.append(self.C, len(feed))
        logits = m.forward(feed, torch.arange(n, n + len(unread), device=dev), self.pool,
                           AttnMeta.prefill(m, prefix, slots),
                           logits_idx=slice(len(feed) - 1, len(feed)), head=self.head)[0]
        first, q0, conf = self._choose(logits, max(1, num_paths), sp)
        self.last_read = (len(unread), time.perf_counter() - t_read)   # (tokens, seconds)
        # Greedy: any pruning is exact. Sampling: the first draws must stay i.i.d. from q for
        # the verifier's residual updates, so none is dropped for its value; a path's length
        # may still depend on its own earlier tokens (that decides whether a node has children,
        # never which child it gets).
        keep = [i for i, c in enumerate(conf) if i == 0 or c >= self.min_conf or not sp.greedy]
        toks = [[first[i]] for i in keep]
        conf = [conf[i] for i in keep]
        qs = [[q0] if q0 is not None else [] for _ in keep]
        self.forks = [kv.fork(self.C) for _ in keep]
        self.fork_tokens = toks
        base = self.C.length
        committed = torch.cat([prefix, slots])                # C's slots, shared by every path
        own = [committed[:0]] * len(self.forks)               # each fork's own slots so far
        for step in range(1, max_len):
            live = [i for i, c in enumerate(conf) if c >= self.min_conf]
            if not live:
                break
            # each live path's last token: its K/V go into its fork, its logits give the next
            write = [kv.append(self.forks[i], 1) for i in live]
            last = torch.tensor([toks[i][-1] for i in live], device=dev)
            pos = torch.full((len(live),), base + step - 1, device=dev)
            if len(live) == 1:                                # one path: a plain decode step
                meta = AttnMeta.prefill(m, torch.cat([committed, own[live[0]]]), write[0])
                lg = m.forward(last, pos, self.pool, meta, head=self.head)
            else:                                             # each query sees C + its fork
                mine = [own[i] for i in live]
                prefix_slots = torch.cat([committed] + mine)
                mask = torch.zeros(len(live), prefix_slots.numel(), dtype=torch.bool)
                mask[:, :base] = True
                col = base
                for j, o in enumerate(mine):
                    mask[j, col:col + o.numel()] = True
                    col += o.numel()
                meta = AttnMeta.branches(m, prefix_slots, torch.cat(write), mask)
                lg = m.forward(last, pos, self.pool, meta, head=self.head)
            for j, i in enumerate(live):
                own[i] = torch.cat([own[i], write[j]])
                (t,), q, (c,) = self._choose(lg[j], 1, sp)
                toks[i].append(t)
                conf[i] *= c
                if q is not None:
                    qs[i].append(q)
        return [DraftPath(t, torch.stack(q) if q else None, self.name)
                for t, q in zip(toks, qs)]

    # -- helpers --------------------------------------------------------------------------------
    def _extend_head(self, tokens: list[int]) -> None:
        """Give the head a row for every token of the context it lacks (copying a name or an
        identifier from the prompt is what a draft predicts best); rare after the prompt.
        The vocabulary's rows are one matmul in the draft's weight format, built once; the
        request's extra rows a small float one beside it, rebuilt when they grow."""
        ids = torch.tensor(tokens, dtype=torch.long)
        new = ids[~self.in_head[ids]].unique()
        if self.head is not None and new.numel() == 0:
            return
        self.in_head[new] = True
        self.extra_ids = torch.cat([self.extra_ids, new])
        self.head_ids = torch.cat([self.vocab, self.extra_ids])
        extra = None
        if self.extra_ids.numel():
            lm = self.model.hf.lm_head
            at = self.extra_ids.to(lm.weight.device)
            extra = Linear(lm.weight.detach().index_select(0, at),
                           None if lm.bias is None else lm.bias.detach()[at])
        self.head = DraftHead(self._static[0], extra)

    def _choose(self, logits: torch.Tensor, k: int, sp: SamplingParams):
        """(tokens, q, their draft probabilities). Greedy: top-k of the plain softmax,
        deterministic (q=None). Sampling: k i.i.d. draws from the warped q (returned, `[V]`).
        With a vocabulary head, `logits` cover `head_ids` only."""
        ids = self.head_ids
        if sp.greedy:
            p, idx = logits.float().softmax(-1).topk(min(k, logits.shape[-1]))
            idx = idx.cpu()
            return (idx if ids is None else ids[idx]).tolist(), None, p.tolist()
        q = probs_from_logits(logits.float(), sp.temperature, sp.top_k, sp.top_p).cpu()
        draws = torch.multinomial(q, k, replacement=True, generator=sp.generator)
        p = q[draws].tolist()
        if ids is not None:
            draws = ids[draws]
            q = torch.zeros(self.model.vocab_size).index_copy_(0, ids, q)
        return draws.tolist(), q, p

    def _drop_forks(self) -> None:
        for f in self.forks:
            self.kv.release(f)
        self.forks, self.fork_tokens = [], []
