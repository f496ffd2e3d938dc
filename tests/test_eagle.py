"""EAGLE drafters: target features out of the forward, the published checkpoint layouts (every
key consumed, every misfit a one-line error), the dynamic tree, and exactness with the drafts."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from specfork.decoder import SpecDecoder
from specfork.drafters import eagle
from specfork.drafters.ngram import NgramDrafter
from specfork.drafters.registry import make_drafters
from specfork.errors import SpecforkError
from specfork.model import Model
from specfork.types import SamplingParams

V, HID, LAYERS = 96, 32, 8


def tiny_target(seed=0, layers=LAYERS, vocab=V, std=0.2):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=HID, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, initializer_range=std)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def write_checkpoint(path, arch, vocab=V, draft_vocab=40, fmt="safetensors", spelling="midlayer",
                     aux=None, embed=False, seed=1, std=0.3, drop=None, extra=None, reshape=None):
    """A random head in exactly the layout the EAGLE authors publish."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * std

    def one(*shape):
        return 1.0 + r(*shape) * 0.1

    H, heads, kvh, inter = HID, 4, 2, 48
    D = H // heads
    cfg = {"architectures": ["LlamaForCausalLMEagle3" if arch == "eagle3" else "LlamaForCausalLM"],
           "hidden_size": H, "intermediate_size": inter, "num_attention_heads": heads,
           "num_key_value_heads": kvh, "num_hidden_layers": 1, "vocab_size": vocab,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 256}
    if arch == "eagle3":
        cfg["draft_vocab_size"] = draft_vocab
        if aux is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
        p = "midlayer." if spelling == "midlayer" else "layers.0."
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
        sd = {"fc.weight": r(H, 3 * H), p + "self_attn.q_proj.weight": r(heads * D, 2 * H),
              p + "self_attn.k_proj.weight": r(kvh * D, 2 * H),
              p + "self_attn.v_proj.weight": r(kvh * D, 2 * H),
              p + "input_layernorm.weight": one(H), p + "hidden_norm.weight": one(H),
              "norm.weight": one(H), "lm_head.weight": r(draft_vocab, H),
              "d2t": ids - torch.arange(draft_vocab), "t2d": t2d}
    else:
        cfg["rope_theta"] = 10000.0
        p = "layers.0."
        sd = {"fc.weight": r(H, 2 * H), "fc.bias": r(H),
              p + "self_attn.q_proj.weight": r(heads * D, H),
              p + "self_attn.k_proj.weight": r(kvh * D, H),
              p + "self_attn.v_proj.weight": r(kvh * D, H)}
    sd.update({p + "self_attn.o_proj.weight": r(H, heads * D),
               p + "mlp.gate_proj.weight": r(inter, H), p + "mlp.up_proj.weight": r(inter, H),
               p + "mlp.down_proj.weight": r(H, inter),
               p + "post_attention_layernorm.weight": one(H)})
    if embed:
        sd["embed_tokens.weight"] = r(vocab, H)
    for k in drop or ():
        del sd[k]
    sd.update(extra or {})
    for k, shape in (reshape or {}).items():
        sd[k] = r(*shape)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))
    else:
        torch.save(sd, path / "pytorch_model.bin")
    return path


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                      pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_forward_captures_the_residual_entering_each_layer_like_hf():
    hf = tiny_target()
    m = Model(hf)
    ids = [5, 9, 2, 33, 7, 1, 60]
    from specfork.attention import AttnMeta
    dec = SpecDecoder(m, None, eos_token_ids=[])
    B = dec.kv.new_branch()
    slots = dec.kv.append(B, len(ids))
    logits, feats = m.forward(torch.tensor(ids), torch.arange(len(ids)), dec.pool,
                              AttnMeta.prefill(m, slots[:0], slots), capture=(2, 4, LAYERS))
    dec.kv.release(B)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    hs = ref.hidden_states                    # [0] embeddings, [i] input of layer i, [L] normed
    want = torch.cat([hs[2][0], hs[4][0], hs[LAYERS][0]], dim=-1)
    torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits, ref.logits[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch,fmt,spelling,embed", [
    ("eagle3", "safetensors", "midlayer", False),
    ("eagle3", "bin", "layers.0", True),
    ("eagle1", "bin", "layers.0", False),
    ("eagle1", "safetensors", "layers.0", True)])
def test_published_layouts_load_and_stay_exact(tmp_path, arch, fmt, spelling, embed):
    """Every key of the published layout is consumed (else the loader names it), and greedy
    output with the head alone and mixed with n-gram is HF greedy's, token for token."""
    hf = tiny_target()
    m = Model(hf)
    path = write_checkpoint(tmp_path / "ck", arch, fmt=fmt, spelling=spelling, embed=embed)
    prompt = [3, 17, 4, 3, 17, 4, 90, 11]
    ref = hf_greedy(hf, prompt, 24)
    kind = "eagle3" if arch == "eagle3" else "eagle"
    for spec in (f"{kind}:{path}", f"ngram,{kind}:{path}"):
        ds = make_drafters(spec, "tiny", m, drafts=2, tree=(3, 4, 10))
        dec = SpecDecoder(m, None, ds, num_paths=2, draft_len=3, eos_token_ids=[])
        r = dec.generate(prompt, max_new_tokens=24)
        assert r.token_ids == ref, spec
        assert r.stats["kv_blocks_leaked"] == 0
        assert r.stats["per_drafter"][f"{kind}:{path}"]["proposed"] > 0
        for d in ds:
            if isinstance(d, eagle.EagleDrafter):
                assert d.pool.used_blocks == 0 and d.kv.live_branches == 0


@pytest.mark.parametrize("case,msg", [
    (dict(drop=["midlayer.hidden_norm.weight"]), "lacks 'midlayer.hidden_norm.weight'"),
    (dict(extra={"midlayer.self_attn.q_proj.bias": torch.zeros(HID)}), "unexpected keys: "
                                                                         "midlayer.self_attn"),
    (dict(reshape={"fc.weight": (HID, 2 * HID)}), r"'fc.weight' has shape \(32, 64\)"),
    (dict(vocab=V + 1), "vocab_size 97, the target 96"),
    (dict(aux=[2, 4, 99]), "aux layers"),
])
def test_bad_checkpoints_are_one_line_errors(tmp_path, case, msg):
    m = Model(tiny_target())
    path = write_checkpoint(tmp_path / "ck", "eagle3", **case)
    with pytest.raises(SpecforkError, match=msg) as e:
        eagle.load_eagle(path, m, eagle.EAGLE3)
    assert "\n" not in str(e.value)


def test_config_variants_of_published_heads(tmp_path):
    """What other exporters write: a full-vocabulary head without d2t/t2d and with
    `draft_vocab_size: null`, aux layer ids at the config's top level (vLLM, speculators), and a
    `training_args.bin` beside `pytorch_model.bin`."""
    m = Model(tiny_target())
    path = write_checkpoint(tmp_path / "ck", "eagle3", draft_vocab=V, fmt="bin",
                            drop=["d2t", "t2d"])
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(draft_vocab_size=None, eagle_aux_hidden_state_layer_ids=[1, 3, 5])
    (path / "config.json").write_text(json.dumps(cfg))
    torch.save({"lr": torch.tensor(1.0)}, path / "training_args.bin")
    head = eagle.load_eagle(path, m, eagle.EAGLE3)
    assert head.capture == (1, 3, 5) and head.lm_head.w.shape[0] == V
    assert head.vocab_ids.tolist() == list(range(V))
    prompt = [3, 17, 4, 3, 17, 4, 90, 11]
    dec = SpecDecoder(m, None, make_drafters(f"eagle3:{path}", "tiny", m, drafts=1,
                                             tree=(3, 4, 10)), num_paths=1, eos_token_ids=[])
    assert dec.generate(prompt, max_new_tokens=16).token_ids == hf_greedy(m.hf, prompt, 16)


def test_two_heads_reading_different_layers_get_their_own_columns(tmp_path):
    """An EAGLE-3 head (layers 2, 4, 5 of 8) beside an EAGLE-1 head (the final norm's output):
    one capture of four layers, each head handed its own columns; still HF greedy exactly."""
    hf = tiny_target()
    m = Model(hf)
    a = write_checkpoint(tmp_path / "a", "eagle3")
    b = write_checkpoint(tmp_path / "b", "eagle1")
    ds = make_drafters(f"eagle3:{a},eagle:{b}", "tiny", m, drafts=1, tree=(3, 3, 8))
    dec = SpecDecoder(m, None, ds, num_paths=1, eos_token_ids=[])
    assert dec.capture == (2, 4, 5, LAYERS)
    assert dec.feature_cols[id(ds[0])].numel() == 3 * HID
    assert dec.feature_cols[id(ds[1])].tolist() == list(range(3 * HID, 4 * HID))
    prompt = [3, 17, 4, 3, 17, 4, 90, 11]
    r = dec.generate(prompt, max_new_tokens=20)
    assert r.token_ids == hf_greedy(hf, prompt, 20)
    assert all(r.stats["per_drafter"][d.name]["proposed"] > 0 for d in ds)


def test_cli_help_states_the_tree_defaults_in_force(capsys):
    """The parser stays torch-free, so its help spells the defaults out; they must be the
    engine's."""
    from specfork import cli
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag, v in (("--tree-topk", eagle.TREE_TOPK), ("--tree-depth", eagle.TREE_DEPTH),
                    ("--draft-tokens", eagle.DRAFT_TOKENS)):
        assert f"(default {v})" in text.split(flag, 2)[-1].split("--", 1)[0], flag


def test_bad_d2t_and_missing_files_are_errors(tmp_path):
    m = Model(tiny_target())
    bad = torch.full((40,), 0)                     # every draft row maps to target ids 0..39 ...
    bad[1] = -1                                    # ... except one that collides with row 0
    path = write_checkpoint(tmp_path / "ck", "eagle3", extra={"d2t": bad})
    with pytest.raises(SpecforkError, match="d2t and t2d"):
        eagle.load_eagle(path, m, eagle.EAGLE3)
    with pytest.raises(SpecforkError, match="not a directory"):
        eagle.load_eagle(tmp_path / "nowhere", m, eagle.EAGLE3)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(SpecforkError, match="no .safetensors or .bin"):
        eagle.load_eagle(tmp_path / "empty", m, eagle.EAGLE3)


def test_dynamic_tree_shape(tmp_path):
    """At most N nodes, at most `depth` deep, ancestor-closed (every path's prefixes are kept),
    best leaf first; the scratch fork is freed at observe and nothing leaks at end."""
    m = Model(tiny_target())
    head = eagle.load_eagle(write_checkpoint(tmp_path / "ck", "eagle3"), m, eagle.EAGLE3)
    d = eagle.EagleDrafter(head, topk=3, depth=4, tokens=11)
    ctx = [3, 17, 4, 3, 17, 4, 90, 11]
    dec = SpecDecoder(m, None, [d], num_paths=1, eos_token_ids=[])
    from specfork.attention import AttnMeta
    B = dec.kv.new_branch()
    slots = dec.kv.append(B, len(ctx))
    _, feats = m.forward(torch.tensor(ctx), torch.arange(len(ctx)), dec.pool,
                         AttnMeta.prefill(m, slots[:0], slots), capture=d.features)
    dec.kv.release(B)
    d.begin(ctx[:-1])
    assert d.propose(ctx, 0, 0, SamplingParams()) == []       # no features yet: no draft
    d.observe(ctx, feats[:-1])
    paths = d.propose(ctx, 0, 0, SamplingParams())
    nodes = {tuple(p.tokens[:i]) for p in paths for i in range(1, len(p.tokens) + 1)}
    assert len(nodes) == 11 and max(len(p.tokens) for p in paths) <= 4
    scores = [p.meta["score"] for p in paths]
    assert scores == sorted(scores, reverse=True)
    assert all(p.q is None for p in paths)
    assert d.pool.used_blocks == len(ctx) - 1 + 3 * 3          # committed pairs + expanded nodes
    d.observe(ctx + [5], feats[-1:])
    assert d.pool.used_blocks == len(ctx) - 1
    d.end()
    assert d.pool.used_blocks == 0 and d.kv.live_branches == 0


def test_tree_options_are_checked_before_loading():
    with pytest.raises(SpecforkError, match="tree_depth must be in"):
        SpecDecoder.from_pretrained("smollm2-135m", drafts=1, drafter="eagle", tree_depth=0)
    with pytest.raises(SpecforkError, match="needs a checkpoint: eagle3:PATH"):
        SpecDecoder.from_pretrained("smollm2-135m", drafts=1, drafter="eagle3")


# -- lossless sampling over several verify steps, every drafter ----------------------------------

SV, SN = 4, 6       # the prefill samples 1 token, each verify step (paths of 1) at most 2:
                    # >= 3 steps
RUNS = 1500


def _joint_law(hf, prompt, n, temperature, top_k, top_p):
    """Exact law of the first `n` sampled tokens under the warping, `[SV ** n]`."""
    from specfork.sampling import probs_from_logits
    law = torch.ones(1)
    prefixes = [[]]
    with torch.no_grad():
        for _ in range(n):
            lg = hf(torch.tensor([prompt + p for p in prefixes])).logits[:, -1]
            p = torch.stack([probs_from_logits(r, temperature, top_k, top_p) for r in lg])
            law = (law[:, None] * p).flatten()
            prefixes = [q + [x] for q in prefixes for x in range(SV)]
    return law


def _drafters(kind, tmp_path):
    from specfork.drafters.model_drafter import ModelDrafter
    target_layers = 2
    if kind == "eagle":
        path = write_checkpoint(tmp_path / "ck", "eagle3", vocab=SV, draft_vocab=3, aux=[0, 1, 1],
                                std=0.8)
        return lambda m: [eagle.EagleDrafter(eagle.load_eagle(path, m, eagle.EAGLE3), topk=2,
                                             depth=1, tokens=2)]
    draft = tiny_target(seed=5, layers=target_layers, vocab=SV, std=0.8)
    if kind == "model":
        return lambda m: [ModelDrafter(Model(draft), "draft", min_conf=0.0)]
    if kind == "ngram":
        return lambda m: [NgramDrafter(min_ngram=1)]
    path = write_checkpoint(tmp_path / "ck", "eagle3", vocab=SV, draft_vocab=3, aux=[0, 1, 1],
                            std=0.8)
    return lambda m: [NgramDrafter(min_ngram=1), ModelDrafter(Model(draft), "draft", min_conf=0.0),
                      eagle.EagleDrafter(eagle.load_eagle(path, m, eagle.EAGLE3), topk=2, depth=1,
                                         tokens=2)]


def _sample_counts(kind, tmp_path, warp, runs, monkeypatch=None):
    from test_spec_decode import chi2_pvalue
    hf = tiny_target(seed=3, layers=2, vocab=SV, std=0.8)
    m = Model(hf)
    prompt = [1, 2, 3, 1, 2]
    law = _joint_law(hf, prompt, SN, *warp)
    dec = SpecDecoder(m, None, _drafters(kind, tmp_path)(m), num_paths=2, draft_len=1,
                      eos_token_ids=[], max_kv_tokens=64)
    counts = torch.zeros(SV ** SN)
    for s in range(runs):
        r = dec.generate(prompt, max_new_tokens=SN, temperature=warp[0], top_k=warp[1],
                         top_p=warp[2], seed=s)
        assert r.stats["spec_steps"] >= 3 and r.stats["kv_blocks_leaked"] == 0
        idx = 0
        for t in r.token_ids:
            idx = idx * SV + t
        counts[idx] += 1
    return chi2_pvalue(counts, law)


@pytest.mark.parametrize("kind,warp", [("eagle", (1.0, None, None)), ("mix", (1.0, None, None)),
                                       ("mix", (1.0, 3, None)), ("mix", (0.8, None, 0.8))],
                         ids=["eagle", "mix", "mix-topk", "mix-topp"])
def test_joint_law_over_three_verify_steps_is_the_targets(tmp_path, kind, warp):
    """The first 6 sampled tokens (>= 3 verify steps: draft paths of one token) follow the
    target's exact joint law under each warping, for EAGLE alone and mixed with n-gram lookup and
    a draft model (all three draft in every step of the mix)."""
    assert _sample_counts(kind, tmp_path, warp, RUNS) > 0.01


def test_joint_law_test_catches_a_commit_that_keeps_a_rejected_token(tmp_path, monkeypatch):
    """The same test fails when the accepted fork keeps one K/V row too many (a rejected
    token's): later steps then condition on a context the output does not have."""
    from specfork.kv_tree import KVTree
    truncate = KVTree.truncate
    monkeypatch.setattr(KVTree, "truncate", lambda self, br, n: truncate(self, br, n + 1)
                        if br.length > n else truncate(self, br, n))
    assert _sample_counts("model", tmp_path, (1.0, None, None), RUNS) < 1e-4


# -- the shipped head of the embedded target -----------------------------------------------------

@pytest.mark.slow
def test_shipped_head_is_small_fast_to_load_and_drafts_the_targets_tokens(smol, mt_prompts):
    """Inside the package (<= 25 MB), loads in under a second, and its greedy chain drafts
    tokens the target accepts, with output equal to plain greedy; refused for another target."""
    import time
    from specfork.drafters.trained_draft import DraftTargetMismatch
    hf, tok, model = smol
    size = sum(f.stat().st_size for f in eagle.SHIPPED.iterdir())
    assert size <= 25 * 2 ** 20, size
    t = time.perf_counter()
    head = eagle.load_shipped(model)
    assert time.perf_counter() - t < 1.0
    assert head.arch == eagle.EAGLE3 and head.capture == eagle.default_capture(30)
    assert head.embed is model.embed                         # borrowed, not copied
    plain = SpecDecoder(model, tok, max_kv_tokens=512)
    chain = SpecDecoder(model, tok, [eagle.EagleDrafter(head, topk=1, depth=4, tokens=4)],
                        num_paths=1, max_kv_tokens=512)
    emitted = forwards = 0
    for p in mt_prompts[1:4]:
        ref = plain.generate(p["text"], max_new_tokens=48)
        out = chain.generate(p["text"], max_new_tokens=48)
        assert out.token_ids == ref.token_ids and out.stats["kv_blocks_leaked"] == 0
        emitted += len(out.token_ids) - 1
        forwards += out.stats["target_forwards"] - 1
    # tokens per verify step: an untrained head gives 1.0, this one 1.64
    assert emitted / forwards > 1.25, emitted / forwards
    other = tiny_target(vocab=49152)
    with pytest.raises(DraftTargetMismatch):
        eagle.load_shipped(Model(other))


def test_head_rope_rows_equal_the_rotary_module_at_any_position(tmp_path):
    """The head's RoPE on a CPU comes from a table that grows by doubling; each row equals what
    the checkpoint's rotary module gives for that position alone."""
    from specfork.model import rope_tables
    m = Model(tiny_target())
    head = eagle.load_eagle(write_checkpoint(tmp_path / "ck", "eagle3"), m, eagle.EAGLE3)
    for pos in ([3], [0, 1, 2], [700, 5, 300], [1500]):
        p = torch.tensor(pos)
        for got, want in zip(head.rope(p), rope_tables(head.rotary, head.embed, p)):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert head._rope[0].shape[0] >= 1501
