"""How often a probe of a costly drafter (the trained draft beside n-gram lookup, the default mix)
finds it worth keeping: its first probe in a request against its later ones, under each given
share of the time later probes may take (`adaptive.EXPLORE_AGAIN`), the numbers that share
rests on.
Runs on tune_drafting's hand-written prompts, none from MT-bench or HumanEval.

    python eval/probe_outcomes.py --weights auto --explore-again 0.03 0.015 \\
        --out results/probe_outcomes_int4

Each request's probes come from its stats (`adaptive.probes`: step, drafter, first, kept).
A probe's outcome follows measured step costs, so counts vary a little from run to run.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from provenance import command, machine, write_results
from specfork.errors import SpecforkError, check_positive, run_command
from tune_drafting import PROMPTS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--weights", default="auto", help="the target's weight format")
    p.add_argument("--explore-again", type=float, nargs="+", default=None,
                   help="shares of the time later probes may take, each run in turn "
                        "(default: the shipped adaptive.EXPLORE_AGAIN)")
    p.add_argument("--reps", type=int, default=2, help="runs of every prompt per share")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="writes OUT.json and OUT.md")
    a = p.parse_args(argv)
    check_positive(reps=a.reps, max_new_tokens=a.max_new_tokens, threads=a.threads)
    if a.explore_again is not None and not all(0 < x < 1 for x in a.explore_again):
        raise SpecforkError("--explore-again takes shares in (0, 1)")
    from specfork.weights import check_weights
    check_weights(a.weights, None)
    torch.set_num_threads(a.threads)
    host = machine()

    from specfork import SpecDecoder, adaptive
    dec = SpecDecoder.from_pretrained(drafts=3, weights=a.weights)
    ids = [dec.encode(q) for q in PROMPTS]
    dec.generate(ids[0], max_new_tokens=8)                # times the drafters once
    rows = []
    for share in a.explore_again or [adaptive.EXPLORE_AGAIN]:
        adaptive.EXPLORE_AGAIN = share
        got = {"first": [0, 0], "later": [0, 0]}          # [kept, probes]
        tokens = 0
        for _ in range(a.reps):
            for x in ids:
                r = dec.generate(x, max_new_tokens=a.max_new_tokens)
                tokens += len(r.token_ids)
                for pr in r.stats["adaptive"]["probes"]:
                    c = got["first" if pr["first"] else "later"]
                    c[0] += pr["kept"]
                    c[1] += 1
        rows.append({"explore_again": share, "requests": a.reps * len(ids), "tokens": tokens,
                     "first_kept": got["first"][0], "first_probes": got["first"][1],
                     "later_kept": got["later"][0], "later_probes": got["later"][1]})
        print(rows[-1], flush=True)
    res = {"command": command("probe_outcomes", argv), "machine": host,
           "target": f"smollm2-135m ({dec.model.weights}), drafts 3 (the default mix)",
           "prompts": PROMPTS, "max_new_tokens": a.max_new_tokens, "rows": rows}
    if a.out:
        write_results(a.out, res, markdown)


def markdown(res: dict) -> str:
    m = res["machine"]
    out = [f"# Probe outcomes: {res['target']}", "",
           f"`{res['command']}` on {m['cpu']} ({m['torch_threads']} threads), {m['date']}; "
           f"{len(res['prompts'])} tune_drafting prompts, {res['max_new_tokens']} new tokens.",
           "", "| later-probe share | requests | first probes kept | later probes kept |",
           "|---|---|---|---|"]
    for r in res["rows"]:
        out.append(f"| {r['explore_again']:g} | {r['requests']} | "
                   f"{r['first_kept']} of {r['first_probes']} | "
                   f"{r['later_kept']} of {r['later_probes']} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(run_command("probe_outcomes", main))
