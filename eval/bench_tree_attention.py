"""CPU timing of one layer's tree attention on a SmolLM2-135M layer shape (9 heads, 3 KV heads,
head_dim 64, fp32), tree size x prefix length. The two paths the engine takes on a CPU
run as `Model.forward` runs them (`specfork/attention.py`: `AttnMeta.tree` built once per
forward, then `meta.attend` per layer, which gathers the prefix from the pool's one-token slots):
  bmm         the "masked" path: two bmm's under one additive mask over [prefix | tree]; the
              engine's path for 0 < prefix <= SHORT_PREFIX and 1 < tree <= SHORT_TREE
  cascade     the "cascade" path, `tree_attention_torch`: dense prefix by flash with lse,
              masked tree, merged; the engine's path above SHORT_PREFIX
Each path is forced by building its AttnMeta with SHORT_PREFIX moved out of the way. `bmm_ms`
and `cascade_ms` are one layer's `attend` plus 1/num_layers of building the metadata (built once
per forward, shared by every layer; `*_meta_ms` alone is reported too).
and, beside them, what the engine does without either:
  tree        tree_attention(): gather 16-token pages + cascade (the paged/Triton entry point)
  masked      gather + one SDPA over [prefix | tree] under the ancestor mask (public ops only)
  per_path    gather once, then one SDPA per root-to-leaf path over prefix + that path
              (causal), i.e. verifying the tree as a batch of independent sequences.
Trees are layered like EAGLE-style drafts: widths 1, 2, 4, ... capped at 16, each token's
parent drawn from the previous layer. `break_even` gives, per tree size, the shortest measured
prefix from which the cascade is faster than the bmm path (what SHORT_PREFIX should be).

    python eval/bench_tree_attention.py --threads 2 --json results/tree_attention_cpu.json
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from provenance import command, machine
from specfork import attention
from specfork.attention import SHORT_PREFIX, SHORT_TREE, AttnMeta
from specfork.kernels.tree_attention import (ancestor_mask, gather_prefix, tree_attention,
                                             tree_attention_sdpa)

LAYERS = 30                        # SmolLM2-135M: the metadata is built once for this many layers


def layered_tree(T: int, seed: int = 0, width: int = 16) -> list[int]:
    """Parent array (parents[i] < i): layers of width 1, 2, 4, ... <= `width`."""
    rng, parents, prev = random.Random(seed), [-1], [0]
    while len(parents) < T:
        n, start = min(2 * len(prev), width, T - len(parents)), len(parents)
        parents += [rng.choice(prev) for _ in range(n)]
        prev = list(range(start, start + n))
    return parents[:T]


def root_paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path, as token indices from the root down."""
    has_child = set(parents)
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, j = [], leaf
        while j >= 0:
            path.append(j)
            j = parents[j]
        paths.append(path[::-1])
    return paths


def make_layer(T: int, prefix_len: int, heads: int, kv_heads: int, head_dim: int,
               block_size: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0) -> dict:
    """Random q, a paged cache with the prefix in shuffled pages, and tree k/v (kwargs of tree_attention)."""
    g = torch.Generator(device=device).manual_seed(seed)
    nb = -(-prefix_len // block_size)
    shape = (nb + 8, block_size, kv_heads, head_dim)
    rand = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype)
    return dict(q=rand(T, heads, head_dim), k_cache=rand(*shape), v_cache=rand(*shape),
                block_table=torch.randperm(nb + 8, generator=g, device=device)[:nb].int(),
                prefix_len=prefix_len, k_tree=rand(T, kv_heads, head_dim),
                v_tree=rand(T, kv_heads, head_dim))


def per_path(c: dict, paths: list[list[int]]) -> torch.Tensor:
    """One causal SDPA per root-to-leaf path (prefix gathered once); a token on several paths
    keeps the last result (they are all equal)."""
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    out = torch.empty_like(c["q"])
    for path in paths:
        idx = torch.tensor(path)
        chain = torch.ones(len(path), len(path), dtype=torch.bool).tril_()
        out[idx] = tree_attention_sdpa(c["q"][idx], kp, vp, c["k_tree"][idx], c["v_tree"][idx], chain)
    return out


def masked(c: dict, mask: torch.Tensor) -> torch.Tensor:
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    return tree_attention_sdpa(c["q"], kp, vp, c["k_tree"], c["v_tree"], mask)


def slot_layer(c: dict, seed: int = 0) -> dict:
    """The same prefix K/V as one layer of the engine's pool sees it: one-token slots in a flat
    `[slots, KVH, D]` array, the prefix's slots scattered (a KV tree's free list)."""
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    L, n = kp.shape[0], kp.shape[0] + 64
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:L]
    kf, vf = torch.randn(n, *kp.shape[1:]), torch.randn(n, *vp.shape[1:])
    kf[slots], vf[slots] = kp, vp
    return dict(kf=kf, vf=vf, slots=slots)


class LayerShape:
    """What `AttnMeta` reads from a model: device, dtype, heads."""
    device, dtype = torch.device("cpu"), torch.float32

    def __init__(self, heads: int, kv_heads: int):
        self.num_heads, self.kv_heads = heads, kv_heads


def engine_meta(shape: LayerShape, e: dict, mask: torch.Tensor, path: str) -> AttnMeta:
    """The engine's metadata for this tree, its path forced to `path` ("masked" / "cascade")
    by moving the SHORT_PREFIX and SHORT_TREE cuts for the duration of the build."""
    saved = attention.SHORT_PREFIX, attention.SHORT_TREE
    cut = 1 << 30 if path == attention.MASKED else 0
    attention.SHORT_PREFIX = attention.SHORT_TREE = cut
    try:
        meta = AttnMeta.tree(shape, e["slots"], mask)
    finally:
        attention.SHORT_PREFIX, attention.SHORT_TREE = saved
    assert meta.path == path, (meta.path, path)
    return meta


def break_even(rows: list[dict]) -> dict[int, int | None]:
    """Per tree size: the shortest measured prefix from which the cascade beats the bmm path at
    that prefix and every longer one (None: the bmm path wins everywhere measured)."""
    out = {}
    for T in sorted({r["tree_size"] for r in rows}):
        rs = sorted((r for r in rows if r["tree_size"] == T), key=lambda r: r["prefix_len"])
        out[T] = next((r["prefix_len"] for i, r in enumerate(rs)
                       if all(x["cascade_ms"] < x["bmm_ms"] for x in rs[i:])), None)
    return out


def engine_path(T: int, L: int) -> str:
    """Which attention `Model.forward` runs on a CPU for a draft tree of T tokens over L."""
    return attention.pick_path(T, L, gpu=False, causal=False, per_query=False, plain_write=True)


def time_ms(fns: dict, min_rounds: int = 7, min_s: float = 1.0) -> dict[str, float]:
    """Best wall time (ms) of each fn, called round-robin (one call of each per round) for
    >= min_rounds rounds and >= min_s seconds after a warm-up round. The CPUs are shared with
    other jobs: round-robin spreads the disturbance evenly, the minimum is the calmest call."""
    best = {name: float("inf") for name in fns}
    for fn in fns.values():
        fn()
    rounds, start = 0, time.perf_counter()
    while rounds < min_rounds or time.perf_counter() - start < min_s:
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], (time.perf_counter() - t0) * 1e3)
        rounds += 1
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: stable on a shared box)")
    ap.add_argument("--trees", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64],
                    help="tree sizes >= 2 (one token is a decode step, its own path)")
    ap.add_argument("--prefixes", type=int, nargs="+",
                    default=[64, 128, 256, 384, 512, 768, 1024, 2048])
    ap.add_argument("--min-s", type=float, default=1.0, help="seconds of timing per cell")
    args = ap.parse_args(argv)
    if min(args.trees) < 2 or min(args.prefixes) < 1:
        from specfork.errors import SpecforkError
        raise SpecforkError("--trees must be >= 2 and --prefixes >= 1")
    torch.set_num_threads(args.threads)
    host = machine()
    shape = dict(heads=9, kv_heads=3, head_dim=64, block_size=16, dtype=torch.float32)
    scale = shape["head_dim"] ** -0.5
    ls = LayerShape(shape["heads"], shape["kv_heads"])

    rows = []
    print(f"{'T':>4} {'prefix':>6} {'path':>7} {'bmm ms':>7} {'cascade':>7} {'tree ms':>8} "
          f"{'masked':>7} {'per-path':>8} {'cascade/bmm':>11}")
    for L in args.prefixes:
        for T in args.trees:
            parents = layered_tree(T)
            paths, mask = root_paths(parents), ancestor_mask(parents)
            c = make_layer(T, L, **shape)
            e = slot_layer(c)
            mb = engine_meta(ls, e, mask, attention.MASKED)
            mc = engine_meta(ls, e, mask, attention.CASCADE)
            args_ = (c["q"], c["k_tree"], c["v_tree"], e["kf"], e["vf"], scale)
            ref = per_path(c, paths)
            err = max((f() - ref).abs().max().item() for f in (
                lambda: tree_attention(**c, tree_mask=mask),
                lambda: mb.attend(*args_), lambda: mc.attend(*args_)))
            assert err < 1e-4, f"tree attention vs per-path mismatch {err}"
            t = time_ms({
                "bmm_ms": lambda: mb.attend(*args_),
                "cascade_ms": lambda: mc.attend(*args_),
                "bmm_meta_ms": lambda: engine_meta(ls, e, mask, attention.MASKED),
                "cascade_meta_ms": lambda: engine_meta(ls, e, mask, attention.CASCADE),
                "tree_ms": lambda: tree_attention(**c, tree_mask=mask),
                "masked_sdpa_ms": lambda: masked(c, mask),
                "per_path_ms": lambda: per_path(c, paths)}, min_s=args.min_s)
            t["bmm_ms"] += t["bmm_meta_ms"] / LAYERS          # its share of the per-forward meta
            t["cascade_ms"] += t["cascade_meta_ms"] / LAYERS
            r = dict(tree_size=T, prefix_len=L, leaves=len(paths), depth=max(map(len, paths)),
                     engine_path=engine_path(T, L), max_abs_diff=err, **t)
            r["cascade_over_bmm"] = r["cascade_ms"] / r["bmm_ms"]
            r["speedup_vs_per_path"] = r["per_path_ms"] / r["tree_ms"]
            r["speedup_vs_masked"] = r["masked_sdpa_ms"] / r["tree_ms"]
            rows.append(r)
            print(f"{T:>4} {L:>6} {r['engine_path']:>7} {r['bmm_ms']:>7.3f} "
                  f"{r['cascade_ms']:>7.3f} {r['tree_ms']:>8.3f} {r['masked_sdpa_ms']:>7.3f} "
                  f"{r['per_path_ms']:>8.3f} {r['cascade_over_bmm']:>10.2f}x", flush=True)
    even = break_even(rows)
    print("cascade faster than bmm from prefix (per tree size):", even,
          f"SHORT_PREFIX = {SHORT_PREFIX}")
    if args.json:
        meta = dict(shape, dtype="float32", model="SmolLM2-135M layer", layers=LAYERS,
                    threads=args.threads, short_prefix=SHORT_PREFIX, short_tree=SHORT_TREE,
                    tree="layered, widths 1,2,4,... capped at 16, seed 0",
                    timing=f"min ms, methods called round-robin, >= 7 rounds and >= "
                           f"{args.min_s:g} s, after a warm-up")
        with open(args.json, "w") as f:
            json.dump(dict(command=command("bench_tree_attention", argv), machine=host,
                           config=meta, break_even_prefix=even, results=rows), f, indent=1)


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("bench_tree_attention", main))
