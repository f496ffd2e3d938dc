"""How well the trained draft predicts the embedded target, and what a draft token costs.

    python eval/eval_draft.py --n 40 --tau-prompts 2 --json results/draft_eval.json \\
        --md results/draft_eval.md

- Greedy acceptance: the target (fp32, our Model) decodes `--tokens` greedy tokens per prompt on
  `--n` MT-bench and HumanEval prompts spread evenly over each file (40: five of each MT-bench
  category, reported per category too; chat template); the draft reads the target's greedy
  prefix in one teacher-forced forward, and a position counts when its argmax is the target's
  token: exactly the per-token acceptance of greedy chain drafting. Reported for the
  fp32 draft, for the `--draft-dtype` the engine runs it in (fp16: a third of the cost here),
  and for that draft with the engine's output head (argmax over the `--draft-vocab` most frequent
  target tokens plus the prompt and the tokens generated so far).
- tau(k), tokens per target verification step for a chain of k drafted tokens (accepted + the
  target's own), follows from those match vectors (a step accepts the run of matches from where
  it starts, capped at k) for every prompt; on the first `--tau-prompts` prompts of each set it
  is also measured with SpecDecoder + ModelDrafter(Model(draft), vocab) at num_paths=1, draft_len=k
  (output checked against the plain greedy decode), with wall-clock speed beside plain decoding
  and the n-gram drafter in the same setting as the reference to beat.
- Cost: one draft decode token vs one target decode step, both single-token forwards of our
  Model over a `--ctx`-token KV prefix, timed round-robin (medians) at 1 thread and at the
  default thread count, for the draft in fp32, bf16 and fp16, and fp16 with the engine's
  output head (the target stays fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from specfork.decoder import SpecDecoder  # noqa: E402
from specfork.drafters.model_drafter import ModelDrafter  # noqa: E402
from specfork.drafters.ngram import NgramDrafter  # noqa: E402
from specfork.drafters.trained_draft import (DRAFT_VOCAB, WEIGHTS, load_trained_draft,  # noqa: E402
                                             load_vocab)
from specfork.errors import SpecforkError, check_positive, run_command  # noqa: E402
from specfork.kv_tree import KVTree  # noqa: E402
from specfork.attention import AttnMeta  # noqa: E402
from specfork.model import Linear, Model  # noqa: E402
from specfork.loader import load_hf  # noqa: E402
from prompts import load_prompts, mtbench_categories  # noqa: E402
from provenance import command, machine  # noqa: E402

KS = range(2, 9)
ENGINE_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@torch.inference_mode()
def match_vector(draft_hf, prompt_ids: list[int], gen: list[int],
                 vocab: torch.Tensor | None = None) -> list[bool]:
    """m[j]: the draft's argmax after prompt + gen[:j] equals the target's greedy gen[j]; with
    `vocab`, the argmax over vocab + prompt + gen[:j] (the engine's output head)."""
    ids = torch.tensor([prompt_ids + gen[:-1]])
    logits = draft_hf(input_ids=ids).logits[0, len(prompt_ids) - 1:].float()
    if vocab is not None:
        allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
        allowed[vocab] = True
        allowed[prompt_ids] = True
        for j in range(len(gen)):
            if j:
                allowed[gen[j - 1]] = True
            logits[j].masked_fill_(~allowed, float("-inf"))
    return (logits.argmax(-1) == torch.tensor(gen)).tolist()


def tau_from_matches(m: list[bool], k: int) -> float:
    """Tokens per verification step of a greedy chain of length k. Token 0 comes from the
    prefill; a step at j drafts gen[j:j+k] and emits its run of matches plus one target token."""
    j, steps = 1, 0
    while j < len(m):
        a = 0
        while a < k and j + a < len(m) and m[j + a]:
            a += 1
        j += a + 1
        steps += 1
    return (len(m) - 1) / max(1, steps)


def pooled(xs: list[list[bool]]) -> float:
    return sum(map(sum, xs)) / max(1, sum(map(len, xs)))


def time_forwards(models: dict[str, Model], ctx: int, reps: int, threads: int) -> dict:
    """Median ms of a single-token decode forward per model over a ctx-token prefix, round-robin
    so background load lands on every model alike."""
    torch.set_num_threads(threads)
    setups = {}
    heads = {name: m[1] if isinstance(m, tuple) else None for name, m in models.items()}
    models = {name: m[0] if isinstance(m, tuple) else m for name, m in models.items()}
    for name, m in models.items():
        pool = m.make_pool(num_blocks=ctx + 4)
        kv = KVTree(pool)
        br = kv.new_branch()
        slots = kv.append(br, ctx)
        toks = torch.randint(100, 20000, (ctx,), generator=torch.Generator().manual_seed(0))
        m.forward(toks, torch.arange(ctx), pool, AttnMeta.prefill(m, slots[:0], slots),
                  logits_idx=slice(ctx - 1, ctx))
        setups[name] = (m, pool, kv, br)
    times = {name: [] for name in models}
    for r in range(reps + 3):
        for name, (m, pool, kv, br) in setups.items():
            prefix = kv.slots(br)
            slot = kv.append(br, 1)
            t0 = time.perf_counter()
            m.forward(torch.tensor([7]), torch.tensor([ctx]), pool,
                      AttnMeta.prefill(m, prefix, slot), head=heads[name])
            dt = time.perf_counter() - t0
            kv.truncate(br, ctx)
            if r >= 3:
                times[name].append(dt * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=40, help="prompts per set, spread over the file")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--tau-prompts", dest="tau_prompts", type=int, default=2,
                   help="prompts per set decoded for real with SpecDecoder at every k")
    p.add_argument("--draft-dtype", dest="draft_dtype", default="fp16", choices=ENGINE_DTYPE,
                   help="dtype of the draft inside the engine (the target stays fp32)")
    p.add_argument("--draft-vocab", dest="draft_vocab", type=int, default=DRAFT_VOCAB,
                   help="output rows of the engine's draft head (0: all)")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--json", type=Path, default=Path("results/draft_eval.json"))
    p.add_argument("--md", type=Path, default=Path("results/draft_eval.md"))
    args = p.parse_args(argv)
    check_positive(n=args.n, tokens=args.tokens, ctx=args.ctx, reps=args.reps)
    if args.tau_prompts < 0 or args.draft_vocab < 0:
        raise SpecforkError("--tau-prompts and --draft-vocab must be >= 0")
    default_threads = torch.get_num_threads()
    torch.manual_seed(0)

    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    target = Model(hf)
    draft_hf = load_trained_draft(hf)
    info = json.loads((WEIGHTS / "train_info.json").read_text())
    plain = SpecDecoder(target, tok, max_kv_tokens=1024)
    sets = {name: load_prompts(name, args.n, spread=True) for name in ("mtbench", "humaneval")}
    category = mtbench_categories()

    draft_eng = load_trained_draft(hf, dtype=ENGINE_DTYPE[args.draft_dtype])
    vocab = load_vocab(args.draft_vocab) if args.draft_vocab else None
    eng = f"{args.draft_dtype}_head{args.draft_vocab}" if vocab is not None else args.draft_dtype
    acc, tau, real = {}, {}, {}
    t_start = time.perf_counter()
    for name, prompts in sets.items():
        ms = {"fp32": [], args.draft_dtype: [], eng: []}
        rows = []
        for pr in prompts:
            t0 = time.perf_counter()
            out = plain.generate(pr["text"], max_new_tokens=args.tokens)
            wall = time.perf_counter() - t0
            for dt, d in {"fp32": draft_hf, args.draft_dtype: draft_eng}.items():  # once each
                ms[dt].append(match_vector(d, out.prompt_token_ids, out.token_ids))
            if vocab is not None:
                ms[eng].append(match_vector(draft_eng, out.prompt_token_ids, out.token_ids, vocab))
            rows.append({"id": pr["id"], "text": pr["text"], "greedy": out.token_ids,
                         "plain_tok_s": len(out.token_ids) / wall})
        m_eng = ms[eng]
        acc[name] = {"acceptance": round(pooled(ms["fp32"]), 4),
                     f"acceptance_{args.draft_dtype}": round(pooled(ms[args.draft_dtype]), 4),
                     f"acceptance_{eng}": round(pooled(m_eng), 4),
                     "per_prompt": {r["id"]: round(sum(m) / len(m), 3)
                                    for r, m in zip(rows, ms["fp32"])},
                     "tokens": sum(map(len, m_eng))}
        if name == "mtbench":             # the fp32 draft per category, as in "acceptance"
            by_cat: dict[str, list] = {}
            for r, m in zip(rows, ms["fp32"]):
                by_cat.setdefault(category[r["id"]], []).append(m)
            acc[name]["per_category"] = {c: {"acceptance": round(pooled(v), 4),
                                             "prompts": len(v)} for c, v in by_cat.items()}
        tau[name] = {k: round(statistics.mean(tau_from_matches(m, k) for m in m_eng), 3)
                     for k in KS}
        sub = rows[:args.tau_prompts]
        # fixed chain lengths: min_conf=0 turns the engine's early path stop off
        drafters = {"trained": ModelDrafter(Model(draft_eng), name="trained", max_kv_tokens=1024,
                                            min_conf=0.0, vocab=vocab),
                    "ngram": NgramDrafter()}
        real[name] = {}
        for dname, drafter in drafters.items():
            real[name][dname] = {}
            for k in KS:
                dec = SpecDecoder(target, tok, [drafter], num_paths=1, draft_len=k,
                                  max_kv_tokens=1024)
                taus, speed, same = [], [], True
                for r in sub:
                    o = dec.generate(r["text"], max_new_tokens=args.tokens)
                    same &= o.token_ids == r["greedy"]
                    st = o.stats
                    taus.append((st["new_tokens"] - 1) / max(1, st["spec_steps"]))
                    speed.append(st["tokens_per_s"] / r["plain_tok_s"])
                real[name][dname][k] = {"tau": round(statistics.mean(taus), 3),
                                        "speedup_vs_plain": round(statistics.mean(speed), 3),
                                        "output_equals_greedy": same}
                if dname == "trained":
                    real[name][dname][k]["tau_from_acceptance"] = round(statistics.mean(
                        tau_from_matches(m, k) for m in m_eng[:len(sub)]), 3)
        print(f"{name}: acceptance {acc[name]} tau {tau[name]} "
              f"({time.perf_counter() - t_start:.0f} s)", flush=True)

    fp16 = Model(load_trained_draft(hf, dtype=torch.float16))
    drafts = {"draft_fp32": Model(draft_hf),
              "draft_bf16": Model(load_trained_draft(hf, dtype=torch.bfloat16)),
              "draft_fp16": fp16}
    if vocab is not None:                 # + the prompt's tokens, as in the engine: ~100 rows
        rows_ = torch.cat([vocab, torch.randint(0, fp16.vocab_size, (100,))]).unique()
        drafts[f"draft_fp16_head{args.draft_vocab}"] = (fp16, Linear(fp16.lm_head.w[rows_]))
    cost = {}
    for threads in sorted({1, default_threads}):
        ms_ = time_forwards({"target_fp32": target, **drafts}, args.ctx, args.reps, threads)
        cost[f"{threads}_thread"] = {
            "ms": {k: round(v, 2) for k, v in ms_.items()},
            "draft_over_target": {k: round(v / ms_["target_fp32"], 3)
                                  for k, v in ms_.items() if k != "target_fp32"}}
    torch.set_num_threads(default_threads)

    weights = sum(f.stat().st_size for f in WEIGHTS.iterdir() if f.is_file())
    res = {
        "draft": {"layers": draft_hf.config.num_hidden_layers,
                  "init_from_target_layers": info["init_layers"],
                  "hidden": draft_hf.config.hidden_size,
                  "shipped_bytes": weights, "training": {k: info[k] for k in
                                                         ("data", "train", "held_out_agreement")}},
        "setup": {"prompts_per_set": args.n, "greedy_tokens_per_prompt": args.tokens,
                  "tau_measured_prompts_per_set": args.tau_prompts, "cost_ctx": args.ctx,
                  "engine_draft_dtype": args.draft_dtype, "engine_draft": eng,
                  "draft_vocab": args.draft_vocab,
                  "cost_reps": args.reps, "default_threads": default_threads,
                  "machine": machine(), "load_avg_end": os.getloadavg(),
                  "command": command("eval_draft", argv)},
        "greedy_acceptance": acc,
        "tau_from_acceptance": tau,
        "tau_measured_specdecoder": real,
        "cost_per_draft_token": cost,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=2) + "\n")
    args.md.write_text(markdown(res))
    print(markdown(res))


def markdown(r: dict) -> str:
    d, s = r["draft"], r["setup"]
    tr, dt = d["training"], s["engine_draft_dtype"]
    eng = s.get("engine_draft", dt)
    V = s.get("draft_vocab", 0)
    runs = f"{dt}" + (f", its output layer cut to the {V} most frequent target tokens plus the "
                      f"request's own (`{eng}`)" if eng != dt else "")
    goal = {True: "met", False: "missed"}
    lines = [
        "# Trained draft for SmolLM2-135M-Instruct", "",
        f"`{s['command']}` (torch {s['machine']['torch']}, {s['default_threads']} default "
        f"threads, load average {s['load_avg_end'][0]:.1f} at the end: the CPU is shared, timings are noisy)",
        "",
        f"Draft: LlamaForCausalLM, {d['layers']} decoder layers of width {d['hidden']} "
        f"(initialised from target layers {d['init_from_target_layers']}), target embeddings "
        f"and tied lm_head shared at load; shipped files {d['shipped_bytes'] / 2**20:.1f} MiB. "
        f"Trained on {tr['data']['target_tokens']} target tokens "
        f"({tr['data']['sequences']} sequences, {tr['data']['generation_seconds']} s of "
        f"generation) for {tr['train']['steps']} steps ({tr['train']['seconds']} s); held-out "
        f"agreement {tr['held_out_agreement']['init']} at init -> "
        f"{tr['held_out_agreement']['final']}. In the engine the draft runs in {runs}.", "",
        f"## Greedy acceptance ({s['prompts_per_set']} prompts per set spread over the file, "
        f"{s['greedy_tokens_per_prompt']} greedy target tokens each; goal >= 0.6)", "",
        f"| set | acceptance (fp32 draft) | acceptance ({dt} draft) | acceptance ({eng}) | "
        "positions | goal |",
        "|---|---|---|---|---|---|"]
    for name, a in r["greedy_acceptance"].items():
        lines.append(f"| {name} | {a['acceptance']:.3f} | {a['acceptance_' + dt]:.3f} | "
                     f"{a['acceptance_' + eng]:.3f} | {a['tokens']} | "
                     f"{goal[a['acceptance'] >= 0.6]} |")
    cats = r["greedy_acceptance"].get("mtbench", {}).get("per_category")
    if cats:
        lines += ["", "MT-bench by category (fp32 draft): " + ", ".join(
            f"{c} {v['acceptance']:.3f}" for c, v in cats.items()) + "."]
    sets = list(r["tau_from_acceptance"])
    lines += ["", "## tau (tokens per target verification step, chain of k drafted tokens)", "",
              f"`tau`: from the {eng} draft's match vectors over all prompts. `measured`: "
              f"SpecDecoder (num_paths=1, draft_len=k) on the first "
              f"{s['tau_measured_prompts_per_set']} prompts per set, beside the same formula on "
              "those prompts (`formula`), and its wall-clock speed relative to plain decoding; "
              "`ngram`: the prompt-lookup drafter in the same setting. Every measured output "
              "equals the plain greedy decode unless marked.", ""]
    for n in sets:
        lines += [f"### {n}", "",
                  "| k | tau | measured | formula | speedup | ngram tau | ngram speedup |",
                  "|---|---|---|---|---|---|---|"]
        for k in KS:
            t, g = r["tau_measured_specdecoder"][n]["trained"][k], \
                r["tau_measured_specdecoder"][n]["ngram"][k]
            bad = "" if t["output_equals_greedy"] and g["output_equals_greedy"] else " MISMATCH"
            lines.append(f"| {k} | {r['tau_from_acceptance'][n][k]:.2f} | {t['tau']:.2f}{bad} | "
                         f"{t['tau_from_acceptance']:.2f} | {t['speedup_vs_plain']:.2f}x | "
                         f"{g['tau']:.2f} | {g['speedup_vs_plain']:.2f}x |")
        lines.append("")
    cols = list(r["cost_per_draft_token"]["1_thread"]["draft_over_target"])
    lines += ["## Cost of one draft token / one target decode step (goal <= 0.15)", "",
              f"Single-token forwards of our Model over a {s['cost_ctx']}-token prefix, median of "
              f"{s['cost_reps']} round-robin reps; target fp32.", "",
              "| threads | target ms | " + " | ".join(f"{k} ms | {k} ratio" for k in cols) + " |",
              "|---|---|" + "---|---|" * len(cols)]
    for th, c in r["cost_per_draft_token"].items():
        lines.append(f"| {th.split('_')[0]} | {c['ms']['target_fp32']:.1f} | " + " | ".join(
            f"{c['ms'][k]:.1f} | {v:.3f}" for k, v in c["draft_over_target"].items()) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(run_command("eval_draft", main))
