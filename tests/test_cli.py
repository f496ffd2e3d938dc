"""`specfork generate` as a user runs it: JSON schema, streaming, one-line errors."""
import json
import os
import subprocess
import sys
import time

import pytest

ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def run(*args, timeout=120, stdin=None):
    t = time.time()
    p = subprocess.run([sys.executable, "-m", "specfork.cli", *args], capture_output=True,
                       text=True, timeout=timeout, env=ENV, stdin=stdin or subprocess.DEVNULL)
    return p, time.time() - t


@pytest.fixture(scope="module")
def converted():
    """The embedded GGUF converted before the CLI runs: on a fresh machine the first load prints
    one line saying so, which is not part of an error message."""
    from specfork.loader import embedded_dir
    embedded_dir()


@pytest.mark.parametrize("args,needle", [
    (["--target", "no-such-model", "--prompt", "hi"], "unknown model 'no-such-model'"),
    (["--target", "meta-llama/Meta-Llama-3-8B-Instruct", "--prompt", "hi"],
     "huggingface-cli download meta-llama/Meta-Llama-3-8B-Instruct"),
    (["--target", "llama3-8b", "--prompt", "hi"], "meta-llama/Meta-Llama-3-8B-Instruct"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_new_tokens must be a positive"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--seed", str(2 ** 64)], "seed must be in [-2**63, 2**64)"),
    (["--prompt", "hi", "--device", "cudax"], "device 'cudax' is not supported"),
    (["--prompt", "hi", "--beams", "2", "--drafter", "ngram"],
     "--beams is greedy beam search: drop --drafter"),
    (["--prompt", "  "], "the prompt is empty"),
    (["--prompt", "hi", "--weights", "int3"], "--weights: unknown format 'int3'"),
    (["--prompt", "hi", "--device", "mps"], "device 'mps' is not supported"),
    (["--prompt", "hi", "--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", "0.7", "--top-k", "-1"], "top_k must be an integer >= 0"),
    (["--prompt", "hi", "--drafts", "-2"], "drafts must be in [0, 64]"),
    (["--prompt", "hi", "--drafts", "2", "--draft-len", "1000000000"],
     "draft_len must be in [1, 64]"),
    (["--prompt", "hi", "--drafter", "ngram", "--min-conf", "0.5"],
     "--drafter, --min-conf apply only with --drafts N"),
    (["--prompt", "hi", "--beams", "2", "--temperature", "0.7", "--seed", "1"],
     "--beams is greedy beam search: drop --temperature, --seed"),
    (["--prompt-file", "/no/such/file"], "No such file"),
    (["--prompt", "hi", "--max-new-tokens", "ten"], "invalid int value"),
    ([], "one of the arguments --prompt --prompt-file is required"),
    (["--prompt", "hi", "--drafts", "2", "--drafter", "bogus"], "unknown drafter 'bogus'"),
    (["--prompt", "hi", "--drafts", "2", "--min-conf", "1.5"], "min_conf must be in [0, 1]"),
    (["--prompt", "hi", "--drafts", "2", "--draft-vocab", "-1"], "draft_vocab must be an integer >= 0"),
    (["--prompt", "hi", "--no-adaptive"], "--no-adaptive applies only with --drafts N"),
])
def test_bad_input_one_line_error(converted, args, needle):
    p, dt = run("generate", *args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specfork: error:"), p.stderr
    assert needle in lines[0]
    assert "Traceback" not in p.stderr
    assert dt < 60


@pytest.mark.parametrize("args,needle", [
    (["--port", "0"], "--port must be in 1..65535"),
    (["--max-batch", "0"], "--max-batch must be > 0"),
    (["--prefill-tokens", "-5"], "--prefill-tokens must be > 0"),
    (["--min-conf", "0.2"], "--min-conf applies only with --drafts N"),
    (["--kv-cache", "turbo9"], "turbo9"),
    (["--target", "no-such-model"], "unknown model 'no-such-model'"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--ray-address", "head:6379"], "--ray-address applies only with --replicas R"),
    (["--replicas", "2", "--tensor-parallel", "3"], "--replicas with --tensor-parallel"),
    (["--tensor-parallel", "0"], "--tensor-parallel must be >= 1"),
])
def test_serve_bad_flags_one_line_error(converted, args, needle):
    p, dt = run("serve", *args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specfork: error:"), p.stderr
    assert needle in lines[0] and dt < 60


@pytest.mark.slow
def test_prompt_longer_than_context(tmp_path):
    f = tmp_path / "long.txt"
    f.write_text("hello " * 9000)
    p, _ = run("generate", "--prompt-file", str(f), "--raw")
    assert p.returncode == 2 and "exceeds the context" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_json_output_schema():
    # float32: under int4 (auto) the embedded model answers this prompt as llama.cpp does on
    # the same GGUF, 8-bit activations and all: "L'Etoile, la ..."
    p, _ = run("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
               "--json", "--drafts", "2", "--weights", "float32")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)                     # exactly one JSON object on stdout
    assert set(out) == {"text", "token_ids", "prompt_token_ids", "stats"}
    s = out["stats"]
    for k in ("new_tokens", "target_forwards", "mean_accepted", "tokens_per_s", "wall_s",
              "kv_peak_bytes", "kv_blocks_leaked"):
        assert k in s
    assert s["new_tokens"] == len(out["token_ids"]) <= 12
    assert s["kv_blocks_leaked"] == 0 and s["kv_peak_bytes"] > 0
    assert "Paris" in out["text"]
    # adaptive drafting by default: each drafter's depth per verify step (0: it did not draft)
    ad = s["adaptive"]
    assert set(ad["depth"]) == {"0:ngram", "1:trained"}
    assert all(len(v) == s["spec_steps"] for v in ad["depth"].values())
    assert 0 <= ad["off_steps"] <= s["spec_steps"]
    p, _ = run("generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
               "--json", "--drafts", "2", "--no-adaptive", "--weights", "float32")
    fixed = json.loads(p.stdout)
    assert fixed["token_ids"] == out["token_ids"] and "adaptive" not in fixed["stats"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "bfloat16"])
def test_weights_flag_end_to_end(fmt):
    """`--weights` as a user runs it: plain and `--drafts 3` under the format give the same
    tokens, an answer in words, nothing leaked."""
    args = ("generate", "--prompt", "Name three primary colors.", "--max-new-tokens", "24",
            "--json", "--weights", fmt)
    p, _ = run(*args)
    assert p.returncode == 0, p.stderr
    plain = json.loads(p.stdout)
    p, _ = run(*args, "--drafts", "3")
    assert p.returncode == 0, p.stderr
    spec = json.loads(p.stdout)
    assert spec["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) > 4
    assert spec["stats"]["kv_blocks_leaked"] == 0 and any(c.isalpha() for c in plain["text"])


@pytest.mark.slow
def test_streams_text(smol):
    _, tok, _ = smol
    p, _ = run("generate", "--prompt", "Count from one to five.", "--max-new-tokens", "16")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() and "tok/s" in p.stderr
