"""Long prompts: speculation against plain decoding and HF greedy, bucketed by prompt length.

    python eval/bench_long.py                  # -> results/long_prompts.{json,md,png}

Document tasks (summarise, answer from a passage, rewrite, extract) over text assembled here
from the Python standard library's own documentation (pydoc's plain-text help of a module, cut
at a token budget), so no prompt comes from a public benchmark. Per prompt, in one process and
one after the other: HF `generate` greedy (the peer), our plain decoding, `--drafts N` as
`specfork generate` runs it (adaptive drafting) and the same with `--no-adaptive`. Every one of
ours must equal HF greedy token for token. Time to first token is the prefill's cost (both
sides stream). The plot shows speedup against HF greedy per bucket and, for the longest prompt,
each drafter's depth per step as the adaptive controller chose it.
"""
from __future__ import annotations

import argparse
import datetime
import os
import pydoc
import re
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine, write_results  # noqa: E402

MODULES = ["json", "argparse", "collections", "functools", "itertools", "pathlib", "logging",
           "textwrap", "shutil", "heapq", "string", "csv", "datetime", "statistics",
           "fractions", "difflib"]
TASKS = {
    "summarise": "Summarise the documentation below in a short paragraph.\n\n{doc}",
    "answer": "Answer the question using only the documentation below.\n\n{doc}\n\n"
              "Question: what does `{name}` do, and what arguments does it take?",
    "rewrite": "Rewrite the documentation below as a bulleted list of its key points, keeping "
               "the names of functions and classes exactly as written.\n\n{doc}",
    "extract": "List every function, class and method named in the documentation below, one "
               "per line, each with a short description.\n\n{doc}",
}
# document tokens per prompt in each bucket, in turn
BUCKETS = {"<=256": (180,), "256-1K": (400, 750), "1K-4K": (1500, 3300)}


def documents(tok, sizes: tuple, count: int, skip: int = 0) -> list[tuple[str, str, str]]:
    """`count` (module, text, a function named in it), each cut to about the next of `sizes`
    tokens (whole lines); a module whose text names no function is passed over."""
    out = []
    for name in MODULES[skip:] + MODULES[:skip]:
        size = sizes[len(out) % len(sizes)]
        text = pydoc.render_doc(__import__(name), renderer=pydoc.plaintext)
        keep, n = [], 0
        for line in text.splitlines():
            n += len(tok(line + "\n", add_special_tokens=False)["input_ids"])
            if n > size:
                break
            keep.append(line)
        doc = "\n".join(keep).strip()
        funcs = re.findall(r"^\s*\|?\s*(\w+)\(", doc, flags=re.M)
        funcs = [f for f in funcs if not f.startswith("_")]
        if funcs:
            out.append((name, doc, funcs[len(funcs) // 2]))
        if len(out) == count:
            break
    return out


def build_prompts(tok, per_bucket: int) -> list[dict]:
    prompts = []
    tasks = list(TASKS)
    for b, (bucket, size) in enumerate(BUCKETS.items()):
        for i, (mod, doc, fn) in enumerate(documents(tok, size, per_bucket, skip=5 * b)):
            task = tasks[i % len(tasks)]
            prompts.append({"id": f"{bucket}/{task}/{mod}", "bucket": bucket, "task": task,
                            "text": TASKS[task].format(doc=doc, name=fn)})
    return prompts


class FirstToken:
    """A generate() streamer noting when the first new token arrives (the first put is the
    prompt)."""

    def __init__(self):
        self.t, self.puts = None, 0

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.t = time.perf_counter()

    def end(self) -> None:
        pass


def run_hf(hf, ids: list[int], n: int) -> dict:
    gc = hf.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    x = torch.tensor([ids])
    st = FirstToken()
    t0 = time.perf_counter()
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                      pad_token_id=eos[0], streamer=st)
    wall = time.perf_counter() - t0
    toks = out[0, len(ids):].tolist()
    return {"tokens": toks, "wall": wall, "ttft": (st.t or time.perf_counter()) - t0}


def run_ours(dec, ids: list[int], n: int) -> dict:
    first = []
    t0 = time.perf_counter()
    r = dec.generate(ids, max_new_tokens=n,
                     on_tokens=lambda new: first or first.append(time.perf_counter()))
    wall = time.perf_counter() - t0
    s = r.stats
    out = {"tokens": r.token_ids, "wall": wall, "ttft": first[0] - t0,
           "tau": s["mean_accepted"], "leaked": s["kv_blocks_leaked"]}
    if "adaptive" in s:
        out["off_steps"] = s["adaptive"]["off_steps"]
        out["steps"] = s["spec_steps"]
        out["depth"] = s["adaptive"]["depth"]
    return out


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--drafter", default=None, help="drafter mix (default: the target's)")
    p.add_argument("--per-bucket", dest="per_bucket", type=int, default=4,
                   help="prompts per length bucket (tasks in turn)")
    p.add_argument("--buckets", default=",".join(BUCKETS),
                   help="comma-separated subset of " + ",".join(BUCKETS))
    p.add_argument("--max-new-tokens", dest="new", type=int, default=128)
    p.add_argument("--reps", type=int, default=1,
                   help="runs of each of ours per prompt, in turn; the fastest counts (HF: one)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--weights", default="float32",
                   help="the target's weight format (specfork/weights.py; auto: what "
                        "`specfork generate` picks). Other than float32, outputs are checked "
                        "against our plain decoding under it, not HF's float32 greedy")
    p.add_argument("--out", default="results/long_prompts", help="path stem of .json/.md/.png")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command
    buckets = [b.strip() for b in a.buckets.split(",") if b.strip()]

    def go():
        if a.per_bucket <= 0 or a.new <= 0 or a.reps <= 0 or (
                a.threads is not None and a.threads <= 0):
            raise SpecforkError("--per-bucket, --max-new-tokens, --reps and --threads must be "
                                "positive")
        bad = sorted(set(buckets) - set(BUCKETS))
        if bad or not buckets:
            raise SpecforkError(f"--buckets: unknown {bad}; choose from {','.join(BUCKETS)}")
        from specfork.weights import check_weights
        check_weights(a.weights, "cpu")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, buckets, command_line("bench_long", argv))
    return run_command("bench_long", go)


def _run(a, buckets: list[str], command: str) -> int:
    from specfork.decoder import SpecDecoder
    from specfork.drafters.registry import make_drafters
    from specfork.engine import Engine
    from specfork.loader import load_hf
    from specfork.model import Model
    host = machine()
    t_start = time.perf_counter()
    hf, tok = load_hf(a.target)
    model = Model(hf, weights=a.weights)
    low = model.weights != "float32"        # checked against our plain decoding, not HF's
    enc = Engine(model, tok, max_kv_tokens=1)
    prompts = [q for q in build_prompts(tok, a.per_bucket) if q["bucket"] in buckets]
    for q in prompts:
        q["ids"] = enc.encode(q["text"])
        q["prompt_tokens"] = len(q["ids"])
    room = max(q["prompt_tokens"] for q in prompts) + a.new + 64
    systems = {
        "plain": SpecDecoder(model, tok, max_kv_tokens=room),
        "spec": SpecDecoder(model, tok, make_drafters(a.drafter, a.target, model, a.drafts,
                                                      max_kv_tokens=room),
                            num_paths=a.drafts, max_kv_tokens=room, adaptive=True),
        "spec_fixed": SpecDecoder(model, tok, make_drafters(a.drafter, a.target, model,
                                                            a.drafts, max_kv_tokens=room),
                                  num_paths=a.drafts, max_kv_tokens=room, adaptive=False),
    }
    rows = []
    with torch.inference_mode():
        run_hf(hf, prompts[0]["ids"][:32], 4)                  # warm both sides up
        run_ours(systems["plain"], prompts[0]["ids"][:32], 4)
        for q in prompts:
            res, outs = {"hf": run_hf(hf, q["ids"], a.new)}, []
            for _ in range(a.reps):     # ours in turn, each rep: the host's speed drifts
                for k, dec in systems.items():
                    r = run_ours(dec, q["ids"], a.new)
                    outs.append(r)
                    if k not in res or r["wall"] < res[k]["wall"]:
                        res[k] = r
            ref = res["plain" if low else "hf"]["tokens"]
            row = {k: v for k, v in q.items() if k not in ("ids", "text")}
            row["new_tokens"] = len(ref)
            row["exact"] = all(r["tokens"] == ref for r in outs)
            row["leaked"] = sum(r["leaked"] for r in outs)
            for k, r in res.items():
                row[k] = {"wall_s": round(r["wall"], 3), "ttft_s": round(r["ttft"], 3),
                          "tok_s": round(len(r["tokens"]) / r["wall"], 2)}
                for x in ("tau", "off_steps", "steps", "depth"):
                    if x in r:
                        row[k][x] = round(r[x], 3) if x == "tau" else r[x]
            for k in systems:                   # per token: HF's and ours may differ in length
                row[k]["vs_hf"] = round(res["hf"]["wall"] / res[k]["wall"] * len(
                    res[k]["tokens"]) / max(1, len(res["hf"]["tokens"])), 3)
            for k in ("spec", "spec_fixed"):
                row[k]["vs_plain"] = round(res["plain"]["wall"] / res[k]["wall"], 3)
            row["prefill_vs_hf"] = round(res["hf"]["ttft"] / res["plain"]["ttft"], 3)
            rows.append(row)
            fixed = row["spec_fixed"]["vs_plain"]
            print(f"{q['id']:<34} {q['prompt_tokens']:>5} tok  spec {row['spec']['vs_hf']:.2f}x "
                  f"HF, {row['spec']['vs_plain']:.2f}x plain (fixed {fixed:.2f}x), prefill "
                  f"{row['prefill_vs_hf']:.2f}x HF, exact {row['exact']}", file=sys.stderr,
                  flush=True)
    summary = {}
    for b in buckets:
        rs = [r for r in rows if r["bucket"] == b]
        if rs:
            summary[b] = {"prompts": len(rs),
                          "prompt_tokens": [min(r["prompt_tokens"] for r in rs),
                                            max(r["prompt_tokens"] for r in rs)],
                          **{f"{k}_vs_hf": round(statistics.median(r[k]["vs_hf"] for r in rs), 3)
                             for k in ("plain", "spec", "spec_fixed")},
                          **{f"{k}_vs_plain_min": round(min(r[k]["vs_plain"] for r in rs), 3)
                             for k in ("spec", "spec_fixed")},
                          "prefill_vs_hf": round(statistics.median(r["prefill_vs_hf"]
                                                                   for r in rs), 3)}
    res = {"command": command, "machine": host,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "elapsed_s": round(time.perf_counter() - t_start),
           "config": {"target": a.target, "drafts": a.drafts, "reps": a.reps,
                      "drafter": a.drafter or "default mix", "max_new_tokens": a.new,
                      "dtype": str(hf.dtype).split(".")[-1], "weights": model.weights,
                      "kv_cache": model.kv_cache,
                      "checked_against": "plain decoding (ours)" if low else "HF greedy"},
           "all_exact": all(r["exact"] for r in rows),
           "leaked_blocks": sum(r["leaked"] for r in rows),
           "summary": summary, "prompts": rows}
    write_results(a.out, res, markdown, plot)
    if not res["all_exact"]:
        print(f"WARNING: some output differs from {res['config']['checked_against']}",
              file=sys.stderr)
    return 0


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    lines = ["# Long prompts: speculation vs plain decoding and HF greedy", "",
             f"`{res['command']}` on {m['cpu']} ({m['torch_threads']} threads), {res['date']}; "
             f"{c['target']} {c['dtype']}, weights {c.get('weights', 'float32')}, K/V "
             f"{c.get('kv_cache', 'auto')}, `--drafts {c['drafts']}` ({c['drafter']}), "
             f"{c['max_new_tokens']} new tokens, greedy. Every output of ours equals "
             f"{c.get('checked_against', 'HF greedy')}: **{res['all_exact']}**; leaked KV "
             f"blocks: {res['leaked_blocks']}. HF runs its float32 greedy decoding in every "
             "case.", "",
             "Medians per bucket (speed ratios of wall time, same process, one after the other"
             + (f"; ours the fastest of {c['reps']} runs in turn" if c.get("reps", 1) > 1 else "")
             + "; `min vs plain` is the worst prompt):", "",
             "| bucket | prompts | prompt tokens | plain vs HF | spec (adaptive) vs HF | "
             "spec fixed vs HF | adaptive min vs plain | fixed min vs plain | prefill vs HF |",
             "|---|---|---|---|---|---|---|---|---|"]
    for b, s in res["summary"].items():
        lines.append(f"| {b} | {s['prompts']} | {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} "
                     f"| {s['plain_vs_hf']:.2f}x | {s['spec_vs_hf']:.2f}x | "
                     f"{s['spec_fixed_vs_hf']:.2f}x | {s['spec_vs_plain_min']:.2f}x | "
                     f"{s['spec_fixed_vs_plain_min']:.2f}x | {s['prefill_vs_hf']:.2f}x |")
    lines += ["", "| prompt | tokens | HF tok/s | plain tok/s | adaptive tok/s (tau, steps off) "
              "| fixed tok/s (tau) | exact |", "|---|---|---|---|---|---|---|"]
    for r in res["prompts"]:
        s, f = r["spec"], r["spec_fixed"]
        lines.append(f"| {r['id']} | {r['prompt_tokens']} | {r['hf']['tok_s']:.1f} | "
                     f"{r['plain']['tok_s']:.1f} | {s['tok_s']:.1f} ({s['tau']:.2f}, "
                     f"{s.get('off_steps', 0)}/{s.get('steps', 0)}) | {f['tok_s']:.1f} "
                     f"({f['tau']:.2f}) | {r['exact']} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(res["summary"])
    for i, (k, label) in enumerate([("plain", "plain (ours)"), ("spec_fixed", "drafts, fixed"),
                                    ("spec", "drafts, adaptive")]):
        ax.bar([j + 0.27 * (i - 1) for j in range(len(names))],
               [res["summary"][b][f"{k}_vs_hf"] for b in names], 0.27, label=label)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), [f"{b} tokens" for b in names])
    ax.set_ylabel("speed vs HF greedy (median)")
    ax.legend()
    longest = max(res["prompts"], key=lambda r: r["prompt_tokens"])
    for name, depths in longest["spec"].get("depth", {}).items():
        bx.step(range(len(depths)), depths, where="post", label=name.split(":", 1)[1])
    bx.set_xlabel("verify step")
    bx.set_ylabel("draft depth chosen (0: off)")
    bx.set_title(f"adaptive budget, {longest['id']} ({longest['prompt_tokens']} tokens)",
                 fontsize=9)
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
