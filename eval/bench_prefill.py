"""Long-prompt costs of the target on this machine: a prompt's prefill and a decode step over a
long prefix, each by the attention path the engine picks and by the one it replaced, beside HF.

    python eval/bench_prefill.py --threads 2 --json results/prefill_cpu.json

- prefill (time to the first new token, `generate(max_new_tokens=1)`): fused causal SDPA (the
  engine's choice) vs the flash cascade under a causal tree mask, and HF `generate`;
- decode step (mean time between streamed tokens over `--steps` steps): the prefix's leading
  run read as a view of the pool (the engine's choice) vs gathered slot by slot in every layer,
  and HF's step over its own contiguous cache.
Random token ids (the cost does not depend on them); every path must give HF's tokens. The
fastest of `--reps` runs counts.

    python eval/bench_prefill.py --threads 2 --weights int4 --json results/prefill_cpu_int4.json

`--weights` other than float32 times the engine as it runs under that format (prompt rows then
attend row by row, `ROWS` in specfork/attention.py, so the two variants are not timed) beside HF
fp32, whose tokens it need not give.
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


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--lengths", default="200,1000,3300", help="prompt lengths, comma-separated")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per length")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--weights", default="float32",
                   help="the target's weight format (specfork/weights.py)")
    a = p.parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from specfork.errors import SpecforkError, run_command

    def go():
        try:
            lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
        except ValueError:
            raise SpecforkError(f"--lengths: not a list of integers: {a.lengths!r}") from None
        if not lengths or min(lengths) < 2 or min(a.steps, a.reps) <= 0 or (
                a.threads is not None and a.threads <= 0):
            raise SpecforkError("--lengths (each >= 2), --steps, --reps and --threads must be "
                                "positive")
        from specfork.weights import check_weights
        check_weights(a.weights, "cpu")
        if a.threads:
            torch.set_num_threads(a.threads)
        return _run(a, lengths, command_line("bench_prefill", argv))
    return run_command("bench_prefill", go)


def _run(a, lengths: list[int], command: str) -> int:
    import specfork.attention as sa
    from specfork.decoder import SpecDecoder
    from specfork.loader import load_hf
    from specfork.model import Model
    host = machine()
    hf, tok = load_hf(a.target)
    model = Model(hf, weights=a.weights)
    low = model.weights != "float32"             # only the engine's own path; no HF identity
    dec = SpecDecoder(model, tok, max_kv_tokens=max(lengths) + a.steps + 8)
    pick, run_min = sa.pick_path, sa.RUN_MIN

    def cascade_prefill(T, L, **kw):                 # the path prefill took before
        return sa.CASCADE if kw["causal"] and L == 0 and T > 1 else pick(T, L, **kw)

    class Stamps:
        """A generate() streamer: the time each new token arrives (the first put: the prompt)."""

        def __init__(self):
            self.t = []

        def put(self, value) -> None:
            self.t.append(time.perf_counter())

        def end(self) -> None:
            pass

    def ours(ids, n):
        st = Stamps()
        t0 = time.perf_counter()
        out = dec.generate(ids, max_new_tokens=n, on_tokens=st.put).token_ids
        return t0, st.t, out

    def peer(ids, n):
        x, st = torch.tensor([ids]), Stamps()
        t0 = time.perf_counter()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, pad_token_id=0, streamer=st)
        return t0, st.t[1:], out[0, len(ids):].tolist()

    def best(f, ids, n):
        """(fastest time to the first token, fastest mean step after it, the tokens)."""
        runs = [f(ids, n) for _ in range(a.reps)]
        first = min(t[0] - t0 for t0, t, _ in runs)
        step = min((t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else float("nan")
                   for _, t, _ in runs)
        return first, step, runs[0][2]

    def variant(name: str) -> None:
        """Route the engine's attention as `name` says ("": as it runs)."""
        sa.pick_path = cascade_prefill if name == "cascade" else pick
        sa.RUN_MIN = 1 << 30 if name == "gathered" else run_min

    g = torch.Generator().manual_seed(0)
    rows, exact = [], True
    try:
        with torch.inference_mode():
            ours(list(range(100, 132)), 2)
            peer(list(range(100, 132)), 2)
            for P in lengths:
                ids = torch.randint(100, hf.config.vocab_size - 100, (P,), generator=g).tolist()
                row = {"prompt_tokens": P}
                first, step, ref = best(peer, ids, 1 + a.steps)
                row["new_tokens"] = len(ref)
                row["prefill_s"] = {"hf": round(first, 4)}
                row["decode_step_ms"] = {"hf": round(step * 1e3, 2)}
                if low:
                    first, step, _ = best(ours, ids, 1 + a.steps)
                    row["prefill_s"]["ours"] = round(first, 4)
                    row["decode_step_ms"]["ours"] = round(step * 1e3, 2)
                    row["prefill_vs_hf"] = round(row["prefill_s"]["hf"] / first, 3)
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    continue
                for name in ("causal_sdpa", "cascade"):
                    variant(name)
                    first, step, out = best(ours, ids, 1 + a.steps)
                    exact &= out == ref
                    row["prefill_s"][name] = round(first, 4)
                    if name == "causal_sdpa":                 # the run view, as the engine runs
                        row["decode_step_ms"]["run_view"] = round(step * 1e3, 2)
                variant("gathered")
                _, step, out = best(ours, ids, 1 + a.steps)
                exact &= out == ref
                row["decode_step_ms"]["gathered"] = round(step * 1e3, 2)
                variant("")
                row["prefill_vs_hf"] = round(row["prefill_s"]["hf"]
                                             / row["prefill_s"]["causal_sdpa"], 3)
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    finally:
        variant("")
    res = {"command": command, "machine": host, "target": a.target,
           "dtype": str(hf.dtype).split(".")[-1], "weights": model.weights,
           "decode_steps": a.steps, "reps": a.reps,
           "all_equal_hf": None if low else exact, "rows": rows}
    text = json.dumps(res, indent=1)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text + "\n")
    print(text)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
