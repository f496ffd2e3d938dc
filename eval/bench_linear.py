"""Why `specfork.model.Linear` packs weights: one forward's matmuls (every layer's q|k|v, o,
gate|up, down, then the lm_head) at the embedded target's shapes, for 1..32 rows (decode is 1
row, beam search W rows, tree verification one per tree token): F.linear against weights
pre-packed for oneDNN, for MKL's packed sgemm, and, where the compiled ops have the AVX-512
kernel, in specfork's float32 panels (`kernels/panel_linear.cpp`, what specfork uses there).

    python eval/bench_linear.py --threads 2 --json results/linear_cpu.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from provenance import command, machine


def shapes(cfg) -> list[tuple[int, int]]:
    """(out, in) of the matmuls in one forward, in order."""
    d = cfg.hidden_size
    hd = getattr(cfg, "head_dim", None) or d // cfg.num_attention_heads
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd
    layer = [(qkv, d), (cfg.num_attention_heads * hd, d), (2 * cfg.intermediate_size, d),
             (d, cfg.intermediate_size)]
    return layer * cfg.num_hidden_layers + [(cfg.vocab_size, d)]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--rows", default="1,2,4,8,16,32")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from transformers import AutoConfig
    from specfork.loader import resolve
    cfg = AutoConfig.from_pretrained(resolve(a.target))
    gen = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=gen) * 0.02 for o, i in shapes(cfg)]
    from specfork.model import PACK_ROWS
    dnn = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS) for w in ws]
    from specfork.model import panel_fits
    pan = [torch.ops.specfork.panel_pack(w) for w in ws] if all(map(panel_fits, ws)) else None
    out = {"command": command("bench_linear", argv), "machine": machine(), "target": a.target,
           "threads": torch.get_num_threads(), "reps": a.reps,
           "timing": "median ms of one forward's matmuls, methods interleaved", "rows": {}}
    for m in [int(r) for r in a.rows.split(",")]:
        xs = [torch.randn(m, w.shape[1], generator=gen) for w in ws]
        mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]

        def plain():
            for x, w in zip(xs, ws):
                F.linear(x, w)

        def onednn():
            for x, w in zip(xs, dnn):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        def mkl_packed():
            for x, w, pw in zip(xs, ws, mkl):
                torch.ops.mkl._mkl_linear(x, pw, w, None, m)

        def panels():
            for x, w in zip(xs, pan):
                torch.ops.specfork.panel_linear(x, w, None, None)

        fns = {"F.linear": plain, "onednn_packed": onednn, "mkl_packed": mkl_packed}
        if pan is not None:
            fns["panels"] = panels
        err = max((torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                   - F.linear(x, w0)).abs().max().item() for x, w, w0 in zip(xs, dnn, ws))
        t = {k: [] for k in fns}
        for _ in range(a.reps):                       # interleaved: drift hits all alike
            for name, f in fns.items():
                t0 = time.perf_counter()
                f()
                t[name].append(time.perf_counter() - t0)
        med = {k: statistics.median(v) * 1e3 for k, v in t.items()}
        out["rows"][m] = {**{f"{k}_ms": round(v, 2) for k, v in med.items()},
                          "onednn_speedup": round(med["F.linear"] / med["onednn_packed"], 3),
                          "onednn_max_abs_diff": err}
        if pan is not None:
            out["rows"][m]["panels_vs_best_torch"] = round(
                min(med["F.linear"], med["onednn_packed"]) / med["panels"], 3)
        print(f"rows {m:3d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in med.items()),
              flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("bench_linear", main))
