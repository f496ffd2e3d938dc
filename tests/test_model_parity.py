"""Our forward over the KV tree against the Hugging Face model itself (the peer)."""
import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config)

from specfork.decoder import SpecDecoder
from specfork.kv_tree import KVTree
from specfork.attention import AttnMeta
from specfork.model import Model, panel_fits

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_models():
    yield "llama", LlamaConfig(**TINY)
    yield "llama3.1-rope", LlamaConfig(**TINY, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    yield "qwen2", Qwen2Config(**TINY)                     # q/k/v biases
    yield "mistral", MistralConfig(**TINY, sliding_window=None)


def _hf(cfg):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _prefill_then_decode(model: Model, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Logits of every position: prefill `split` tokens, then decode one token at a time."""
    pool = model.make_pool(num_blocks=64, block_size=16)
    kv = KVTree(pool)
    b = kv.new_branch()
    slots = kv.append(b, split)
    out = [model.forward(ids[:split], torch.arange(split), pool,
                         AttnMeta.prefill(model, slots[:0], slots))]
    for i in range(split, len(ids)):
        meta = AttnMeta.prefill(model, kv.slots(b), kv.append(b, 1))
        out.append(model.forward(ids[i:i + 1], torch.tensor([i]), pool, meta))
    kv.release(b)
    assert pool.used_blocks == 0
    return torch.cat(out)


@pytest.mark.parametrize("name,cfg", list(tiny_models()), ids=lambda x: x if isinstance(x, str) else "")
def test_tiny_logits_and_greedy_match_hf(name, cfg):
    hf = _hf(cfg)
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = _prefill_then_decode(Model(hf), ids, split=21)     # prefix ends mid-block
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

    dec = SpecDecoder(Model(hf), tokenizer=None, eos_token_ids=[])
    prompt = ids[:12].tolist()
    hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False,
                         eos_token_id=None, pad_token_id=0)[0, 12:].tolist()
    res = dec.generate(prompt, max_new_tokens=48)
    assert res.token_ids == hf_out
    assert res.stats["kv_blocks_leaked"] == 0


@pytest.mark.slow
def test_embedded_logits_match_hf(smol, mt_prompts):
    hf, tok, model = smol
    text = mt_prompts[0]["text"]
    ids = torch.tensor(tok.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    ours = _prefill_then_decode(model, ids, split=len(ids) - 8)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_embedded_greedy_128_tokens_matches_hf_generate(smol, mt_prompts):
    hf, tok, model = smol
    dec = SpecDecoder(model, tok)
    for p in mt_prompts[:3]:
        res = dec.generate(p["text"], max_new_tokens=128)
        ids = torch.tensor([res.prompt_token_ids])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=128,
                          do_sample=False)[0, ids.shape[1]:].tolist()
        assert res.token_ids == ref, p["id"]
        assert res.stats["kv_blocks_leaked"] == 0
        assert res.stats["target_forwards"] == len(res.token_ids)


def test_packed_path_is_chosen_by_rows_measured_on_this_machine(monkeypatch):
    """Below `min_rows` a Linear runs F.linear itself, from it the oneDNN-packed matmul; the
    threshold is measured once per shape set (results differ by CPU: AMD EPYC packs from 1 row,
    a Sapphire Rapids Xeon from 4)."""
    import torch.nn.functional as F
    from specfork import model as mm
    torch.manual_seed(0)
    w, b = torch.randn(100, 64), torch.randn(100)          # not 32-output panels: oneDNN's
    lin = mm.Linear(w, b, pack=True, min_rows=4)
    assert lin.panel is None
    for rows in (1, 3, 4, 8):
        x = torch.randn(rows, 64)
        want = (F.linear(x, w, b) if rows < 4 else
                torch.ops.mkldnn._linear_pointwise(x, lin.packed, b, "none", [], ""))
        assert torch.equal(lin(x), want), rows                  # bitwise: that very path ran
        assert torch.allclose(lin(x), F.linear(x, w, b), atol=1e-5)
    monkeypatch.setattr(mm, "_PACKED_FROM", {})
    monkeypatch.setenv("SPECFORK_PANELS", "0")
    m = Model(_hf(LlamaConfig(**TINY)), pack=True)
    assert m.packed_min_rows in (1, 2, 4, 8, mm.MAX_PACKED_ROWS + 1)
    assert {x.min_rows for x in m.linears()} == {m.packed_min_rows}
    assert len(mm._PACKED_FROM) == 1
    Model(_hf(LlamaConfig(**TINY)), pack=True)                  # same shapes: not timed again
    assert len(mm._PACKED_FROM) == 1
    assert Model(_hf(LlamaConfig(**TINY)), pack=False).packed_min_rows == 1


@pytest.mark.skipif(not panel_fits(torch.zeros(32, 1)), reason="no AVX-512 build of the ops here")
def test_panel_matmul_is_row_invariant_and_runs_the_layer_loop_too(monkeypatch):
    """float32 weights with a multiple of 32 outputs run as panels (kernels/panel_linear.cpp):
    within float32 rounding of F.linear, bias then residual added, and a row's bits the same
    whatever the row count or its place in the call; the compiled layer loop (PANEL kind) gives
    the Python loop's bits."""
    import torch.nn.functional as F
    from specfork import model as mm
    torch.manual_seed(0)
    w, b = torch.randn(96, 80), torch.randn(96)
    lin = mm.Linear(w, b, pack=True)
    assert lin.panel is not None and lin.packed is None and lin.packed_bytes == w.nbytes
    x, res = torch.randn(21, 80), torch.randn(21, 96)
    y = lin(x)
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert torch.equal(lin.add_to(res, x), y + res)
    for rows in (1, 3, 8, 9, 17):
        assert torch.equal(lin(x[4:4 + rows]), y[4:4 + rows]), rows
    m = Model(_hf(LlamaConfig(**TINY)), pack=True)
    assert all(x.panel is not None for x in m.linears())
    ids = torch.tensor([3, 17, 29, 5, 8, 40, 2, 11])
    want = _prefill_then_decode(m, ids, 5)                  # decode steps: the compiled loop
    monkeypatch.setenv("SPECFORK_LAYER_STACK", "0")
    assert torch.equal(_prefill_then_decode(m, ids, 5), want)


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0,
                                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                             "original_max_position_embeddings": 64}])
def test_rope_table_rows_are_the_rotary_modules_values(scaling):
    """`Model.rope` reads a table that grows by doubling: every row equals, bit for bit, what
    HF's rotary module gives for that position alone (a decode step) and for a whole prompt,
    before and after the table grows, with Llama 3.1's frequency scaling too."""
    from specfork.model import rope_tables
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      rope_scaling=scaling)
    m = Model(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval())
    for pos in ([5], list(range(40)), [300], [1000, 7, 2047], [3000], [255, 256, 257]):
        p = torch.tensor(pos)
        got = m.rope(p)
        for i, q in enumerate(pos):
            want = rope_tables(m.rotary, m.embed, torch.tensor([q]))
            assert torch.equal(got[0][i], want[0][0]) and torch.equal(got[1][i], want[1][0])
        want = rope_tables(m.rotary, m.embed, p)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
