"""Tensor parallelism (specfork/parallel.py) on this CPU: ranks spawned over gloo on 127.0.0.1
give the tokens one process gives (plain, with drafts, beam search), each rank holds 1/N of
the KV, and a rank that dies ends the others with a clear error instead of a hang."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from specfork.decoder import SpecDecoder
from specfork.drafters.registry import make_drafters
from specfork.errors import SpecforkError
from specfork.search import beam_search

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama with 8 heads over 4 KV heads, saved with the embedded tokenizer
    (so spawned ranks load the same weights from disk)."""
    from transformers import AutoModelForCausalLM, LlamaConfig
    from specfork.loader import load_tokenizer
    d = tmp_path_factory.mktemp("tiny_tp")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=1024, initializer_range=0.05)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    load_tokenizer("smollm2-135m").save_pretrained(d)
    return str(d)


def outputs(target: str, tp: int, prompts: list, max_new: int, raw: bool) -> dict:
    """Greedy tokens per prompt: plain, with 3 drafts of the target's default mix, beam
    search (width 3); and the KV bytes per rank of one pool."""
    dec = SpecDecoder.from_pretrained(target, tensor_parallel=tp, dtype=torch.float32,
                                      device="cpu", max_kv_tokens=4096, weights="float32")
    model, tok = dec.model, dec.tokenizer
    try:
        spec = SpecDecoder(model, tok, make_drafters(None, target, model, 3),
                           num_paths=3, adaptive=True, max_kv_tokens=4096)
        out = {"plain": [], "drafts": [], "beam": []}
        for p in prompts:
            out["plain"].append(dec.generate(p, max_new_tokens=max_new, raw=raw).token_ids)
            r = spec.generate(p, max_new_tokens=max_new, raw=raw)
            out["drafts"].append((r.token_ids, r.stats["target_forwards"] < max_new))
            out["beam"].append(beam_search(dec.engine, p, num_beams=3, max_new_tokens=max_new,
                                           raw=raw).token_ids)
        out["kv_bytes"] = ([r["kv"] for r in model.rank_bytes(dec.pool)] if tp > 1
                           else [dec.pool.k.nbytes + dec.pool.v.nbytes])
        out["num_blocks"] = dec.pool.num_blocks
        return out
    finally:
        if tp > 1:
            model.close()


def check_same(one: dict, many: dict, tp: int) -> None:
    assert many["plain"] == one["plain"]
    # the same tokens; whether a prompt's drafts saved forwards is the adaptive controller's
    # call from measured step times, which differ between one process and N ranks
    assert [t for t, _ in many["drafts"]] == [t for t, _ in one["drafts"]]
    assert any(fewer for _, fewer in many["drafts"])      # the drafts did get accepted
    assert [t for t, _ in many["drafts"]] == many["plain"]
    assert many["beam"] == one["beam"]
    assert many["num_blocks"] == one["num_blocks"]
    assert many["kv_bytes"] == [one["kv_bytes"][0] // tp] * tp


def test_tiny_llama_two_ranks(tiny_dir):
    prompts = [list(range(5, 40)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]]
    check_same(outputs(tiny_dir, 1, prompts, 40, True), outputs(tiny_dir, 2, prompts, 40, True),
               2)


@pytest.mark.slow
def test_embedded_model_two_ranks_uneven():
    """3 KV heads over 2 ranks (1 and 2): the same greedy tokens as one process."""
    p = "Give me two tips for writing clear emails."
    one = SpecDecoder.from_pretrained("smollm2-135m", max_kv_tokens=1024, weights="float32")
    ids = one.generate(p, max_new_tokens=24).token_ids
    del one
    dec = SpecDecoder.from_pretrained("smollm2-135m", tensor_parallel=2, max_kv_tokens=1024,
                                      weights="float32")
    try:
        assert dec.generate(p, max_new_tokens=24).token_ids == ids
    finally:
        dec.model.close()


@pytest.mark.slow
def test_embedded_model_three_ranks():
    prompts = ["Name three uses of a paperclip.", "Write a Python function that reverses a "
               "list in place."]
    check_same(outputs("smollm2-135m", 1, prompts, 24, False),
               outputs("smollm2-135m", 3, prompts, 24, False), 3)


@pytest.mark.parametrize("shm", ["1", "0"])
def test_uneven_split_and_too_many_ranks(tiny_dir, monkeypatch, shm):
    """4 KV heads over 3 ranks: 1, 1 and 2 heads, the same tokens, with the collectives in
    shared memory or over gloo (a 700-token prompt's rows are past the shared-memory slots:
    gloo either way); 5 ranks: refused."""
    monkeypatch.setenv("SPECFORK_TP_SHM", shm)
    one = SpecDecoder.from_pretrained(tiny_dir, dtype=torch.float32, device="cpu")
    dec = SpecDecoder.from_pretrained(tiny_dir, tensor_parallel=3, dtype=torch.float32,
                                      device="cpu")
    try:
        long = torch.randint(0, 96, (700,), generator=torch.Generator().manual_seed(1)).tolist()
        for p in (list(range(5, 40)), [7] * 20, long):
            assert (dec.generate(p, max_new_tokens=30, raw=True).token_ids
                    == one.generate(p, max_new_tokens=30, raw=True).token_ids)
        nll = dec.score(long[:300])["nll"]                    # every row's logits gathered
        assert torch.allclose(torch.tensor(nll), torch.tensor(one.score(long[:300])["nll"]),
                              atol=1e-4)
        full = one.pool.k.nbytes + one.pool.v.nbytes
        assert [r["kv"] for r in dec.model.rank_bytes(dec.pool)] == [full // 4, full // 4,
                                                                      full // 2]
    finally:
        dec.model.close()
    with pytest.raises(SpecforkError, match="the target has 4 KV heads, fewer than ranks"):
        SpecDecoder.from_pretrained(tiny_dir, tensor_parallel=5)


def test_cli_refuses_bad_rank_counts():
    for n, msg in (("0", "--tensor-parallel must be >= 1"),
                   ("4", "the target has 3 KV heads, fewer than ranks")):
        r = subprocess.run([sys.executable, "-m", "specfork.cli", "generate", "--prompt", "hi",
                            "--tensor-parallel", n], capture_output=True, text=True, cwd=ROOT,
                           timeout=120)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.splitlines()) == 1


LOOP = """
import faulthandler, signal, sys, torch
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's view of a hang
from specfork.decoder import SpecDecoder
from specfork.errors import run_command
dec = SpecDecoder.from_pretrained({target!r}, tensor_parallel=2, dtype=torch.float32,
                                  device="cpu")
print(dec.model._procs[0].pid, flush=True)
def body():
    while True:
        dec.generate(list(range(5, 40)), max_new_tokens=200, raw=True)
sys.exit(run_command("specfork", body))
"""


def _sigint_default():
    """Rank 0 starts as from a terminal, Ctrl-C at its default: a suite launched in the
    background (`pytest &` from a script) has SIGINT ignored, a child inherits that, and Python
    then installs no KeyboardInterrupt handler, so the Ctrl-C test waited on a rank 0 that could
    not hear it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tiny_dir):
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(LOOP.format(target=tiny_dir))],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=env, preexec_fn=_sigint_default)
    worker = int(p.stdout.readline())
    time.sleep(1.0)                                  # well into the generation loop
    return p, worker


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" in f.read()
    except FileNotFoundError:
        return True


def test_killing_a_rank_stops_rank_zero(tiny_dir):
    p, worker = _start(tiny_dir)
    try:
        os.kill(worker, signal.SIGKILL)
        rc = p.wait(timeout=60)
        err = p.stderr.read()
        assert rc == 1, err
        assert err.splitlines() == [
            "specfork: error: RankFailed: tensor parallelism stopped: rank 1 exited with code "
            "-9 (SPECFORK_DEBUG=1 shows the traceback)"]
    finally:
        p.kill()


@pytest.mark.parametrize("how", ["kill rank 0", "ctrl-c"])
def test_the_other_ranks_stop_with_rank_zero(tiny_dir, how):
    """Rank 0 killed, or interrupted mid-generation (status 130): no rank is left waiting."""
    p, worker = _start(tiny_dir)
    try:
        if how == "kill rank 0":
            p.kill()
            p.wait(timeout=30)
        else:
            p.send_signal(signal.SIGINT)
            try:
                rc = p.wait(timeout=60)
            except subprocess.TimeoutExpired:       # where it hangs: every thread's stack
                p.send_signal(signal.SIGUSR1)
                time.sleep(2)
                p.kill()
                if not _gone(worker):               # it holds rank 0's stderr open
                    os.kill(worker, signal.SIGKILL)
                pytest.fail("rank 0 still running 60 s after Ctrl-C; its threads:\n"
                            + p.stderr.read()[-8000:])
            assert rc == 130
        deadline = time.time() + 60
        while not _gone(worker) and time.time() < deadline:
            time.sleep(0.2)
        assert _gone(worker)
    finally:
        p.kill()
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)


def test_a_rank_dying_stops_an_idle_server(tiny_dir):
    """Between requests rank 0 is in no collective: the watchdog notices, and the server
    stops with one line and status 1."""
    import urllib.request
    port = _port()
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    p = subprocess.Popen([sys.executable, "-m", "specfork.cli", "serve", "--target", tiny_dir,
                          "--tensor-parallel", "2", "--port", str(port), "--max-kv-tokens",
                          "1024"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while True:
            assert p.poll() is None and time.time() < deadline
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            (worker,) = [int(x) for x in f.read().split()]
        os.kill(worker, signal.SIGKILL)
        assert p.wait(timeout=60) == 1
        assert p.stderr.read().splitlines()[-1] == (
            "specfork: error: RankFailed: tensor parallelism stopped: rank 1 exited with code "
            "-9 (SPECFORK_DEBUG=1 shows the traceback)")
    finally:
        p.kill()


def _port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
