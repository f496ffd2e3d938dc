"""Beam search on the KV tree vs sequential greedy vs naive beams vs HF: peak KV bytes, speed,
and HF parity on MT-bench prompts. Everything reported is measured from the pool or a clock.

    python eval/bench_beam.py --prompts 16 --threads 2 --out results/beam_memory.json

Memory: `pool.peak_bytes` over the whole request (prefill included), greedy from
`SpecDecoder.generate`, at the default block size (one token: the peak is the number of
distinct tokens the live beams hold, the floor for any exact beam search) and again at 16-token
blocks (greedy and beams alike), where every beam also pays its partial tail block.
The floor is also measured on HF: a logits processor reads the beams HF forwards at each step
(`hf_floor_tokens`), so "ours holds no more than it must" is checked on the peer's trajectory.
Speed: greedy and beam runs interleaved, median over repetitions, wall clock and process CPU
time (the CPU is shared; CPU time shows the work, wall time what a user waits).
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def hf_beam(hf, ids, W, n):
    """HF's best sequence, its score, and the most distinct generated tokens its live beams held."""
    from transformers import LogitsProcessorList

    from specfork.search import LiveTokenPeak
    live = LiveTokenPeak(len(ids))
    with torch.no_grad():
        o = hf.generate(torch.tensor([ids]), num_beams=W, do_sample=False, max_new_tokens=n,
                        return_dict_in_generate=True, output_scores=True,
                        logits_processor=LogitsProcessorList([live]))
    return o.sequences[0, len(ids):].tolist(), float(o.sequences_scores[0]), live.peak


def memory_and_parity(dec, dec16, hf, prompts, widths, n, parity):
    from specfork.search import beam_search
    rows = []
    for p in prompts:
        ids = dec.encode(p["text"])
        g = dec.generate(ids, max_new_tokens=n).stats["kv_peak_bytes"]
        g16 = dec16.generate(ids, max_new_tokens=n).stats["kv_peak_bytes"]
        for W in widths:
            fork = beam_search(dec.engine, ids, num_beams=W, max_new_tokens=n)
            naive = beam_search(dec.engine, ids, num_beams=W, max_new_tokens=n, naive=True)
            b16 = beam_search(dec16.engine, ids, num_beams=W, max_new_tokens=n)
            row = {"prompt": p["id"], "prompt_tokens": len(ids), "num_beams": W,
                   "new_tokens": fork.stats["new_tokens"],
                   "greedy_peak_bytes": g, "fork_peak_bytes": fork.stats["kv_peak_bytes"],
                   "naive_peak_bytes": naive.stats["kv_peak_bytes"],
                   "fork_ratio": fork.stats["kv_peak_bytes"] / g,
                   "naive_ratio": naive.stats["kv_peak_bytes"] / g,
                   "greedy_tokens": g // dec.pool.block_bytes * dec.pool.block_size,
                   "fork_tokens": fork.stats["kv_peak_bytes"] // dec.pool.block_bytes
                   * dec.pool.block_size,
                   "block16_ratio": b16.stats["kv_peak_bytes"] / g16,
                   "forks": fork.stats["forks"],
                   "leaked_blocks": fork.stats["kv_blocks_leaked"] + naive.stats["kv_blocks_leaked"],
                   "naive_same_tokens": naive.token_ids == fork.token_ids,
                   "block16_same_tokens": b16.token_ids == fork.token_ids}
            if parity:
                h, hs, live = hf_beam(hf, ids, W, n)
                row.update(hf_equal=h == fork.token_ids, score=fork.stats["score"], hf_score=hs,
                           hf_floor_tokens=len(ids) + live,
                           hf_floor_ratio=(len(ids) + live) / row["greedy_tokens"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def width_summary(rows: list[dict]) -> dict:
    """Per-width memory summary; the total ratio weighs prompts by their greedy bytes."""
    med = statistics.median
    out = {"fork_ratio_median": med(r["fork_ratio"] for r in rows),
           "fork_ratio_max": max(r["fork_ratio"] for r in rows),
           "fork_ratio_total": sum(r["fork_peak_bytes"] for r in rows)
           / sum(r["greedy_peak_bytes"] for r in rows),
           "naive_ratio_median": med(r["naive_ratio"] for r in rows),
           "fork_within_1.15": sum(r["fork_ratio"] <= 1.15 for r in rows),
           "block16_ratio_median": med(r["block16_ratio"] for r in rows),
           "hf_equal": sum(r.get("hf_equal", False) for r in rows),
           "prompts": len(rows)}
    if all("hf_floor_tokens" in r for r in rows):
        out["fork_at_hf_floor"] = sum(r["fork_tokens"] == r["hf_floor_tokens"] for r in rows)
        out["hf_floor_within_1.15"] = sum(r["hf_floor_ratio"] <= 1.15 for r in rows)
    return out


def speed(dec, hf, prompts, W, n, reps, with_hf):
    from specfork.search import beam_search
    out = []
    for p in prompts:
        ids = dec.encode(p["text"])
        gw, gc, bw, bc, hw, hbw = [], [], [], [], [], []
        for _ in range(reps):
            g, w, c = timed(lambda: dec.generate(ids, max_new_tokens=n))
            gw.append(len(g.token_ids) / w), gc.append(len(g.token_ids) / c)
            b, w, c = timed(lambda: beam_search(dec.engine, ids, num_beams=W, max_new_tokens=n))
            bw.append(len(b.token_ids) / w), bc.append(len(b.token_ids) / c)
            if with_hf:
                with torch.no_grad():
                    _, w, _ = timed(lambda: hf.generate(torch.tensor([ids]), do_sample=False,
                                                        max_new_tokens=n, min_new_tokens=n))
                    hw.append(n / w)
                    o, w, _ = timed(lambda: hf.generate(torch.tensor([ids]), num_beams=W,
                                                        do_sample=False, max_new_tokens=n))
                    hbw.append((o.shape[1] - len(ids)) / w)
        med = statistics.median
        row = {"prompt": p["id"], "num_beams": W, "reps": reps,
               "greedy_tok_s": med(gw), "beam_tok_s": med(bw), "wall_ratio": med(bw) / med(gw),
               "greedy_tok_cpu_s": med(gc), "beam_tok_cpu_s": med(bc),
               "cpu_ratio": med(bc) / med(gc)}
        if with_hf:
            row.update(hf_greedy_tok_s=med(hw), hf_beam_tok_s=med(hbw),
                       hf_ratio=med(hbw) / med(hw))
        out.append(row)
        print(json.dumps(row), flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16,
                    help="N MT-bench prompts spread evenly over the file (its 8 categories)")
    ap.add_argument("--widths", default="2,4")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--speed-prompts", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--no-hf", action="store_true", help="skip HF parity and HF speed")
    ap.add_argument("--out", default="results/beam_memory.json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    host = machine()
    from specfork.decoder import SpecDecoder
    from specfork.model import Model
    from specfork.loader import load_hf
    from prompts import load_prompts
    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    model = Model(hf)
    dec, dec16 = SpecDecoder(model, tok), SpecDecoder(model, tok, block_size=16)
    prompts = load_prompts("mtbench", a.prompts, spread=True)
    widths = [int(w) for w in a.widths.split(",")]
    mem = memory_and_parity(dec, dec16, hf, prompts, widths, a.max_new_tokens, not a.no_hf)
    spd = speed(dec, hf, prompts[:a.speed_prompts], max(widths), a.max_new_tokens, a.reps,
                not a.no_hf)
    med = statistics.median
    summary = {f"W{W}": width_summary([r for r in mem if r["num_beams"] == W]) for W in widths}
    summary["speed_wall_ratio_median"] = med(r["wall_ratio"] for r in spd)
    summary["speed_cpu_ratio_median"] = med(r["cpu_ratio"] for r in spd)
    if not a.no_hf:
        summary["hf_speed_ratio_median"] = med(r["hf_ratio"] for r in spd)
    res = {"command": command("bench_beam", argv), "machine": host,
           "loadavg_1m_end": os.getloadavg()[0],
           "model": "smollm2-135m (fp32)", "block_size": dec.pool.block_size,
           "max_new_tokens": a.max_new_tokens, "threads": a.threads,
           "summary": summary, "memory": mem, "speed": spd}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    from specfork.errors import run_command
    sys.exit(run_command("bench_beam", main))
