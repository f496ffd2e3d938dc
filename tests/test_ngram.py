from hypothesis import given, settings, strategies as st

from specfork.types import SamplingParams
from specfork.drafters.ngram import NgramDrafter

SP = SamplingParams()


def propose(ctx, num_paths=1, max_len=5, **kw):
    d = NgramDrafter(**kw)
    d.begin(ctx)
    return d.propose(ctx, num_paths, max_len, SP)


def toks(paths):
    return [p.tokens for p in paths]


def test_exact_path():
    (p,) = propose([1, 2, 3, 4, 5, 9, 1, 2, 3])
    assert p.tokens == [4, 5, 9, 1, 2] and p.q is None and p.drafter == "ngram"
    assert p.meta == {"ngram": 3, "pos": 3, "match": 3}


def test_longest_match_first_then_shorter_fill():
    ctx = [7, 1, 2, 5, 2, 8, 1, 2]  # (1,2) was followed by 5; the latest (2,) by 8
    assert toks(propose(ctx, 1, 3)) == [[5, 2, 8]]
    assert toks(propose(ctx, 3, 3)) == [[5, 2, 8], [8, 1, 2]]  # (2,)@3 repeats [5,2,8]: dropped
    assert [p.meta["ngram"] for p in propose(ctx, 3, 3)] == [2, 1]


def test_distinct_paths_most_recent_first():
    ctx = [5, 1, 5, 2, 5, 3, 5, 2, 5]
    one = {"max_ngram": 1, "max_match": 1}       # matches measured to 1 token: recency only
    assert toks(propose(ctx, 4, 1, **one)) == [[2], [3], [1]]  # 5@7, 5@5, (5@3), 5@1
    assert toks(propose(ctx, 2, 1, **one)) == [[2], [3]]
    assert toks(propose(ctx, 4, 2, **one)) == [[2, 5], [3, 5], [1, 5]]
    assert toks(propose(ctx, 4, 1)) == [[3], [2], [1]]  # (5,2,5)@5 was followed by 3
    # indexed to 1-grams, but 5@5's match reaches back 3 tokens (5, 2, 5): it still leads
    assert toks(propose(ctx, 4, 1, max_ngram=1)) == [[3], [2], [1]]


def test_extension_replaces_cut_short_match():
    # the latest (2,3,1,2) is followed only by [3,1,2] before the context ends; (1,2)@2 goes on
    (p,) = propose([1, 2, 3, 1, 2, 3, 1, 2], 2, 5)
    assert p.tokens == [3, 1, 2, 3, 1] and p.meta == {"ngram": 2, "pos": 2, "match": 2}


def test_max_len():
    ctx = list(range(10)) + [0]
    for m in (1, 3, 10, 50):
        assert toks(propose(ctx, 1, m)) == [list(range(1, 10))[:m] + ([0] if m > 9 else [])]


def test_min_ngram():
    ctx = [1, 2, 3, 9, 3]
    assert toks(propose(ctx)) == [[9, 3]]
    assert propose(ctx, min_ngram=2) == []


def test_empty():
    assert propose([1, 2, 3, 4]) == []
    assert propose([]) == []
    assert propose([1, 1], num_paths=0) == []
    assert propose([1, 1], max_len=0) == []


def test_incremental_observe_and_rebuild():
    d = NgramDrafter()
    d.begin([4, 5, 6])
    assert d.propose([4, 5, 6, 7], 2, 4, SP) == []
    d.observe([4, 5, 6, 7, 4, 5])
    assert toks(d.propose([4, 5, 6, 7, 4, 5], 2, 4, SP)) == [[6, 7, 4, 5]]
    # a context that does not extend the indexed one (new request without begin) is reindexed
    assert toks(d.propose([8, 9, 8], 2, 4, SP)) == [[9, 8]]
    d.begin([1, 2, 3])
    assert toks(d.propose([9, 8, 9, 8], 2, 4, SP)) == [[9, 8]]
    d.end()
    assert d.propose([8, 9], 2, 4, SP) == []


def test_sites_ranked_by_how_far_the_match_reaches_back():
    # the suffix (7, 1, 2, 3, 4) recurs once, long ago (-> 5); the 4-gram (1, 2, 3, 4) also
    # recurs more recently after other tokens (-> 6): the longer match leads
    ctx = [7, 1, 2, 3, 4, 5, 0, 8, 1, 2, 3, 4, 6, 0, 7, 1, 2, 3, 4]
    ps = propose(ctx, 2, 1)
    assert toks(ps) == [[5], [6]]
    assert [p.meta["match"] for p in ps] == [5, 4]
    assert toks(propose(ctx, 2, 1, max_match=4)) == [[6], [5]]   # reach capped: recency


def _reach(ctx, e, n, cap):
    m = n
    while m < cap and m < e and ctx[e - 1 - m] == ctx[len(ctx) - 1 - m]:
        m += 1
    return m


def _best_site(ctx, max_ngram, min_ngram, cap=32):
    """The longest n-gram's site whose match reaches furthest back, most recent among equals."""
    L = len(ctx)
    for n in range(min(max_ngram, L), min_ngram - 1, -1):
        sites = [e for e in range(L - 1, n - 1, -1) if ctx[e - n:e] == ctx[L - n:]][:64]
        if sites:
            return max(sites, key=lambda e: (_reach(ctx, e, n, max(cap, max_ngram)), e))
    return None


@settings(max_examples=300, deadline=None)
@given(ctx=st.lists(st.integers(0, 3), max_size=60), split=st.integers(0, 60),
       num_paths=st.integers(1, 4), max_len=st.integers(1, 6),
       ngrams=st.tuples(st.integers(1, 4), st.integers(1, 4)).map(sorted))
def test_paths_follow_suffix_occurrences(ctx, split, num_paths, max_len, ngrams):
    min_ngram, max_ngram = ngrams
    d = NgramDrafter(max_ngram, min_ngram)
    d.begin(ctx[:split])
    d.observe(ctx[:split + 3])
    paths = d.propose(ctx, num_paths, max_len, SP)
    L = len(ctx)
    assert len(paths) <= num_paths
    for p in paths:
        n, e = p.meta["ngram"], p.meta["pos"]
        assert min_ngram <= n <= max_ngram and n <= e < L
        assert ctx[e - n:e] == ctx[L - n:]
        assert p.tokens == ctx[e:e + max_len]
    for a in paths:
        for b in paths:
            assert a is b or a.tokens[:len(b.tokens)] != b.tokens
    e = _best_site(ctx, max_ngram, min_ngram)
    assert (e is None) == (paths == [])
    if paths:  # the best-reaching longest match leads, possibly extended by another site
        assert paths[0].tokens[:min(max_len, L - e)] == ctx[e:e + max_len]
    fresh = NgramDrafter(max_ngram, min_ngram).propose(ctx, num_paths, max_len, SP)
    assert [(p.tokens, p.meta) for p in fresh] == [(p.tokens, p.meta) for p in paths]
