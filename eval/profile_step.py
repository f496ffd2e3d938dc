"""Where a decode step's time goes, per weight format: matmuls (and the GB/s they reach on the
weight bytes), attention, norms, RoPE, KV writes and gathers, casts, everything else, the host
time outside any op (Python, dispatch), and the step against its bandwidth limit (every byte it
reads over the read bandwidth measured here).

    python eval/profile_step.py --threads 2 --json results/step_profile.json

One chat prompt from no benchmark, `--tokens` plain greedy tokens; the decode steps after the
first token run under torch.profiler, each op's self CPU time summed into a category, per step;
"outside ops" is the step's wall time left over (the profiler's own overhead included, so the
step is a little slower than unprofiled).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import command as command_line, machine  # noqa: E402
from bench_cpu import (FORMATS, parse_formats, read_bandwidth, step_bytes,  # noqa: E402
                       weight_bytes)

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
CATEGORIES = [   # (category, substrings of the op name), first match wins
    ("matmul", ("_weight_int8pack_mm", "_weight_int4pack_mm", "specfork::lowbit_linear",
                "_linear_pointwise", "aten::mm",
                "aten::addmm", "aten::linear")),
    ("attention", ("aten::bmm", "aten::baddbmm", "softmax", "scaled_dot_product",
                   "_flash_attention", "specfork::slot_attention")),
    ("norms", ("rms_norm", "aten::pow", "aten::mean", "aten::rsqrt")),
    ("rope", ("aten::flip", "aten::addcmul")),
    ("kv write / gather", ("index_copy", "index_select")),
    ("casts / copies", ("aten::to", "_to_copy", "aten::copy_", "aten::cat")),
    ("layer loop (compiled)", ("specfork::layer_stack",)),   # its own time between its calls
]


def category(name: str) -> str:
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other ops"


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command

    def go():
        fmts = parse_formats(a.formats)
        if a.tokens < 2 or (a.threads is not None and a.threads <= 0):
            raise SpecforkError("--tokens must be >= 2 and --threads positive")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, fmts, command_line("profile_step", argv))
    return run_command("profile_step", go)


def _run(a, fmts, command) -> int:
    from torch.profiler import ProfilerActivity, profile
    from specfork.decoder import SpecDecoder
    from specfork.loader import load_hf
    from specfork.model import Model
    host = machine()
    bw = read_bandwidth(1024)
    hf, tok = load_hf("smollm2-135m")
    out = {"command": command, "machine": host, "read_bandwidth_gb_s": round(bw / 1e9, 1),
           "tokens": a.tokens, "formats": {}}
    for fmt in fmts:
        m = Model(hf, weights=fmt)
        dec = SpecDecoder(m, tok)
        ids = dec.encode(PROMPT)
        dec.generate(ids, max_new_tokens=8)
        prof = profile(activities=[ProfilerActivity.CPU])
        t0 = []

        def first(new):                           # profile from the first decode step on
            if not t0:
                prof.start()
                t0.append(time.perf_counter())
        with torch.inference_mode():
            r = dec.generate(ids, max_new_tokens=a.tokens, on_tokens=first)
        wall = time.perf_counter() - t0[0]
        prof.stop()
        steps = max(1, len(r.token_ids) - 1)
        ms = {}
        for e in prof.key_averages():
            c = category(e.key)
            ms[c] = ms.get(c, 0.0) + e.self_cpu_time_total / 1e3
        per = {c: round(v / steps, 3) for c, v in sorted(ms.items(), key=lambda x: -x[1])}
        step = wall * 1e3 / steps
        per["outside ops"] = round(step - sum(per.values()), 3)
        limit_ms = step_bytes(m, len(ids) + steps // 2) / bw * 1e3
        wbytes = weight_bytes(m)
        out["formats"][fmt] = {"step_ms": round(step, 3), "tok_s": round(1e3 / step, 1),
                               "breakdown_ms": per,
                               "bandwidth_limit_ms": round(limit_ms, 3),
                               "of_limit": round(limit_ms / step, 3),
                               "weights_mib": round(wbytes / 2 ** 20, 1),
                               "matmul_gb_s": round(wbytes / per.get("matmul", 1e-9) / 1e6, 1)}
        print(fmt, json.dumps(out["formats"][fmt]), file=sys.stderr, flush=True)
    text = json.dumps(out, indent=1)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
