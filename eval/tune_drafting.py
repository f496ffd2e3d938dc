"""Tune the drafting policy (mix, paths, draft length, `min_conf`) on hand-written prompts that
are in neither MT-bench nor HumanEval, so the reported sets stay untouched by tuning.

    python eval/tune_drafting.py --out results/tune_drafting.json \\
        '{"mix":"ngram,trained","paths":3,"len":4,"conf":0.3,"vocab":8192}' \\
        '{"mix":"ngram,trained","paths":3,"len":4,"conf":0}' \\
        '{"mix":"ngram,trained","paths":3,"len":4,"conf":0.3}'

Each config is a JSON object: mix (drafters, in order: ngram, trained, eagle), paths, len, conf
(the trained draft's min_conf), optionally ngmin (n-gram drafter's shortest match) and vocab (the
trained draft's output rows: the target's N most frequent tokens plus the request's; 0 or
absent: all), dtype (the trained draft's format: auto, the default, as `specfork generate`
runs it; float16, bfloat16 or int4) and topk, depth,
tokens (the shipped EAGLE head's tree: --tree-topk, --tree-depth, --draft-tokens) and adaptive
(true: adaptive drafting as `specfork generate` runs it; false or absent: the full budget every
step). Greedy and
every config run interleaved per prompt, twice, so machine noise hits all alike; prints
tokens/s, the ratio to our greedy decoding measured in the same loop, τ, and whether the tokens
equal greedy's;
`--out` writes the same as JSON, with the command and the machine. `--weights` sets the target's
weight format (float32 by default; `auto` is what `specfork generate` runs).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from provenance import command, machine
from specfork.errors import SpecforkError, check_positive, run_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

PROMPTS = [
    "Write a short letter to a neighbour apologising for a noisy party last weekend.",
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a Python function that returns the list of all divisors of an integer n, "
    "with a docstring.",
    "What are three tips for staying focused while studying at home?",
    "Describe the rules of tic-tac-toe and give a simple winning strategy.",
    "Write a bash script that counts the lines of every .txt file in a folder.",
]


REQUIRED = {"mix", "paths", "len", "conf"}
OPTIONAL = {"ngmin", "vocab", "dtype", "topk", "depth", "tokens", "adaptive"}


def parse_config(text: str) -> dict:
    """One config (see the module docstring), checked before any model loads."""
    try:
        c = json.loads(text)
    except ValueError as e:
        raise SpecforkError(f"config {text!r} is not JSON: {e}") from None
    if not isinstance(c, dict) or not REQUIRED <= c.keys() or not c.keys() <= REQUIRED | OPTIONAL:
        raise SpecforkError(f"config {text!r}: need keys {sorted(REQUIRED)}, optional "
                            f"{sorted(OPTIONAL)}")
    ok = isinstance(c["mix"], str) and all(k in ("ngram", "trained", "eagle")
                                           for k in c["mix"].split(","))
    if ok and "eagle" in c["mix"].split(","):
        from specfork.drafters.eagle import check_tree, tree_shape
        check_tree(*tree_shape(c.get("topk"), c.get("depth"), c.get("tokens")))
    ok = ok and all(isinstance(c[k], (int, float)) for k in ("paths", "len", "conf"))
    if not ok or c["paths"] < 1 or c["len"] < 1 or not 0 <= c["conf"] < 1 \
            or c.get("dtype", "auto") not in ("auto", "float16", "bfloat16", "int4") \
            or not isinstance(c.get("adaptive", False), bool):
        raise SpecforkError(f"config {text!r}: mix of ngram/trained/eagle, paths >= 1, len >= 1, "
                            "0 <= conf < 1, dtype auto, float16, bfloat16 or int4, adaptive "
                            "true or false")
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="JSON objects, see the module docstring")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the comparison here as JSON")
    ap.add_argument("--weights", default="float32",
                    choices=["auto", "float32", "bfloat16", "int8", "int4"],
                    help="the target's weight format (auto: what `specfork generate` picks)")
    a = ap.parse_args(argv)
    check_positive(max_new_tokens=a.max_new_tokens, reps=a.reps, threads=a.threads)
    cfgs = [parse_config(c) for c in a.configs]
    torch.set_num_threads(a.threads)
    host = machine()
    from specfork.decoder import SpecDecoder
    from specfork.drafters.model_drafter import ModelDrafter
    from specfork.drafters.ngram import NgramDrafter
    from specfork.drafters.eagle import EagleDrafter, load_shipped, tree_shape
    from specfork.drafters.registry import trained_model
    from specfork.drafters.trained_draft import load_vocab
    from specfork.model import Model
    from specfork.loader import load_hf

    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    model = Model(hf, weights=a.weights)
    drafts = {dt: trained_model(model, dt)
              for dt in {c.get("dtype", "auto") for c in cfgs
                         if "trained" in c["mix"].split(",")}}

    eagle_head = (load_shipped(model) if any("eagle" in c["mix"].split(",") for c in cfgs)
                  else None)

    def one(k, c):
        if k == "ngram":
            return NgramDrafter(min_ngram=c.get("ngmin", 1))
        if k == "eagle":
            return EagleDrafter(eagle_head, "eagle", *tree_shape(c.get("topk"), c.get("depth"),
                                                                 c.get("tokens")))
        return ModelDrafter(drafts[c.get("dtype", "auto")], name="trained", min_conf=c["conf"],
                            vocab=load_vocab(c["vocab"]) if c.get("vocab") else None)

    def make(c):
        ds = [one(k, c) for k in c["mix"].split(",")]
        return SpecDecoder(model, tok, ds, num_paths=c["paths"], draft_len=c["len"],
                           adaptive=c.get("adaptive", False))

    decs, greedy = [make(c) for c in cfgs], SpecDecoder(model, tok)
    N = a.max_new_tokens
    tg, ts, fw, same = 0.0, [0.0] * len(cfgs), [0] * len(cfgs), [True] * len(cfgs)
    off = [0] * len(cfgs)                        # adaptive: verify steps with speculation off
    for _ in range(a.reps):
        for p in PROMPTS:
            ids = greedy.encode(p)
            t = time.perf_counter()
            ref = greedy.generate(ids, max_new_tokens=N).token_ids
            tg += time.perf_counter() - t
            for j, d in enumerate(decs):
                t = time.perf_counter()
                o = d.generate(ids, max_new_tokens=N)
                ts[j] += time.perf_counter() - t
                fw[j] += o.stats["target_forwards"]
                off[j] += o.stats.get("adaptive", {}).get("off_steps", 0)
                same[j] &= o.token_ids == ref
    n = a.reps * N * len(PROMPTS)
    rows = [{"config": c, "tokens_per_s": n / t, "speedup_vs_greedy": tg / t, "tau": n / f,
             "tokens_equal_greedy": k, "steps_speculation_off": o}
            for c, t, f, k, o in zip(cfgs, ts, fw, same, off)]
    print(f"greedy {n / tg:.2f} tok/s")
    for r in rows:
        print(json.dumps(r["config"]), f"{r['tokens_per_s']:.2f} tok/s  "
              f"x{r['speedup_vs_greedy']:.3f} greedy  tau {r['tau']:.2f}",
              "exact" if r["tokens_equal_greedy"] else "MISMATCH", flush=True)
    if a.out:
        res = {"command": command("tune_drafting", argv), "machine": host,
               "target": f"smollm2-135m ({model.weights})", "prompts": PROMPTS,
               "max_new_tokens": N, "reps": a.reps,
               "timing": "greedy and every config interleaved per prompt; tokens/s counts "
                         "max_new_tokens per run (wall time summed over prompts and reps)",
               "greedy_tokens_per_s": n / tg, "configs": rows}
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(run_command("tune_drafting", main))
