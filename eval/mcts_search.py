"""MCTS over the embedded target model on the KV tree, against the same search with full copies.

Every tree node is a session context forked from its parent; a node's children are its top-B
next tokens (B = branching), computed together in one forward; a leaf is valued by a greedy
rollout to the depth limit (all B rollouts in one forward per token, on forks released right
after), value = mean target log-prob of the path + rollout. Selection is PUCT with the target's
probabilities as priors. The same search is run again with `Session(full_copy=True)`, where
every fork copies the whole cache: its peak KV bytes are what a design without sharing needs.
Forks, fork latency, peak KV bytes: measured (pool counters and a clock around each fork).

    python eval/mcts_search.py --branching 4 --depth 12 --simulations 40 --out results/mcts.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from specfork.errors import SpecforkError, check_positive, run_command

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


class Node:
    __slots__ = ("h", "depth", "logps", "prior", "children", "n", "w")

    def __init__(self, h, depth, logps, prior):
        self.h, self.depth, self.logps, self.prior = h, depth, logps, prior
        self.children: list[Node] = []
        self.n, self.w = 0, 0.0


def rollout_values(sess, nodes, depth):
    """Mean log-prob of each node's path plus its greedy rollout to `depth`, batched."""
    lps = [list(n.logps) for n in nodes]
    live = [i for i, n in enumerate(nodes) if n.depth < depth]
    forks = {i: sess.fork(nodes[i].h) for i in live}
    while live:
        sess.flush([forks[i] for i in live])
        for i in live:
            lp = torch.log_softmax(forks[i].logits.float(), -1)
            t = int(lp.argmax())
            lps[i].append(float(lp[t]))
            sess.extend(forks[i], [t])
        live = [i for i in live if len(lps[i]) < depth]
    for f in forks.values():
        sess.release(f)
    return [sum(x) / len(x) for x in lps]


def expand(sess, node, branching):
    """B children of `node`: one fork each, their tokens computed in one forward."""
    lp = torch.log_softmax(sess.logits(node.h).float(), -1)
    top = torch.topk(lp, branching)
    kids = []
    for t, l in zip(top.indices.tolist(), top.values.tolist()):
        h = sess.extend(sess.fork(node.h), [t])
        kids.append(Node(h, node.depth + 1, node.logps + [l], math.exp(l)))
    sess.flush([k.h for k in kids])
    node.children = kids
    return kids


def search(sess, prompt_ids, branching, depth, simulations, c_puct):
    root = Node(sess.start(prompt_ids), 0, [], 1.0)
    sess.logits(root.h)
    sess.pool.reset_peak()
    expanded: list[list[int]] = []
    for _ in range(simulations):
        path, node = [root], root
        while node.children:
            sq = math.sqrt(node.n)
            node = max(node.children, key=lambda k: (k.w / k.n if k.n else 0.0)
                       + c_puct * k.prior * sq / (1 + k.n))
            path.append(node)
        if node.depth < depth:
            kids = expand(sess, node, branching)
            vals = rollout_values(sess, kids, depth)
            for k, v in zip(kids, vals):
                k.n, k.w = 1, v
            value = max(vals)
            expanded.append(node.h.tokens[len(prompt_ids):])
        else:
            value = sum(node.logps) / len(node.logps)
        for p in path:
            p.n += 1
            p.w += value
    best, node = [], root
    while node.children:
        node = max(node.children, key=lambda k: k.n)
        best.append(node)
    nodes, stack = 0, [root]
    while stack:                                     # release every context, count nodes
        n = stack.pop()
        nodes += 1
        stack += n.children
        sess.release(n.h)
    leaf = best[-1]
    return {"nodes": nodes, "expansions": len(expanded), "expanded": expanded,
            "best_path_tokens": leaf.h.tokens[len(prompt_ids):],
            "best_path_mean_logprob": sum(leaf.logps) / len(leaf.logps),
            "best_path_depth": leaf.depth}


def run(model, tok, prompt_ids, a, full_copy):
    from specfork.session import Session
    sess = Session(model, tok, max_kv_tokens=a.max_kv_tokens, block_size=a.block_size,
                   full_copy=full_copy)
    t0 = time.perf_counter()
    out = search(sess, prompt_ids, a.branching, a.depth, a.simulations, a.c_puct)
    wall = time.perf_counter() - t0
    ns = sorted(sess.fork_ns)
    out.update({
        "full_copy": full_copy, "wall_s": wall, "forwards": sess.forwards,
        "forks": sess.forks,
        "fork_latency_us": {"median": statistics.median(ns) / 1e3,
                            "p90": ns[int(0.9 * (len(ns) - 1))] / 1e3, "max": ns[-1] / 1e3,
                            "mean": sum(ns) / len(ns) / 1e3},
        "kv_peak_bytes": sess.pool.peak_bytes, "kv_peak_blocks": sess.pool.peak_blocks,
        "kv_blocks_leaked": sess.pool.used_blocks, "live_branches": sess.kv.live_branches})
    out["best_path_text"] = tok.decode(out["best_path_tokens"])
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
    res = {"model": "smollm2-135m (fp32)", "prompt": p["id"], "prompt_tokens": len(ids),
           "branching": a.branching, "depth": a.depth, "simulations": a.simulations,
           "block_size": a.block_size or model.block_size, "threads": a.threads,
           "greedy_path_mean_logprob": g_mean / len(greedy.token_ids),
           "kv_tree": tree, "full_copy": copy,
           "same_search": tree["expanded"] == copy["expanded"],
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


if __name__ == "__main__":
    sys.exit(run_command("mcts_search", main))
