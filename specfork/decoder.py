"""SpecDecoder: drafters -> token tree -> one target forward (tree attention) -> verifier ->
KV-tree commit/free. With no drafter it is plain sequential decoding on the same KV tree.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specfork.drafters.base import Drafter
from specfork.types import DraftPath, SamplingParams
from specfork.errors import SpecforkError
from specfork.kv_tree import KVTree
from specfork.model import Model, causal_mask
from specfork.sampling import probs_from_logits, sample
from specfork.token_tree import TokenTree
from specfork.verifiers.greedy import verify_greedy
from specfork.verifiers.sampling import verify_sampling


@dataclass
class GenerateOutput:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    stats: dict = field(default_factory=dict)


MAX_PATHS = MAX_DRAFT_LEN = 64       # beyond these a verify tree outgrows any useful budget


def check_sampling(max_new_tokens: int, temperature: float, top_p, top_k,
                   seed: int | None = None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise SpecforkError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if temperature is None or not math.isfinite(temperature) or temperature < 0:
        raise SpecforkError(f"temperature must be a finite number >= 0, got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise SpecforkError(f"top_p must be in (0, 1], got {top_p}")
    if top_k is not None and top_k <= 0:
        raise SpecforkError(f"top_k must be a positive integer, got {top_k}")
    if seed is not None and not -2 ** 63 <= seed < 2 ** 64:        # what torch accepts
        raise SpecforkError(f"seed must be in [-2**63, 2**64), got {seed}")


def check_drafting(num_paths: int, draft_len: int) -> None:
    if not 0 <= num_paths <= MAX_PATHS:
        raise SpecforkError(f"draft paths must be in [0, {MAX_PATHS}], got {num_paths}")
    if not 1 <= draft_len <= MAX_DRAFT_LEN:
        raise SpecforkError(f"draft length must be in [1, {MAX_DRAFT_LEN}], got {draft_len}")


def check_token_ids(ids: list[int], vocab_size: int) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise SpecforkError(f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")


class SpecDecoder:
    """Speculative decoding with any mix of drafters over one target model."""

    def __init__(self, model: Model, tokenizer, drafters: list[Drafter] | None = None,
                 num_paths: int = 0, draft_len: int = 4, tree_budget: int | None = None,
                 max_kv_tokens: int | None = None, block_size: int | None = None,
                 eos_token_ids: list[int] | None = None):
        check_drafting(num_paths, draft_len)
        self.model, self.tokenizer = model, tokenizer
        self.drafters = list(drafters or [])
        self.num_paths = num_paths if self.drafters else 0
        self.draft_len = draft_len
        self.tree_budget = tree_budget or max(1, self.num_paths) * draft_len
        self.context_len = model.max_positions
        kv_tokens = max_kv_tokens or min(self.context_len, 8192)
        block_size = block_size or model.block_size
        extra = (self.num_paths + 1) * (self.draft_len + 2 * block_size)
        self.pool = model.make_pool(num_blocks=-(-(kv_tokens + extra) // block_size) + 1,
                                    block_size=block_size)
        self.kv = KVTree(self.pool)
        self.max_kv_tokens = kv_tokens
        # Verify through the paged Triton kernel on GPU: it reads the committed prefix in place
        # through the block table instead of gathering it first.
        self.use_kernel = model.device.type == "cuda"
        eos = model.hf.generation_config.eos_token_id if eos_token_ids is None else eos_token_ids
        if eos is None and tokenizer is not None:
            eos = tokenizer.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else ([] if eos is None else [eos]))

    @classmethod
    def from_pretrained(cls, target: str = "smollm2-135m", drafts: int = 0,
                        drafter: str | None = None, draft_len: int = 4,
                        dtype: torch.dtype | None = None, device: str | None = None,
                        min_conf: float | None = None, draft_vocab: int | None = None,
                        **kw) -> "SpecDecoder":
        from specfork.drafters.registry import make_drafters
        from specfork.loader import load_hf
        check_drafting(drafts, draft_len)                  # before any weights load
        hf, tok = load_hf(target, dtype=dtype, device=device)
        model = Model(hf)
        drafters = (make_drafters(drafter, target, model, drafts, min_conf, draft_vocab,
                                  draft_len=draft_len) if drafts > 0 else [])
        return cls(model, tok, drafters, num_paths=drafts, draft_len=draft_len, **kw)

    # -- input ----------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], raw: bool = False) -> list[int]:
        if isinstance(prompt, str) and not prompt.strip():
            raise SpecforkError("the prompt is empty")
        if not isinstance(prompt, str) or self.tokenizer is None:
            ids = [int(t) for t in prompt]
        elif not raw and getattr(self.tokenizer, "chat_template", None):
            ids = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=True)["input_ids"]
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        if not ids:
            raise SpecforkError("the prompt is empty")
        check_token_ids(ids, self.model.vocab_size)
        return list(ids)

    # -- the loop -------------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int = 128,
                 temperature: float = 0.0, top_p: float | None = None,
                 top_k: int | None = None, seed: int | None = None, raw: bool = False,
                 on_tokens: Callable[[list[int]], None] | None = None) -> GenerateOutput:
        check_sampling(max_new_tokens, temperature, top_p, top_k, seed)
        prompt_ids = self.encode(prompt, raw)
        limit = min(self.context_len, self.max_kv_tokens)
        if len(prompt_ids) + max_new_tokens > limit:
            raise SpecforkError(f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens "
                                f"exceeds the context of {limit} tokens")
        gen = None
        if seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(seed)
        sp = SamplingParams(temperature=float(temperature), top_k=top_k, top_p=top_p,
                            generator=gen)
        st = _Stats(self.drafters)
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
        text = self.tokenizer.decode(out, skip_special_tokens=True) if self.tokenizer else ""
        return GenerateOutput(text, out, prompt_ids, st.finish(len(out), wall, self.pool,
                                                                 self.kv))

    def _pick(self, logits: torch.Tensor, sp: SamplingParams) -> int:
        if sp.greedy:
            return int(logits.argmax())
        return sample(probs_from_logits(logits.float(), sp.temperature, sp.top_k, sp.top_p),
                      sp.generator)

    def _run(self, B, prompt_ids, max_new, sp, st, on_tokens) -> list[int]:
        m, kv = self.model, self.kv
        P = len(prompt_ids)
        dev = m.device
        ids = torch.tensor(prompt_ids, device=dev)
        slots = kv.append(B, P).to(dev)
        logits = m.forward(ids, torch.arange(P, device=dev), self.pool, slots[:0], slots,
                           tree_mask=causal_mask(P, dev), logits_idx=slice(P - 1, P))
        st.forwards += 1
        tok = self._pick(logits[0], sp)
        out = [tok]
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
        prefix = kv.slots(B).to(m.device)
        slot = kv.append(B, 1).to(m.device)
        logits = m.forward(torch.tensor([tok], device=m.device), torch.tensor([n], device=m.device),
                           self.pool, prefix, slot)
        return [self._pick(logits[0], sp)]

    def _propose(self, context: list[int], sp: SamplingParams) -> list[DraftPath]:
        """Split the path budget evenly over the drafters; a drafter's unused share moves on."""
        paths: list[DraftPath] = []
        left, k = self.num_paths, len(self.drafters)
        for i, d in enumerate(self.drafters):
            share = -(-left // (k - i))
            got = d.propose(context, share, self.draft_len, sp) if share else []
            paths += got[:share]
            left -= len(got[:share])
        return paths

    def _spec_step(self, B, context: list[int], sp: SamplingParams, st: "_Stats") -> list[int]:
        """Draft, verify every path in one forward, commit the accepted fork, free the rest."""
        m, kv, dev = self.model, self.kv, self.model.device
        n = B.length
        paths = self._propose(context, sp)
        tree = TokenTree.build(context[-1], paths, self.tree_budget)
        leaves = tree.leaf_paths()                       # node lists root..leaf
        forks = []                                       # one CoW fork of B per draft path
        try:                                             # a failure (or Ctrl-C) frees them
            writes = []
            for p in leaves:
                forks.append(kv.fork(B))
                writes.append(kv.append(forks[-1], len(p)))
            write_slots = torch.cat(writes).to(dev)
            write_src = torch.tensor([i for p in leaves for i in p], device=dev)
            prefix = kv.slots(B).to(dev)
            table = (torch.tensor(kv.block_table(B), dtype=torch.int32, device=dev)
                     if self.use_kernel else None)
            T = len(tree.tokens)
            logits = m.forward(tree.tokens.to(dev), tree.positions(n).to(dev), self.pool, prefix,
                               write_slots, write_src,
                               tree_mask=tree.ancestor_mask().to(dev) if T > 1 else None,
                               block_table=table)
            if sp.greedy:
                path, nxt = verify_greedy(tree, logits)
            else:
                path, nxt = verify_sampling(tree, logits, sp)
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
        for d in self.drafters:
            d.observe(context + emitted)
        return emitted


class _Stats:
    def __init__(self, drafters):
        self.forwards = 0
        self.proposed = {d.name: 0 for d in drafters}
        self.accepted = {d.name: 0 for d in drafters}
        self.steps = 0
        self.tree_nodes = 0
        self.accepted_nodes = 0

    def record(self, tree: TokenTree, path: list[int]) -> None:
        self.steps += 1
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
            "kv_blocks_leaked": pool.used_blocks,
            "spec_steps": self.steps,
            "draft_tokens_proposed": self.tree_nodes,
            "draft_tokens_accepted": self.accepted_nodes,
            "acceptance_rate": self.accepted_nodes / self.tree_nodes if self.tree_nodes else 0.0,
            "per_drafter": {k: {"proposed": self.proposed[k], "accepted": self.accepted.get(k, 0)}
                            for k in self.proposed},
        }
