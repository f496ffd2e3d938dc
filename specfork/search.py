"""Beam search on the KV tree ("fork search"): every beam is a branch, a beam that several
candidates extend is forked (O(1), prefix blocks shared), pruned beams are released at once,
and all beams decode in one forward whose prefix gather reads each shared block once.

Selection, finishing and stopping follow transformers' `_beam_search` step for step (top 2W of
beam score + fp32 log-softmax over W*V, EOS hypotheses among the top W, length penalty on the
generated length, the early-stopping heuristic), so greedy beam search returns HF's sequence.
`naive=True` keeps the same search but gives each beam a private full copy of the cache,
as a cache without sharing must.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specfork.engine import Engine
from specfork.errors import SpecforkError
from specfork.kv_tree import Branch, KVTree, PoolExhausted
from specfork.sampling import check_sampling
from specfork.session import copy_branch, forward_branches
from specfork.types import GenerateOutput

NEG = -1.0e9                                     # HF's "impossible" score offset


@dataclass
class BeamOutput(GenerateOutput):
    """GenerateOutput of the best hypothesis plus all finished ones, best first."""
    hypotheses: list[tuple[list[int], float]] = field(default_factory=list)
    trace: list[dict] = field(default_factory=list)     # per step, with trace=True


@dataclass
class _State:
    """HF's per-step beam state for one prompt (batch of 1), with Python token lists."""
    run_scores: torch.Tensor                     # [W] summed log-probs of the running beams
    run_seqs: list[list[int]]
    fin_scores: torch.Tensor                     # [W] length-normalised, NEG when empty
    fin_seqs: list[list[int]]
    fin_done: torch.Tensor                       # [W] bool
    unsat: bool = True                           # the early-stop heuristic still says "go on"

    @classmethod
    def new(cls, W: int) -> "_State":
        run = torch.zeros(W)
        run[1:] = NEG                            # only beam 0 is real at the first step
        return cls(run, [[] for _ in range(W)], torch.full((W,), NEG), [[] for _ in range(W)],
                   torch.zeros(W, dtype=torch.bool))


def _beam_step(st: _State, logp: torch.Tensor, cur: int, max_new: int, eos: torch.Tensor,
               length_penalty: float, early_stopping) -> tuple[list[int], list[int], bool, list]:
    """One HF beam-search step on `logp [W, V]` (fp32 log-softmax) with `cur` tokens generated.
    Updates `st`; returns each new running beam's parent index and token, whether to stop, and
    the step's candidates as (tokens, summed log-prob, stopped)."""
    W, V = logp.shape
    K = max(2, 1 + eos.numel()) * W
    acc = (logp + st.run_scores[:, None]).reshape(1, -1)
    top_lp, top_idx = torch.topk(acc, K)
    top_lp, top_idx = top_lp[0], top_idx[0]
    src, tok = top_idx // V, top_idx % V
    cand = [st.run_seqs[s] + [t] for s, t in zip(src.tolist(), tok.tolist())]
    hits = torch.isin(tok, eos) | (cur + 1 >= max_new)

    # e. the best W candidates that did not stop keep running
    run_lp = top_lp + hits.to(torch.float32) * NEG
    nxt = torch.topk(run_lp, W).indices
    # f. candidates that stopped among the top W become hypotheses if they beat the worst one
    just = hits & (torch.arange(K) < W)
    fl = top_lp / ((cur + 1) ** length_penalty)
    fl = fl + float(bool(st.fin_done.all()) and early_stopping is True) * NEG
    fl = fl + float(not st.unsat) * NEG
    fl = fl + (~just) * NEG
    merged = torch.cat((st.fin_scores, fl))
    keep = torch.topk(merged, W).indices
    pool_seqs = st.fin_seqs + cand
    st.fin_scores = merged[keep]
    st.fin_seqs = [pool_seqs[i] for i in keep.tolist()]
    st.fin_done = torch.cat((st.fin_done, just))[keep]

    st.run_scores = run_lp[nxt]
    st.run_seqs = [cand[i] for i in nxt.tolist()]
    # g. HF's stopping: can a running beam still beat the worst finished one?
    cur += 1
    best_len = max_new if (early_stopping == "never" and length_penalty > 0.0) else cur
    best = st.run_scores[:1] / (best_len ** length_penalty)
    worst = torch.where(st.fin_done, st.fin_scores.min(), NEG)
    st.unsat = st.unsat and bool((best > worst).any())
    open_beam = not (bool(st.fin_done.all()) and early_stopping is True)
    stop = not (st.unsat and open_beam and not bool(hits.all()))
    return src[nxt].tolist(), tok[nxt].tolist(), stop, \
        list(zip(cand, top_lp.tolist(), hits.tolist()))


def live_tokens(seqs: list[list[int]]) -> int:
    """Distinct generated tokens that running beams `seqs` hold: the nodes of their prefix trie.
    A forward over these beams reads the K/V of every one, so no exact beam search can keep
    fewer past the prompt: the floor for the peak of fork search at one-token blocks."""
    return len({tuple(s[:i + 1]) for s in seqs for i in range(len(s))})


class LiveTokenPeak:
    """A logits processor for HF `generate(num_beams=W)` that measures the same floor on the
    peer: at every step it sees the running beams HF just forwarded and keeps the most distinct
    generated tokens they held (`peak`), so our peak can be checked against HF's trajectory."""

    def __init__(self, prompt_len: int):
        self.prompt_len, self.peak = prompt_len, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.peak = max(self.peak, live_tokens(input_ids[:, self.prompt_len:].tolist()))
        return scores


def _regroup(kv: KVTree, old: list[Branch], parents: list[int], naive: bool,
             made: list[Branch]) -> list[Branch]:
    """Branches of the new beams. A parent's first child continues in the parent's branch, the
    others fork it (or copy it whole when naive); parents with no child are released first, so
    the pool never holds pruned and new beams at once. New branches go to `made` as they are
    made, so a failure half way leaks nothing."""
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        kids.setdefault(id(old[p]), []).append(i)
    seen: dict[int, Branch] = {}
    for b in old:
        seen.setdefault(id(b), b)
    for key, b in seen.items():
        if key not in kids:
            kv.release(b)
    new: list[Branch | None] = [None] * len(parents)
    for key, idx in kids.items():
        b = seen[key]
        for i in idx[1:]:
            new[i] = copy_branch(kv, b) if naive else kv.fork(b)
            made.append(new[i])
        new[idx[0]] = b
    return new


def beam_search(engine: Engine, prompt: str | list[int], num_beams: int = 4,
                max_new_tokens: int = 128, raw: bool = False, naive: bool = False,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                trace: bool = False) -> BeamOutput:
    """Best beam-search continuation of `prompt` on `engine`'s model and KV tree (a
    SpecDecoder's `.engine` shares them); equals HF's `generate(num_beams=W, do_sample=False)`
    with the same length_penalty / early_stopping. `trace=True` keeps every step's candidates
    (for explaining a divergence from HF)."""
    if not isinstance(num_beams, int) or num_beams < 1:
        raise SpecforkError(f"num_beams must be a positive integer, got {num_beams}")
    if early_stopping not in (False, True, "never"):
        raise SpecforkError(f"early_stopping must be True, False or 'never', got {early_stopping}")
    check_sampling(max_new_tokens, 0.0)
    m, kv, pool, W = engine.model, engine.kv, engine.pool, num_beams
    prompt_ids = engine.encode(prompt, raw)
    engine.check_length(len(prompt_ids), max_new_tokens)
    eos = torch.tensor(sorted(engine.eos), dtype=torch.long)
    used0 = pool.used_blocks
    pool.reset_peak()
    t0 = time.perf_counter()
    branches = [kv.new_branch()] * W           # HF starts from W copies of the prompt
    made: list[Branch] = []
    steps: list[dict] = []
    forwards = 0
    try:
        logits = forward_branches(m, kv, branches[:1], [prompt_ids])
        forwards += 1
        st = _State.new(W)
        logp = torch.log_softmax(logits.float(), dim=-1).cpu().expand(W, -1)
        cur = 0
        while True:
            parents, toks, stop, cands = _beam_step(st, logp, cur, max_new_tokens, eos,
                                                    length_penalty, early_stopping)
            if trace:
                steps.append({"candidates": cands, "running": st.run_seqs,
                              "running_scores": st.run_scores.tolist()})
            cur += 1
            if stop:
                break
            branches = _regroup(kv, branches, parents, naive, made)
            logits = forward_branches(m, kv, branches, [[t] for t in toks])
            forwards += 1
            logp = torch.log_softmax(logits.float(), dim=-1).cpu()
    except PoolExhausted as e:
        raise SpecforkError(f"beam search with {W} beams does not fit the KV pool: {e}") from e
    finally:
        for b in {id(b): b for b in branches + made}.values():
            if b.held:
                kv.release(b)
    wall = time.perf_counter() - t0
    best = st.fin_seqs[0]
    text = engine.decode(best)
    n = len(best)
    stats = {"new_tokens": n, "target_forwards": forwards, "mean_accepted": n / forwards,
             "tokens_per_s": n / wall if wall > 0 else 0.0, "wall_s": wall,
             "kv_peak_bytes": pool.peak_bytes, "kv_blocks_leaked": pool.used_blocks - used0,
             "num_beams": W, "naive": naive, "forks": len(made), "steps": cur,
             "score": float(st.fin_scores[0])}
    hyps = [(s, float(x)) for s, x, d in zip(st.fin_seqs, st.fin_scores, st.fin_done) if d]
    return BeamOutput(text, best, prompt_ids, stats, hyps, steps)
