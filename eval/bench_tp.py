"""Tensor parallelism on this machine: decode speed and memory per rank at N = 1, 2, 3 on the
embedded target (greedy, plain decoding), all in one run. A 2-core machine cannot show a
speedup (N ranks share the same cores); what this measures is the cost of the collectives
per decode step and the memory each rank holds (weights and KV measured from its tensors).

    python eval/bench_tp.py --ranks 1,2,3 --prompts 4 --max-new-tokens 64 --out results/tp_cpu
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

THREADS = torch.get_num_threads()       # one process's default: every core

from prompts import load_prompts  # noqa: E402
from provenance import command, machine, write_results  # noqa: E402


def run(target: str, n: int, prompts: list[str], max_new: int, threads: int | None,
        transport: str, weights: str = "auto") -> dict:
    from specfork.decoder import SpecDecoder
    from specfork.parallel import rank_bytes
    torch.set_num_threads(threads or THREADS)
    os.environ["SPECFORK_TP_SHM"] = "1" if transport == "shm" else "0"
    dec = SpecDecoder.from_pretrained(target, tensor_parallel=n, max_kv_tokens=4096,
                                      weights=weights)
    try:
        dec.generate(prompts[0], max_new_tokens=8)                      # warm-up
        steps, toks, secs, ids = 0, 0, 0.0, []
        for p in prompts:
            t = time.perf_counter()
            r = dec.generate(p, max_new_tokens=max_new)
            secs += time.perf_counter() - t
            steps += r.stats["target_forwards"]
            toks += r.stats["new_tokens"]
            ids.append(r.token_ids)
        mem = (dec.model.rank_bytes(dec.pool) if n > 1 else [rank_bytes(dec.model, dec.pool)])
        return {"weights": weights, "ranks": n, "transport": transport if n > 1 else "-",
                "threads_per_rank": torch.get_num_threads(), "tokens": toks,
                "seconds": secs, "tokens_per_s": toks / secs, "ms_per_forward":
                1e3 * secs / steps, "bytes_per_rank": mem, "token_ids": ids}
    finally:
        if n > 1:
            dec.model.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--ranks", default="1,2,3")
    p.add_argument("--prompts", type=int, default=4, help="MT-bench prompts, spread")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--transports", default="shm,gloo",
                   help="how the ranks' collectives travel: shm (shared memory), gloo")
    p.add_argument("--weights", default="float32",
                   help="weight formats, each its own rows (compared with its own N = 1; auto: "
                        "what specfork generate picks)")
    p.add_argument("--out", default="results/tp_cpu")
    a = p.parse_args(argv)
    prompts = [q["text"] for q in load_prompts("mtbench", a.prompts, spread=True)]
    rows = []
    for w in a.weights.split(","):
        first = None
        for n in (int(x) for x in a.ranks.split(",")):
            # N = 1 on every core and on one (what each rank of N = 2 gets here)
            for threads, tr in ([(None, "-"), (1, "-")] if n == 1 else
                               [(None, t) for t in a.transports.split(",")]):
                r = run(a.target, n, prompts, a.max_new_tokens, threads, tr, w)
                first = first or r
                r["same_tokens_as_first"] = r["token_ids"] == first["token_ids"]
                r["first_difference"] = [next((i for i, (x, y) in enumerate(zip(o, f))
                                               if x != y), None)
                                         for o, f in zip(r["token_ids"], first["token_ids"])]
                rows.append(r)
                print({k: v for k, v in r.items() if k != "token_ids"}, flush=True)
    res = {"command": command("bench_tp", argv), "machine": machine(), "target": a.target,
           "max_new_tokens": a.max_new_tokens, "prompts": len(prompts), "rows": rows}
    write_results(a.out, res, markdown)


def markdown(res: dict) -> str:
    m = res["machine"]
    out = ["# Tensor parallelism on one CPU machine\n", f"`{res['command']}`\n",
           f"{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}. "
           f"{res['target']}, greedy, {res['prompts']} MT-bench prompts x "
           f"{res['max_new_tokens']} tokens. Ranks share these cores: this shows the cost of "
           "the collectives and memory per rank, not a speedup.\n",
           "| weights | ranks | collectives | threads/rank | tok/s | ms per forward | "
           "weights MiB (rank 0) | KV MiB per rank | same tokens as N=1 (first difference) |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        b = r["bytes_per_rank"]
        diff = ", ".join("-" if i is None else str(i) for i in r.get("first_difference", []))
        out.append(f"| {r.get('weights', 'auto')} | {r['ranks']} | {r['transport']} | "
                   f"{r['threads_per_rank']} | "
                   f"{r['tokens_per_s']:.1f} | "
                   f"{r['ms_per_forward']:.1f} | {b[0]['weights'] / 2**20:.0f} | "
                   + ", ".join(f"{x['kv'] / 2**20:.0f}" for x in b)
                   + f" | {'yes' if r['same_tokens_as_first'] else 'no'}"
                   + (f" ({diff})" if diff else "") + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
