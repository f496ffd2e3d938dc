"""`specfork serve --replicas 2` on a local Ray instance (loopback only, bounded in time): the
real `openai` client gets the tokens the model gives alone, streams stream, and both replicas
answer some of the requests."""
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["Name three colors.", "What is 2 + 2?", "Write one word about the sea.",
           "List two fruits.", "Say hello in Spanish.", "Name a planet."]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_replicas_behind_one_endpoint():
    from specfork.decoder import SpecDecoder
    port = _port()
    env = {**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    p = subprocess.Popen([sys.executable, "-m", "specfork.cli", "serve", "--replicas", "2",
                          "--port", str(port), "--max-kv-tokens", "4096"], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        deadline = time.time() + 240
        while True:
            assert p.poll() is None, p.stderr.read()
            assert time.time() < deadline, "replicas did not come up in 240 s"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                time.sleep(1)
        ref = SpecDecoder.from_pretrained(max_kv_tokens=4096)
        want = {q: ref.generate(q, max_new_tokens=16).text for q in PROMPTS}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               timeout=120, max_retries=0)

        def ask(i):
            q = PROMPTS[i % len(PROMPTS)]
            msgs = [{"role": "user", "content": q}]
            if i % 2:                                    # a stream: several chunks, then done
                chunks = list(client.chat.completions.create(
                    model="smollm2-135m", messages=msgs, max_tokens=16, temperature=0,
                    stream=True))
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                assert len(chunks) > 2
                return q, text, None
            raw = client.chat.completions.with_raw_response.create(
                model="smollm2-135m", messages=msgs, max_tokens=16, temperature=0)
            return q, raw.parse().choices[0].message.content, raw.headers["x-specfork-replica"]

        with ThreadPoolExecutor(12) as ex:
            got = list(ex.map(ask, range(24)))
        for q, text, _ in got:
            assert text == want[q]
        assert len({r for _, _, r in got if r}) == 2          # both replicas served some
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=60)
        finally:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0
