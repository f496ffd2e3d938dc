"""Serving benchmark, like vLLM's benchmark_serving: a live `specfork serve` driven by the real
`openai` client, beside Hugging Face `generate` with static padded batches, in one run.

    python eval/bench_serving.py          # -> results/serving.{json,md,png}

Workloads (MT-bench first turns, one per category in turn, chat template, greedy):
- closed loop at each `--concurrency` (1, 4, 16): that many clients, each sending its next
  request when the last one is done, `--requests` requests per level (at least the level);
- open loop at a fixed `--rate` (requests/s, Poisson arrivals, seeded);
- shared system prompt: a ~500-token system message (the standard library's pydoc of
  `textwrap`, no benchmark text) before each question, 16 clients, prefix cache on and off;
  the server's /metrics say how many prompt tokens were prefilled and how many came from the
  cache.
Per run: output tokens/s (all output tokens over the run's wall time), TTFT (request sent to
its first streamed token) and TPOT (the rest of its tokens over the time they took), p50/p99.
Server configurations (`--configs`): plain decoding, speculation (`--drafts 3`, the default
drafter mix, adaptive), each with and without the prefix cache where the workload asks; and
plain-rR (plain-r2, ...): plain decoding on R Ray Serve replicas behind one endpoint (closed and
open loop only: each replica has its own prefix cache and /metrics). On a cluster, from its
head node: `ray start --head` there, `ray start --address HEAD:6379` on the others, then
`python eval/bench_serving.py --configs plain,plain-r8 --ray-address HEAD:6379`. Each
configuration is a server process of its own (its model load and one warm-up request are not
timed); this process only waits on sockets while one runs. The same closed loops also run on
the engine itself in this process, plain decoding with no HTTP, tokenizer or client (`engine
in-process`): what the server adds is the difference (`--no-engine`: skip). Every workload
runs `--reps` times on each configuration, the configurations in turn each round, and each
one's best run counts (the shortest wall time; at a fixed rate the lowest mean latency): this
host's speed drifts by 20-30% over minutes, which a single run per configuration measured as
their difference. Each system-prompt run starts from an empty prefix cache
(`POST /reset_prefix_cache`). Hugging Face runs after, alone: batches of
`concurrency` prompts, left padded, `generate(do_sample=False)`; its TTFT is a 1-token
`generate` of the same batch, its output tokens those before each row's EOS.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine, write_results  # noqa: E402
from specfork.errors import SpecforkError  # noqa: E402

MODEL = "smollm2-135m"
CONFIGS = ("plain", "spec", "plain-rR")


def config_flags(name: str, ray_address: str | None) -> list[str]:
    """Server flags of a configuration; plain-rR (plain-r2, ...): plain decoding on R Ray Serve
    replicas (a local Ray instance, or the cluster at `ray_address`)."""
    m = re.fullmatch(r"plain-r(\d+)", name)
    if m:
        return ["--drafts", "0", "--replicas", m.group(1)] + (
            ["--ray-address", ray_address] if ray_address else [])
    if name not in ("plain", "spec"):
        raise SpecforkError(f"unknown configuration {name!r}: use {', '.join(CONFIGS)}")
    return {"plain": ["--drafts", "0"], "spec": ["--drafts", "3"]}[name]


def system_prompt(tok, tokens: int = 500) -> str:
    import pydoc
    import textwrap
    text = pydoc.render_doc(textwrap, renderer=pydoc.plaintext)
    ids = tok(text)["input_ids"][:tokens]
    return "You answer questions. Reference notes follow.\n" + tok.decode(ids)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


class Live:
    """A `specfork serve` process on a free loopback port, stopped on exit."""

    def __init__(self, args: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "specfork.cli", "serve",
                                      "--port", str(self.port)] + args,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("server did not start: "
                                       + self.proc.stderr.read().decode()[-500:])
                time.sleep(0.5)

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=10).read().decode()
        return {ln.split()[0]: float(ln.split()[1]) for ln in text.splitlines()
                if ln and not ln.startswith("#")}

    def reset_prefix_cache(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + "/reset_prefix_cache",
                                                      method="POST"), timeout=30).read()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def _one(client, messages, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    first, n = None, 0
    s = await client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                             max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True})
    async for ch in s:
        if ch.usage:
            n = ch.usage.completion_tokens
        if first is None and ch.choices and ch.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    first = first or end
    return {"ttft": first - t0, "tpot": (end - first) / (n - 1) if n > 1 else None,
            "tokens": n, "latency": end - t0}


async def _closed(url, convs, concurrency: int, max_tokens: int) -> tuple[list, float]:
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900,
                                max_retries=0)
    async with client:
        return await _closed_on(client, convs, concurrency, max_tokens)


async def _closed_on(client, convs, concurrency: int, max_tokens: int) -> tuple[list, float]:
    todo = list(convs)
    out = []

    async def worker():
        while todo:
            out.append(await _one(client, todo.pop(0), max_tokens))

    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    return out, time.perf_counter() - t0


async def _open(url, convs, rate: float, max_tokens: int, seed: int = 0):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900,
                                max_retries=0)
    async with client:
        return await _open_on(client, convs, rate, max_tokens, seed)


async def _open_on(client, convs, rate: float, max_tokens: int, seed: int):
    rng = random.Random(seed)
    tasks = []
    t0 = time.perf_counter()
    for c in convs:
        tasks.append(asyncio.create_task(_one(client, c, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    out = await asyncio.gather(*tasks)
    return list(out), time.perf_counter() - t0


def engine_closed(dec, prompts: list[list[int]], concurrency: int,
                  max_tokens: int) -> tuple[list, float]:
    """The closed loop on the engine in this process: `concurrency` requests in flight, the next
    added when one finishes; TTFT from a request's add to its first token."""
    todo, live, out = list(prompts), [], []

    def start(ids):
        first = []
        (r,) = dec.request(ids, max_tokens, on_tokens=lambda i, new: first or first.append(
            time.perf_counter()))
        dec.engine.add(r)
        return r, time.perf_counter(), first

    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < concurrency:
            live.append(start(todo.pop(0)))
        dec.engine.step()
        end = time.perf_counter()
        for x in [x for x in live if x[0].done]:
            live.remove(x)
            r, t, first = x
            f, n = (first[0] if first else end), len(r.out)
            out.append({"ttft": f - t, "tpot": (end - f) / (n - 1) if n > 1 else None,
                        "tokens": n, "latency": end - t})
    return out, time.perf_counter() - t0


def summary(recs: list[dict], wall: float) -> dict:
    ttft = [r["ttft"] for r in recs]
    tpot = [r["tpot"] for r in recs if r["tpot"] is not None]
    toks = sum(r["tokens"] for r in recs)
    return {"requests": len(recs), "output_tokens": toks, "wall_s": round(wall, 3),
            "output_tok_s": round(toks / wall, 2),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "tpot_p50_s": pct(tpot, 50), "tpot_p99_s": pct(tpot, 99),
            "latency_mean_s": round(sum(r["latency"] for r in recs) / max(1, len(recs)), 4)}


def system_run(srv: "Live", convs, max_tokens: int) -> tuple[list, float, dict]:
    """The shared-system-prompt closed loop (16 clients), from a cold prefix cache (reset
    first, so every run prefills the system prompt at least once), and the prompt tokens the
    server prefilled and found cached meanwhile, from its /metrics."""
    srv.reset_prefix_cache()
    before = srv.metrics()
    recs, wall = asyncio.run(_closed(srv.url, convs, 16, max_tokens))
    after = srv.metrics()
    prompt = after["specfork_prompt_tokens_total"] - before["specfork_prompt_tokens_total"]
    hit = (after["specfork_prefix_cache_hit_tokens_total"]
           - before["specfork_prefix_cache_hit_tokens_total"])
    return recs, wall, {"prompt_tokens": int(prompt), "cached_prompt_tokens": int(hit),
                        "prefilled_prompt_tokens": int(prompt - hit)}


def in_turn(runners, reps: int, closed: bool) -> list:
    """Run each (key, run) `reps` times, all of them in turn each round (this host's speed
    drifts by 20-30% over minutes, so configurations compared with each other alternate), and
    keep each one's best run: the shortest wall time for a closed loop, the lowest mean
    latency at a fixed rate. Returns [(key, summary + "reps" + what run returned besides)]."""
    best = {}
    for _ in range(reps):
        for key, run in runners:
            recs, wall, *extra = run()
            s = {**summary(recs, wall), **(extra[0] if extra else {}), "reps": reps}
            score = wall if closed else s["latency_mean_s"]
            if key not in best or score < best[key][0]:
                best[key] = (score, s)
    return [(key, best[key][1]) for key, _ in runners]


def hf_static(prompts_msgs, concurrency: int, max_tokens: int, tok, hf) -> dict:
    import torch
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    toks, wall, ttfts, tpots = 0, 0.0, [], []
    for a in range(0, len(prompts_msgs), concurrency):
        batch = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                 for m in prompts_msgs[a:a + concurrency]]
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            t0 = time.perf_counter()
            hf.generate(**enc, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)
            t1 = time.perf_counter()
            out = hf.generate(**enc, max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=tok.pad_token_id)
            t2 = time.perf_counter()
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        counts = []
        for row in new:
            k = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            counts.append(k)
        toks += sum(counts)
        wall += t2 - t1
        ttfts += [t1 - t0] * len(new)
        steps = max(counts)
        if steps > 1:
            tpots += [(t2 - t1 - (t1 - t0)) / (steps - 1)] * len(new)
    return {"requests": len(prompts_msgs), "output_tokens": toks, "wall_s": round(wall, 3),
            "output_tok_s": round(toks / wall, 2), "ttft_p50_s": pct(ttfts, 50),
            "ttft_p99_s": pct(ttfts, 99), "tpot_p50_s": pct(tpots, 50),
            "tpot_p99_s": pct(tpots, 99)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32, help="requests per closed-loop level "
                    "(at least the level itself)")
    ap.add_argument("--single-requests", type=int, default=8,
                    help="requests at concurrency 1")
    ap.add_argument("--rate", type=float, default=2.0, help="open loop: requests per second")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=500)
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--no-engine", dest="engine", action="store_false",
                    help="skip the in-process engine rows")
    ap.add_argument("--configs", default="plain,spec",
                    help="server configurations, of: " + ", ".join(CONFIGS))
    ap.add_argument("--ray-address", default=None,
                    help="plain-rR on this Ray cluster (default: a local instance)")
    ap.add_argument("--weights", default="float32",
                    help="the servers' --weights (float32: HF's weights as the peer runs them; "
                         "auto: what specfork serve picks, int4 for the embedded target)")
    ap.add_argument("--reps", type=int, default=3,
                    help="runs of each workload per configuration, in turn; the best counts")
    ap.add_argument("--out", default="results/serving")
    a = ap.parse_args(argv)
    import torch  # noqa: F401
    from prompts import load_prompts
    from specfork.loader import load_hf
    levels = [int(x) for x in a.concurrency.split(",")]
    if a.reps < 1:
        raise SpecforkError("--reps must be at least 1")
    res = {"command": command_line("bench_serving", argv), "machine": machine(),
           "max_tokens": a.max_tokens, "runs": []}
    qs = [p["text"] for p in load_prompts("mtbench")]
    qs = [qs[(i % 8) * 10 + i // 8] for i in range(len(qs))]        # categories in turn
    hf, tok = load_hf(MODEL, dtype=torch.float32, device="cpu")
    sys_text = system_prompt(tok, a.system_tokens)
    res["system_prompt_tokens"] = len(tok(sys_text)["input_ids"])

    def convs(n, system=False):
        return [([{"role": "system", "content": sys_text}] if system else [])
                + [{"role": "user", "content": qs[i % len(qs)]}] for i in range(n)]

    servers = {}                                    # (name, prefix cache) -> Live
    with contextlib.ExitStack() as stack:
        for name in a.configs.split(","):
            flags = config_flags(name, a.ray_address) + ["--weights", a.weights]
            for cache in ((False,) if "--replicas" in flags else (False, True)):
                srv = stack.enter_context(Live(flags + ([] if cache else ["--no-prefix-cache"])))
                asyncio.run(_closed(srv.url, convs(2), 2, 8))               # warm-up
                servers[(name, cache)] = srv
        dec = None
        if a.engine:
            from specfork.decoder import SpecDecoder
            dec = SpecDecoder.from_pretrained(MODEL, drafts=0, weights=a.weights).serving(
                prefix_cache=False)
            chat = lambda m: list(tok.apply_chat_template(          # noqa: E731
                m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
            engine_closed(dec, [chat(m) for m in convs(2)], 2, 8)     # warm-up
        cold = [(k, s) for k, s in servers.items() if not k[1]]
        for c in levels:
            n = a.single_requests if c == 1 else max(c, a.requests)
            runners = [(k, lambda s=s: asyncio.run(_closed(s.url, convs(n), c, a.max_tokens)))
                       for k, s in cold]
            if dec is not None:
                runners.append((("engine in-process", False),
                                lambda: engine_closed(dec, [chat(m) for m in convs(n)], c,
                                                      a.max_tokens)))
            for (name, cache), r in in_turn(runners, a.reps, closed=True):
                res["runs"].append({"server": name, "prefix_cache": cache,
                                    "workload": f"closed c={c}", "concurrency": c, **r})
                print(name, res["runs"][-1], flush=True)
        runners = [(k, lambda s=s: asyncio.run(_open(s.url, convs(a.requests), a.rate,
                                                      a.max_tokens))) for k, s in cold]
        for (name, cache), r in in_turn(runners, a.reps, closed=False):
            res["runs"].append({"server": name, "prefix_cache": cache,
                                "workload": f"rate {a.rate}/s", "rate": a.rate, **r})
            print(name, res["runs"][-1], flush=True)
        runners = [(k, lambda s=s: system_run(s, convs(16, system=True), a.max_tokens))
                   for k, s in servers.items() if not k[0].startswith("plain-r")]
        for (name, cache), r in in_turn(runners, a.reps, closed=True):
            res["runs"].append({"server": name, "prefix_cache": cache,
                                "workload": "system prompt c=16", "concurrency": 16, **r})
            print(name, cache, res["runs"][-1], flush=True)
        dec = None                                  # free its model before HF runs
    if a.hf:
        for c in levels:
            n = a.single_requests if c == 1 else max(c, a.requests)
            r = hf_static(convs(n), c, a.max_tokens, tok, hf)
            res["runs"].append({"server": "hf static batch", "prefix_cache": False,
                                "workload": f"closed c={c}", "concurrency": c, **r})
            print("hf", res["runs"][-1], flush=True)
        r = hf_static(convs(16, system=True), 16, a.max_tokens, tok, hf)
        res["runs"].append({"server": "hf static batch", "prefix_cache": False,
                            "workload": "system prompt c=16", "concurrency": 16, **r})
    order = a.configs.split(",") + ["engine in-process", "hf static batch"]
    res["runs"].sort(key=lambda r: (order.index(r["server"]), r["prefix_cache"]))
    res["reps"] = a.reps
    base = next(r["output_tok_s"] for r in res["runs"] if r["server"] == "plain"
                and r["workload"] == "closed c=1")
    for r in res["runs"]:
        r["vs_plain_c1"] = round(r["output_tok_s"] / base, 2)
    write_results(a.out, res, markdown, plot)
    return 0


def markdown(res: dict) -> str:
    m = res["machine"]
    out = ["# Serving: `specfork serve` vs Hugging Face static batching\n",
           f"`{res['command']}` on {m['cpu']} ({m['cores']} cores, torch "
           f"{m['torch']}), {m['date']}. Greedy, up to {res['max_tokens']} tokens per request; "
           "MT-bench first turns, chat template. Output tokens/s over each run's wall time; "
           "`x plain c=1`: its ratio to our plain decoding at concurrency 1 in this run. "
           f"Each workload ran {res.get('reps', 1)} times per configuration, the "
           "configurations in turn, and the best run is shown (Hugging Face: one run; "
           "system-prompt runs each from an empty prefix cache).\n",
           "| server | prefix cache | workload | requests | output tok/s | x plain c=1 | "
           "TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | prompt tokens prefilled / cached |",
           "|---|---|---|---|---|---|---|---|---|"]
    f = lambda x, k=1: "-" if x is None else f"{x * k:.{2 if k == 1 else 0}f}"  # noqa: E731
    for r in res["runs"]:
        pre = (f"{r['prefilled_prompt_tokens']} / {r['cached_prompt_tokens']}"
               if "cached_prompt_tokens" in r else "")
        out.append(f"| {r['server']} | {'on' if r['prefix_cache'] else 'off'} | "
                   f"{r['workload']} | {r['requests']} | {r['output_tok_s']:.1f} | "
                   f"{r['vs_plain_c1']:.2f} | {f(r['ttft_p50_s'])} / {f(r['ttft_p99_s'])} | "
                   f"{f(r['tpot_p50_s'], 1000)} / {f(r['tpot_p99_s'], 1000)} | {pre} |")
    out.append(f"\nShared system prompt: {res['system_prompt_tokens']} tokens before each of "
               "16 concurrent questions.")
    return "\n".join(out) + "\n"


def plot(res: dict, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for srv in sorted({r["server"] for r in res["runs"]}):
        pts = sorted((r["concurrency"], r["output_tok_s"]) for r in res["runs"]
                     if r["server"] == srv and r["workload"].startswith("closed")
                     and not r["prefix_cache"])
        if pts:
            ax.plot(*zip(*pts), marker="o", label=srv)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("output tokens/s")
    ax.set_title("specfork serve vs HF static batching")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("bench_serving", lambda: main(sys.argv[1:])))
