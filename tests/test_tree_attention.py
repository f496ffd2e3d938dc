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


@pytest.mark.parametrize("bs", [1, 16])
def test_engine_verifies_through_the_paged_kernel(monkeypatch, bs):
    """SpecDecoder's verify step as it runs on GPU (`use_kernel`): the Triton kernel, here
    under the interpreter, reads the committed prefix in place through the block table; the
    tokens equal plain greedy decoding, with one-token pages and with 16-token pages."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import specfork.model as sm
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    calls = []

    def kernel(q, k_cache, v_cache, block_table, prefix_len, k, v, mask, scale):
        calls.append(prefix_len)
        return tta.tree_attention_triton(q, k_cache, v_cache, block_table, prefix_len, k, v,
                                         mask, scale)

    monkeypatch.setattr(sm, "tree_attention", kernel)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      initializer_range=0.3)
    model = sm.Model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]              # repeats: n-gram lookup has paths
    plain = SpecDecoder(model, None, eos_token_ids=[], max_kv_tokens=96, block_size=bs)
    spec = SpecDecoder(model, None, [NgramDrafter()], num_paths=2, draft_len=3,
                       eos_token_ids=[], max_kv_tokens=96, block_size=bs)
    spec.use_kernel = True
    out = spec.generate(prompt, max_new_tokens=16)
    assert out.token_ids == plain.generate(prompt, max_new_tokens=16).token_ids
    assert len(calls) == 2 * out.stats["spec_steps"]           # every layer of every verify
    assert out.stats["kv_blocks_leaked"] == 0
