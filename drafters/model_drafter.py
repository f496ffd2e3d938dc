"""A small causal LM as drafter, with its own KV tree.

Its committed branch C follows the request's context; every candidate path is a CoW fork of C,
and all paths extend in one batched forward per draft position (each query sees C plus its own
fork). After verification the fork holding the accepted tokens is adopted into C, the rest freed.
"""
from __future__ import annotations

import torch

from specfork.drafters.base import DraftPath, SamplingParams
from specfork.errors import SpecforkError
from specfork.kv_tree import KVTree
from specfork.model import Model, causal_mask
from specfork.sampling import probs_from_logits


class ModelDrafter:
    def __init__(self, model: Model, name: str = "model", max_kv_tokens: int = 8192,
                 max_paths: int = 8, max_len: int = 16, block_size: int | None = None):
        self.model, self.name = model, name
        block_size = block_size or model.block_size
        blocks = -(-max_kv_tokens // block_size) + max_paths * (-(-max_len // block_size) + 2)
        self.pool = model.make_pool(num_blocks=blocks, block_size=block_size)
        self.kv = KVTree(self.pool)
        self.C = None
        self.forks: list = []                # live draft forks of C, one per proposed path
        self.fork_tokens: list[list[int]] = []

    @classmethod
    def load(cls, name: str, target_model: Model | None = None) -> "ModelDrafter":
        from specfork.models import load_hf, resolve
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
        return cls(model, name=f"model:{name}")

    # -- protocol -------------------------------------------------------------------------------
    def begin(self, prompt_ids: list[int]) -> None:
        self.end()
        self.C = self.kv.new_branch()

    def end(self) -> None:
        self._drop_forks()
        if self.C is not None:
            self.kv.release(self.C)
            self.C = None

    def observe(self, context: list[int]) -> None:
        """Adopt the fork that holds the longest accepted prefix; free the others."""
        n = self.C.length
        new = context[n:]
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

    @torch.inference_mode()
    def propose(self, context: list[int], num_paths: int, max_len: int,
                sp: SamplingParams) -> list[DraftPath]:
        m, kv, dev = self.model, self.kv, self.model.device
        self._drop_forks()
        n = self.C.length
        if n >= len(context):                     # never expected: the context only grows
            kv.truncate(self.C, len(context) - 1)
            n = self.C.length
        feed = torch.tensor(context[n:], device=dev)
        prefix = kv.slots(self.C).to(dev)
        slots = kv.append(self.C, len(feed)).to(dev)
        logits = m.forward(feed, torch.arange(n, len(context), device=dev), self.pool, prefix,
                           slots, tree_mask=causal_mask(len(feed), dev),
                           logits_idx=slice(len(feed) - 1, len(feed)))[0]
        k = max(1, num_paths)
        first, q0 = self._choose(logits, k, sp, first=True)
        toks = [[t] for t in first]
        qs = [[q0] if q0 is not None else [] for _ in first]
        self.forks = [kv.fork(self.C) for _ in first]
        self.fork_tokens = toks
        base = self.C.length
        committed = torch.cat([prefix, slots])                # C's slots, shared by every path
        own = [committed[:0]] * len(self.forks)               # each fork's own slots so far
        for step in range(1, max_len):
            # every path's last token: its K/V go into its fork, its logits give the next token
            write = [kv.append(f, 1).to(dev) for f in self.forks]
            last = torch.tensor([t[-1] for t in toks], device=dev)
            pos = torch.full((len(toks),), base + step - 1, device=dev)
            if len(self.forks) == 1:                          # one path: a plain decode step
                lg = m.forward(last, pos, self.pool, torch.cat([committed, own[0]]), write[0])
            else:                                             # each query sees C + its fork
                prefix_slots = torch.cat([committed] + own)
                mask = torch.zeros(len(self.forks), prefix_slots.numel(), dtype=torch.bool,
                                   device=dev)
                mask[:, :base] = True
                col = base
                for i, o in enumerate(own):
                    mask[i, col:col + o.numel()] = True
                    col += o.numel()
                lg = m.forward(last, pos, self.pool, prefix_slots, torch.cat(write),
                               prefix_mask=mask)
            own = [torch.cat([o, w]) for o, w in zip(own, write)]
            for i in range(len(toks)):
                (t,), q = self._choose(lg[i], 1, sp, first=False)
                toks[i].append(t)
                if q is not None:
                    qs[i].append(q)
        return [DraftPath(t, torch.stack(q) if q else None, self.name)
                for t, q in zip(toks, qs)]

    # -- helpers --------------------------------------------------------------------------------
    def _choose(self, logits: torch.Tensor, k: int, sp: SamplingParams, first: bool):
        """Greedy: top-k (deterministic, q=None). Sampling: k i.i.d. draws from q (returned)."""
        if sp.greedy:
            return logits.topk(k).indices.tolist(), None
        q = probs_from_logits(logits.float(), sp.temperature, sp.top_k, sp.top_p)
        draws = torch.multinomial(q.cpu(), k, replacement=True, generator=sp.generator).tolist()
        return draws, q.cpu()

    def _drop_forks(self) -> None:
        for f in self.forks:
            self.kv.release(f)
        self.forks, self.fork_tokens = [], []
