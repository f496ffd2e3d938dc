"""`specfork serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine.

One thread steps the engine (`Engine.step`: every running request in one forward); the event
loop turns requests into engine requests and streams their tokens back. Text is detokenized
incrementally per choice; a stop string ends a choice at the exact character it starts (the
tokens after it are dropped and the request cancelled), and a streamed chunk never holds part
of a stop string or of a UTF-8 character. A client that disconnects cancels its requests, which
frees their branches at the next step.
"""
import asyncio
import concurrent.futures
import contextlib
import gc
import json
import signal
import threading
import time
import uuid

from specfork.errors import SpecforkError

MAX_WAITING = 256            # queued requests beyond which new ones get 429
MAX_STOP = 4                 # stop strings per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20


class APIError(Exception):
    """An OpenAI-style error: HTTP status, message, the parameter at fault, a code."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (status, message, param,
                                                                       code, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


class EngineLoop:
    """Steps the engine while it has work; sleeps otherwise. A step that fails ends the
    requests it ran with an error (the server stays up).

    `specfork serve` runs it on the main thread and the event loop on another: torch's
    OpenMP team belongs to the thread that first ran a parallel op (the model load's), and
    a second thread's ops ran several times slower beside it on this 2-core Xeon (serving
    with drafts ran at half its in-process speed until requests were made on this thread
    too). `thread=True` (tests) steps it on a thread of its own."""

    def __init__(self, engine, thread: bool = True):
        self.engine = engine
        self.wake = threading.Event()
        self.lock = threading.Lock()
        self.calls: list = []
        self.stopping = False
        self.thread = None
        if thread:
            self.thread = threading.Thread(target=self.run, name="specfork-engine",
                                           daemon=True)
            self.thread.start()

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn()` on the engine's thread before its next step (any thread may ask): what
        makes requests (drafter sets, their KV pools) runs there too, since a torch op on the
        event loop's thread starts a second OpenMP team that slows the engine's ops."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            self.calls.append((fn, fut))
        self.wake.set()
        return fut

    def _run_calls(self) -> None:
        with self.lock:
            calls, self.calls = self.calls, []
        for fn, fut in calls:
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def cancel(self, req) -> None:
        self.engine.cancel(req)
        self.wake.set()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)

    def run(self, alive=lambda: True) -> None:
        """Step until `stop` (or until `alive()` turns false)."""
        eng = self.engine
        while not self.stopping and alive():
            self._run_calls()
            if not eng.has_work:
                self.wake.wait(0.2)
                self.wake.clear()
                continue
            try:
                eng.step()
            except Exception as e:              # fail what ran; keep serving the rest
                line = str(e).splitlines()[0] if str(e) else ""
                eng.fail_running(f"{type(e).__name__}: {line}")


class _Choice:
    """One choice's incremental text: tokens in, text out, stop strings honoured."""

    def __init__(self, tok, stops: list[str]):
        self.tok, self.stops = tok, stops
        self.ids: list[int] = []
        self.text = ""                   # decoded so far (may end mid stop-string)
        self.sent = 0                    # characters handed to the client
        self.finish: str | None = None
        self.closed = False              # its request is over (no more events)
        self.hold = max((len(s) for s in stops), default=1) - 1

    def add(self, new: list[int]) -> None:
        self.ids += new
        self.text = self.tok.decode(self.ids, skip_special_tokens=True)
        if self.stops:
            cut = min((i for i in (self.text.find(s, max(0, self.sent - len(s) + 1))
                                   for s in self.stops) if i >= 0), default=-1)
            if cut >= 0:
                self.text = self.text[:cut]
                self.finish = "stop"

    def ready(self, final: bool) -> str:
        """Text that may go out now: all of it at the end, else what cannot start a stop
        string or end inside a UTF-8 character."""
        end = len(self.text)
        if not final and self.finish is None:
            if self.text.endswith("\ufffd"):
                end = len(self.text.rstrip("\ufffd"))
            end = max(self.sent, end - self.hold)
        out = self.text[self.sent:end]
        self.sent = end
        return out


def _num(body: dict, key: str, kind, default=None, lo=None, hi=None, lo_open=False):
    v = body.get(key, default)
    if v is None:
        return default
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise APIError(400, f"'{key}' must be an integer", key)
    if kind is float and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise APIError(400, f"'{key}' must be a number", key)
    if lo is not None and (v <= lo if lo_open else v < lo) or hi is not None and v > hi:
        raise APIError(400, f"'{key}' = {v} is out of range", key)
    return kind(v)


class Server:
    """The routes' logic over one `SpecDecoder` (its engine configured for serving)."""

    def __init__(self, dec, model_name: str, max_waiting: int = MAX_WAITING,
                 engine_thread: bool = True):
        self.dec, self.name, self.max_waiting = dec, model_name, max_waiting
        self.engine = dec.engine
        self.loop = EngineLoop(self.engine, engine_thread)
        self.created = int(time.time())

    # -- request parsing ----------------------------------------------------------------------
    def _params(self, body: dict, chat: bool) -> dict:
        model = body.get("model")
        if model is not None and model != self.name:
            raise APIError(404, f"the model '{model}' does not exist (this server serves "
                                f"'{self.name}')", "model", "model_not_found")
        n = _num(body, "n", int, 1, 1, 16)
        max_key = "max_completion_tokens" if chat and "max_completion_tokens" in body \
            else "max_tokens"
        max_tokens = _num(body, max_key, int, 16 if not chat else None, 1)
        temperature = _num(body, "temperature", float, 1.0, 0, 2)
        top_p = _num(body, "top_p", float, None, 0, 1, lo_open=True)
        top_k = _num(body, "top_k", int, None, -1)
        seed = _num(body, "seed", int, None)
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is None:
            stop = []
        if not isinstance(stop, list) or len(stop) > MAX_STOP or \
                not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, f"'stop' must be a non-empty string or a list of up to "
                                f"{MAX_STOP}", "stop")
        if chat:
            lp = body.get("logprobs") or False
            if not isinstance(lp, bool):
                raise APIError(400, "'logprobs' must be a boolean", "logprobs")
            top = _num(body, "top_logprobs", int, 0, 0, MAX_TOP_LOGPROBS)
            logprobs = top if lp else None
            if top and not lp:
                raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        else:
            logprobs = _num(body, "logprobs", int, None, 0, 5)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError(400, "'stream' must be a boolean", "stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError(400, "'stream_options' must be an object", "stream_options")
        best_of = None if chat else _num(body, "best_of", int, None, 1, 16)
        if best_of is not None and (best_of < n or stream):
            raise APIError(400, "'best_of' must be >= n, and cannot be streamed", "best_of")
        # best_of: that many choices, the n of highest log-probability returned
        draws = best_of or n
        return dict(n=n, draws=draws, max_tokens=max_tokens, temperature=temperature,
                    top_p=top_p, top_k=None if top_k in (None, -1, 0) else top_k, seed=seed,
                    stop=stop, logprobs=logprobs, stream=stream,
                    kept_logprobs=logprobs if logprobs is not None or draws == n else 0,
                    usage_in_stream=bool(opts.get("include_usage")))

    def _chat_ids(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' must be a non-empty list", "messages")
        conv = []
        for m in msgs:
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant",
                                                                  "developer", "tool"):
                raise APIError(400, "each message needs a role (system, user, assistant)",
                               "messages")
            c = m.get("content")
            if isinstance(c, list):                  # content parts: their text, in order
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in c):
                    raise APIError(400, "only text content parts are supported", "messages")
                c = "".join(p.get("text", "") for p in c)
            if not isinstance(c, str):
                raise APIError(400, "message content must be a string", "messages")
            conv.append({"role": "system" if m["role"] == "developer" else m["role"],
                         "content": c})
        tok = self.dec.tokenizer
        if not getattr(tok, "chat_template", None):
            raise APIError(400, "this model has no chat template: use /v1/completions")
        ids = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]
        return self._checked(list(ids))

    def _completion_ids(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            if not p:
                raise APIError(400, "the prompt is empty", "prompt")
            return self._checked(self.dec.tokenizer(p)["input_ids"])
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in p):
            return self._checked(p)
        raise APIError(400, "'prompt' must be a string or a list of token ids (one prompt)",
                       "prompt")

    def _checked(self, ids: list[int]) -> list[int]:
        try:
            return self.dec.engine.encode(list(ids))
        except SpecforkError as e:
            raise APIError(400, str(e), "prompt") from None

    # -- running --------------------------------------------------------------------------------
    async def start(self, ids: list[int], p: dict, aloop: asyncio.AbstractEventLoop):
        """Engine requests for one prompt, made and queued on the engine's thread, and the
        asyncio queue their events reach: ("tokens", choice, new) and ("done", choice,
        request)."""
        if len(self.engine.scheduler.waiting) + len(self.engine.inbox) >= self.max_waiting:
            raise APIError(429, "the server is overloaded: too many queued requests",
                           code="overloaded", kind="rate_limit_error")
        q: asyncio.Queue = asyncio.Queue()

        def on_tokens(i, new):
            aloop.call_soon_threadsafe(q.put_nowait, ("tokens", i, list(new)))

        max_tokens = p["max_tokens"] or self._room(ids)

        def make():
            reqs = self.dec.request(ids, max_tokens, p["temperature"], p["top_p"], p["top_k"],
                                    p["seed"], p["draws"], on_tokens, p["kept_logprobs"])
            for i, r in enumerate(reqs):
                r.on_done = lambda r, i=i: aloop.call_soon_threadsafe(q.put_nowait,
                                                                      ("done", i, r))
            self.engine.add(reqs[0])
            return reqs

        try:
            reqs = await asyncio.wrap_future(self.loop.call(make))
        except SpecforkError as e:
            code = "context_length_exceeded" if "exceeds the context" in str(e) else None
            raise APIError(400, str(e), "max_tokens" if code else None, code) from None
        return reqs, q

    def _room(self, ids: list[int]) -> int:
        """max_tokens when the client gives none (chat): what the context leaves."""
        limit = min(self.engine.context_len, self.engine.max_kv_tokens)
        if len(ids) >= limit:
            raise APIError(400, f"the prompt of {len(ids)} tokens leaves no room in the "
                                f"context of {limit} tokens", "messages",
                           "context_length_exceeded")
        return limit - len(ids)

    def cancel(self, reqs) -> None:
        for r in reqs:
            if not r.done:
                self.loop.cancel(r)

    def usage(self, ids, reqs) -> dict:
        comp = sum(len(r.out) for r in reqs)
        return {"prompt_tokens": len(ids), "completion_tokens": comp,
                "total_tokens": len(ids) + comp}

    def logprobs_of(self, r, start: int, end: int, chat: bool):
        """The choice's tokens [start, end) with their log-probabilities, OpenAI's layout."""
        tok = self.dec.tokenizer
        if r.logprobs is None:
            return None
        items = [(t, *r.token_logprobs[j]) for j, t in enumerate(r.out[start:end], start)]
        piece = lambda t: tok.decode([t])                      # noqa: E731
        if chat:
            return {"content": [{"token": piece(t), "logprob": lp,
                                 "bytes": list(piece(t).encode()),
                                 "top_logprobs": [{"token": piece(a), "logprob": v,
                                                   "bytes": list(piece(a).encode())}
                                                  for a, v in alts]}
                                for t, lp, alts in items]}
        return {"tokens": [piece(t) for t, _, _ in items],
                "token_logprobs": [lp for _, lp, _ in items],
                "top_logprobs": [{piece(a): v for a, v in alts} for _, _, alts in items],
                "text_offset": []}

    def reset_prefix_cache(self) -> int:
        """Drop every cached prompt branch (on the engine's thread); the tokens dropped. A
        request holding a branch keeps it: its blocks go when it ends."""
        cache = self.engine.cache
        n = cache.cached_tokens if cache else 0
        if cache:
            cache.clear()
        return n

    def metrics(self) -> str:
        e = self.engine
        c = e.counters
        sch = e.scheduler
        busy = c["busy_s"]
        lines = [
            ("specfork_requests_running", "gauge", len(sch.running)),
            ("specfork_requests_waiting", "gauge", len(sch.waiting) + len(e.inbox)),
            ("specfork_kv_blocks_used", "gauge", e.pool.used_blocks),
            ("specfork_kv_blocks_total", "gauge", e.pool.num_blocks),
            ("specfork_prefix_cache_tokens", "gauge", e.cache.cached_tokens if e.cache else 0),
            ("specfork_prefix_cache_hit_tokens_total", "counter", c["cached_tokens"]),
            ("specfork_prompt_tokens_total", "counter", c["prompt_tokens"]),
            ("specfork_generation_tokens_total", "counter", c["emitted"]),
            ("specfork_engine_steps_total", "counter", c["steps"]),
            ("specfork_preemptions_total", "counter", c["preemptions"]),
            ("specfork_draft_tokens_proposed_total", "counter", c["draft_proposed"]),
            ("specfork_draft_tokens_accepted_total", "counter", c["draft_accepted"]),
            ("specfork_draft_acceptance_rate", "gauge",
             c["draft_accepted"] / c["draft_proposed"] if c["draft_proposed"] else 0.0),
            ("specfork_generation_tokens_per_busy_second", "gauge",
             c["emitted"] / busy if busy else 0.0),
        ]
        out = []
        for name, kind, v in lines:
            out += [f"# TYPE {name} {kind}", f"{name} {v}"]
        return "\n".join(out) + "\n"


def build_app(server: Server):
    """The FastAPI app: /v1/chat/completions, /v1/completions, /v1/models, /health,
    /metrics. Every error is OpenAI's error JSON with a 4xx status."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        server.loop.stop()

    app = FastAPI(title="specfork", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, e):
        return JSONResponse(APIError(400, "invalid request").body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e):
        return JSONResponse(APIError(e.status_code, str(e.detail),
                                     kind="invalid_request_error").body(),
                            status_code=e.status_code)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics())

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        """vLLM's endpoint of this name: a benchmark that reruns a workload starts cold."""
        n = await asyncio.wrap_future(server.loop.call(server.reset_prefix_cache))
        return {"dropped_tokens": n}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model",
                                            "created": server.created, "owned_by": "specfork"}]}

    async def complete(request: Request, chat: bool):
        body = await body_of(request)
        p = server._params(body, chat)
        ids = server._chat_ids(body) if chat else server._completion_ids(body)
        aloop = asyncio.get_running_loop()
        reqs, q = await server.start(ids, p, aloop)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        created = int(time.time())
        choices = [_Choice(server.dec.tokenizer, p["stop"]) for _ in reqs]
        lp_sent = [0] * len(reqs)

        def on_event(ev) -> int | None:
            """Apply one event; the choice index it touched."""
            kind, i, x = ev
            ch = choices[i]
            if ch.finish is not None and kind == "tokens":
                return None
            if kind == "tokens":
                ch.add(x)
                if ch.finish is not None:            # a stop string: the rest is not wanted
                    server.cancel([reqs[i]])
                return i
            if ch.finish is None:
                r = x
                ch.finish = ("error" if r.finish_reason == "error" else
                             "length" if r.finish_reason == "length" else "stop")
            ch.closed = True
            return i

        def chunk(i: int, text: str, finish: str | None) -> dict:
            r = reqs[i]
            n_tok = len(r.out) if finish else len(choices[i].ids)
            lp = server.logprobs_of(r, lp_sent[i], n_tok, chat) if p["logprobs"] is not None \
                else None
            lp_sent[i] = n_tok
            if chat:
                delta = {"content": text} if text else {}
                c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                c = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            return {"id": rid, "object": obj + ".chunk" if chat else obj, "created": created,
                    "model": server.name, "choices": [c]}

        def all_closed() -> bool:
            return all(c.closed for c in choices)

        if p["stream"]:
            async def events():
                try:
                    if chat:
                        for i in range(len(reqs)):
                            yield _sse({"id": rid, "object": "chat.completion.chunk",
                                        "created": created, "model": server.name,
                                        "choices": [{"index": i, "delta": {
                                            "role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
                    while not all_closed():
                        i = on_event(await q.get())
                        if i is None:
                            continue
                        ch = choices[i]
                        text = ch.ready(final=ch.closed)
                        if ch.closed:
                            yield _sse(chunk(i, text, ch.finish))
                        elif text:
                            yield _sse(chunk(i, text, None))
                    if p["usage_in_stream"]:
                        yield _sse({"id": rid, "object": obj + ".chunk" if chat else obj,
                                    "created": created, "model": server.name, "choices": [],
                                    "usage": server.usage(ids, reqs)})
                    yield "data: [DONE]\n\n"
                finally:                              # a client gone mid-stream: cancel
                    server.cancel(reqs)
            return StreamingResponse(events(), media_type="text/event-stream")

        try:
            while not all_closed():
                try:
                    on_event(await asyncio.wait_for(q.get(), timeout=0.5))
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        server.cancel(reqs)
                        return JSONResponse({}, status_code=499)
        finally:
            server.cancel(reqs)
        if any(c.finish == "error" for c in choices):
            msg = next(r.error for r in reqs if r.finish_reason == "error")
            return JSONResponse(APIError(500, f"generation failed: {msg}",
                                         kind="server_error").body(), status_code=500)
        picked = list(range(len(reqs)))
        if p["draws"] > p["n"]:                       # best_of: by cumulative log-probability
            def total(i):
                return sum(lp for lp, _ in reqs[i].token_logprobs[:len(choices[i].ids)])
            picked = sorted(picked, key=lambda i: -total(i))[:p["n"]]
        out = []
        for i, (r, ch) in enumerate((reqs[j], choices[j]) for j in picked):
            lp = server.logprobs_of(r, 0, len(ch.ids), chat) if p["logprobs"] is not None \
                else None
            if chat:
                out.append({"index": i, "message": {"role": "assistant", "content": ch.text},
                            "logprobs": lp, "finish_reason": ch.finish})
            else:
                out.append({"index": i, "text": ch.text, "logprobs": lp,
                            "finish_reason": ch.finish})
        return {"id": rid, "object": obj, "created": created, "model": server.name,
                "choices": out, "usage": server.usage(ids, reqs)}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def freeze_startup_objects() -> None:
    """Keep what start-up made (model, tokenizer, app: about half a million objects) out of
    the garbage collector's full passes, as vLLM does after start-up: they live as long as the
    server, and a full pass over them took 240 ms here, a stall of every running request,
    whenever request bookkeeping had allocated enough to trigger one."""
    gc.collect()
    gc.freeze()


def unfreeze() -> None:
    """Undo `freeze_startup_objects` before the process ends: frozen objects are never
    collected, and native extensions that count their live objects at exit (triton's nanobind
    bindings) would then print leak reports after the server's last line."""
    gc.unfreeze()
    gc.collect()


def serve(dec, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          max_waiting: int = MAX_WAITING) -> None:
    """Run the server until interrupted: the engine on this (the main) thread, the event
    loop on another (see `EngineLoop`)."""
    import uvicorn
    server = Server(dec, model_name, max_waiting, engine_thread=False)
    uv = uvicorn.Server(uvicorn.Config(build_app(server), host=host, port=port,
                                       log_level="warning"))
    freeze_startup_objects()
    web = threading.Thread(target=uv.run, name="specfork-http", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):     # Ctrl-C or a kill: stop, then exit
        signal.signal(sig, lambda *_: server.loop.stop())
    web.start()
    try:
        server.loop.run(alive=web.is_alive)
    finally:
        uv.should_exit = True
        web.join(timeout=30)
        unfreeze()
