"""MCTS on KV-tree forks (`specfork.mcts`): nothing leaks, sharing changes the memory and not the
search, and the reported score is the model's own."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specfork.engine import Engine
from specfork.errors import SpecforkError
from specfork.mcts import mcts
from specfork.model import Model
from specfork.session import Session

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.3)       # peaked: the top-B children are not near-ties


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()
    return hf, Model(hf)


def _prompt(seed, n=19):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _session(model, full_copy=False, block_size=None, tok=None, max_kv_tokens=8192):
    return Session(Engine(model, tok, max_kv_tokens=max_kv_tokens, block_size=block_size,
                          eos_token_ids=[]), full_copy=full_copy)


def _search(model, prompt, full_copy, block_size=None, **kw):
    s = _session(model, full_copy, block_size)
    root = s.start(prompt)
    res = mcts(s, root, **kw)
    assert root.tokens == prompt and root.branch.held            # the root stays the caller's
    s.release(root)
    return s, res


def _hf_mean_logprob(hf, prompt, path):
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt + path])).logits[0].float(), -1)
    return sum(float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(path)) / len(path)


@pytest.mark.parametrize("seed,bs", [(0, None), (1, None), (2, 16)])
def test_tree_and_full_copy_same_search_less_memory(tiny, seed, bs):
    hf, model = tiny
    prompt = _prompt(seed)
    kw = dict(branching=3, depth=6, simulations=12, c_puct=1.0)
    st, tree = _search(model, prompt, False, bs, **kw)
    sc, copy = _search(model, prompt, True, bs, **kw)
    for s, r in ((st, tree), (sc, copy)):
        assert r.kv_blocks_leaked == 0
        assert s.pool.used_blocks == 0 and s.kv.live_branches == 0
    assert tree.expanded == copy.expanded                  # same nodes expanded, same order
    assert tree.best_tokens == copy.best_tokens
    assert tree.nodes == copy.nodes == 1 + kw["branching"] * len(tree.expanded)
    assert len(tree.best_tokens) >= 2
    assert tree.kv_peak_bytes < copy.kv_peak_bytes
    assert tree.best_mean_logprob == pytest.approx(
        _hf_mean_logprob(hf, prompt, tree.best_tokens), abs=1e-4)


def test_best_path_starts_with_a_top_b_token(tiny):
    """The children are the target's top-B tokens: the best path's first token is one of
    them (HF's own logits), and its path was expanded from the root first."""
    hf, model = tiny
    prompt = _prompt(3)
    _, res = _search(model, prompt, False, branching=4, depth=5, simulations=10)
    with torch.no_grad():
        top = hf(torch.tensor([prompt])).logits[0, -1].topk(4).indices.tolist()
    assert res.best_tokens[0] in top
    assert res.expanded[0] == []


def test_errors_and_cleanup_on_failure(tiny, monkeypatch):
    _, model = tiny
    s = _session(model, max_kv_tokens=1024)
    root = s.start(_prompt(4))
    for kw in (dict(branching=0), dict(depth=0), dict(simulations=0), dict(c_puct=-1.0),
               dict(branching=257)):
        with pytest.raises(SpecforkError):
            mcts(s, root, **kw)
    s.logits(root)
    used = s.pool.used_blocks
    calls, forward = [0], model.forward

    def flaky(*a, **k):                                 # the 5th forward fails mid-search
        calls[0] += 1
        if calls[0] == 5:
            raise RuntimeError("boom")
        return forward(*a, **k)
    monkeypatch.setattr(model, "forward", flaky)
    with pytest.raises(RuntimeError, match="boom"):
        mcts(s, root, branching=3, depth=6, simulations=8)
    monkeypatch.setattr(model, "forward", forward)
    assert s.pool.used_blocks == used and s.kv.live_branches == 1   # only the root is held


@pytest.mark.slow
def test_embedded_model(smol, mt_prompts):
    hf, tok, model = smol
    ids = Engine(model, tok, max_kv_tokens=1).encode(mt_prompts[0]["text"])
    kw = dict(branching=3, depth=4, simulations=5)
    st, tree = _search(model, ids, False, **kw)
    _, copy = _search(model, ids, True, **kw)
    assert tree.kv_blocks_leaked == 0 and st.pool.used_blocks == 0
    assert tree.best_tokens == copy.best_tokens and tree.expanded == copy.expanded
    assert tree.kv_peak_bytes < copy.kv_peak_bytes
    assert tree.best_mean_logprob == pytest.approx(
        _hf_mean_logprob(hf, ids, tree.best_tokens), abs=1e-4)
