"""Benchmark of `specfork.mcts` on the embedded target: the KV tree against full copies.

The search (`specfork/mcts.py`) runs once on a `Session` whose forks share the KV tree and once
with `Session(full_copy=True)`, where every fork copies the whole cache: its peak KV bytes are
what a design without sharing needs. Forks, fork latency, peak KV bytes: measured (pool counters
and a clock around each fork). Also reported: greedy decoding's mean log-prob over `depth`
tokens, the baseline the search's best path is compared with.

    python eval/mcts_search.py --branching 4 --depth 12 --simulations 40 --out results/mcts.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from provenance import command, machine
from specfork.errors import SpecforkError, check_positive, run_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def run(model, tok, prompt_ids, a, full_copy):
    """One search on a fresh session; its result plus fork latency and what stayed held."""
    from dataclasses import asdict

    from specfork.engine import Engine
    from specfork.mcts import mcts
    from specfork.session import Session
    sess = Session(Engine(model, tok, max_kv_tokens=a.max_kv_tokens, block_size=a.block_size),
                   full_copy=full_copy)
    root = sess.start(prompt_ids)
    t0 = time.perf_counter()
    res = mcts(sess, root, a.branching, a.depth, a.simulations, a.c_puct)
    wall = time.perf_counter() - t0
    sess.release(root)
    ns = sorted(sess.fork_ns)
    out = asdict(res)
    out.update({
        "full_copy": full_copy, "wall_s": wall, "expansions": len(res.expanded),
        "best_path_depth": len(res.best_tokens),
        "fork_latency_us": {"median": statistics.median(ns) / 1e3,
                            "p90": ns[int(0.9 * (len(ns) - 1))] / 1e3, "max": ns[-1] / 1e3,
                            "mean": sum(ns) / len(ns) / 1e3},
        "kv_blocks_held_after_release": sess.pool.used_blocks,
        "live_branches": sess.kv.live_branches,
        "best_path_text": tok.decode(res.best_tokens)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=0, help="MT-bench prompt index")
    ap.add_argument("--branching", type=int, default=4)
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--simulations", type=int, default=40)
    ap.add_argument("--c-puct", type=float, default=1.0)
    ap.add_argument("--max-kv-tokens", type=int, default=24576)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size (default: one token)")
    ap.add_argument("--out", default="results/mcts.json")
    a = ap.parse_args(argv)
    check_positive(branching=a.branching, depth=a.depth, simulations=a.simulations,
                   max_kv_tokens=a.max_kv_tokens, threads=a.threads)
    if a.block_size is not None:
        check_positive(block_size=a.block_size)
    torch.set_num_threads(a.threads)
    host = machine()
    from specfork.decoder import SpecDecoder
    from specfork.model import Model
    from specfork.loader import load_hf
    from prompts import load_prompts
    prompts = load_prompts("mtbench")
    if not 0 <= a.prompt < len(prompts):
        raise SpecforkError(f"--prompt must be in 0..{len(prompts) - 1}, got {a.prompt}")
    p = prompts[a.prompt]
    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    model = Model(hf)
    dec = SpecDecoder(model, tok)
    ids = dec.encode(p["text"])
    greedy = dec.generate(ids, max_new_tokens=a.depth)
    with torch.no_grad():
        g_lp = torch.log_softmax(hf(torch.tensor([ids + greedy.token_ids])).logits[0].float(), -1)
    g_mean = sum(float(g_lp[len(ids) - 1 + i, t]) for i, t in enumerate(greedy.token_ids))
    tree = run(model, tok, ids, a, full_copy=False)
    copy = run(model, tok, ids, a, full_copy=True)
    res = {"command": command("mcts_search", argv), "machine": host,
           "model": "smollm2-135m (fp32)", "prompt": p["id"], "prompt_tokens": len(ids),
           "branching": a.branching, "depth": a.depth, "simulations": a.simulations,
           "block_size": a.block_size or model.block_size, "threads": a.threads,
           "greedy_path_mean_logprob": g_mean / len(greedy.token_ids),
           "kv_tree": tree, "full_copy": copy,
           "same_search": tree["expanded"] == copy["expanded"],
           "same_best_path": tree["best_tokens"] == copy["best_tokens"],
           "peak_bytes_ratio_full_copy_over_tree": copy["kv_peak_bytes"] / tree["kv_peak_bytes"]}
    for r in (tree, copy):
        r.pop("expanded")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("kv_tree", "full_copy")},
                     indent=1))
    for r in (tree, copy):
        print(json.dumps({k: r[k] for k in ("full_copy", "nodes", "forks", "fork_latency_us",
                                            "kv_peak_bytes", "kv_blocks_leaked", "wall_s")}))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    sys.exit(run_command("mcts_search", main))
