"""CPU engines on the embedded target, one run, the same prompts: llama.cpp on the shipped GGUF,
HF greedy, and ours (plain and `--drafts N`) in every weight format, beside each format's
bandwidth limit.

    python eval/bench_cpu.py --threads 2        # -> results/cpu_engines.{json,md,png}

- llama.cpp: `llama-cpp-python` (the optional `bench` extra, built from source) on
  SmolLM2-135M-Instruct.Q4_1.gguf, greedy, fed our token ids; where it is not installed the row
  says so and the rest runs.
- Ours: `--weights` float32, bfloat16, int8, int4; plain decoding and `--drafts N` (the default
  mix, adaptive), as `specfork generate` runs them, in turn on each prompt (the host's speed
  drifts; the `--drafts` row gives speculation over plain decoding per prompt: median and worst
  prompt). float32 must equal HF greedy token for token and its speculation plain decoding
  (else exit 1); under a lower format the table counts the prompts where speculation equals
  plain decoding.
- Bandwidth limit: the bytes a decode step reads (every matmul's weights in its format, plus the
  KV cache at the mean context) over the read bandwidth measured here (`--bw-mib` of fp32
  summed, best of 5), as tokens/s; "of limit" is plain decoding's share of it.
- Quality per format against float32: perplexity on held-out text (the standard library's pydoc
  of `textwrap`, no benchmark), top-1 agreement of the teacher-forced logits, and the share of
  128 greedy tokens equal to float32's before the first difference (mean over prompts).
tokens/s is new tokens / wall time of the call (prefill included), the median over prompts;
every row is warmed up once. Each engine runs `--reps` times on each prompt, in turn with the
engines it is compared with, and its fastest run counts: this host's speed drifts and other
tenants slow single runs by 10-25% at random, which is what a single run's ratio measured.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
from itertools import zip_longest
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine, write_results  # noqa: E402

FORMATS = ("float32", "bfloat16", "int8", "int4")


def parse_formats(text: str) -> list[str]:
    """`--formats`: a comma-separated subset of FORMATS (a one-line error otherwise)."""
    from specfork.errors import SpecforkError
    fmts = [f.strip() for f in text.split(",") if f.strip()]
    bad = sorted(set(fmts) - set(FORMATS))
    if bad or not fmts:
        raise SpecforkError(f"--formats: unknown {bad}; choose from {','.join(FORMATS)}")
    return fmts


def read_bandwidth(mib: int) -> float:
    """Bytes/s of `tensor.sum()` over `mib` MiB (best of 5): what streaming weights can reach."""
    x = torch.ones(mib << 18)                       # fp32: 4 bytes each
    x.sum()
    best = math.inf
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.nbytes / best


def weight_bytes(model) -> int:
    """Bytes of every matmul's weights as a decode step reads them (a low-bit format's own
    tensors and scales; fp32: the weights)."""
    return sum(lin.nbytes if hasattr(lin, "fmt") else lin.w.nbytes for lin in model.linears())


def step_bytes(model, context: int) -> int:
    """Bytes a one-token decode step reads: every matmul's weights as held, the KV cache of
    `context` tokens, one embedding row."""
    kv = 2 * model.num_layers * model.kv_heads * model.head_dim * context * 4
    return weight_bytes(model) + kv + model.embed.shape[1] * model.embed.element_size()


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts-per-set", dest="per_set", type=int, default=4,
                   help="MT-bench and HumanEval prompts each, spread over the file")
    p.add_argument("--max-new-tokens", dest="new", type=int, default=128)
    p.add_argument("--drafts", type=int, default=3)
    p.add_argument("--reps", type=int, default=3,
                   help="runs per engine and prompt, in turn; the fastest counts")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--bw-mib", dest="bw_mib", type=int, default=1024,
                   help="MiB read to measure the bandwidth (well past the caches)")
    p.add_argument("--out", default="results/cpu_engines", help="path stem of .json/.md/.png")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command

    def go():
        fmts = parse_formats(a.formats)
        if min(a.per_set, a.new, a.drafts, a.bw_mib, a.reps) <= 0 or (
                a.threads is not None and a.threads <= 0):
            raise SpecforkError("--prompts-per-set, --max-new-tokens, --drafts, --reps, "
                                "--bw-mib and --threads must be positive")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, fmts, command_line("bench_cpu", argv))
    return run_command("bench_cpu", go)


def _llama_worker() -> int:
    """In a child process (a crash in llama.cpp must not take the run down): reads
    {"gguf", "threads", "n", "reps", "prompts": [ids]} on stdin, writes {"outputs", "walls"}
    (the first prompt run once more first, as warm-up; each prompt's fastest of `reps`)."""
    from llama_cpp import Llama
    job = json.load(sys.stdin)
    llm = Llama(model_path=job["gguf"], n_ctx=4096, n_threads=job["threads"],
                n_threads_batch=job["threads"], verbose=False)
    eos = llm.token_eos()

    def gen(ids: list[int]) -> list[int]:
        llm.reset()
        out = []
        for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
            if t == eos:
                break
            out.append(int(t))
            if len(out) == job["n"]:
                break
        return out

    gen(job["prompts"][0][:16])
    outs, walls = [], []
    for ids in job["prompts"]:
        best = float("inf")
        for _ in range(job.get("reps", 1)):
            t = time.perf_counter()
            out = gen(ids)
            best = min(best, time.perf_counter() - t)
        outs.append(out)
        walls.append(best)
    json.dump({"outputs": outs, "walls": walls}, sys.stdout)
    return 0


def _llama_cpp(prompts: list[list[int]], n: int, threads: int, reps: int = 1):
    """llama.cpp greedy on the shipped GGUF, in a child process: ({"outputs", "walls"}, None)
    or (None, why not)."""
    import importlib.util
    import subprocess
    if importlib.util.find_spec("llama_cpp") is None:
        return None, ("llama-cpp-python is not installed; pip install --no-binary "
                      "llama-cpp-python '.[bench]'")
    from specfork.loader import embedded_gguf
    job = {"gguf": str(embedded_gguf()), "threads": threads, "n": n, "reps": reps,
           "prompts": prompts}
    p = subprocess.run([sys.executable, __file__, "_llama_worker"], input=json.dumps(job),
                       capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        how = (f"killed by signal {-p.returncode}" if p.returncode < 0
               else f"exit {p.returncode}")
        tail = (p.stderr.strip().splitlines() or ["no message"])[-1][:200]
        return None, f"llama.cpp failed ({how}: {tail})"
    return json.loads(p.stdout), None


def _speed(got: dict) -> float:
    """Median tokens per second over a llama.cpp run's prompts."""
    return round(statistics.median(len(o) / w for o, w in zip(got["outputs"], got["walls"])), 2)


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced logits `[T, V]` of `ids` in one prefill."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    pool = model.make_pool(num_blocks=len(ids) + 8)
    kv = KVTree(pool)
    s = kv.append(kv.new_branch(), len(ids))
    return model.forward(ids, torch.arange(len(ids)), pool, AttnMeta.prefill(model, s[:0], s))


def _quality(lg: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor) -> dict:
    """Perplexity ratio and top-1 agreement of logits `lg` against float32's `ref`."""
    ce = torch.nn.functional.cross_entropy
    return {"ppl_ratio": round(math.exp(ce(lg[:-1], ids[1:]).item()
                                        - ce(ref[:-1], ids[1:]).item()), 4),
            "top1_agreement": round((lg.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)}


def _run(a, fmts: list[str], command: str) -> int:
    import pydoc
    from prompts import load_prompts
    from specfork.decoder import SpecDecoder
    from specfork.drafters.registry import make_drafters
    from specfork.loader import load_hf
    from specfork.model import Model
    host = machine()
    t_start = time.perf_counter()
    bw = read_bandwidth(a.bw_mib)
    hf, tok = load_hf("smollm2-135m")
    base = SpecDecoder(Model(hf), tok)
    sets = [load_prompts(n, a.per_set, spread=True) for n in ("mtbench", "humaneval")]
    prompts = [q for pair in zip_longest(*sets) for q in pair if q]
    for q in prompts:
        q["ids"] = base.encode(q["text"], raw=q["kind"] == "code")
    text = pydoc.render_doc(__import__("textwrap"), renderer=pydoc.plaintext)
    held = torch.tensor(tok(text)["input_ids"][:1024])
    n = a.new
    rows, notes = [], []
    gc = hf.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]

    def timed(run, ids):
        t = time.perf_counter()
        out = run(ids)
        return out, time.perf_counter() - t

    def add(*engines):
        """Rows for (key, name, run, extra) engines run in turn on each prompt, `a.reps` rounds
        (the host's speed drifts, so engines compared with each other go prompt by prompt):
        their outputs and per-prompt speeds (each prompt's fastest run)."""
        for _, _, run, _ in engines:
            run(prompts[0]["ids"][:16])                           # warm-up
        outs, speeds = [[] for _ in engines], [[] for _ in engines]
        for q in prompts:
            best, got = [float("inf")] * len(engines), [None] * len(engines)
            for _ in range(a.reps):
                for i, (_, _, run, _) in enumerate(engines):
                    out, wall = timed(run, q["ids"])
                    best[i] = min(best[i], wall)
                    got[i] = out if got[i] is None else got[i]
            for i in range(len(engines)):
                outs[i].append(got[i])
                speeds[i].append(len(got[i]) / best[i])
        for (key, name, _, extra), sp in zip(engines, speeds):
            rows.append({"key": key, "engine": name, "tok_s": round(statistics.median(sp), 2),
                         **extra, "per_prompt_tok_s": [round(x, 1) for x in sp]})
            print(f"{name:<40} {rows[-1]['tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)
        return outs, speeds

    with torch.inference_mode():
        got, why = _llama_cpp([q["ids"] for q in prompts], n, torch.get_num_threads(), a.reps)
        if got is None:
            notes.append(f"llama.cpp row skipped: {why}")
            print(notes[-1], file=sys.stderr)
        else:
            rows.append({"key": "llama_cpp", "engine": "llama.cpp greedy (the Q4_1 GGUF)",
                         "weights": "Q4_1 (output Q8_0)", "tok_s": _speed(got)})

        def hf_run(ids):
            x = torch.tensor([ids])
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                              do_sample=False, pad_token_id=eos[0])
            return out[0, len(ids):].tolist()
        (ref,), _ = add(("hf_greedy", "HF generate greedy (fp32)", hf_run,
                         {"weights": "float32"}))
        ref_logits = _logits(base.model, held)
        context = statistics.mean(len(q["ids"]) for q in prompts) + n / 2
        exact = {}
        base_out = None
        for fmt in fmts:
            m = base.model if fmt == "float32" else Model(hf, weights=fmt)
            limit = bw / step_bytes(m, int(context))
            plain = SpecDecoder(m, tok)
            spec = SpecDecoder(m, tok, make_drafters(None, "smollm2-135m", m, a.drafts),
                               num_paths=a.drafts, adaptive=True)
            qual = {} if fmt == "float32" else _quality(_logits(m, held), ref_logits, held)
            (po, so), (ps, ss) = add(
                (f"plain_{fmt}", f"ours plain, {fmt}",
                 lambda ids: plain.generate(ids, max_new_tokens=n).token_ids,
                 {"weights": fmt, "bandwidth_limit_tok_s": round(limit, 1),
                  "step_mib": round(step_bytes(m, int(context)) / 2 ** 20, 1)}),
                (f"spec_{fmt}", f"ours --drafts {a.drafts}, {fmt}",
                 lambda ids: spec.generate(ids, max_new_tokens=n).token_ids, {"weights": fmt}))
            rows[-2]["of_limit"] = round(rows[-2]["tok_s"] / limit, 3)
            same_spec = [x == y for x, y in zip(so, po)]
            rows[-1]["spec_equals_plain"] = f"{sum(same_spec)}/{len(same_spec)}"
            ratio = [x / y for x, y in zip(ss, ps)]        # the same prompt, one after the other
            rows[-1]["vs_plain_median"] = round(statistics.median(ratio), 3)
            rows[-1]["vs_plain_min"] = round(min(ratio), 3)
            if fmt == "float32":
                exact["float32_spec_vs_plain"] = all(same_spec)
                base_out = po
                exact["float32_vs_hf"] = po == ref
            else:
                same = []
                for x, y in zip(po, base_out or ref):
                    k = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v),
                             min(len(x), len(y)))
                    same.append(k / max(1, len(y)))
                qual["greedy_prefix_share"] = round(statistics.mean(same), 3)
            for r in rows[-2:]:
                r.update(qual)
    by = {r["key"]: r for r in rows}
    if got is not None:
        # the host's speed drifts over a run: llama.cpp runs first and last, and its row is the
        # median over both
        again, why = _llama_cpp([q["ids"] for q in prompts], n, torch.get_num_threads(), a.reps)
        if again is not None:
            r = by["llama_cpp"]
            r["tok_s_first"], r["tok_s_last"] = r["tok_s"], _speed(again)
            r["tok_s"] = _speed({k: got[k] + again[k] for k in ("outputs", "walls")})
            notes.append(f"llama.cpp ran first and last in the run ({r['tok_s_first']} and "
                         f"{r['tok_s_last']} tok/s); its row is the median over both")
    ll = by.get("llama_cpp", {}).get("tok_s")
    for r in rows:
        r["vs_hf"] = round(r["tok_s"] / by["hf_greedy"]["tok_s"], 3)
        r["vs_llama_cpp"] = round(r["tok_s"] / ll, 3) if ll else None
    res = {"command": command, "machine": host,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "elapsed_s": round(time.perf_counter() - t_start),
           "config": {"prompts": [q["id"] for q in prompts], "max_new_tokens": n,
                      "drafts": a.drafts, "read_bandwidth_gb_s": round(bw / 1e9, 1),
                      "mean_context": round(context), "held_out_tokens": len(held)},
           "exact": exact, "notes": notes, "rows": rows}
    write_results(a.out, res, markdown, plot)
    if not all(exact.values()):                 # float32's contract; lower formats report
        print(f"WARNING: not exact: {exact}", file=sys.stderr)
        return 1
    return 0


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    lines = ["# CPU engines on the embedded SmolLM2-135M-Instruct", "",
             f"`{res['command']}` on {m['cpu']} ({m['torch_threads']} threads), {res['date']}; "
             f"{len(c['prompts'])} prompts (MT-bench and HumanEval, spread), "
             f"{c['max_new_tokens']} new tokens, greedy; read bandwidth "
             f"{c['read_bandwidth_gb_s']} GB/s; exact: {res['exact']}.", ""]
    lines += [f"- {x}" for x in res["notes"]] + ([""] if res["notes"] else [])
    lines += ["| engine | weights | tok/s | vs HF | vs llama.cpp | bandwidth limit | of limit | "
              "ppl vs fp32 | top-1 agree | greedy prefix | spec = plain | spec / plain: median, "
              "worst prompt |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(v, fmt="{:.2f}"):
        return "—" if v is None else fmt.format(v)
    for r in res["rows"]:
        lines.append(f"| {r['engine']} | {r['weights']} | {r['tok_s']:.1f} | {r['vs_hf']:.2f}x | "
                     f"{f(r['vs_llama_cpp'], '{:.2f}x')} | "
                     f"{f(r.get('bandwidth_limit_tok_s'), '{:.0f}')} | "
                     f"{f(r.get('of_limit'))} | {f(r.get('ppl_ratio'), '{:.4f}')} | "
                     f"{f(r.get('top1_agreement'), '{:.3f}')} | "
                     f"{f(r.get('greedy_prefix_share'), '{:.2f}')} | "
                     f"{r.get('spec_equals_plain', '—')} | "
                     + (f"{r['vs_plain_median']:.2f}x, {r['vs_plain_min']:.2f}x |"
                        if "vs_plain_median" in r else "— |"))
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(10, 4.2))
    ax.barh(range(len(rows)), [r["tok_s"] for r in rows],
            color=["tab:gray" if not r["key"].startswith(("plain", "spec")) else
                   "tab:blue" if r["key"].startswith("plain") else "tab:green" for r in rows])
    for i, r in enumerate(rows):
        if r.get("bandwidth_limit_tok_s"):
            ax.plot([r["bandwidth_limit_tok_s"]] * 2, [i - 0.4, i + 0.4], color="red", lw=2)
    ax.set_yticks(range(len(rows)), [r["engine"] for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median over prompts); red: bandwidth limit of the format")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(_llama_worker() if sys.argv[1:] == ["_llama_worker"] else main())
