"""Fork latency of the KV tree vs tree depth and prefix length, beside a full KV copy and release.

    python eval/bench_fork.py --json results/fork_latency.json --png results/fork_latency.png

Pool shape is the embedded target's (30 layers, 3 KV heads, head_dim 64, fp32, block_size 16).
Fork and release are timed separately inside fork+release pairs with time.perf_counter_ns; the
timer's own cost (reported as timer_overhead_ns) is included, not subtracted. Configurations are
measured round-robin so that load from other processes spreads evenly over all of them.
The full copy gathers the prefix's blocks of K and V in every layer into preallocated buffers
(the cheapest a copy-on-fork cache could do: no allocation, no page faults counted).
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
from specfork.kv_tree import BlockPool, KVTree

LAYERS, KV_HEADS, HEAD_DIM, BS, DTYPE = 30, 3, 64, 16, torch.float32
DEPTHS = [1, 10, 50, 100, 500]
PREFIXES = [16, 256, 4096, 16384]
pc = time.perf_counter_ns


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])


def summary(xs: list[int]) -> dict:
    return {"p50_ns": statistics.median(xs), "p90_ns": pct(xs, 0.9), "reps": len(xs)}


def fork_release(tree: KVTree, targets: dict, reps: int, fork_at: int | None = None) -> tuple:
    """`reps` fork+release pairs of every branch in `targets`, round-robin (one pair of each in
    turn, so every configuration sees the same background load): fork ns, release ns lists."""
    fork, release = tree.fork, tree.release
    items = list(targets.items())
    forks = {k: [] for k in targets}
    frees = {k: [] for k in targets}
    for i in range(reps + 200):                       # the first 200 rounds warm up
        for k, br in items:
            t0 = pc()
            c = fork(br, fork_at)
            t1 = pc()
            release(c)
            t2 = pc()
            if i >= 200:
                forks[k].append(t1 - t0)
                frees[k].append(t2 - t1)
    return forks, frees


def bench_depth(reps: int) -> dict:
    """Chains of d nested forks, 16 tokens appended at each level; fork the deepest branch."""
    pool = BlockPool(LAYERS, KV_HEADS, HEAD_DIM, BS, num_blocks=sum(DEPTHS) + len(DEPTHS),
                     dtype=DTYPE)
    tree = KVTree(pool)
    tips = {}
    for d in DEPTHS:
        b = tree.new_branch()
        tree.append(b, BS)
        for _ in range(d):
            b = tree.fork(b)
            tree.append(b, BS)
        tips[str(d)] = b
    for k, b in tips.items():
        n = 0
        while b.parent is not None:
            b, n = b.parent, n + 1
        assert n == int(k), (k, n)
    forks, frees = fork_release(tree, tips, reps)
    # forking at token 8 of the deepest branch hangs the child off the root: a walk up the chain
    deep_forks, _ = fork_release(tree, tips, reps // 4, fork_at=8)
    return {"fork_vs_depth": {k: summary(v) for k, v in forks.items()},
            "free_vs_depth": {k: summary(v) for k, v in frees.items()},
            "fork_at_token_8_vs_depth": {k: summary(v) for k, v in deep_forks.items()}}


def bench_prefix(reps: int) -> dict:
    """One branch per prefix length (real data in every block); fork it, and copy its KV."""
    pool = BlockPool(LAYERS, KV_HEADS, HEAD_DIM, BS, num_blocks=sum(PREFIXES) // BS + 1,
                     dtype=DTYPE)
    pool.k.fill_(0.5)                                 # touch every page: no lazy zero pages
    pool.v.fill_(-0.5)
    tree = KVTree(pool)
    roots = {}
    for p in PREFIXES:
        roots[str(p)] = b = tree.new_branch()
        tree.append(b, p)
    forks, frees = fork_release(tree, roots, reps)
    out = {"fork_vs_prefix_tokens": {k: summary(v) for k, v in forks.items()},
           "free_vs_prefix_tokens": {k: summary(v) for k, v in frees.items()},
           "full_copy_vs_prefix_tokens": {}}
    for k, b in roots.items():
        table = torch.tensor(tree.block_table(b), dtype=torch.long)
        nbytes = table.numel() * pool.block_bytes   # K and V
        n = max(5, min(2000, int(3e8 // nbytes)))     # about 0.3 GB moved per size, >= 5 reps
        kc = torch.empty((LAYERS, table.numel(), BS, KV_HEADS, HEAD_DIM), dtype=DTYPE)
        vc = torch.empty_like(kc)
        times = []
        for i in range(n + 1):                        # copy 0 faults the buffers in: dropped
            t0 = pc()
            torch.index_select(pool.k, 1, table, out=kc)    # every layer's K and V
            torch.index_select(pool.v, 1, table, out=vc)
            t1 = pc()
            if i:
                times.append(t1 - t0)
        out["full_copy_vs_prefix_tokens"][k] = summary(times) | {"bytes": nbytes}
        del kc, vc
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    d = [int(k) for k in res["fork_vs_depth"]]
    a.plot(d, [v["p50_ns"] for v in res["fork_vs_depth"].values()], "o-", label="fork (at end)")
    a.plot(d, [v["p50_ns"] for v in res["free_vs_depth"].values()], "s-", label="release")
    a.plot(d, [v["p50_ns"] for v in res["fork_at_token_8_vs_depth"].values()], "^--",
           label="fork at token 8 (walks up)")
    a.set(xscale="log", yscale="log", xlabel="tree depth (nested forks)", ylabel="p50 latency (ns)",
          title="fork vs depth")
    p = [int(k) for k in res["fork_vs_prefix_tokens"]]
    for key, label, m in [("fork_vs_prefix_tokens", "fork", "o-"),
                          ("free_vs_prefix_tokens", "release", "s-"),
                          ("full_copy_vs_prefix_tokens", "full KV copy", "x-")]:
        b.plot(p, [v["p50_ns"] for v in res[key].values()], m, label=label)
    b.set(xscale="log", yscale="log", xlabel="prefix tokens", ylabel="p50 latency (ns)",
          title="fork vs prefix (30 layers, 3 KV heads, d=64, fp32)")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--png")
    ap.add_argument("--reps", type=int, default=20000, help="fork+release pairs per configuration")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    overhead = []
    for _ in range(10000):
        t0 = pc()
        overhead.append(pc() - t0)
    res = {"command": command("bench_fork", argv), "machine": machine(),
           "shape": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                     "block_size": BS, "dtype": str(DTYPE)},
           "timer_overhead_ns": statistics.median(overhead)}
    res |= bench_depth(args.reps)
    res |= bench_prefix(args.reps)
    fd, fp = res["fork_vs_depth"], res["fork_vs_prefix_tokens"]
    worst_fork = max(v["p50_ns"] for v in list(fd.values()) + list(fp.values()))
    res["targets"] = {
        "depth500_over_depth1": fd["500"]["p50_ns"] / fd["1"]["p50_ns"],            # <= 1.2
        "max_fork_p50_ns": worst_fork,                                              # <= 3000
        "copy4096_over_fork4096": res["full_copy_vs_prefix_tokens"]["4096"]["p50_ns"]
        / fp["4096"]["p50_ns"]}                                                     # >= 1000
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    if args.png:
        plot(res, args.png)
    t = res["targets"]
    print(f"depth 500 / depth 1: {t['depth500_over_depth1']:.3f}  (target <= 1.2)")
    print(f"slowest fork p50: {t['max_fork_p50_ns']:.0f} ns  (target <= 3000)")
    print(f"copy / fork at 4096 tokens: {t['copy4096_over_fork4096']:.0f}x  (target >= 1000)")


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("bench_fork", main))
