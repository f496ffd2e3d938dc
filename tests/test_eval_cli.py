"""The eval scripts as a user runs them: bad input is one line on stderr and exit status 2,
checked before any model loads; what they write names its command and machine."""
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("script,args,needle", [
    ("eval_draft", ["--n", "0"], "--n must be > 0"),
    ("tune_drafting", ["notjson"], "is not JSON"),
    ("tune_drafting", ['{"mix": "ngram"}'], "need keys"),
    ("tune_drafting", ['{"mix": "beam", "paths": 3, "len": 4, "conf": 0.3}'], "mix of ngram"),
    ("mcts_search", ["--branching", "0"], "--branching must be > 0"),
    ("mcts_search", ["--prompt", "999"], "--prompt must be in 0..79"),
    ("train_draft", ["gen", "--batch", "0"], "--batch must be > 0"),
    ("train_draft", ["train", "--data", "/no/such/data.pt"], "No such file"),
    ("run_table", ["--beams", "0"], "--beams must be positive"),
    ("bench_tree_attention", ["--trees", "1"], "--trees must be >= 2"),
    ("bench_long", ["--per-bucket", "0"], "must be positive"),
    ("bench_long", ["--reps", "0"], "must be positive"),
    ("bench_long", ["--buckets", "<=256,huge"], "--buckets: unknown ['huge']"),
    ("bench_long", ["--weights", "int3"], "unknown format 'int3'"),
    ("bench_prefill", ["--lengths", "100,x"], "--lengths: not a list of integers"),
    ("bench_prefill", ["--steps", "0"], "must be positive"),
    ("bench_prefill", ["--weights", "int3"], "--weights: unknown format 'int3'"),
    ("bench_cpu", ["--formats", "float32,int3"], "--formats: unknown ['int3']"),
    ("bench_cpu", ["--drafts", "0"], "must be positive"),
    ("bench_cpu", ["--reps", "0"], "must be positive"),
    ("profile_step", ["--tokens", "1"], "--tokens must be >= 2"),
    ("bench_kv_quant", ["--formats", "float32,turbo9"], "unknown KV cache format 'turbo9'"),
    ("bench_kv_quant", ["--prompts", "0"], "must be positive"),
    ("bench_kv_quant", ["--formats", "turbo3.5+wx"], "a window is written +w<tokens>"),
    ("bench_kv_quant", ["--formats", "float16+w8"], "--kv-window needs a TurboQuant"),
    ("kv_window_study", ["--formats", "float16"], "takes turbo formats"),
    ("kv_window_study", ["--docs", "0"], "--docs must be 1..6"),
    ("bench_slot_attention", ["--rows", "2,4"], "--rows includes 1"),
    ("bench_slot_attention", ["--prefixes", "300,x"], "comma-separated integers"),
    ("probe_outcomes", ["--reps", "0"], "--reps must be > 0"),
    ("probe_outcomes", ["--explore-again", "2"], "shares in (0, 1)"),
    ("probe_outcomes", ["--weights", "int3"], "unknown format 'int3'"),
])
def test_bad_input_is_one_line(script, args, needle):
    p = subprocess.run([sys.executable, str(ROOT / "eval" / f"{script}.py"), *args],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert needle in lines[-1], p.stderr
    assert lines[-1].startswith(script)
    if script != "run_table":                        # argparse's error prints its usage first
        assert len(lines) == 1, p.stderr


def test_provenance_fields():
    from provenance import command, machine
    assert command("bench_x", ["--out", "a b.json", "-k"]) == \
        "python eval/bench_x.py --out 'a b.json' -k"
    assert command("bench_x", []) == "python eval/bench_x.py"
    m = machine()
    assert m["cores"] >= 1 and m["torch_threads"] >= 1 and m["cpu"]
    assert {"torch", "transformers", "python", "platform", "loadavg_1m_start", "date"} <= m.keys()


def test_result_file_names_its_command(tmp_path):
    """A bench run end to end (tiny sizes): the JSON's command reruns it, and names the machine."""
    out = tmp_path / "t.json"
    args = ["--trees", "2", "4", "--prefixes", "16", "--min-s", "0.01", "--json", str(out)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_tree_attention.py"), *args],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["command"] == "python eval/bench_tree_attention.py " + " ".join(args)
    assert res["machine"]["cores"] == os.cpu_count()
    assert [(r["tree_size"], r["prefix_len"], r["engine_path"]) for r in res["results"]] == \
        [(2, 16, "masked"), (4, 16, "masked")]
    assert all(r["max_abs_diff"] < 1e-4 for r in res["results"])


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["float32", "auto"])
def test_bench_long_end_to_end(tmp_path, weights):
    """bench_long on one short document prompt: ours equal HF greedy (float32; under `auto`,
    the embedded target's int4 with float16 K/V, speculation equals our plain decoding),
    nothing leaks, the files name their command, and the adaptive run records a depth per
    step."""
    stem = tmp_path / "long"
    args = ["--buckets", "<=256", "--per-bucket", "1", "--max-new-tokens", "12",
            "--weights", weights, "--out", str(stem)] + (["--reps", "2"] if weights == "auto"
                                                         else [])
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_long.py"), *args],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    res = json.loads(stem.with_suffix(".json").read_text())
    assert res["command"] == "python eval/bench_long.py " + shlex.join(args)
    assert res["all_exact"] and res["leaked_blocks"] == 0
    assert res["config"]["checked_against"] == ("HF greedy" if weights == "float32" else
                                                "plain decoding (ours)")
    assert res["config"]["reps"] == (2 if weights == "auto" else 1)
    (row,) = res["prompts"]
    assert row["bucket"] == "<=256" and row["prompt_tokens"] <= 256
    assert all(len(v) == row["spec"]["steps"] for v in row["spec"]["depth"].values())
    assert stem.with_suffix(".png").is_file() and "| <=256 |" in stem.with_suffix(".md").read_text()


@pytest.mark.slow
def test_bench_prefill_end_to_end(tmp_path):
    """bench_prefill at two short lengths: every path of ours gives HF's tokens, and each row
    has a prefill time and a decode step per path."""
    out = tmp_path / "prefill.json"
    args = ["--lengths", "40,90", "--steps", "3", "--reps", "1", "--json", str(out)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_prefill.py"), *args],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["command"] == "python eval/bench_prefill.py " + " ".join(args)
    assert res["all_equal_hf"] is True
    assert [r["prompt_tokens"] for r in res["rows"]] == [40, 90]
    for r in res["rows"]:
        assert set(r["prefill_s"]) == {"hf", "causal_sdpa", "cascade"}
        assert set(r["decode_step_ms"]) == {"hf", "run_view", "gathered"}
        assert all(v > 0 for v in (*r["prefill_s"].values(), *r["decode_step_ms"].values()))


def test_bench_slot_attention_end_to_end(tmp_path):
    """bench_slot_attention at two short prefixes: a cell per (prefix, rows), each timed, one
    row the unit of its prefix, and the command that reproduces it."""
    from specfork.kernels import slot_attention as slot_op
    if not slot_op.available(64):
        pytest.skip("no compiled slot op here")
    args = ["--prefixes", "20,40", "--rows", "1,3", "--reps", "1", "--out", str(tmp_path / "s")]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_slot_attention.py"), *args],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr
    res = json.loads((tmp_path / "s.json").read_text())
    assert res["command"] == "python eval/bench_slot_attention.py " + shlex.join(args)
    assert [(c["prefix"], c["rows"]) for c in res["cells"]] == [(20, 1), (20, 3), (40, 1),
                                                                (40, 3)]
    assert all(c["ms"] > 0 for c in res["cells"])
    assert [c["vs_one_row"] for c in res["cells"] if c["rows"] == 1] == [1.0, 1.0]
    assert "| 40 |" in (tmp_path / "s.md").read_text()


def test_bench_prefill_low_bit(tmp_path):
    """Under --weights int8 bench_prefill times the engine as it runs beside HF fp32 (no
    identity claimed) and says which format it ran."""
    out = tmp_path / "prefill.json"
    args = ["--lengths", "40", "--steps", "3", "--reps", "1", "--weights", "int8",
            "--json", str(out)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_prefill.py"), *args],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    res = json.loads(out.read_text())
    assert res["weights"] == "int8" and res["all_equal_hf"] is None
    (r,) = res["rows"]
    assert set(r["prefill_s"]) == set(r["decode_step_ms"]) == {"hf", "ours"}
    assert r["prefill_vs_hf"] > 0 and r["decode_step_ms"]["ours"] > 0


@pytest.mark.slow
def test_bench_cpu_end_to_end(tmp_path):
    """bench_cpu on one prompt per set, float32 and int4: float32 equals HF greedy and its
    speculation plain decoding; int4 reports its quality against float32 and its bandwidth
    limit; the llama.cpp row is there or says why not."""
    stem = tmp_path / "cpu"
    args = ["--prompts-per-set", "1", "--max-new-tokens", "6", "--formats", "float32,int4",
            "--reps", "2", "--bw-mib", "64", "--out", str(stem)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_cpu.py"), *args],
                       capture_output=True, text=True, timeout=900, env=ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(stem.with_suffix(".json").read_text())
    assert res["command"] == "python eval/bench_cpu.py " + shlex.join(args)
    assert res["exact"] == {"float32_spec_vs_plain": True, "float32_vs_hf": True}
    by = {r["key"]: r for r in res["rows"]}
    assert {"hf_greedy", "plain_float32", "spec_float32", "plain_int4", "spec_int4"} <= set(by)
    assert "llama_cpp" in by or any(n.startswith("llama.cpp row skipped") for n in res["notes"])
    q = by["plain_int4"]
    assert 0.97 < q["ppl_ratio"] < 1.03 and q["top1_agreement"] > 0.9
    assert q["bandwidth_limit_tok_s"] > by["plain_float32"]["bandwidth_limit_tok_s"] * 3
    s = by["spec_int4"]                   # speculation over plain decoding, prompt by prompt
    assert 0 < s["vs_plain_min"] <= s["vs_plain_median"] and s["spec_equals_plain"] == "2/2"
    assert stem.with_suffix(".png").is_file()


@pytest.mark.slow
def test_profile_step_end_to_end(tmp_path):
    """profile_step on int4 for a few tokens: a breakdown whose parts add up to the step."""
    out = tmp_path / "prof.json"
    args = ["--formats", "int4", "--tokens", "6", "--json", str(out)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "profile_step.py"), *args],
                       capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["command"] == "python eval/profile_step.py " + shlex.join(args)
    f = res["formats"]["int4"]
    assert f["breakdown_ms"]["matmul"] > 0 and 0 < f["of_limit"] < 1
    assert abs(sum(f["breakdown_ms"].values()) - f["step_ms"]) < 0.01


@pytest.mark.slow
def test_bench_kv_quant_end_to_end(tmp_path):
    """bench_kv_quant on one prompt, float32, turbo3.5 and turbo3.5 with a 32-token window:
    speculation equals plain decoding under each format, turbo3.5 stores 4.57x fewer bytes
    than float16 and its key distortion lies under the 3-bit upper bound, the window lowers
    its perplexity; the files name their command."""
    stem = tmp_path / "kvq"
    args = ["--formats", "turbo3.5,turbo3.5+w32", "--prompts", "1", "--max-new-tokens", "8",
            "--long-tokens", "600", "--beam-tokens", "4", "--out", str(stem)]
    p = subprocess.run([sys.executable, str(ROOT / "eval" / "bench_kv_quant.py"), *args],
                       capture_output=True, text=True, timeout=900, env=ENV)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(stem.with_suffix(".json").read_text())
    assert res["command"] == "python eval/bench_kv_quant.py " + shlex.join(args)
    f = res["formats"]
    assert list(f) == ["float32", "turbo3.5", "turbo3.5+w32"]
    assert all(r["spec_exact"] == 1 and r["leaked_blocks"] == 0 for r in f.values())
    t = f["turbo3.5"]
    assert 1.0 < f["turbo3.5+w32"]["ppl_ratio"] < t["ppl_ratio"]
    assert t["vs_float16_bytes"] == pytest.approx(128 / 28, rel=1e-3)
    assert f["float32"]["ppl_ratio"] == 1.0 and 1.0 < t["ppl_ratio"] < 2.0
    assert 0 < t["distortion"]["k"] < 0.0425 and t["kv_peak_8k_bytes"] > 0
    assert stem.with_suffix(".png").is_file() and "| turbo3.5 |" in \
        stem.with_suffix(".md").read_text()


def test_bench_serving_engine_loop_keeps_its_concurrency_and_tokens():
    """bench_serving's in-process rows: the closed loop on the engine runs every request to its
    max_tokens with at most `concurrency` in flight, each emitting what it emits alone, and
    leaks no KV block."""
    import torch
    from bench_serving import engine_closed, summary
    from conftest import tiny_model
    from specfork.decoder import SpecDecoder
    dec = SpecDecoder(tiny_model(), None, eos_token_ids=[], max_kv_tokens=512).serving(
        prefix_cache=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (5 + 3 * i,), generator=g).tolist() for i in range(5)]
    alone = [dec.generate(p, max_new_tokens=6).token_ids for p in prompts]
    seen, made = [], []
    step, request = dec.engine.step, dec.request
    dec.engine.step = lambda: seen.append(len(dec.engine.scheduler.running)) or step()
    dec.request = lambda *a, **k: made.extend(request(*a, **k)) or made[-1:]
    recs, wall = engine_closed(dec, prompts, 2, 6)
    assert [r["tokens"] for r in recs] == [6] * 5 and max(seen) == 2
    assert [r.out for r in made] == alone
    assert all(r["ttft"] <= r["latency"] for r in recs)
    s = summary(recs, wall)
    assert s["requests"] == 5 and s["output_tokens"] == 30
    assert dec.pool.used_blocks == 0


def test_bench_serving_runs_configurations_in_turn_and_keeps_each_ones_best():
    """bench_serving's --reps: every round runs each configuration once, in the given order,
    and each keeps its own best run: the shortest wall time in a closed loop, the lowest mean
    latency at a fixed rate (where wall time is set by the arrivals)."""
    from bench_serving import in_turn
    log = []
    walls = {"a": iter([3.0, 1.0, 2.0]), "b": iter([1.5, 2.5, 0.5])}
    lats = {"a": iter([0.2, 0.4, 0.3]), "b": iter([0.9, 0.1, 0.5])}

    def run(k):
        log.append(k)
        lat = next(lats[k])
        recs = [{"ttft": lat / 2, "tpot": None, "tokens": 4, "latency": lat}]
        return recs, next(walls[k]), {"tag": k}
    got = in_turn([("a", lambda: run("a")), ("b", lambda: run("b"))], 3, closed=True)
    assert log == ["a", "b"] * 3
    assert [k for k, _ in got] == ["a", "b"]
    assert [s["wall_s"] for _, s in got] == [1.0, 0.5]
    assert all(s["reps"] == 3 and s["tag"] == k for k, s in got)
    walls = {"a": iter([3.0, 1.0, 2.0]), "b": iter([1.5, 2.5, 0.5])}
    lats = {"a": iter([0.2, 0.4, 0.3]), "b": iter([0.9, 0.1, 0.5])}
    got = dict(in_turn([("a", lambda: run("a")), ("b", lambda: run("b"))], 3, closed=False))
    assert got["a"]["latency_mean_s"] == 0.2 and got["a"]["wall_s"] == 3.0
    assert got["b"]["latency_mean_s"] == 0.1 and got["b"]["wall_s"] == 2.5
