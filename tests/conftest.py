"""Shared fixtures: the embedded model is loaded once per test session."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
torch.manual_seed(0)
EVAL = Path(__file__).resolve().parents[1] / "eval"
sys.path.insert(0, str(EVAL))                    # benchmark helpers (prompts) live in eval/


@pytest.fixture(scope="session")
def smol():
    """(HF model, tokenizer, our Model) for the embedded SmolLM2-135M-Instruct."""
    from specfork.model import Model
    from specfork.loader import load_hf
    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    return hf, tok, Model(hf)


@pytest.fixture(scope="session")
def mt_prompts():
    from prompts import load_prompts
    return load_prompts("mtbench")


@pytest.fixture(scope="session")
def he_prompts():
    from prompts import load_prompts
    return load_prompts("humaneval")


def tiny_model(weights: str = "float32", kv_cache: str = "auto", hidden: int = 64,
               kv_window: int = 0):
    """A 2-layer random Llama (vocab 96, 4 heads over 2 kv heads of hidden / 4) as our Model,
    under a weight and a KV format (and KV window); seeded, so every call builds the same
    weights."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from specfork.model import Model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, initializer_range=0.05)
    return Model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval(),
                 weights=weights, kv_cache=kv_cache, kv_window=kv_window)


def tree_and_steps(m, P: int = 300):
    """Over a P-token prefix, a verify tree (root -> a -> b and root -> c, two CoW forks) and
    the decode steps of the path root, a, b: (tree logits [4, V], step logits [3][1, V], the
    tree's keys [layers, 3, ...] as written, the steps' keys as written). Checks that the tree
    took the row-by-row path."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    g = torch.Generator().manual_seed(4)
    prompt, path = torch.randint(0, 96, (P,), generator=g), torch.randint(0, 96, (3,),
                                                                           generator=g)
    pool = m.make_pool(num_blocks=P + 20)
    kv = KVTree(pool)
    B = kv.new_branch()
    s = kv.append(B, P)
    m.forward(prompt, torch.arange(P), pool, AttnMeta.prefill(m, s[:0], s))
    toks = torch.tensor([int(path[0]), int(path[1]), int(path[2]), 7])
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    f1, f2 = kv.fork(B), kv.fork(B)
    w = torch.cat((kv.append(f1, 3), kv.append(f2, 2)))
    meta = AttnMeta.tree(m, kv.slots(B), mask, w, torch.tensor([0, 1, 2, 0, 3]))
    assert meta.path == "rows"
    tree = m.forward(toks, torch.tensor([P, P + 1, P + 2, P + 1]), pool, meta)
    tree_k = pool.k[:, kv.slots(f1)[P:]].clone()
    kv.release(f1)
    kv.release(f2)
    steps = []
    for i, t in enumerate(path.tolist()):
        meta = AttnMeta.prefill(m, kv.slots(B), kv.append(B, 1))
        steps.append(m.forward(torch.tensor([t]), torch.tensor([P + i]), pool, meta))
    return tree, steps, tree_k, pool.k[:, kv.slots(B)[P:]]


def fork_and_copy_continue(m) -> tuple:
    """Sessions on `m`: a context of 37 tokens continued for 12 on a CoW fork and on a full
    copy; (the two continuations, whether every block and shadow was given back each time)."""
    from specfork.engine import Engine
    from specfork.session import Session
    outs, clean = [], True
    for full in (False, True):
        eng = Engine(m, None, max_kv_tokens=256, eos_token_ids=[])
        s = Session(eng, full_copy=full)
        h = s.start(list(range(3, 40)))
        a = s.fork(h)
        outs.append(str(s.generate(a, max_new_tokens=12)))
        s.release(a)
        s.release(h)
        clean &= eng.pool.used_blocks == 0 and eng.pool.shadows_in_use == 0
    return outs, clean


def spec_and_beams(m) -> tuple:
    """On `m`: a repetitive prompt decoded plainly and with n-gram speculation (2 paths of 3),
    then beam search (width 3, 8 tokens) on an engine of its own. Returns (plain output,
    speculative output, the speculative decoder, the beam result, the beam engine)."""
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    from specfork.engine import Engine
    from specfork.search import beam_search
    prompt = [5, 6, 7, 8, 9] * 4 + [5, 6]
    plain = SpecDecoder(m, None, eos_token_ids=[], max_kv_tokens=128)
    spec = SpecDecoder(m, None, [NgramDrafter()], num_paths=2, draft_len=3, eos_token_ids=[],
                       max_kv_tokens=128)
    want = plain.generate(prompt, max_new_tokens=24)
    got = spec.generate(prompt, max_new_tokens=24)
    eng = Engine(m, None, max_kv_tokens=256, eos_token_ids=[])
    res = beam_search(eng, prompt, num_beams=3, max_new_tokens=8)
    return want, got, spec, res, eng
