"""What a verify tree's attention costs beside a decode step's, over long prefixes: the compiled
CPU slot op (`specfork/kernels/slot_attention.cpp`) alone, on the embedded target's shape.

    python eval/bench_slot_attention.py --threads 2     # -> results/slot_attention.{json,md}

Per prefix length and row count: one forward's attention (one op call per layer, 30 layers),
R query rows over one shared prefix each followed by its own chain of ancestors (a verify
tree), as the engine calls it, from a float16 or float32 pool of random K/V. Reported: the
median time, the cost of each row past the first, and the time against one row (a decode step).
Rows over a shared prefix read it once per 512-key chunk, but each still does its own
arithmetic: the FMA count, and so a floor on time, grows with the rows.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine, write_results  # noqa: E402

LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64          # SmolLM2-135M


def time_call(k, v, n: int, rows: int, reps: int) -> float:
    """Median seconds of one forward's attention: `rows` tree rows over an n-key prefix."""
    idx = torch.arange(n + rows)
    offs = torch.tensor([[0, n, n, n + r + 1] for r in range(rows)])
    q = torch.randn(rows, HEADS, HEAD_DIM)
    op = torch.ops.specfork.slot_attention
    walls = []
    for i in range(reps + 2):                              # two warm-ups
        t = time.perf_counter()
        for layer in range(LAYERS):
            op(q, k[layer], v[layer], idx, offs, HEAD_DIM ** -0.5)
        if i >= 2:
            walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", default="300,1000,3000,8000")
    p.add_argument("--rows", default="1,2,4,8,16")
    p.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="results/slot_attention", help="path stem of .json/.md")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command

    def go():
        try:
            prefixes = [int(x) for x in a.prefixes.split(",")]
            rows = [int(x) for x in a.rows.split(",")]
        except ValueError:
            raise SpecforkError("--prefixes and --rows take comma-separated integers") from None
        if min(prefixes + rows + [a.reps]) <= 0 or 1 not in rows:
            raise SpecforkError("--prefixes, --rows and --reps must be positive; --rows "
                                "includes 1")
        from specfork.kernels import slot_attention as slot_op
        if not slot_op.available(HEAD_DIM):
            raise SpecforkError("the compiled slot op is not available on this machine")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, prefixes, sorted(set(rows)), command_line("bench_slot_attention", argv))
    return run_command("bench_slot_attention", go)


def _run(a, prefixes: list[int], rows: list[int], command: str) -> int:
    host = machine()
    dt = getattr(torch, a.dtype)
    gen = torch.Generator().manual_seed(0)
    S = max(prefixes) + max(rows) + 1
    k = [torch.randn(S, KV_HEADS, HEAD_DIM, generator=gen).to(dt) for _ in range(LAYERS)]
    v = [torch.randn(S, KV_HEADS, HEAD_DIM, generator=gen).to(dt) for _ in range(LAYERS)]
    cells = []
    with torch.inference_mode():
        for n in prefixes:
            one = time_call(k, v, n, 1, a.reps)
            for r in rows:
                t = one if r == 1 else time_call(k, v, n, r, a.reps)
                cells.append({"prefix": n, "rows": r, "ms": round(t * 1e3, 3),
                              "vs_one_row": round(t / one, 3),
                              "ms_per_extra_row": (round((t - one) * 1e3 / (r - 1), 3)
                                                   if r > 1 else None)})
                print(f"prefix {n:>5} rows {r:>2}: {t * 1e3:8.2f} ms ({t / one:.2f}x one row)",
                      file=sys.stderr, flush=True)
    res = {"command": command, "machine": host,
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "config": {"layers": LAYERS, "heads": HEADS, "kv_heads": KV_HEADS,
                      "head_dim": HEAD_DIM, "pool_dtype": a.dtype, "reps": a.reps},
           "cells": cells}
    write_results(a.out, res, markdown)
    return 0


def markdown(res: dict) -> str:
    c = res["config"]
    rows = sorted({x["rows"] for x in res["cells"]})
    lines = ["# Slot attention: a verify tree's rows beside a decode step's one\n",
             f"`{res['command']}` on {res['machine']['cpu']} "
             f"({res['machine']['torch_threads']} threads), {res['date']}; one forward's "
             f"attention ({c['layers']} calls, {c['heads']} heads, {c['kv_heads']} kv heads, "
             f"head_dim {c['head_dim']}, {c['pool_dtype']} pool), rows over one shared prefix "
             f"each followed by its own ancestors; median of {c['reps']}.\n",
             "| prefix | " + " | ".join(f"{r} row{'s' if r > 1 else ''}" for r in rows) + " |",
             "|---|" + "---|" * len(rows)]
    for n in sorted({x["prefix"] for x in res["cells"]}):
        got = {x["rows"]: x for x in res["cells"] if x["prefix"] == n}
        lines.append(f"| {n} | " + " | ".join(
            f"{got[r]['ms']:.2f} ms" + (f" ({got[r]['vs_one_row']:.2f}x)" if r > 1 else "")
            for r in rows) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    raise SystemExit(main())
