"""Memory per tensor-parallel rank, computed (not measured) from model configs and the bytes our
own formats store: weights (`specfork/weights.py`) and one KV slot of each KV format, read off a
real `BlockPool` of that format (`specfork/kv_quant.py`), so the table follows the code.

What a rank holds under `--tensor-parallel N` (specfork/parallel.py): 1/N of every layer's
matrices and of the vocabulary head, the whole token embedding (replicated), and a block pool of
its 1/N of the KV heads. Norms and activations are left out (< 1% here); leave headroom.

    python eval/sizing.py --context 8192 --batch 16 --out results/sizing
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from provenance import command, write_results  # noqa: E402
from specfork.kv_quant import KV_FORMATS, layer_codecs  # noqa: E402
from specfork.kv_tree import BlockPool  # noqa: E402
from specfork.weights import GROUP, HEAD_FORMAT  # noqa: E402

# The published configs (config.json of meta-llama/Meta-Llama-3-8B and -70B; 3.1 is the same).
MODELS = {
    "Llama-3-8B": dict(hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                       intermediate=14336, vocab=128256, tied=False),
    "Llama-3-70B": dict(hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                        intermediate=28672, vocab=128256, tied=False),
}
GPUS = {"24 GB (L4, A10)": 24e9, "48 GB (L40S)": 48e9, "80 GB (H100, A100)": 80e9,
        "141 GB (H200)": 141e9}
HEADROOM = 0.9                   # of a GPU's memory for weights + KV (activations, runtime)
RANKS = (1, 2, 4, 8)
GiB = 1 << 30


def weight_bytes(rows: int, cols: int, fmt: str) -> float:
    """Bytes of one [rows, cols] matrix in `fmt` (scales included)."""
    if fmt == "float32":
        return 4 * rows * cols
    if fmt == "bfloat16":
        return 2 * rows * cols
    if fmt == "int8":
        return rows * cols + rows * (cols // GROUP) * 2     # Q8_0: a 16-bit scale per group
    return rows * cols / 2 + rows * (cols // GROUP) * 4     # Q4_1: 16-bit scale + offset/group


def slot_bytes(kv_format: str, head_dim: int) -> int:
    """Bytes one token's K and V take for one KV head in one layer, off a real pool (bf16
    model, as on a GPU)."""
    pool = BlockPool(1, 1, head_dim, block_size=1, num_blocks=1, dtype=torch.bfloat16,
                     codecs=layer_codecs(kv_format, 1, head_dim, torch.bfloat16))
    return pool.block_bytes


def per_rank(cfg: dict, n: int, weights: str, kv_format: str, tokens: int) -> dict | None:
    """GiB of weights and KV one of n ranks holds (None: n does not divide the KV heads)."""
    if cfg["kv_heads"] % n or cfg["intermediate"] % n:
        return None
    H, D, L = cfg["hidden"], cfg["head_dim"], cfg["layers"]
    qkv = (cfg["heads"] + 2 * cfg["kv_heads"]) * D
    layer = (weight_bytes(qkv // n, H, weights) + weight_bytes(H, cfg["heads"] * D // n, weights)
             + weight_bytes(2 * cfg["intermediate"] // n, H, weights)
             + weight_bytes(H, cfg["intermediate"] // n, weights))
    embed = 2 * cfg["vocab"] * H                             # bf16, replicated
    head = 0 if cfg["tied"] else weight_bytes(-(-cfg["vocab"] // n), H,
                                              HEAD_FORMAT.get(weights, weights))
    w = L * layer + embed + head
    kv = tokens * L * (cfg["kv_heads"] // n) * slot_bytes(kv_format, D)
    return {"weights_gib": w / GiB, "kv_gib": kv / GiB, "total_gib": (w + kv) / GiB}


def fewest_ranks(cfg, weights, kv_format, tokens, mem: float) -> int | None:
    for n in RANKS:
        r = per_rank(cfg, n, weights, kv_format, tokens)
        if r is not None and r["total_gib"] * GiB <= HEADROOM * mem:
            return n
    return None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=int, default=8192, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=16, help="sequences held at once")
    p.add_argument("--weights", default="bfloat16",
                   help="weight format of the table (float32, bfloat16, int8, int4)")
    p.add_argument("--out", default="results/sizing")
    a = p.parse_args(argv)
    tokens = a.context * a.batch
    kv_formats = [f for f in KV_FORMATS if f not in ("auto", "float32")]
    res = {"command": command("sizing", argv), "context": a.context, "batch": a.batch,
           "weights": a.weights, "headroom": HEADROOM, "models": MODELS, "gpus": GPUS,
           "slot_bytes_per_layer_head": {f: slot_bytes(f, 128) for f in kv_formats},
           "per_rank": {m: {f: {n: per_rank(cfg, n, a.weights, f, tokens) for n in RANKS}
                            for f in kv_formats} for m, cfg in MODELS.items()},
           "weights_only": {m: {w: {n: per_rank(cfg, n, w, "bfloat16", 0) for n in RANKS}
                                for w in ("bfloat16", "int8", "int4")}
                            for m, cfg in MODELS.items()},
           "fewest_ranks": {m: {f: {g: fewest_ranks(cfg, a.weights, f, tokens, mem)
                                    for g, mem in GPUS.items()} for f in kv_formats}
                            for m, cfg in MODELS.items()}}
    write_results(a.out, res, markdown)


def markdown(res: dict) -> str:
    n_cols = " | ".join(f"N={n}" for n in RANKS)
    out = ["# Memory per tensor-parallel rank (computed, not measured)\n",
           f"`{res['command']}`\n",
           f"{res['weights']} weights + KV for {res['batch']} sequences x {res['context']} "
           f"tokens; GiB per rank as weights + KV = total. Each rank holds 1/N of the layers "
           "and of the vocabulary head, the whole embedding, and 1/N of the KV heads. The "
           "int8/int4 formats run on CPU only for now.\n",
           f"| model | KV format | {n_cols} |", "|---|---|" + "---|" * len(RANKS)]
    for m, fm in res["per_rank"].items():
        for f, ns in fm.items():
            cells = ["—" if r is None else
                     f"{r['weights_gib']:.1f} + {r['kv_gib']:.1f} = **{r['total_gib']:.1f}**"
                     for r in ns.values()]
            out.append(f"| {m} | {f} | " + " | ".join(cells) + " |")
    out += ["", "Weights alone per rank (GiB):\n", f"| model | weights | {n_cols} |",
            "|---|---|" + "---|" * len(RANKS)]
    for m, wm in res["weights_only"].items():
        for w, ns in wm.items():
            out.append(f"| {m} | {w} | " + " | ".join(f"{r['weights_gib']:.1f}"
                                                     for r in ns.values()) + " |")
    gpus = list(res["gpus"])
    out += ["", f"Fewest ranks (GPUs) for that load, using {res['headroom']:.0%} of each GPU "
            "(— : not even 8):\n", "| model | KV format | " + " | ".join(gpus) + " |",
            "|---|---|" + "---|" * len(gpus)]
    for m, fm in res["fewest_ranks"].items():
        for f, gm in fm.items():
            out.append(f"| {m} | {f} | " + " | ".join("—" if n is None else str(n)
                                                     for n in gm.values()) + " |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
