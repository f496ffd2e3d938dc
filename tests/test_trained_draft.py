"""The shipped draft: small on disk, an ordinary HF causal LM, and a useful predictor of the
embedded target (loose floor; results/draft_eval.json has the real numbers)."""
import pytest
import torch

from specfork.drafters.trained_draft import (DRAFT_VOCAB, WEIGHTS, DraftTargetMismatch,
                                             DraftWeightsMissing, load_trained_draft, load_vocab)
from specfork.errors import SpecforkError


def test_shipped_files_small():
    files = [f for f in WEIGHTS.iterdir() if f.is_file()]
    assert {"config.json", "model.safetensors", "train_info.json"} <= {f.name for f in files}
    assert sum(f.stat().st_size for f in files) <= 25 * 2**20


def test_vocab_ranking_covers_every_id_once():
    import json
    ids = load_vocab(10**6)
    assert sorted(ids.tolist()) == list(range(49152))
    assert len(load_vocab(DRAFT_VOCAB)) == DRAFT_VOCAB
    counts = json.loads((WEIGHTS / "vocab.json").read_text())["counts"]     # ranked, seen ids
    assert len(counts) >= DRAFT_VOCAB // 2 and min(counts) >= 1
    assert all(a >= b for a, b in zip(counts, counts[1:]))
    with pytest.raises(SpecforkError, match="positive"):
        load_vocab(0)
    with pytest.raises(DraftWeightsMissing, match="train_draft.py vocab"):
        load_vocab(10, weights_dir="/nonexistent")


def test_missing_weights_is_a_clear_error(tmp_path):
    with pytest.raises(DraftWeightsMissing, match="train_draft.py"):
        load_trained_draft(torch.nn.Module(), weights_dir=tmp_path)


@pytest.mark.slow
def test_loads_as_hf_model_sharing_target_embeddings(smol):
    from transformers import LlamaForCausalLM
    hf, tok, _ = smol
    draft = load_trained_draft(hf)
    assert isinstance(draft, LlamaForCausalLM) and not draft.training
    assert draft.model.embed_tokens.weight is hf.model.embed_tokens.weight
    assert draft.lm_head.weight is hf.model.embed_tokens.weight
    assert draft.config.num_hidden_layers < hf.config.num_hidden_layers
    half = load_trained_draft(hf, dtype=torch.bfloat16)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert hf.model.embed_tokens.weight.dtype == torch.float32       # target untouched


@pytest.mark.slow
def test_refuses_another_target(smol):
    from transformers import LlamaConfig, LlamaForCausalLM
    other = LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=1,
                                         num_attention_heads=9, num_key_value_heads=3,
                                         intermediate_size=64))
    with pytest.raises(DraftTargetMismatch):
        load_trained_draft(other)


@pytest.mark.slow
def test_greedy_acceptance_and_engine_use(smol, mt_prompts, he_prompts):
    """The draft's argmax matches the target's greedy tokens often; inside SpecDecoder the output
    is the plain greedy decode; HF assisted generation takes the same model object."""
    from specfork.decoder import SpecDecoder
    from specfork.drafters.model_drafter import ModelDrafter
    from specfork.model import Model
    hf, tok, model = smol
    draft = load_trained_draft(hf)
    plain = SpecDecoder(model, tok, max_kv_tokens=512)
    spec = SpecDecoder(model, tok, [ModelDrafter(Model(draft), "trained", max_kv_tokens=512)],
                       num_paths=1, draft_len=4, max_kv_tokens=512)
    hits = total = 0
    for p in [mt_prompts[0], he_prompts[0], he_prompts[2]]:
        ref = plain.generate(p["text"], max_new_tokens=40)
        ids = torch.tensor([ref.prompt_token_ids + ref.token_ids[:-1]])
        with torch.inference_mode():
            pred = draft(input_ids=ids).logits[0, len(ref.prompt_token_ids) - 1:].argmax(-1)
        hits += int((pred == torch.tensor(ref.token_ids)).sum())
        total += len(ref.token_ids)
        out = spec.generate(p["text"], max_new_tokens=40)
        assert out.token_ids == ref.token_ids
        assert out.stats["kv_blocks_leaked"] == 0
    assert hits / total >= 0.3, hits / total          # ~0.02 untrained

    enc = tok.apply_chat_template([{"role": "user", "content": mt_prompts[1]["text"]}],
                                  add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)
    with torch.inference_mode():
        a = hf.generate(**enc, max_new_tokens=16, do_sample=False)
        b = hf.generate(**enc, max_new_tokens=16, do_sample=False, assistant_model=draft)
    assert torch.equal(a, b)


@pytest.mark.slow
def test_default_mix_of_the_embedded_target_uses_the_trained_draft(smol):
    from specfork.drafters.registry import make_drafters
    _, _, model = smol
    ds = make_drafters(None, "smollm2-135m", model, 3)
    assert [d.name for d in ds] == ["ngram", "trained"]
    assert ds[1].min_conf == 0.3                   # default: paths stop on draft confidence
    assert make_drafters(None, "smollm2-135m", model, 3, min_conf=0.0)[1].min_conf == 0.0
    with pytest.raises(SpecforkError):
        make_drafters(None, "smollm2-135m", model, 3, min_conf=-0.1)
    # its output layer: the DRAFT_VOCAB most frequent target tokens plus the request's own
    d = ds[1]
    assert d.vocab.tolist() == sorted(load_vocab(DRAFT_VOCAB).tolist())
    prompt = [12345, 40000, 49151]
    d.begin(prompt)
    assert d.head is None                          # built on the first propose
    from specfork.types import SamplingParams
    d.propose(prompt, 1, 1, SamplingParams())
    x = torch.randn(2, model.config.hidden_size)
    assert d.head(x).shape == (2, len(d.head_ids))
    assert set(d.head_ids.tolist()) == set(d.vocab.tolist()) | set(prompt)
    assert d.spawn()._static[0] is d._static[0]    # the vocabulary's rows: built once
    d.end()
    assert make_drafters(None, "smollm2-135m", model, 3, draft_vocab=0)[1].vocab is None
    with pytest.raises(SpecforkError):
        make_drafters(None, "smollm2-135m", model, 3, draft_vocab=-1)


def test_long_context_read_as_sinks_and_window(smol):
    """A context longer than SINK + WINDOW is read as its first SINK and last WINDOW tokens:
    the drafts, and the drafts after an accepted step, are those of a drafter given exactly
    that shorter context; and a long prompt decodes to plain decoding's tokens."""
    from specfork.decoder import SpecDecoder
    from specfork.drafters import model_drafter as md
    from specfork.drafters.registry import trained_drafter
    from specfork.sampling import sampling_params
    hf, tok, model = smol
    sp = sampling_params(0.0)
    text = " ".join(f"item {i} costs {i * 7 % 13} coins;" for i in range(120))
    ids = tok(text)["input_ids"]
    assert len(ids) > md.SINK + md.WINDOW + 100
    short = ids[:md.SINK] + ids[-md.WINDOW:]
    a, b = trained_drafter(model, max_paths=2), trained_drafter(model, max_paths=2)
    a.begin(ids)
    b.begin(short)
    pa = [p.tokens for p in a.propose(ids, 2, 4, sp)]
    assert pa == [p.tokens for p in b.propose(short, 2, 4, sp)]
    step = pa[0][:2] + [5]                       # two draft tokens accepted, then another
    a.observe(ids + step)
    b.observe(short + step)
    assert a.C.length == b.C.length == len(short) + 2
    assert ([p.tokens for p in a.propose(ids + step, 2, 4, sp)]
            == [p.tokens for p in b.propose(short + step, 2, 4, sp)])
    a.end()
    b.end()
    dec = SpecDecoder(model, tok, [trained_drafter(model, max_paths=2)], num_paths=2,
                      max_kv_tokens=4096)
    plain = SpecDecoder(model, tok, max_kv_tokens=4096)
    r = dec.generate(text + " List the items that cost 3 coins.", max_new_tokens=48)
    assert r.token_ids == plain.generate(text + " List the items that cost 3 coins.",
                                         max_new_tokens=48).token_ids
    assert r.stats["target_forwards"] < 48                  # the windowed drafts are accepted


def test_the_draft_runs_low_bit_with_a_head_of_the_vocabulary_and_the_requests_rows(smol):
    """Where specfork's low-bit kernel runs, the trained draft's matmuls take int4 weights
    (its layers then run as one compiled op), whatever the target's format; its output layer is
    the vocabulary's rows (int8, as the int4 format's lm_head) then the request's own (float32):
    each logit is the full output layer's for that token, within the 8-bit rounding."""
    from specfork.drafters.registry import trained_drafter, trained_model
    from specfork.types import SamplingParams
    from specfork.weights import native
    hf, tok, model = smol
    m = trained_model(model)
    assert m.weights == ("int4" if native() else "float32")
    assert trained_model(model, "float16").dtype == torch.float16
    d = trained_drafter(model, max_paths=1)
    prompt = tok("zyzzyva quokka")["input_ids"]
    assert not set(prompt) <= set(d.vocab.tolist())         # rows beyond the vocabulary
    d.begin(prompt)
    d.propose(prompt, 1, 1, SamplingParams())
    x = torch.randn(4, model.config.hidden_size, dtype=m.dtype)   # float16 where not native
    full = x.float() @ d.model.hf.lm_head.weight.detach().float().T
    got = d.head(x).float()
    want = full[:, d.head_ids]
    n = d.vocab.numel()
    tol = {} if native() else {"rtol": 1e-2, "atol": 1e-2}       # float16 rows there
    torch.testing.assert_close(got[:, n:], want[:, n:], **tol)  # the request's rows: float
    err = (got[:, :n] - want[:, :n]).abs().max() / want[:, :n].abs().max()
    assert err < (0.02 if native() else 1e-2), err
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    d.end()
