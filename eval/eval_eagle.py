"""How well the shipped EAGLE-3 head drafts for the embedded target, and what drafting costs.

    python eval/eval_eagle.py --json results/eagle_eval.json --md results/eagle_eval.md

- Per-token acceptance: greedy chain drafting (tree top-1, `--chain` deep) on `--mt` MT-bench
  prompts spread over the file (one per category per 8) and `--he` HumanEval prompts, `--tokens`
  new tokens each. A step that proposes k tokens and accepts a of them tried a+1 (a < k) or k
  tokens; acceptance = accepted / tried, pooled per category and per set. Every run's output
  is checked against plain greedy decoding of the same prompt (it must be token-identical).
- First-token agreement: the head's argmax given the target's real features at t and token t+1
  against the target's greedy token t+2, at every answer position of the same runs (teacher
  forced, one prefill of prompt + answer): the measure `results/draft_eval.md` calls acceptance
  for the standalone draft, so the two compare directly.
- tau against tree size: the dynamic tree (top-`--topk`, depth `--depth`) at each of `--sizes`
  nodes on the first `--tau-prompts` prompts of each set: tokens per target forward (prefill
  excluded), tokens/s, and the ratio to plain greedy decoding timed in the same loop.
- Cost: one draft step (the head over `--topk` tree rows after a `--ctx`-token prefix) and one
  whole draft tree (`propose`) against one target decode step over the same prefix, medians of
  `--reps` round-robin timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from provenance import command, machine  # noqa: E402
from specfork.errors import check_positive, run_command  # noqa: E402


def chain_counts(stats_steps: list[int], k: int) -> tuple[int, int]:
    """(accepted, tried) over a run's verify steps, given tokens emitted per step (a + 1)."""
    acc = tried = 0
    for e in stats_steps:
        a = e - 1
        acc += a
        tried += a + 1 if a < k else k
    return acc, tried


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mt", type=int, default=16)
    ap.add_argument("--he", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--chain", type=int, default=6)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--sizes", default="8,16,32,48,64")
    ap.add_argument("--tau-prompts", dest="tau_prompts", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    ap.add_argument("--md", default=None)
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",") if x.strip()]
    check_positive(mt=a.mt, he=a.he, tokens=a.tokens, chain=a.chain, topk=a.topk, depth=a.depth,
                   tau_prompts=a.tau_prompts, ctx=a.ctx, reps=a.reps, threads=a.threads,
                   sizes=min(sizes) if sizes else 0)
    torch.set_num_threads(a.threads)
    host = machine()
    from prompts import load_prompts, mtbench_categories
    from specfork.attention import AttnMeta
    from specfork.decoder import SpecDecoder
    from specfork.drafters.eagle import EagleDrafter, load_shipped
    from specfork.loader import load_hf
    from specfork.model import Model

    hf, tok = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    model = Model(hf)
    head = load_shipped(model)
    cats = mtbench_categories()
    prompts = ([dict(p, set="MT-bench") for p in load_prompts("mtbench", a.mt, spread=True)]
               + [dict(p, set="HumanEval") for p in load_prompts("humaneval", a.he, spread=True)])
    greedy = SpecDecoder(model, tok)
    chain = SpecDecoder(model, tok, [EagleDrafter(head, topk=1, depth=a.chain, tokens=a.chain)],
                        num_paths=1)

    # -- per-token acceptance -------------------------------------------------------------------
    per, exact, refs = {}, True, {}
    for p in prompts:
        ids = greedy.encode(p["text"], raw=p["kind"] == "code")
        ref = greedy.generate(ids, max_new_tokens=a.tokens).token_ids
        refs[p["id"]] = (ids, ref)
        steps = []
        r = chain.generate(ids, max_new_tokens=a.tokens, on_tokens=lambda n: steps.append(len(n)))
        exact &= r.token_ids == ref
        acc, tried = chain_counts(steps[1:-1], a.chain)     # the last step may be cut short
        key = p["set"] if p["set"] == "HumanEval" else f"MT-bench/{cats.get(p['id'], '?')}"
        for k in dict.fromkeys((key, p["set"])):   # HumanEval has no categories
            s = per.setdefault(k, [0, 0])
            s[0] += acc
            s[1] += tried
        print(f"{p['id']}: acceptance {acc / max(1, tried):.3f}", file=sys.stderr, flush=True)
    acceptance = {k: {"accepted": v[0], "tried": v[1], "acceptance": v[0] / max(1, v[1])}
                  for k, v in sorted(per.items())}

    # -- first-token agreement, teacher forced ------------------------------------------------
    first = {}
    for p in prompts:
        ids, ref = refs[p["id"]]
        hit, n = first_token_agreement(model, head, ids + ref, len(ids))
        key = p["set"] if p["set"] == "HumanEval" else f"MT-bench/{cats.get(p['id'], '?')}"
        for k in dict.fromkeys((key, p["set"])):   # HumanEval has no categories
            s = first.setdefault(k, [0, 0])
            s[0] += hit
            s[1] += n
    first = {k: {"agree": v[0], "positions": v[1], "agreement": v[0] / max(1, v[1])}
             for k, v in sorted(first.items())}

    # -- tau against tree size ------------------------------------------------------------------
    subset = ([p for p in prompts if p["set"] == "MT-bench"][:a.tau_prompts]
              + [p for p in prompts if p["set"] == "HumanEval"][:a.tau_prompts])
    decs = {n: SpecDecoder(model, tok, [EagleDrafter(head, topk=a.topk, depth=a.depth,
                                                     tokens=n)], num_paths=1) for n in sizes}
    tg, tn, fw, same = 0.0, {n: 0.0 for n in sizes}, {n: 0 for n in sizes}, {n: True for n in sizes}
    total = 0
    for p in subset:
        ids, ref = refs[p["id"]]
        t = time.perf_counter()
        greedy.generate(ids, max_new_tokens=a.tokens)
        tg += time.perf_counter() - t
        total += len(ref)
        for n, d in decs.items():
            t = time.perf_counter()
            r = d.generate(ids, max_new_tokens=a.tokens)
            tn[n] += time.perf_counter() - t
            fw[n] += r.stats["target_forwards"] - 1
            same[n] &= r.token_ids == ref
    tau = [{"tree_tokens": n, "tau": (total - len(subset)) / max(1, fw[n]) + 0.0,
            "tokens_per_s": total / tn[n], "speedup_vs_our_greedy": tg / tn[n],
            "tokens_equal_greedy": same[n]} for n in sizes]
    for row in tau:
        print(json.dumps(row), file=sys.stderr, flush=True)

    # -- cost -----------------------------------------------------------------------------------
    with torch.inference_mode():
        ctx = torch.randint(100, 40000, (a.ctx,)).tolist()
        pool = model.make_pool(num_blocks=a.ctx + 8)
        from specfork.kv_tree import KVTree
        kv = KVTree(pool)
        B = kv.new_branch()
        s = kv.append(B, a.ctx)
        _, feats = model.forward(torch.tensor(ctx), torch.arange(a.ctx), pool,
                                 AttnMeta.prefill(model, s[:0], s), capture=head.capture)
        d = EagleDrafter(head, topk=a.topk, depth=a.depth, tokens=max(sizes))
        d.begin(ctx[:-1])
        d.observe(ctx, feats[:-1])
        d.propose(ctx, 0, 0, None)                   # the head reads the prefix once
        d.observe(ctx, None)
        hp = d.kv.slots(d.C, 0, len(ctx) - 2)      # the step below re-drafts from ctx - 2
        S = d.kv.fork(d.C, at=len(ctx) - 2)
        w = d.kv.append(S, a.topk)
        mask = torch.ones(a.topk, hp.numel(), dtype=torch.bool)
        hmeta = AttnMeta.branches(head, hp, w, mask)
        toks = torch.tensor(ctx[:a.topk])
        hin = torch.zeros(a.topk, head.hidden)
        pos = torch.full((a.topk,), a.ctx)
        f = kv.fork(B)
        tw = kv.append(f, 1)
        tmeta = AttnMeta.prefill(model, kv.slots(B), tw)
        times = {"target_decode_step": [], "head_step": [], "draft_tree": []}
        for _ in range(a.reps):
            t = time.perf_counter()
            model.forward(toks[:1], torch.tensor([a.ctx]), pool, tmeta)
            times["target_decode_step"].append(time.perf_counter() - t)
            t = time.perf_counter()
            head.step(toks, hin, pos, d.pool, hmeta)
            times["head_step"].append(time.perf_counter() - t)
            d.known = len(ctx) - 1                   # re-draft the same step each time
            d.pending = [feats[-2:-1]]
            d.kv.truncate(d.C, len(ctx) - 2)
            t = time.perf_counter()
            d.propose(ctx, 0, 0, None)
            times["draft_tree"].append(time.perf_counter() - t)
            d.observe(ctx, None)
        d.kv.release(S)
        d.end()
        kv.release(f)
        kv.release(B)
    med = {k: statistics.median(v) for k, v in times.items()}
    cost = {"ctx": a.ctx, "tree_rows": a.topk, "seconds": med,
            "head_step_vs_target_step": med["head_step"] / med["target_decode_step"],
            "draft_tree_vs_target_step": med["draft_tree"] / med["target_decode_step"],
            "draft_tree": f"top-{a.topk}, depth {a.depth}, {max(sizes)} nodes"}
    res = {"command": command("eval_eagle", argv), "machine": host,
           "target": "smollm2-135m (float32)", "head": "specfork/drafters/weights/eagle",
           "tokens": a.tokens, "chain_depth": a.chain, "outputs_equal_greedy": exact,
           "acceptance": acceptance, "first_token_agreement": first, "tau_vs_tree_size": tau,
           "cost": cost,
           "prompts": [p["id"] for p in prompts]}
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)
    md = render(res)
    if a.md:
        with open(a.md, "w") as fh:
            fh.write(md)
    print(md)


@torch.inference_mode()
def first_token_agreement(model, head, full: list[int], start: int) -> tuple[int, int]:
    """(hits, positions): the head's first draft token from the real pair (feature t, token
    t+1) equals full[t+2], over the answer positions t+2 >= start."""
    from specfork.attention import AttnMeta
    from specfork.kv_tree import KVTree
    T = len(full)
    pool = model.make_pool(num_blocks=T + 1)
    kv = KVTree(pool)
    B = kv.new_branch()
    s = kv.append(B, T)
    _, feats = model.forward(torch.tensor(full), torch.arange(T), pool,
                             AttnMeta.prefill(model, s[:0], s), capture=head.capture)
    kv.release(B)
    hp = head.make_pool(T + 1)
    hk = KVTree(hp)
    C = hk.new_branch()
    w = hk.append(C, T - 1)
    _, logits = head.step(torch.tensor(full[1:]), head.lift(feats[:-1]), torch.arange(T - 1),
                          hp, AttnMeta.prefill(head, w[:0], w))
    hk.release(C)
    pred = logits.argmax(-1)
    if head.vocab_ids is not None:
        pred = head.vocab_ids[pred]
    lo = max(0, start - 2)                       # pair t predicts full[t + 2]
    got, want = pred[lo:T - 2], torch.tensor(full[lo + 2:])
    return int((got == want).sum()), int(want.numel())


def render(r: dict) -> str:
    out = ["# EAGLE-3 head of the embedded SmolLM2-135M-Instruct", "",
           f"`{r['command']}`  ", f"{r['machine']['cpu']}, {r['machine']['torch_threads']} "
           f"threads, torch {r['machine']['torch']}, {r['machine']['date']}", "",
           f"## Per-token acceptance (greedy chain of {r['chain_depth']}, {r['tokens']} new "
           f"tokens; outputs equal plain greedy: {r['outputs_equal_greedy']})", "",
           "| prompts | accepted / tried | acceptance |", "|---|---|---|"]
    for k, v in r["acceptance"].items():
        out.append(f"| {k} | {v['accepted']} / {v['tried']} | {v['acceptance']:.3f} |")
    out += ["", "## First draft token, teacher forced (the standalone draft's measure in "
            "`results/draft_eval.md`)", "", "| prompts | agree / positions | agreement |",
            "|---|---|---|"]
    for k, v in r["first_token_agreement"].items():
        out.append(f"| {k} | {v['agree']} / {v['positions']} | {v['agreement']:.3f} |")
    out += ["", "## τ against tree size", "",
            "| nodes | τ (tokens / target forward) | tokens/s | × our greedy | exact |",
            "|---|---|---|---|---|"]
    for t in r["tau_vs_tree_size"]:
        out.append(f"| {t['tree_tokens']} | {t['tau']:.2f} | {t['tokens_per_s']:.1f} | "
                   f"{t['speedup_vs_our_greedy']:.2f} | {t['tokens_equal_greedy']} |")
    c = r["cost"]
    out += ["", f"## Cost over a {c['ctx']}-token prefix", "",
            f"- one head step over {c['tree_rows']} tree rows: "
            f"{c['head_step_vs_target_step']:.3f} of a target decode step "
            f"({c['seconds']['head_step'] * 1e3:.1f} ms vs "
            f"{c['seconds']['target_decode_step'] * 1e3:.1f} ms)",
            f"- one whole draft tree ({c['draft_tree']}): {c['draft_tree_vs_target_step']:.2f} "
            f"of a target decode step ({c['seconds']['draft_tree'] * 1e3:.1f} ms)", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(run_command("eval_eagle", main))
