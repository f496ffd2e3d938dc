"""KV cache formats on the embedded target, one run: bytes, distortion, quality, speed.

    python eval/bench_kv_quant.py              # -> results/kv_quant.{json,md,png}

Per `--kv-cache` format (float32 is the reference; every number is measured here; `+wN`
after a turbo format: the same codes read with `--kv-window N`, whose float16 shadows the
8K peak counts):
- bytes per token of the pool as allocated (norms included), and the ratio to float16;
- distortion: relative MSE of the real keys and values of a float32 prefill after a round
  trip through the format (keys centred as the format stores them), beside the paper's bounds
  for b-bit codes (measured on random unit vectors: 4^-b <= D <= sqrt(3) pi / 2 * 4^-b);
- perplexity on held-out text: the standard library's pydoc of a few modules, 1024 tokens
  each (`SpecDecoder.score`, as `specfork score` runs it), and one 8K-token document made of
  several modules' docs, whose KV bytes at peak are the "8K context" column;
- greedy agreement with float32 KV: 128 tokens on `--prompts` MT-bench prompts (one per
  category), the share equal to float32's before the first difference, and whole outputs equal;
- tokens/s of plain decoding and of `--drafts 3` (adaptive, as the CLI runs it), tau of the
  same drafters with every drafter drafting (`--no-adaptive`), and whether speculation gives
  plain decoding's tokens under the same format (it must: else exit 1);
- beam search (width 4, 32 tokens) on the same prompts: how often its best sequence equals
  the float32 KV one.
No number here tunes anything: the formats' parameters are fixed in specfork/kv_quant.py.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import pydoc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine, write_results  # noqa: E402

FORMATS = ("float32", "float16", "turbo4", "turbo3.5", "turbo3", "turbo2.5", "turbo3.5-prod",
           "turbo4+w32", "turbo3.5+w32", "turbo3+w32", "turbo2.5+w32")
PPL_MODULES = ("json", "textwrap", "heapq", "csv", "difflib", "fractions")
LONG_MODULES = ("collections", "argparse", "logging", "pathlib", "functools", "itertools",
                "shutil", "string", "datetime", "statistics")
UPPER = math.sqrt(3) * math.pi / 2


def split_format(name: str) -> tuple[str, int]:
    """'turbo3.5+w32' -> ('turbo3.5', 32): the KV format and its `--kv-window`."""
    fmt, _, w = name.partition("+w")
    if _ and not w.isdigit():
        from specfork.errors import SpecforkError
        raise SpecforkError(f"format '{name}': a window is written +w<tokens>, e.g. turbo3.5+w32")
    return fmt, int(w) if w else 0


def module_text(tok, names, budget: int) -> list[int]:
    """Token ids of the modules' pydoc text, concatenated, cut at `budget` tokens."""
    ids: list[int] = []
    for name in names:
        ids += tok(pydoc.render_doc(__import__(name), renderer=pydoc.plaintext))["input_ids"]
        if len(ids) >= budget:
            break
    return ids[:budget]


def paper_points() -> list[dict]:
    """Measured MSE of b-bit Lloyd-Max codes of rotated random unit vectors (d = 64)."""
    from specfork.kv_quant import lloyd_max, rotation
    g = torch.Generator().manual_seed(0)
    u = torch.randn(4000, 64, generator=g)
    u = u / u.norm(dim=-1, keepdim=True)
    y = u @ rotation(64, 1).t()
    out = []
    for b in (1, 2, 3, 4):
        c, _ = lloyd_max(64, b)
        q = c[torch.bucketize(y, (c[1:] + c[:-1]) / 2)]
        out.append({"bits": b, "mse": (y - q).pow(2).sum(-1).mean().item(),
                    "lower": 4.0 ** -b, "upper": UPPER * 4.0 ** -b})
    return out


def distortion(dec_ref, dec, ids: list[int]) -> dict:
    """Relative MSE of the float32 pool's real K and V (one prefill of `ids`) through `dec`'s
    codecs: for keys, of the centred keys (what the format stores and attention reads)."""
    codecs = dec.model.kv_codecs
    if codecs is None:
        return {"k": 0.0, "v": 0.0}
    kv, model = dec_ref.kv, dec_ref.model
    from specfork.attention import AttnMeta
    b = kv.new_branch()
    try:
        s = kv.append(b, len(ids))
        model.forward(torch.tensor(ids), torch.arange(len(ids)), kv.pool,
                      AttnMeta.prefill(model, s[:0], s), logits_idx=slice(0, 0))
        errs = {"k": [], "v": []}
        for i, (kc, vc) in enumerate(codecs):
            kf, vf = kv.pool.layer_slots(i)
            for name, c, x in (("k", kc, kf[s]), ("v", vc, vf[s])):
                back = c.decode(c.encode(x))
                if c.rotated:                  # codes stand for centred keys
                    back, x = back @ c.R, c.prepare(x)
                errs[name].append(((back - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item())
    finally:
        kv.release(b)
    return {k: statistics.mean(v) for k, v in errs.items()}


def agree(a: list[int], b: list[int]) -> float:
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(len(a), len(b))


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--prompts", type=int, default=8, help="MT-bench prompts (spread)")
    p.add_argument("--max-new-tokens", dest="new", type=int, default=128)
    p.add_argument("--long-tokens", dest="long", type=int, default=8000,
                   help="tokens of the long document (0: skip it)")
    p.add_argument("--beam-tokens", dest="beam", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results/kv_quant", help="path stem of .json/.md/.png")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command
    from specfork.kv_quant import check_window_flags, parse_kv_format

    def go():
        fmts = [f.strip() for f in a.formats.split(",") if f.strip()]
        for f in fmts:
            kv, w = split_format(f)
            parse_kv_format(kv)
            check_window_flags(w, kv)
        if "float32" not in fmts:
            fmts.insert(0, "float32")
        if a.prompts <= 0 or a.new <= 0 or a.long < 0 or a.beam < 0:
            raise SpecforkError("--prompts and --max-new-tokens must be positive")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, fmts, command_line("bench_kv_quant", argv))
    return run_command("bench_kv_quant", go)


def _run(a, fmts: list[str], command: str) -> int:
    from prompts import load_prompts
    from specfork.decoder import SpecDecoder
    from specfork.search import beam_search
    host = machine()
    t_start = time.perf_counter()
    prompts = load_prompts("mtbench", a.prompts, spread=True)
    room = max(8192, a.long + 64)
    ref = None
    rows = {}
    for fmt in fmts:
        t0 = time.perf_counter()
        kvf, window = split_format(fmt)
        # float32 weights: the KV format is the one thing that changes (auto is int4 here)
        plain = SpecDecoder.from_pretrained(kv_cache=kvf, kv_window=window, max_kv_tokens=room,
                                            weights="float32")
        tok = plain.tokenizer
        spec = SpecDecoder.from_pretrained(kv_cache=kvf, kv_window=window, drafts=3,
                                           max_kv_tokens=room,
                                           weights="float32")
        fixed = SpecDecoder.from_pretrained(kv_cache=kvf, kv_window=window, drafts=3,
                                            adaptive=False,
                                            max_kv_tokens=room, weights="float32")
        if ref is None:
            ref = {"dec": plain, "docs": [module_text(tok, [m], 1024) for m in PPL_MODULES],
                   "long": module_text(tok, LONG_MODULES, a.long) if a.long else None}
        r = {"bytes_per_token": plain.pool.bytes_per_token}
        r["distortion"] = distortion(ref["dec"], plain, ref["docs"][0])
        nll, n = 0.0, 0
        for ids in ref["docs"]:
            s = plain.score(ids)
            nll += sum(s["nll"])
            n += len(s["nll"])
        r["ppl"] = math.exp(nll / n)
        if ref["long"]:
            plain.pool.reset_peak()
            s = plain.score(ref["long"])
            r["ppl_8k"], r["kv_peak_8k_bytes"] = s["ppl"], plain.pool.peak_bytes
        outs = {"plain": [], "spec": [], "fixed": []}
        speed = {"plain": [], "spec": []}
        taus, leaked = [], 0
        plain.generate(prompts[0]["text"], max_new_tokens=4)        # warm up
        spec.generate(prompts[0]["text"], max_new_tokens=4)
        for q in prompts:
            for name, dec in (("plain", plain), ("spec", spec), ("fixed", fixed)):
                out = dec.generate(q["text"], max_new_tokens=a.new)
                outs[name].append(out.token_ids)
                leaked += out.stats["kv_blocks_leaked"]
                if name in speed:
                    speed[name].append(out.stats["tokens_per_s"])
                else:
                    taus.append(out.stats["mean_accepted"])
        r["tok_s"] = {k: statistics.median(v) for k, v in speed.items()}
        r["tau"] = statistics.mean(taus)
        r["spec_exact"] = sum(x == y == z for x, y, z in zip(outs["plain"], outs["spec"],
                                                             outs["fixed"]))
        r["leaked_blocks"] = leaked
        beams = []
        if a.beam:
            for q in prompts:
                res = beam_search(plain.engine, q["text"], num_beams=4, max_new_tokens=a.beam)
                beams.append(res.token_ids)
        if fmt == "float32":
            ref.update(outs=outs["plain"], beams=beams)
        r["greedy_agree"] = statistics.mean(agree(x, y) for x, y in
                                            zip(outs["plain"], ref["outs"]))
        r["greedy_equal"] = sum(x == y for x, y in zip(outs["plain"], ref["outs"]))
        if a.beam:
            r["beam_equal"] = sum(x == y for x, y in zip(beams, ref["beams"]))
        r["elapsed_s"] = round(time.perf_counter() - t0)
        rows[fmt] = r
        print(f"{fmt:<14} {r['bytes_per_token']:>6} B/token  ppl {r['ppl']:.3f}  tok/s "
              f"{r['tok_s']['plain']:.1f} / {r['tok_s']['spec']:.1f}  tau {r['tau']:.2f}  "
              f"spec exact {r['spec_exact']}/{len(prompts)}  ({r['elapsed_s']} s)",
              file=sys.stderr, flush=True)
    f16 = 2 * 2 * plain.model.num_layers * plain.model.kv_heads * plain.model.head_dim
    base = rows["float32"]
    for r in rows.values():
        r["vs_float16_bytes"] = round(f16 / r["bytes_per_token"], 3)
        r["ppl_ratio"] = round(r["ppl"] / base["ppl"], 4)
        if "ppl_8k" in r:
            r["ppl_8k_ratio"] = round(r["ppl_8k"] / base["ppl_8k"], 4)
        r["tau_ratio"] = round(r["tau"] / base["tau"], 3)
        r["speed_ratio"] = round(r["tok_s"]["plain"] / base["tok_s"]["plain"], 3)
    res = {"command": command, "machine": host,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "elapsed_s": round(time.perf_counter() - t_start),
           "config": {"target": "smollm2-135m", "prompts": len(prompts),
                      "max_new_tokens": a.new, "ppl_modules": list(PPL_MODULES),
                      "long_tokens": len(ref["long"] or []), "beam_tokens": a.beam,
                      "float16_bytes_per_token": f16},
           "paper": paper_points(), "formats": rows}
    write_results(a.out, res, markdown, plot)
    bad = [f for f, r in rows.items() if r["spec_exact"] != len(prompts) or r["leaked_blocks"]]
    if bad:
        print(f"ERROR: speculation differs from plain decoding (or leaks) under {bad}",
              file=sys.stderr)
        return 1
    return 0


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    n = c["prompts"]
    lines = ["# KV cache formats: bytes, distortion, quality, speed", "",
             f"`{res['command']}` on {m['cpu']} ({m['torch_threads']} threads), {res['date']}; "
             f"{c['target']} float32 weights. Perplexity: {len(c['ppl_modules'])} pydoc texts "
             f"of 1024 tokens ({', '.join(c['ppl_modules'])}) and one of {c['long_tokens']} "
             f"tokens; greedy, tau and tokens/s: {n} MT-bench prompts, {c['max_new_tokens']} "
             f"new tokens; beams: width 4, {c['beam_tokens']} tokens. float16 stores "
             f"{c['float16_bytes_per_token']} bytes per token.", "",
             "| format | bytes/token | vs float16 | rel. MSE K / V | ppl (vs float32) | "
             "ppl 8K (vs float32) | KV at 8K | greedy = float32 (prefix share) | beams = "
             "float32 | plain tok/s (vs float32) | spec tok/s | tau fixed (vs float32) | "
             "spec = plain |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for f, r in res["formats"].items():
        d = r["distortion"]
        ppl8 = (f"{r['ppl_8k']:.3f} ({r['ppl_8k_ratio']:.3f}x)" if "ppl_8k" in r else "-")
        kv8 = f"{r['kv_peak_8k_bytes'] / 2**20:.0f} MiB" if "kv_peak_8k_bytes" in r else "-"
        lines.append(
            f"| {f} | {r['bytes_per_token']} | {r['vs_float16_bytes']:.2f}x | "
            f"{d['k']:.4f} / {d['v']:.4f} | {r['ppl']:.3f} ({r['ppl_ratio']:.3f}x) | {ppl8} | "
            f"{kv8} | {r['greedy_equal']}/{n} ({r['greedy_agree']:.2f}) | "
            f"{r.get('beam_equal', '-')}/{n} | {r['tok_s']['plain']:.1f} "
            f"({r['speed_ratio']:.2f}x) | {r['tok_s']['spec']:.1f} | {r['tau']:.2f} "
            f"({r['tau_ratio']:.2f}x) | {r['spec_exact']}/{n} |")
    lines += ["", "Codebook distortion on random unit vectors (d = 64) beside the paper's "
              "bounds:", "", "| bits | measured | lower 4^-b | upper sqrt(3) pi/2 4^-b |",
              "|---|---|---|---|"]
    for p in res["paper"]:
        lines.append(f"| {p['bits']} | {p['mse']:.4f} | {p['lower']:.4f} | {p['upper']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.2))
    b = [p["bits"] for p in res["paper"]]
    ax.semilogy(b, [p["upper"] for p in res["paper"]], "k--", label="paper upper bound")
    ax.semilogy(b, [p["lower"] for p in res["paper"]], "k:", label="paper lower bound")
    ax.semilogy(b, [p["mse"] for p in res["paper"]], "o-", label="Lloyd-Max, unit vectors")
    for f, r in res["formats"].items():
        if f.startswith("turbo") and not f.endswith("prod") and "+w" not in f:
            bits = float(f[5:]) - 0.25               # code bits per coordinate (norm: 16 / 64)
            ax.semilogy([bits], [r["distortion"]["k"]], "rs")
            ax.semilogy([bits], [r["distortion"]["v"]], "g^")
            ax.annotate(f, (bits, r["distortion"]["k"]), fontsize=7)
    ax.plot([], [], "rs", label="real keys (centred)")
    ax.plot([], [], "g^", label="real values")
    ax.set_xlabel("code bits per coordinate")
    ax.set_ylabel("relative MSE")
    ax.legend(fontsize=8)
    fs = [f for f in res["formats"]]
    x = [res["formats"][f]["vs_float16_bytes"] for f in fs]
    y = [res["formats"][f]["ppl_ratio"] for f in fs]
    bx.scatter(x, y)
    for f, xi, yi in zip(fs, x, y):
        bx.annotate(f, (xi, yi), fontsize=8)
    bx.set_xlabel("KV bytes: float16 / format")
    bx.set_ylabel("perplexity / float32 KV")
    bx.set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
