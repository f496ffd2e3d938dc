"""Tree attention (Triton under TRITON_INTERPRET=1, and the torch paths) vs a naive float64
reference that walks the parent array itself and runs one explicit softmax per query."""
import os

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: it picks the mode per kernel

import importlib

import pytest
import torch
from hypothesis import given, settings, strategies as st

import specfork.kernels.triton_tree_attention as tta
from specfork.kernels.tree_attention import (ancestor_mask, gather_prefix, tree_attention,
                                             tree_attention_sdpa, tree_attention_torch)
from triton.runtime.interpreter import InterpretedFunction

if not isinstance(tta._prefix_kernel, InterpretedFunction):   # imported earlier, compiled mode
    tta = importlib.reload(tta)

TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1e-2, 1.6e-2)}  # atol, rtol


def reference(q, k_prefix, v_prefix, k_tree, v_tree, parents, scale=None):
    """float64, per query: keys = whole prefix + the tree tokens on its own root path."""
    T, H, D = q.shape
    G = H // k_tree.shape[1]
    scale = D ** -0.5 if scale is None else scale
    k_all = torch.cat([k_prefix, k_tree]).double().repeat_interleave(G, dim=1)   # [L+T, H, D]
    v_all = torch.cat([v_prefix, v_tree]).double().repeat_interleave(G, dim=1)
    L = k_prefix.shape[0]
    out = torch.empty(T, H, D, dtype=torch.float64)
    for i in range(T):
        path, j = [], i
        while j >= 0:
            path.append(L + j)
            j = parents[j]
        keys = torch.tensor(list(range(L)) + path)
        s = torch.einsum("hd,nhd->hn", q[i].double(), k_all[keys]) * scale
        p = torch.exp(s - s.max(-1, keepdim=True).values)
        out[i] = torch.einsum("hn,nhd->hd", p / p.sum(-1, keepdim=True), v_all[keys])
    return out


def make_case(parents, prefix_len, kvh=2, group=3, head_dim=64, block_size=16,
              dtype=torch.float32, seed=0, index_dtype=torch.int32):
    """Random q, paged cache (blocks in shuffled order, spare blocks filled with garbage), tree k/v."""
    g = torch.Generator().manual_seed(seed)
    T, H = len(parents), kvh * group
    nb = -(-prefix_len // block_size)
    num_blocks = nb + 3
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype)
    k_cache, v_cache = rand(num_blocks, block_size, kvh, head_dim), rand(num_blocks, block_size, kvh, head_dim)
    block_table = torch.randperm(num_blocks, generator=g)[:nb].to(index_dtype)
    return dict(q=rand(T, H, head_dim), k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                prefix_len=prefix_len, k_tree=rand(T, kvh, head_dim), v_tree=rand(T, kvh, head_dim),
                tree_mask=ancestor_mask(parents))


def expected(c, parents):
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    return reference(c["q"], kp, vp, c["k_tree"], c["v_tree"], parents)


def run_triton(c, num_splits=None):
    return tta.tree_attention_triton(**c, num_splits=num_splits)


def run_torch(c):
    return tree_attention(**c)


def run_sdpa(c):
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    return tree_attention_sdpa(c["q"], kp, vp, c["k_tree"], c["v_tree"], c["tree_mask"])


def check(out, ref, dtype):
    assert out.dtype == dtype and out.shape == ref.shape
    atol, rtol = TOL[dtype]
    err = ((out.double() - ref).abs() - rtol * ref.abs()).max().item()
    assert err <= atol, f"{dtype}: error beyond rtol*|ref| is {err:.3g} > atol {atol:.3g}"


CHAIN = list(range(-1, 11))                       # 12 tokens, each the parent of the next
STAR = [-1] + [0] * 11                            # a root and 11 children
BUSHY = [-1, 0, 0, 1, 1, 2, 2, 3, 5, 5, -1, 10]   # two roots (a forest)

EDGE = [  # (name, parents, prefix_len, kvh, group, head_dim, block_size, dtype)
    ("empty-prefix", BUSHY, 0, 2, 3, 64, 16, torch.float32),
    ("chain", CHAIN, 40, 2, 3, 64, 16, torch.float32),
    ("star", STAR, 40, 2, 3, 64, 32, torch.float32),
    ("mid-block-16", BUSHY, 37, 2, 3, 64, 16, torch.float32),
    ("mid-block-32", BUSHY, 37, 2, 3, 64, 32, torch.float32),
    ("full-blocks", BUSHY, 64, 2, 3, 64, 32, torch.float32),
    ("one-token", [-1], 21, 2, 3, 64, 16, torch.float32),
    ("one-token-no-prefix", [-1], 0, 2, 4, 64, 16, torch.float32),
    ("mha", BUSHY, 50, 3, 1, 64, 16, torch.float32),
    ("gqa4", BUSHY, 50, 2, 4, 64, 16, torch.float32),
    ("hd128", BUSHY, 50, 2, 3, 128, 16, torch.float32),
    ("hd128-bs32-gqa4", CHAIN, 70, 1, 4, 128, 32, torch.float32),
    ("bf16", BUSHY, 50, 2, 3, 64, 16, torch.bfloat16),
    ("fp16", BUSHY, 50, 2, 4, 128, 32, torch.float16),
    ("bf16-chain-hd128", CHAIN, 33, 1, 3, 128, 16, torch.bfloat16),
]


@pytest.mark.parametrize("name,parents,L,kvh,group,hd,bs,dtype", EDGE, ids=[e[0] for e in EDGE])
@pytest.mark.parametrize("impl", ["triton", "torch", "sdpa"])
def test_edge_cases(impl, name, parents, L, kvh, group, hd, bs, dtype):
    c = make_case(parents, L, kvh, group, hd, bs, dtype)
    out = {"triton": run_triton, "torch": run_torch, "sdpa": run_sdpa}[impl](c)
    check(out, expected(c, parents), dtype)


@pytest.mark.parametrize("num_splits", [2, 3, 5])
def test_triton_prefix_splits_merge(num_splits):
    """Several prefix partials (uneven last split, int64 block table) merged with the tree."""
    c = make_case(BUSHY, 157, kvh=2, group=3, block_size=16, index_dtype=torch.int64)
    check(run_triton(c, num_splits), expected(c, BUSHY), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_largest_tree(dtype):
    """128 tree tokens x 2 heads: several row blocks (64 rows in fp32, 128 in fp16) and tree
    key blocks in the Triton kernel."""
    g = torch.Generator().manual_seed(1)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, 128)]
    c = make_case(parents, 45, kvh=1, group=2, block_size=32, dtype=dtype)
    ref = expected(c, parents)
    check(run_triton(c), ref, dtype)
    check(run_torch(c), ref, dtype)


def test_long_prefix():
    """An 8k prefix: many pages through the block table, many splits."""
    c = make_case([-1, 0, 0], 8192 - 5, kvh=1, group=4, block_size=16)
    ref = expected(c, [-1, 0, 0])
    check(run_triton(c, num_splits=4), ref, torch.float32)
    check(run_torch(c), ref, torch.float32)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_no_mask_means_all_tree_tokens_visible(impl):
    parents = [-1, 0, 1, 2, 3]
    c = make_case(parents, 20)
    full = dict(c, tree_mask=torch.ones(5, 5, dtype=torch.bool))
    ref = {"triton": run_triton, "torch": run_torch}[impl](full)
    out = {"triton": run_triton, "torch": run_torch}[impl](dict(c, tree_mask=None))
    torch.testing.assert_close(out, ref)
    assert not torch.allclose(out, {"triton": run_triton, "torch": run_torch}[impl](c))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_only_ancestors_matter(impl):
    """Changing a non-ancestor's k/v leaves a query alone; changing an ancestor's does not."""
    run = {"triton": run_triton, "torch": run_torch}[impl]
    parents = [-1, 0, 0, 1, 2]          # 3 = 0-1-3, 4 = 0-2-4
    c = make_case(parents, 20)
    base = run(c)
    v2 = c["v_tree"].clone()
    v2[1] += 1.0                        # ancestor of 3, not of 2 or 4
    out = run(dict(c, v_tree=v2))
    torch.testing.assert_close(out[[0, 2, 4]], base[[0, 2, 4]])
    assert (out[[1, 3]] - base[[1, 3]]).abs().min() > 1e-4


def test_torch_path_args():
    """tree_attention_torch over an already gathered prefix, explicit scale, fp32 and bf16."""
    for dtype in (torch.float32, torch.bfloat16):
        c = make_case(BUSHY, 30, dtype=dtype)
        kp = gather_prefix(c["k_cache"], c["block_table"], 30)
        vp = gather_prefix(c["v_cache"], c["block_table"], 30)
        out = tree_attention_torch(c["q"], kp, vp, c["k_tree"], c["v_tree"], c["tree_mask"], scale=0.05)
        ref = reference(c["q"], kp, vp, c["k_tree"], c["v_tree"], BUSHY, scale=0.05)
        check(out, ref, dtype)
        check(tta.tree_attention_triton(**c, scale=0.05), ref, dtype)


def test_ancestor_mask():
    m = ancestor_mask([-1, 0, 0, 1, -1, 4])
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 1, 1]]
    with pytest.raises(ValueError):
        ancestor_mask([-1, 2, 0])


@st.composite
def tree_cases(draw):
    T = draw(st.integers(1, 24))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, T)]
    return dict(parents=parents, prefix_len=draw(st.integers(0, 120)),
                kvh=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 3, 4])),
                head_dim=draw(st.sampled_from([64, 128])), block_size=draw(st.sampled_from([16, 32])),
                dtype=draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16, torch.float16])),
                seed=draw(st.integers(0, 2**16)))


@settings(max_examples=25, deadline=None)
@given(case=tree_cases(), num_splits=st.sampled_from([None, 1, 2, 3]))
def test_random_trees(case, num_splits):
    parents, dtype = case["parents"], case["dtype"]
    c = make_case(**case)
    ref = expected(c, parents)
    check(run_triton(c, num_splits), ref, dtype)
    check(run_torch(c), ref, dtype)


def _tiny_model():
    from transformers import AutoModelForCausalLM, LlamaConfig

    from specfork.model import Model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.3)
    return Model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())


def _as_on_gpu(monkeypatch, calls: list):
    """Pick attention paths as on a CUDA device, and run the paged path through the Triton
    kernel under the interpreter (recording each call's prefix length)."""
    import specfork.attention as sa
    pick = sa.pick_path

    def kernel(q, k_cache, v_cache, block_table, prefix_len, k, v, mask, scale):
        assert block_table.dtype == torch.int32 and k_cache.shape[1] == 1   # slots as pages
        calls.append(prefix_len)
        return tta.tree_attention_triton(q, k_cache, v_cache, block_table, prefix_len, k, v,
                                         mask, scale)

    monkeypatch.setattr(sa, "pick_path", lambda T, L, **kw: pick(T, L, **{**kw, "gpu": True}))
    monkeypatch.setattr(sa, "tree_attention", kernel)


@pytest.mark.parametrize("bs", [1, 16])
def test_engine_verifies_through_the_paged_kernel(monkeypatch, bs):
    """SpecDecoder as it runs on GPU: the prompt through fused causal SDPA, every verify step
    through the Triton kernel (here under the interpreter), which reads the committed prefix in
    place with the prefix slots as its block table; the tokens equal plain greedy decoding on
    the CPU paths, with one-token and with 16-token KV blocks."""
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    model = _tiny_model()
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]              # repeats: n-gram lookup has paths
    plain = SpecDecoder(model, None, eos_token_ids=[], max_kv_tokens=96, block_size=bs)
    ref = plain.generate(prompt, max_new_tokens=16).token_ids
    calls = []
    _as_on_gpu(monkeypatch, calls)
    spec = SpecDecoder(model, None, [NgramDrafter()], num_paths=2, draft_len=3,
                       eos_token_ids=[], max_kv_tokens=96, block_size=bs)
    out = spec.generate(prompt, max_new_tokens=16)
    assert out.token_ids == ref
    assert len(calls) == 2 * out.stats["tree_steps"] > 0       # every layer of every verify
    assert out.stats["kv_blocks_leaked"] == 0


def test_gpu_prefill_paths_match_cpu(monkeypatch):
    """Prefill as it runs on GPU, forced here on CPU: over an empty prefix fused causal SDPA
    (no T x T mask; the CPU's choice too), over a prefix the Triton kernel with a causal tree
    mask. Logits and the K/V written equal the flash cascade's and the two bmm's within fp32
    tolerance."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    model = _tiny_model()
    ids = torch.randint(0, 64, (29,), generator=torch.Generator().manual_seed(3))

    def prefill_twice():
        pool = model.make_pool(num_blocks=8, block_size=16)
        kv = KVTree(pool)
        b = kv.new_branch()
        s = kv.append(b, 20)
        first = AttnMeta.prefill(model, s[:0], s)
        out = [model.forward(ids[:20], torch.arange(20), pool, first)]
        second = AttnMeta.prefill(model, kv.slots(b), kv.append(b, 9))   # prefix ends mid-block
        out.append(model.forward(ids[20:], torch.arange(20, 29), pool, second))
        k = pool.k.flatten(1, 2)[:, kv.slots(b)]
        return (first.path, second.path), torch.cat(out), k

    import specfork.attention as sa
    assert prefill_twice()[0] == ("causal", "masked")        # the CPU's own choice
    pick = sa.pick_path
    with monkeypatch.context() as mp:                        # the reference: the flash cascade
        mp.setattr(sa, "pick_path", lambda T, L, **kw: sa.CASCADE if kw["causal"] and L == 0
                   else pick(T, L, **kw))
        cpu_paths, cpu_logits, cpu_k = prefill_twice()
    calls = []
    _as_on_gpu(monkeypatch, calls)
    gpu_paths, gpu_logits, gpu_k = prefill_twice()
    assert cpu_paths == ("cascade", "masked") and gpu_paths == ("causal", "paged")
    assert calls == [20, 20]                                   # both layers, 20-token prefix
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(gpu_k, cpu_k, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("T,kvh,group", [(1, 2, 3), (7, 1, 4), (33, 3, 1), (40, 2, 4)])
def test_causal_attention_matches_cascade(T, kvh, group):
    """The fused causal path (4-D SDPA, K/V repeated per group) against the float64 reference
    of a chain and the CPU cascade under a causal tree mask, empty prefix."""
    from specfork.kernels.dense_attention import causal_attention
    g = torch.Generator().manual_seed(T)
    q = torch.randn(T, kvh * group, 64, generator=g)
    k, v = torch.randn(T, kvh, 64, generator=g), torch.randn(T, kvh, 64, generator=g)
    empty = k[:0]
    chain = list(range(-1, T - 1))
    out = causal_attention(q, k, v, 0.125)
    check(out, reference(q, empty, empty, k, v, chain, scale=0.125), torch.float32)
    torch.testing.assert_close(out, tree_attention_torch(q, empty, empty, k, v,
                                                         ancestor_mask(chain), 0.125))


def test_prefix_run_read_in_place_equals_gathered(monkeypatch):
    """CPU decode and cascade read the prefix's leading run of consecutive slots as a view of
    the pool and gather only the rest: the same output as gathering it all, whether the rest
    is empty or scattered, for one token and for trees past the two-bmm size. (The torch
    path: where the compiled slot op runs, a decode step reads its slots in place anyway.)"""
    import specfork.attention as sa
    from specfork.attention import AttnMeta, leading_run
    monkeypatch.setattr(sa, "uses_slot_op", lambda model: False)
    assert leading_run(torch.tensor([4, 5, 6, 9, 10])) == 3
    assert leading_run(torch.tensor([7])) == 1 and leading_run(torch.tensor([3, 2])) == 1
    model = _tiny_model()
    KVH, D = model.kv_heads, model.head_dim
    g = torch.Generator().manual_seed(1)
    kf, vf = torch.randn(700, KVH, D, generator=g), torch.randn(700, KVH, D, generator=g)
    for L, T, scattered in ((300, 1, 0), (300, 1, 20), (500, 13, 0), (500, 13, 7), (450, 40, 30)):
        prefix = torch.cat([torch.arange(10, 10 + L - scattered),
                            torch.randperm(50, generator=g)[:scattered] + 520])
        write = torch.arange(600, 600 + T)
        q = torch.randn(T, model.num_heads, D, generator=g)
        k, v = torch.randn(T, KVH, D, generator=g), torch.randn(T, KVH, D, generator=g)
        kf[write], vf[write] = k, v
        mask = torch.ones(T, T, dtype=torch.bool).tril()

        def meta():
            return (AttnMeta.prefill(model, prefix, write) if T == 1
                    else AttnMeta.tree(model, prefix, mask, write, torch.arange(T)))
        m = meta()
        assert m.run == (10, L - scattered) and m.read.numel() == scattered + (T == 1)
        out = m.attend(q, k, v, kf, vf, D ** -0.5)
        monkeypatch.setattr(sa, "RUN_MIN", 10 ** 9)
        ref = meta()
        assert ref.run is None
        torch.testing.assert_close(out, ref.attend(q, k, v, kf, vf, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)
        monkeypatch.setattr(sa, "RUN_MIN", 64)


@pytest.mark.parametrize("slot_op", [False, True])
def test_long_prompt_decodes_from_its_run_exactly(monkeypatch, slot_op):
    """A 100-token prompt lands in one run of slots (the pool hands large allocations out in
    order, also after earlier requests freed theirs); plain and speculative decoding read it in
    place and equal HF greedy, twice in a row: through the torch path (a view of the run) and
    through the compiled slot op (every slot where it lies)."""
    import specfork.attention as sa
    from specfork.attention import AttnMeta
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    model = _tiny_model()
    if not slot_op:
        monkeypatch.setattr(sa, "uses_slot_op", lambda model: False)
    elif not sa.uses_slot_op(model):
        pytest.skip("the slot op is not built on this machine")
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")     # attention called from the Python loop
    prompt = ([5, 6, 7, 8, 9, 11, 3] * 15)[:100]
    with torch.no_grad():
        ref = model.hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20,
                                do_sample=False, pad_token_id=0)[0, 100:].tolist()
    runs = []
    attend = AttnMeta.attend
    monkeypatch.setattr(AttnMeta, "attend", lambda self, *a: runs.append(
        (self.path, self.slots if slot_op else self.run)) or attend(self, *a))
    for dec in (SpecDecoder(model, None, eos_token_ids=[], max_kv_tokens=128),
                SpecDecoder(model, None, [NgramDrafter()], num_paths=2, draft_len=3,
                            eos_token_ids=[], max_kv_tokens=128)):
        for _ in range(2):
            runs.clear()
            out = dec.generate(prompt, max_new_tokens=20)
            assert out.token_ids == ref and out.stats["kv_blocks_leaked"] == 0
            decode = [r for path, r in runs if path == "decode"]      # trees here: two bmm's
            if slot_op:                    # (slots, offsets): the prompt's and its own
                assert decode and all(r[1].tolist() == [0, r[0].numel()] and
                                      r[0][:100].tolist() == list(range(100)) for r in decode)
            else:
                assert decode and all(r is not None and r[0] == 0 and r[1] >= 100
                                      for r in decode)


@pytest.mark.parametrize("fmt", ["turbo3.5", "float16"])
def test_compressed_pool_through_the_paged_kernel(monkeypatch, fmt):
    """A verify tree over a compressed pool as on a GPU: the prefix decoded from its codes in
    one gather, then the Triton kernel (under the interpreter) over it; logits equal the CPU
    paths' over the same codes."""
    from conftest import tiny_model
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    model = tiny_model(kv_cache=fmt, hidden=128)
    model.rows_exact = False                  # as on a GPU (row-by-row exactness is the CPU's)
    g = torch.Generator().manual_seed(5)
    prompt, toks = torch.randint(0, 96, (40,), generator=g), torch.randint(0, 96, (4,),
                                                                           generator=g)
    mask = ancestor_mask([-1, 0, 1, 0])

    def verify():
        pool = model.make_pool(num_blocks=60)
        kv = KVTree(pool)
        b = kv.new_branch()
        s = kv.append(b, 40)
        model.forward(prompt, torch.arange(40), pool, AttnMeta.prefill(model, s[:0], s))
        f1, f2 = kv.fork(b), kv.fork(b)
        w = torch.cat((kv.append(f1, 3), kv.append(f2, 2)))
        meta = AttnMeta.tree(model, kv.slots(b), mask, w, torch.tensor([0, 1, 2, 0, 3]))
        out = model.forward(toks, torch.tensor([40, 41, 42, 41]), pool, meta)
        return meta.path, out, pool.k[:, kv.slots(f1)].clone()

    cpu_path, cpu_logits, cpu_k = verify()
    calls = []
    _as_on_gpu(monkeypatch, calls)
    gpu_path, gpu_logits, gpu_k = verify()
    assert cpu_path in ("masked", "cascade") and gpu_path == "paged"
    assert calls == [40, 40]                                     # both layers
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(gpu_k[0], cpu_k[0])           # layer 0's codes; the rest follow paths


@pytest.mark.parametrize("fmt", ["turbo3.5", "turbo4", "turbo2.5"])
def test_triton_kernel_decodes_turbo_pages(monkeypatch, fmt):
    """The Triton prefix kernel reading TurboQuant pages itself (bytes -> codes -> centroids
    x scale, under the interpreter) equals the torch cascade over the same pages decoded by
    the codec, for a pool in one-token pages and a scattered block table."""
    from conftest import tiny_model
    import specfork.attention as sa
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    model = tiny_model(kv_cache=fmt, hidden=128)
    model.rows_exact = False
    g = torch.Generator().manual_seed(6)
    prompt, toks = torch.randint(0, 96, (45,), generator=g), torch.randint(0, 96, (3,),
                                                                           generator=g)
    mask = ancestor_mask([-1, 0, 0])

    def verify():
        pool = model.make_pool(num_blocks=80)
        kv = KVTree(pool)
        junk = kv.new_branch()
        kv.append(junk, 7)                               # the prompt's slots start at 7
        b = kv.new_branch()
        s = kv.append(b, 45)
        model.forward(prompt, torch.arange(45), pool, AttnMeta.prefill(model, s[:0], s))
        f1, f2 = kv.fork(b), kv.fork(b)
        w = torch.cat((kv.append(f1, 2), kv.append(f2, 1)))
        meta = AttnMeta.tree(model, kv.slots(b), mask, w, torch.tensor([0, 1, 0]))
        return meta.path, model.forward(toks, torch.tensor([45, 46, 46]), pool, meta)

    cpu_path, cpu_logits = verify()
    layouts = []
    pick = sa.pick_path                                  # the verify as on a GPU
    monkeypatch.setattr(sa, "pick_path", lambda T, L, **kw: pick(T, L, **kw) if kw["causal"]
                        else sa.PAGED)
    monkeypatch.setattr(sa, "_kernel_layout",
                        lambda codec, q: layouts.append(1) or codec.kernel_layout())
    gpu_path, gpu_logits = verify()
    assert cpu_path in ("masked", "cascade") and gpu_path == "paged"
    assert len(layouts) == 4                              # K and V of both layers
    torch.testing.assert_close(gpu_logits, cpu_logits, atol=1e-4, rtol=1e-4)


def test_gpu_script_turbo_pages_section_runs_under_the_interpreter():
    """Section 5 of the prepared GPU script (eval/gpu_tree_attention.py), small and on the
    CPU: the code-reading kernel matches the torch path over the codec's decode."""
    from gpu_tree_attention import turbo_pages
    rows = turbo_pages(tta, None, device="cpu", shapes=((37, 5),), H=4, KVH=2, D=64,
                       dtype=torch.float32)
    assert [r["format"] for r in rows] == ["turbo4", "turbo3.5", "turbo2.5"]
    assert all(r["ok"] and r["err"] < 1e-4 for r in rows), rows
