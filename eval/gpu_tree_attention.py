"""The GPU check, one command (< 5 min on one GPU): Triton tree attention on CUDA
  1. correctness against the torch path in fp32 over shapes, dtypes, pages, trees, splits;
  2. timing on a Llama-3-8B layer (32 heads, 8 KV heads, head_dim 128, bf16, 16-token pages),
     prefix {512, 2048, 8192} x tree {16, 64, 128}: the Triton kernel (pages read in place)
     vs masked SDPA over an already gathered prefix, vs gather + SDPA (the torch path), and
     a dense prefix-only flash SDPA as a floor;
  3. a prefix-split sweep (L=8192, T=16), to check the split heuristic;
  4. prefill as `Model.forward` runs it on CUDA (`specfork/attention.py`): the paths `AttnMeta`
     picks there, then on a Llama-3-8B layer over an empty prefix fused causal SDPA
     (`causal_attention`) and over a prefix the Triton kernel on one-token pages with the
     prefix slots as block table, each against the 3-D masked SDPA prefill used to take (error,
     time, peak memory above the inputs: the old path holds T x (L+T) scores per head).
  5. TurboQuant pages (`--kv-cache turbo*`, `specfork/kv_quant.py`): the prefix kernel decoding
     uint8 code rows itself, against the torch path over the same rows decoded by the codec,
     and its time against the same kernel over bf16 pages (prefix {2048, 8192}, tree 16).
Exits 1 if a correctness case fails (after writing the JSON), 2 without CUDA or Triton.

    python eval/gpu_tree_attention.py --json $OUT/tree_attention_gpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import torch
import torch.nn.functional as F

if importlib.util.find_spec("specfork") is None:
    # A checkout that is not pip-installed (the GPU machine): the package is importable from its root.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_tree_attention import layered_tree, make_layer   # noqa: E402  (eval/ is on sys.path)
from specfork.attention import AttnMeta, causal_mask  # noqa: E402
from specfork.kernels.dense_attention import causal_attention  # noqa: E402
from specfork.kernels.tree_attention import (ancestor_mask, gather_prefix,  # noqa: E402
                                             tree_attention, tree_attention_sdpa)

DEVICE = "cuda"
TOL = {torch.float32: 2e-3, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}   # vs fp32, |err|/(1+|ref|)


def torch_reference(c: dict) -> torch.Tensor:
    """The torch path on CUDA (gather + masked SDPA), in fp32."""
    f = lambda t: t.float()
    kp = gather_prefix(c["k_cache"], c["block_table"], c["prefix_len"])
    vp = gather_prefix(c["v_cache"], c["block_table"], c["prefix_len"])
    return tree_attention_sdpa(f(c["q"]), f(kp), f(vp), f(c["k_tree"]), f(c["v_tree"]), c["tree_mask"])


def correctness(tta) -> list[dict]:
    rows = []
    cases = [  # (T, prefix_len, heads, kv_heads, head_dim, block_size, dtype, num_splits)
        (1, 0, 32, 8, 128, 16, torch.bfloat16, None),
        (1, 4093, 32, 8, 128, 16, torch.bfloat16, None),
        (13, 0, 9, 3, 64, 16, torch.float32, None),
        (13, 37, 9, 3, 64, 32, torch.float32, None),
        (24, 1000, 12, 3, 64, 16, torch.float16, 3),
        (64, 2049, 8, 8, 128, 32, torch.bfloat16, None),
        (128, 8189, 32, 8, 128, 16, torch.bfloat16, None),
        (128, 8189, 32, 8, 128, 16, torch.bfloat16, 1),
        (128, 300, 16, 4, 128, 32, torch.float16, 7),
        (77, 511, 32, 8, 64, 16, torch.float32, 5),
    ]
    for T, L, H, KVH, D, bs, dtype, splits in cases:
        parents = layered_tree(T, seed=T + L)
        c = make_layer(T, L, H, KVH, D, bs, dtype, device=DEVICE, seed=L)
        c["tree_mask"] = ancestor_mask(parents, device=DEVICE)
        ref = torch_reference(c)
        out = tta.tree_attention_triton(**c, num_splits=splits)
        err = ((out.float() - ref).abs() / (1 + ref.abs())).max().item()
        rows.append(dict(tree_size=T, prefix_len=L, heads=H, kv_heads=KVH, head_dim=D,
                         block_size=bs, dtype=str(dtype).removeprefix("torch."), num_splits=splits,
                         err=err, ok=bool(err <= TOL[dtype] and out.dtype == dtype)))
        print(f"correct T={T:>3} L={L:>4} H={H}/{KVH} D={D} bs={bs} {rows[-1]['dtype']:>8} "
              f"splits={splits}: err {err:.2e} {'ok' if rows[-1]['ok'] else 'FAIL'}")
    return rows


def dispatches_to_triton(tta) -> bool:
    """tree_attention() on CUDA tensors must go through tree_attention_triton."""
    calls, real = [], tta.tree_attention_triton
    tta.tree_attention_triton = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        c = make_layer(4, 40, 32, 8, 128, 16, torch.bfloat16, device=DEVICE)
        tree_attention(**c, tree_mask=ancestor_mask([-1, 0, 0, 1], device=DEVICE))
    finally:
        tta.tree_attention_triton = real
    return bool(calls)


def timing(tta, bench) -> tuple[list[dict], list[dict]]:
    H, KVH, D, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    rows, sweep = [], []
    for L in (512, 2048, 8192):
        for T in (16, 64, 128):
            c = make_layer(T, L, H, KVH, D, bs, dtype, device=DEVICE)
            c["tree_mask"] = mask = ancestor_mask(layered_tree(T), device=DEVICE)
            kp = gather_prefix(c["k_cache"], c["block_table"], L)
            vp = gather_prefix(c["v_cache"], c["block_table"], L)
            args = (c["q"], kp, vp, c["k_tree"], c["v_tree"], mask)
            qd, kd, vd = c["q"].transpose(0, 1)[None], kp.transpose(0, 1)[None], vp.transpose(0, 1)[None]
            err = (tree_attention(**c).float() - torch_reference(c)).abs().max().item()
            r = dict(prefix_len=L, tree_size=T, max_abs_err=err,
                     triton_ms=bench(lambda: tree_attention(**c)),
                     sdpa_gathered_ms=bench(lambda: tree_attention_sdpa(*args)),
                     gather_sdpa_ms=bench(lambda: tree_attention_sdpa(
                         c["q"], gather_prefix(c["k_cache"], c["block_table"], L),
                         gather_prefix(c["v_cache"], c["block_table"], L), *args[3:])),
                     dense_prefix_flash_ms=bench(lambda: F.scaled_dot_product_attention(
                         qd, kd, vd, enable_gqa=True)))
            kv_bytes = 2 * L * KVH * D * 2
            r["triton_prefix_GBps"] = kv_bytes / r["triton_ms"] / 1e6
            r["speedup_vs_sdpa_gathered"] = r["sdpa_gathered_ms"] / r["triton_ms"]
            rows.append(r)
            print(f"time L={L:>4} T={T:>3}: triton {r['triton_ms']:.3f} ms, sdpa(gathered) "
                  f"{r['sdpa_gathered_ms']:.3f}, gather+sdpa {r['gather_sdpa_ms']:.3f}, dense flash "
                  f"{r['dense_prefix_flash_ms']:.3f}; {r['triton_prefix_GBps']:.0f} GB/s, err {err:.1e}")
    c = make_layer(16, 8192, H, KVH, D, bs, dtype, device=DEVICE)
    c["tree_mask"] = ancestor_mask(layered_tree(16), device=DEVICE)
    for splits in (1, 2, 4, 8, 16, 32, 64, None):
        ms = bench(lambda: tta.tree_attention_triton(**c, num_splits=splits))
        sweep.append(dict(prefix_len=8192, tree_size=16, num_splits=splits or "auto", triton_ms=ms))
        print(f"splits {splits or 'auto':>4}: {ms:.3f} ms")
    return rows, sweep


def meta_paths() -> dict:
    """The path `AttnMeta` picks on this device for prefill (empty prefix, over a prefix), a
    decode step and a verify tree, and that its indices live on the device (int32 table)."""
    model = argparse.Namespace(device=torch.device(DEVICE, torch.cuda.current_device())
                               if DEVICE == "cuda" else torch.device(DEVICE),
                               dtype=torch.bfloat16, num_heads=32, kv_heads=8)
    pre, new = torch.arange(40), torch.arange(40, 49)
    metas = dict(prefill=AttnMeta.prefill(model, pre[:0], new),
                 prefill_over_prefix=AttnMeta.prefill(model, pre, new),
                 decode=AttnMeta.prefill(model, pre, new[:1]),
                 verify=AttnMeta.tree(model, pre, ancestor_mask([-1, 0, 0, 1]), new[:4]))
    got = {k: m.path for k, m in metas.items()}
    want = dict(prefill="causal", prefill_over_prefix="paged", decode="decode", verify="paged")
    on_device = all(m.read.device == model.device and (m.table is None or (
        m.table.dtype == torch.int32 and m.table.device == model.device)) for m in metas.values())
    return dict(paths=got, ok=got == want and on_device)


def _peak_mib(fn) -> float:
    """CUDA memory `fn` allocates at its peak beyond what was allocated before, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def prefill_paths(bench, shapes=((0, 1024), (0, 4096), (2048, 512), (4096, 2048)),
                  H=32, KVH=8, D=128, dtype=torch.bfloat16) -> list[dict]:
    """Prefill attention of one layer as the engine runs it now vs the 3-D masked SDPA it ran
    before (both against that old path in fp32); `shapes`: (prefix L, new tokens T)."""
    rows = []
    for L, T in shapes:
        g = torch.Generator(device=DEVICE).manual_seed(T + L)
        r = lambda *s: torch.randn(*s, generator=g, device=DEVICE).to(dtype)
        q, k, v = r(T, H, D), r(T, KVH, D), r(T, KVH, D)
        k_pool, v_pool = r(L + 64, 1, KVH, D), r(L + 64, 1, KVH, D)     # one-token pages
        slots = torch.randperm(L + 64, generator=g, device=DEVICE)[:L]
        kp, vp = k_pool[slots, 0], v_pool[slots, 0]
        mask, scale = causal_mask(T, DEVICE), D ** -0.5
        if L == 0:
            new = lambda: causal_attention(q, k, v, scale)
        else:
            table = slots.to(torch.int32)
            new = lambda: tree_attention(q, k_pool, v_pool, table, L, k, v, mask, scale)
        old = lambda: tree_attention_sdpa(q, kp, vp, k, v, mask, scale)
        f = lambda t: t.float()
        ref = tree_attention_sdpa(f(q), f(kp), f(vp), f(k), f(v), mask, scale)
        row = dict(prefix_len=L, new_tokens=T, path="causal" if L == 0 else "paged")
        for name, fn in (("new", new), ("old", old)):
            out = fn()
            row[f"{name}_err"] = ((out.float() - ref).abs() / (1 + ref.abs())).max().item()
            del out
            row[f"{name}_peak_MiB"] = _peak_mib(fn) if q.is_cuda else float("nan")
            row[f"{name}_ms"] = bench(fn)
        row["ok"] = bool(row["new_err"] <= TOL[dtype])
        rows.append(row)
        print(f"prefill L={L:>4} T={T:>4} ({row['path']}): {row['new_ms']:.3f} ms, peak "
              f"{row['new_peak_MiB']:.0f} MiB, err {row['new_err']:.1e} | old 3-D SDPA "
              f"{row['old_ms']:.3f} ms, peak {row['old_peak_MiB']:.0f} MiB "
              f"{'ok' if row['ok'] else 'FAIL'}")
    return rows


def turbo_pages(tta, bench=None, device: str = DEVICE, shapes=((2048, 16), (8192, 16)),
                H: int = 32, KVH: int = 8, D: int = 128, dtype=torch.bfloat16,
                formats=("turbo4", "turbo3.5", "turbo2.5")) -> list[dict]:
    """The prefix kernel over TurboQuant pages (one-token pages, scattered block table) vs
    the torch path over the codec's own decode of the same rows; with `bench`, its time vs
    the kernel over bf16 pages of the same keys."""
    from specfork.kv_quant import TurboCodec, parse_kv_format
    rows = []
    for L, T in shapes:
        g = torch.Generator().manual_seed(L + T)
        k, v = (torch.randn(L, KVH, D, generator=g) * 2 + 0.5).to(device), \
            torch.randn(L, KVH, D, generator=g).to(device)
        q = torch.randn(T, H, D, generator=g).to(device, dtype)
        kt, vt = (torch.randn(T, KVH, D, generator=g).to(device, dtype) for _ in range(2))
        mask = ancestor_mask(layered_tree(T), device=device)
        table = torch.randperm(L, generator=g).to(device, torch.int32)
        for fmt in formats:
            _, rate, _ = parse_kv_format(fmt)
            kc, vc = (TurboCodec(D, rate, seed, dtype=torch.float32, device=device)
                      for seed in (1, 2))
            kr, vr = torch.empty(L, KVH, kc.nbytes, dtype=torch.uint8, device=device), \
                torch.empty(L, KVH, vc.nbytes, dtype=torch.uint8, device=device)
            kr[table.long()], vr[table.long()] = kc.encode(k), vc.encode(v)   # slot = table[i]
            pages = lambda t: t.view(L, 1, KVH, -1)
            codes = kc.kernel_layout() + vc.kernel_layout()
            out = tta.tree_attention_triton(q, pages(kr), pages(vr), table, L, kt, vt, mask,
                                            codes=codes)
            ref = tree_attention_sdpa(q.float(), kc.decode(kr[table.long()]),
                                      vc.decode(vr[table.long()]), kt.float(), vt.float(), mask)
            err = ((out.float() - ref).abs() / (1 + ref.abs())).max().item()
            r = dict(prefix_len=L, tree_size=T, format=fmt, bytes_per_vector=kc.nbytes,
                     err=err, ok=bool(err <= TOL[dtype]))
            if bench is not None:
                kb, vb = (pages(x.to(dtype)) for x in (k, v))
                r["codes_ms"] = bench(lambda: tta.tree_attention_triton(
                    q, pages(kr), pages(vr), table, L, kt, vt, mask, codes=codes))
                r["bf16_pages_ms"] = bench(lambda: tta.tree_attention_triton(
                    q, kb, vb, table, L, kt, vt, mask))
            rows.append(r)
            print(f"turbo pages L={L} T={T} {fmt}: err {err:.2e} {'ok' if r['ok'] else 'FAIL'}"
                  + (f", {r['codes_ms']:.3f} ms vs bf16 pages {r['bf16_pages_ms']:.3f} ms"
                     if bench is not None else ""))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="write the results here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_tree_attention: no CUDA device (torch.cuda.is_available() is False); "
              "this script only runs on a GPU machine", file=sys.stderr)
        sys.exit(2)
    if importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_tree_attention: needs triton installed and TRITON_INTERPRET unset", file=sys.stderr)
        sys.exit(2)
    import triton
    import triton.testing

    import specfork.kernels.triton_tree_attention as tta
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                  triton=triton.__version__, layer="Llama-3-8B: 32 heads, 8 KV heads, "
                  "head_dim 128, bf16, 16-token pages", tree="layered (eval/bench_tree_attention.py)")
    result["correctness"] = correctness(tta)
    result["dispatches_to_triton"] = dispatches_to_triton(tta)
    result["timing"], result["split_sweep"] = timing(tta, bench)
    result["meta_paths"] = meta_paths()
    result["prefill"] = prefill_paths(bench)
    result["turbo_pages"] = turbo_pages(tta, bench)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    ok = (all(r["ok"] for r in result["correctness"] + result["prefill"]
              + result["turbo_pages"])
          and result["dispatches_to_triton"] and result["meta_paths"]["ok"])
    print("all correct" if ok else "CORRECTNESS FAILURES", "->", args.json)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("gpu_tree_attention", main))
