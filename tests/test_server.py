"""`specfork serve` with the real `openai` client against a live server on 127.0.0.1 (the
embedded model, n-gram + trained drafts, continuous batching, prefix cache on)."""
import asyncio
import http.client
import json
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

PROMPTS = ["Name three colors.", "What is 2 + 2?", "Write one word about the sea.",
           "List two fruits."]


def _decoder(smol):
    from specfork.decoder import SpecDecoder
    from specfork.drafters.ngram import NgramDrafter
    from specfork.drafters.registry import trained_drafter
    hf, tok, model = smol
    return SpecDecoder(model, tok, [NgramDrafter(), trained_drafter(model, max_paths=2)],
                       num_paths=2, adaptive=True, max_kv_tokens=8192)


@pytest.fixture(scope="module")
def ref(smol):
    """Each prompt run alone (chat template, greedy, 24 tokens): what `specfork generate`
    prints for it."""
    dec = _decoder(smol)
    return {p: dec.generate(p, max_new_tokens=24).text for p in PROMPTS}


@pytest.fixture(scope="module")
def live(smol):
    """(server, base url): a server on a free loopback port, stopped after the module."""
    from specfork.server import Server, build_app
    dec = _decoder(smol)
    dec.serving(max_batch=16, prefill_tokens=64, prefix_cache=True)
    server = Server(dec, "smollm2-135m")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    t = threading.Thread(target=uv.run, daemon=True)
    t.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline, "server did not start"
        time.sleep(0.05)
    yield server, f"http://127.0.0.1:{port}/v1"
    uv.should_exit = True
    t.join(timeout=30)
    server.loop.stop()


def _client(url):
    return openai.OpenAI(base_url=url, api_key="none", timeout=120, max_retries=0)


def _idle(server, timeout=30):
    """Wait for the engine to have nothing running; then the blocks held are the cache's."""
    deadline = time.time() + timeout
    while server.engine.has_work:
        assert time.time() < deadline, "engine still busy"
        time.sleep(0.05)
    time.sleep(0.1)


def _leaked(server) -> int:
    """Blocks held beyond the prefix cache's, once idle (clears the cache to count)."""
    _idle(server)
    if server.engine.cache is not None:
        server.engine.cache.clear()
    return server.engine.pool.used_blocks


def test_chat_and_completions_equal_generate_alone(live, ref):
    server, url = live
    c = _client(url)
    for p in PROMPTS[:2]:
        r = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24,
                                      messages=[{"role": "user", "content": p}])
        assert r.choices[0].message.content == ref[p]
        assert r.usage.completion_tokens <= 24 and r.usage.prompt_tokens > 5
        chunks = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": p}],
                                           stream=True, stream_options={"include_usage": True})
        got, usage, finish = "", None, None
        for ch in chunks:
            if ch.usage:
                usage = ch.usage
            for x in ch.choices:
                got += x.delta.content or ""
                finish = x.finish_reason or finish
        assert got == ref[p] and finish in ("stop", "length") and usage.completion_tokens > 0
    # completions: the raw prompt, no chat template
    r = c.completions.create(model="smollm2-135m", prompt="The capital of France is",
                             max_tokens=8, temperature=0)
    s = c.completions.create(model="smollm2-135m", prompt="The capital of France is",
                             max_tokens=8, temperature=0, stream=True)
    assert "".join(x.choices[0].text for x in s) == r.choices[0].text
    assert r.choices[0].text.strip().startswith("Paris")
    assert server.engine.counters["cached_tokens"] > 0       # the repeated prompts were cached


def test_n_choices_stop_strings_and_logprobs(live, ref):
    server, url = live
    c = _client(url)
    r = c.chat.completions.create(model="smollm2-135m", n=3, temperature=1.0, seed=5,
                                  max_tokens=12, messages=[{"role": "user",
                                                            "content": PROMPTS[2]}])
    assert sorted(x.index for x in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 36
    assert len({x.message.content for x in r.choices}) > 1      # three draws, not one
    # best_of: three draws, the most likely one returned, every draw's tokens billed
    r = c.completions.create(model="smollm2-135m", prompt="Once upon a time", best_of=3, n=1,
                             temperature=1.0, seed=2, max_tokens=8)
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].logprobs is None
    own = len(server.dec.tokenizer(r.choices[0].text, add_special_tokens=False)["input_ids"])
    assert own - 1 <= r.usage.completion_tokens <= 3 * 8
    counted = server.engine.counters["emitted"]
    r = c.completions.create(model="smollm2-135m", prompt="Once upon a time", best_of=3, n=1,
                             temperature=1.0, max_tokens=8, logprobs=0)
    assert server.engine.counters["emitted"] - counted == r.usage.completion_tokens
    assert len(r.choices[0].logprobs.token_logprobs) >= 1
    for bad in ({"best_of": 1, "n": 2}, {"best_of": 2, "stream": True}):
        with pytest.raises(openai.BadRequestError):
            c.completions.create(model="smollm2-135m", prompt="hi", max_tokens=2, **bad)
    # a stop string in the middle of the greedy answer: cut exactly where it starts
    text = ref[PROMPTS[0]]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    want = text[:text.find(stop)]
    for stream in (False, True):
        out = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=24,
                                        stop=[stop], stream=stream,
                                        messages=[{"role": "user", "content": PROMPTS[0]}])
        if stream:
            got = "".join(x.choices[0].delta.content or "" for x in out if x.choices)
        else:
            got = out.choices[0].message.content
            assert out.choices[0].finish_reason == "stop"
        assert got == want
    r = c.chat.completions.create(model="smollm2-135m", temperature=0, max_tokens=5,
                                  logprobs=True, top_logprobs=3,
                                  messages=[{"role": "user", "content": PROMPTS[1]}])
    lp = r.choices[0].logprobs.content
    assert len(lp) == 5 and all(x.logprob <= 0 for x in lp)
    assert all(len(x.top_logprobs) == 3 and x.top_logprobs[0].logprob >= x.logprob - 1e-5
               for x in lp)                      # greedy: the chosen token is the top one
    assert _leaked(server) == 0


def test_sixteen_concurrent_streams(live, ref):
    server, url = live
    ac = openai.AsyncOpenAI(base_url=url, api_key="none", timeout=300, max_retries=0)

    async def one(p):
        s = await ac.chat.completions.create(model="smollm2-135m", temperature=0,
                                             max_tokens=24, stream=True,
                                             messages=[{"role": "user", "content": p}])
        return "".join([x.choices[0].delta.content or "" async for x in s if x.choices])

    async def main():
        return await asyncio.gather(*[one(PROMPTS[i % 4]) for i in range(16)])

    steps = server.engine.counters["steps"]
    got = asyncio.run(main())
    assert got == [ref[PROMPTS[i % 4]] for i in range(16)]
    assert server.engine.counters["steps"] - steps < 16 * 24 / 2      # they shared forwards
    assert _leaked(server) == 0


def _http(url, method, path, body=None, raw: bytes | None = None):
    """(status, parsed JSON or text) of one plain HTTP call (no client library)."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    h = http.client.HTTPConnection(host, int(port), timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    h.request(method, path, body=data, headers={"content-type": "application/json"})
    r = h.getresponse()
    text = r.read().decode()
    h.close()
    try:
        return r.status, json.loads(text)
    except ValueError:
        return r.status, text


def test_disconnect_cancels_and_frees(live):
    server, url = live
    host, port = url.split("//")[1].split("/")[0].split(":")
    body = {"model": "smollm2-135m", "prompt": "Count: 1, 2, 3,", "max_tokens": 2000,
            "temperature": 0, "stream": True}
    emitted = server.engine.counters["emitted"]
    h = http.client.HTTPConnection(host, int(port), timeout=60)
    h.request("POST", "/v1/completions", body=json.dumps(body).encode(),
              headers={"content-type": "application/json"})
    r = h.getresponse()
    lines = 0
    while lines < 3:
        lines += r.readline().startswith(b"data:")
    h.sock.shutdown(socket.SHUT_RDWR)           # the client goes away mid-stream
    h.close()
    assert _leaked(server) == 0
    assert 3 <= server.engine.counters["emitted"] - emitted < 2000


def test_bad_requests_get_their_status(live):
    server, url = live
    c = _client(url)
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-9", messages=msgs)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="smollm2-135m", messages=msgs, temperature=-1)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="smollm2-135m", messages=msgs, n=0)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="smollm2-135m", messages=[])
    with pytest.raises(openai.BadRequestError) as e:         # longer than the context
        c.completions.create(model="smollm2-135m", prompt="word " * 9000, max_tokens=4)
    assert "context" in str(e.value)
    st, r = _http(url, "POST", "/v1/chat/completions", raw=b"{not json")
    assert st == 400 and "error" in r
    st, r = _http(url, "POST", "/v1/completions", {"prompt": [1.5]})
    assert st == 400 and r["error"]["param"] == "prompt"
    st, r = _http(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": "many"})
    assert st == 400 and r["error"]["param"] == "max_tokens"
    st, r = _http(url, "GET", "/v1/nothing")
    assert st == 404 and "error" in r
    assert _http(url, "GET", "/health") == (200, {"status": "ok"})
    st, m = _http(url, "GET", "/metrics")
    assert "specfork_requests_running 0" in m and "specfork_kv_blocks_used" in m
    assert _http(url, "GET", "/v1/models")[1]["data"][0]["id"] == "smollm2-135m"
    server.max_waiting = 0                                   # overload: 429, not a hang
    try:
        st, r = _http(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert st == 429 and r["error"]["type"] == "rate_limit_error"
    finally:
        server.max_waiting = 256
    assert _leaked(server) == 0


def test_reset_prefix_cache_drops_cached_prompts(live, ref):
    """POST /reset_prefix_cache (vLLM's name): every cached prompt goes and its blocks with it;
    the next request prefills again and still gets the same text."""
    server, url = live
    c = _client(url)
    msgs = [{"role": "user", "content": PROMPTS[1]}]
    out = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24,
                                    temperature=0)
    assert out.choices[0].message.content == ref[PROMPTS[1]]
    _idle(server)
    held = server.engine.cache.cached_tokens
    assert held > 0 and server.engine.pool.used_blocks > 0
    st, r = _http(url, "POST", "/reset_prefix_cache")
    assert st == 200 and r == {"dropped_tokens": held}
    assert server.engine.cache.cached_tokens == 0 and server.engine.pool.used_blocks == 0
    hits = server.engine.counters["cached_tokens"]
    out = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=24,
                                    temperature=0)
    assert out.choices[0].message.content == ref[PROMPTS[1]]
    assert server.engine.counters["cached_tokens"] == hits           # nothing left to hit
    assert _http(url, "POST", "/reset_prefix_cache")[0] == 200
