"""eval/run_table.py end to end on a tiny random Llama (the embedded tokenizer, its own draft):
every row runs, the JSON has the promised schema, the markdown and the plots are written."""
import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]


def _load_script():
    spec = importlib.util.spec_from_file_location("run_table", ROOT / "eval" / "run_table.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["run_table"] = mod              # dataclasses resolve annotations through it
    spec.loader.exec_module(mod)
    return mod


def test_run_table_tiny(tmp_path):
    from specfork.loader import load_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
                      initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                      tie_word_embeddings=True)
    target = tmp_path / "tiny"
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(target)
    load_tokenizer("smollm2-135m").save_pretrained(target)
    out = tmp_path / "results"
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n<!-- run_table:begin -->\nSTALE TABLE\n<!-- run_table:end -->\n"
                      "\nafter\n")

    from test_eagle import write_checkpoint          # a published EAGLE-3 layout, tiny
    head = write_checkpoint(tmp_path / "eagle", "eagle3", vocab=49152, aux=[0, 1, 1])
    rc = _load_script().main(["--target", str(target), "--draft", str(target), "--device", "cpu",
                              "--eagle", f"eagle3:{head}",
                              "--prompts", "mtbench", "--prompts-per-set", "1",
                              "--max-new-tokens", "8", "--out", str(out),
                              "--readme", str(readme)])

    assert rc == 0
    res = json.loads((out / "table.json").read_text())
    assert {"rows", "machine", "command", "date", "config"} <= set(res)
    assert res["machine"]["cores"] and res["machine"]["torch"] == torch.__version__
    assert "--max-new-tokens 8" in res["command"]
    rows = res["rows"]
    assert [r["key"] for r in rows] == ["seq", "hf_greedy", "beam_naive", "beam_fork", "hf_beam",
                                        "spec1", "hf_assisted", "hf_assisted_k", "hf_lookup",
                                        "multi", "eagle", "eagle_ngram", "beam_fork_kv",
                                        "multi_kv"]
    for r in rows:
        assert r["error"] is None, r
        assert isinstance(r["strategy"], str) and r["strategy"]
        for k in ("kv_mem_vs_sequential", "tokens_per_s", "speedup_vs_hf_greedy",
                  "mean_accepted", "total_peak_bytes"):
            assert isinstance(r[k], (int, float)) and r[k] > 0, (r["key"], k)
        assert r["prompts"] == 1
    by = {r["key"]: r for r in rows}
    assert by["seq"]["kv_mem_vs_sequential"] == 1.0
    assert by["hf_greedy"]["speedup_vs_hf_greedy"] == 1.0
    assert [by[k]["branches"] for k in ("seq", "beam_fork", "hf_beam", "multi")] == [1, 4, 4, 3]
    assert by["eagle"]["branches"] == "tree of 8"
    assert by["eagle_ngram"]["branches"] == "3 + tree of 8"
    assert res["config"]["adaptive_drafting"] is True
    # the exactness checks ran: greedy rows against HF greedy, beam rows against HF beam
    for k in ("seq", "spec1", "hf_assisted", "hf_assisted_k", "hf_lookup", "multi", "eagle",
              "eagle_ngram"):
        assert by[k]["matches_hf_greedy"] is True, by[k]
    for k in ("beam_naive", "beam_fork"):
        assert by[k]["matches_hf_beam"] is True and by[k]["matches_hf_greedy"] is None, by[k]
    for k in ("hf_greedy", "hf_beam"):                # the references match nothing but HF
        assert by[k]["reference"] and by[k]["matches_hf_greedy"] is None, by[k]
        assert by[k]["matches_hf_beam"] is None
    # ours hold the packed copy of every matrix too, and a pool reserved up front
    assert by["seq"]["weights_bytes"] > 1.9 * by["hf_greedy"]["weights_bytes"]
    assert by["seq"]["kv_reserved_bytes"] >= by["seq"]["kv_peak_bytes"] > 0
    assert by["beam_naive"]["kv_mem_vs_sequential"] > by["beam_fork"]["kv_mem_vs_sequential"]
    # turbo3.5 at head_dim 16: 7 bytes a vector against float32's 64 (float16's 32)
    for k in ("beam_fork_kv", "multi_kv"):
        assert by[k]["matches_hf_greedy"] is None and by[k]["matches_hf_beam"] is None
    assert by["beam_fork_kv"]["kv_peak_bytes"] < 0.2 * by["beam_fork"]["kv_peak_bytes"]
    assert by["beam_fork_kv"]["kv_vs_float16_sequential"] == \
        by["beam_fork_kv"]["kv_mem_vs_sequential"] * 2
    assert res["config"]["draft"].startswith("self-draft")
    md = (out / "table.md").read_text()
    assert "sequential greedy (ours)" in md and "Command: `python eval/run_table.py" in md
    for png in ("throughput_memory.png", "tau_distribution.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    text = readme.read_text()
    assert "STALE TABLE" not in text and "sequential greedy (ours)" in text
    assert text.startswith("# x\n") and text.endswith("after\n")


def test_run_all_drops_a_failing_row_and_stops_at_the_deadline():
    """A row that raises in warm-up is reported and skipped; the first prompt always runs and
    no prompt starts that would end past the deadline."""
    import time
    rt = _load_script()

    def ok(ids, n):
        return rt.Run(list(ids[:n]), 0.01, 1, 0, 1)

    def bad(ids, n):
        raise RuntimeError("boom")

    prompts = [{"id": f"p{i}", "ids": [1] * (i + 1), "set": "mtbench"} for i in range(3)]
    rows = [rt.Row("seq", "a", 1, False, 0, ok, "greedy"),
            rt.Row("hf_greedy", "b", 1, True, 0, bad, "greedy")]
    assert rt.run_all(rows, prompts, 4, deadline=None) == prompts
    assert rows[1].error == "RuntimeError: boom" and not rows[1].runs
    assert list(rows[0].runs) == ["p0", "p1", "p2"]
    rows[0].runs.clear()
    assert rt.run_all(rows[:1], prompts, 4, deadline=time.perf_counter()) == prompts[:1]
    res = rt.summarize(rows, prompts[:1])
    assert res[1]["error"] and res[1]["tokens_per_s"] is None
    assert rt.check(res) == ["'b' failed: RuntimeError: boom"]


def test_engine_weight_bytes_counts_the_drafts_vocabulary_head():
    """Our rows' weight bytes count the head a request's model draft builds (on its first
    draft: 2 vocabulary rows + the context's) and leave the draft's pool empty."""
    from specfork.drafters.model_drafter import ModelDrafter
    from specfork.model import Model
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    m = Model(hf, pack=False)
    d = ModelDrafter(m, "draft", vocab=[5, 9], max_kv_tokens=32)
    rt = _load_script()
    base = rt.engine_weight_bytes([hf], [m])
    assert rt.engine_weight_bytes([hf], [m], d) == base + 3 * 32 * 4     # rows 0, 5, 9
    assert d.pool.used_blocks == 0 and d.head is None
