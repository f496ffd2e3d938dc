"""The engine's one loop with many requests: continuous batching, prefix cache, n > 1 forks,
preemption and cancellation, each against the same requests run alone (tiny random Llama)."""
import pytest
import torch

from conftest import tiny_model
from specfork.decoder import SpecDecoder
from specfork.drafters.ngram import NgramDrafter


def _decoder(kv_cache="auto", drafts=0, max_kv_tokens=None, **kw):
    m = tiny_model(kv_cache=kv_cache)
    ds = [NgramDrafter()] if drafts else []
    return SpecDecoder(m, None, ds, num_paths=drafts, max_kv_tokens=max_kv_tokens,
                       eos_token_ids=[], **kw)


def _prompts(k, n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(k):
        base = torch.randint(0, 96, (n + 3 * i,), generator=g).tolist()
        out.append(base + base[:5])                  # a repeat: n-gram lookup finds drafts
    return out


def _alone(dec, prompts, max_new, **kw):
    return [dec.generate(p, max_new_tokens=max_new, **kw).token_ids for p in prompts]


@pytest.mark.parametrize("kv_cache,drafts", [("auto", 0), ("auto", 2), ("float16", 2),
                                             ("turbo3.5", 0)])
def test_batched_requests_equal_each_alone(kv_cache, drafts):
    """Six requests of different lengths in one loop (joining as the batch allows, prompts in
    chunks while others decode) emit exactly what each emits alone; nothing leaks."""
    dec = _decoder(kv_cache, drafts)
    prompts = _prompts(6)
    alone = _alone(dec, prompts, 24)
    dec.engine.configure(max_batch=4, prefill_tokens=7)
    reqs = [dec.request(p, 24)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert dec.pool.used_blocks == 0
    assert dec.engine.counters["steps"] > 0


def test_batching_shares_forwards():
    """Four requests decoding together take about a quarter of the forwards of four runs."""
    dec = _decoder()
    prompts = _prompts(4)
    s0 = dec.engine.counters["steps"]
    _alone(dec, prompts, 20)
    alone_steps = dec.engine.counters["steps"] - s0
    s0 = dec.engine.counters["steps"]
    reqs = [dec.request(p, 20)[0] for p in prompts]
    dec.engine.run(reqs)
    assert dec.engine.counters["steps"] - s0 <= alone_steps // 4 + 2


def test_prefix_cache_forks_a_cached_prompt():
    """A second request sharing a prompt's start forks the cached branch (its prefix is not
    prefilled again, no block is copied) and emits what it emits without the cache."""
    dec = _decoder()
    shared = _prompts(1, n=40)[0]
    a, b = shared + [5, 6, 7], shared + [9, 9]
    want = _alone(dec, [a, b], 12)
    dec.engine.configure(prefix_cache=True)
    ra = dec.request(a, 12)[0]
    dec.engine.run([ra])
    held = dec.pool.used_blocks
    assert held == len(a) + 12 - 1                       # the finished branch, cached
    rb = dec.request(b, 12)[0]
    dec.engine.run([rb])
    assert rb.cached_tokens == len(shared)
    assert [ra.out, rb.out] == want
    # b's own blocks: its 2 new prompt tokens and 11 decoded; the shared prefix is stored once
    assert dec.pool.used_blocks == held + 2 + 12 - 1
    dec.engine.configure(prefix_cache=False)
    assert dec.pool.used_blocks == 0


def test_prefix_cache_evicts_under_pressure():
    """Cached branches give their blocks back when running requests need them."""
    dec = _decoder(max_kv_tokens=200)
    dec.engine.configure(prefix_cache=True)
    for p in _prompts(5, n=30, seed=3):
        dec.engine.run([dec.request(p, 20)[0]])
    assert dec.pool.used_blocks <= dec.pool.num_blocks
    assert len(dec.engine.cache) < 5                    # the oldest were evicted
    dec.engine.configure(prefix_cache=False)
    assert dec.pool.used_blocks == 0


def test_n_choices_fork_one_prompt():
    """n = 3 sampled choices share one stored prompt; choice i equals a lone request seeded
    seed + i."""
    dec = _decoder()
    p = _prompts(1, n=60)[0]
    want = [dec.generate(p, max_new_tokens=10, temperature=1.0, seed=7 + i).token_ids
            for i in range(3)]
    dec.pool.reset_peak()
    reqs = dec.request(p, 10, temperature=1.0, seed=7, n=3)
    dec.engine.run(reqs[:1])
    assert [r.out for r in reqs] == want
    assert dec.pool.peak_blocks <= len(p) + 3 * 10     # not 3 copies of the prompt
    assert dec.pool.used_blocks == 0


def test_preemption_recomputes_and_matches():
    """A pool too small for every request at once: the newest are preempted, recomputed
    later, and every output still equals its lone run; nothing leaks."""
    prompts = _prompts(4, n=30, seed=5)
    dec = _decoder(max_kv_tokens=90)
    alone = _alone(dec, prompts, 40)
    dec.engine.configure(max_batch=4)
    reqs = [dec.request(p, 40)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert dec.engine.counters["preemptions"] > 0
    assert dec.pool.used_blocks == 0


def test_cancel_frees_branches():
    dec = _decoder(drafts=2)
    reqs = [dec.request(p, 200)[0] for p in _prompts(3)]
    for r in reqs:
        dec.engine.add(r)
    for _ in range(5):
        dec.engine.step()
    assert dec.pool.used_blocks > 0
    for r in reqs:
        dec.engine.cancel(r)
    dec.engine.step()
    assert all(r.done and r.finish_reason == "abort" for r in reqs)
    assert dec.pool.used_blocks == 0 and not dec.engine.has_work


def test_speculation_backs_off_as_the_batch_grows():
    """With adaptive drafting, a request alone drafts; in a batch of 16, where a forward
    costs a fixed part plus a share per row (as on a CPU), each request's tree rows cost the
    step more than they add, and drafting mostly stops."""
    from specfork.cost_model import CostModel
    dec = _decoder(drafts=2, adaptive=True)
    linear = {r: 1e-3 * (1 + 0.2 * (r - 1)) for r in (1, 2, 4, 8, 16, 32, 64, 128)}
    prompts = _prompts(16, n=10, seed=9)

    def rows_per_step(reqs):
        for r in reqs:
            r.controller.cost = CostModel(linear, rate=0.0)
        dec.engine.run(reqs)
        st = [r.stats for r in reqs]
        return sum(s.tree_nodes for s in st) / sum(s.steps for s in st)

    alone = rows_per_step([dec.request(prompts[0], 30)[0]])
    many = rows_per_step([dec.request(p, 30)[0] for p in prompts])
    assert alone > 0.5 and many < alone / 2


def test_shared_prompt_prefilled_once_for_concurrent_requests():
    """Requests arriving together with a shared 60-token start: the first prefills it, the
    others wait for it to be cached and fork it, so it is prefilled once; outputs equal each
    request run alone."""
    dec = _decoder()
    shared = _prompts(1, n=60, seed=11)[0]
    prompts = [shared + [7 + i, 9] for i in range(4)]
    alone = _alone(dec, prompts, 10)
    dec.engine.configure(max_batch=4, prefix_cache=True)
    before = dict(dec.engine.counters)
    reqs = [dec.request(p, 10)[0] for p in prompts]
    dec.engine.run(reqs)
    assert [r.out for r in reqs] == alone
    assert [r.cached_tokens for r in reqs] == [0] + [len(shared)] * 3
    assert dec.engine.counters["cached_tokens"] - before["cached_tokens"] == 3 * len(shared)
    dec.engine.configure(prefix_cache=False)
    assert dec.pool.used_blocks == 0


def test_spec_gate_follows_the_faster_arm():
    """The gate lets a batch speculate while speculating steps give more tokens per second,
    stops when they give fewer (still trying the slower arm one step in EXPLORE), and never
    gates a lone request."""
    from specfork.spec_gate import EXPLORE, SpecGate
    g = SpecGate()
    assert all(g.allow(1) for _ in range(50))

    def run(spec_rate, plain_rate, steps=200):
        on = 0
        for _ in range(steps):
            s = g.allow(16)
            on += s
            g.record(16, s, 16, 16 / (spec_rate if s else plain_rate))
        return on / steps

    assert run(spec_rate=100, plain_rate=140) < 2 / EXPLORE       # slower: off
    assert run(spec_rate=200, plain_rate=140, steps=300) > 0.6    # faster: back on
    assert g.stats()["16+"]["tok_s_spec"] > g.stats()["16+"]["tok_s_plain"]
