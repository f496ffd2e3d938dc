"""The throughput table: our decoders beside Hugging Face's, on the same loaded weights, the same
prompts and the same token budget, in one run.

    python eval/run_table.py --quick                       # 3 MT-bench + 3 HumanEval, 48 tokens
    python eval/run_table.py                               # 8 + 8 prompts, 128 tokens
    python eval/run_table.py --target llama3-8b --draft llama3.2-1b     # a GPU with the weights

Rows: sequential greedy, HF greedy, naive beam search (cache copied per fork), fork search (CoW
forks), HF beam search, speculative decoding with one draft path, HF assisted generation with the
same draft (at HF's settings for it, and at our drafting settings), HF prompt lookup, multi-draft
speculative decoding (model draft + n-gram paths).
Every row runs on every prompt, rows interleaved per prompt so that load from other processes
falls on all rows alike; each row is warmed up once first. Numbers are medians over prompts.
Prompts are spread evenly over each file (8 MT-bench prompts: one per category) and alternate
between the sets, and the run stops taking new prompts when the next one would
pass --budget-min (10 for --quick, 60 otherwise), so the time limit holds on a slow machine; the
table says how many prompts ran.
Writes table.md, table.json, throughput_memory.png and tau_distribution.png under --out.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Callable

import torch

MiB = 2 ** 20
SETS = {"mtbench": "MT-bench", "humaneval": "HumanEval"}
ROW_KEYS = ["seq", "hf_greedy", "beam_naive", "beam_fork", "hf_beam", "spec1", "hf_assisted",
            "hf_assisted_k",
            "hf_lookup", "multi", "eagle", "eagle_ngram", "beam_fork_kv", "multi_kv"]
README_BEGIN, README_END = "<!-- run_table:begin -->", "<!-- run_table:end -->"


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m",
                   help="alias, local directory or HF id in the local cache")
    p.add_argument("--draft", default="auto",
                   help="auto (the trained draft if it is there, else self-draft), self, or a "
                        "model alias/path sharing the target's tokenizer")
    p.add_argument("--prompts", choices=["mtbench", "humaneval", "both"], default="both")
    p.add_argument("--prompts-per-set", type=int, default=None,
                   help="prompts taken from each set, spread evenly over the file "
                        "(default 8; --quick 3)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128; --quick 48")
    p.add_argument("--quick", action="store_true",
                   help="3 prompts per set, 48 new tokens, 10-minute budget")
    p.add_argument("--budget-min", type=float, default=None,
                   help="take no new prompt once the next would end past this many minutes "
                        "from the start (default 60; --quick 10; 0: no limit)")
    p.add_argument("--beams", type=int, default=4, help="beam width of rows 3-5")
    p.add_argument("--paths", type=int, default=3, help="draft paths of the multi-draft row")
    p.add_argument("--eagle", default="auto",
                   help="EAGLE rows' head: auto (the shipped head of the embedded target), "
                        "eagle3:PATH or eagle:PATH (published EAGLE-3 / EAGLE-1 checkpoints)")
    p.add_argument("--draft-len", type=int, default=4, help="tokens per draft path (ours)")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="rows spec1, multi, eagle, eagle_ngram draft their full budget every step "
                        "(default: adaptive drafting, as `specfork generate` runs)")
    p.add_argument("--lookup-tokens", type=int, default=10,
                   help="HF prompt_lookup_num_tokens (HF's documented example value)")
    p.add_argument("--kv-cache", default="turbo3.5",
                   help="the KV format of the last two rows (fork search and multi-draft "
                        "speculation on a compressed pool; default turbo3.5)")
    p.add_argument("--rows", default=None,
                   help="comma-separated subset of " + ",".join(ROW_KEYS) + " (default: all)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: torch's, one per core); on a CPU shared "
                        "with other jobs 1 is several times faster than 2")
    p.add_argument("--out", default="results", help="output folder")
    p.add_argument("--readme", default=None,
                   help=f"also write the table into this file between {README_BEGIN} and "
                        f"{README_END} (appended if the markers are missing)")
    a = p.parse_args(argv)
    if a.prompts_per_set is None:
        a.prompts_per_set = 3 if a.quick else 8
    if a.max_new_tokens is None:
        a.max_new_tokens = 48 if a.quick else 128
    if a.budget_min is None:
        a.budget_min = 10.0 if a.quick else 60.0
    for k in ("prompts_per_set", "max_new_tokens", "beams", "paths", "draft_len",
              "lookup_tokens", "threads"):
        if getattr(a, k) is not None and getattr(a, k) <= 0:
            p.error(f"--{k.replace('_', '-')} must be positive")
    a.rows = [k.strip() for k in a.rows.split(",") if k.strip()] if a.rows else ROW_KEYS
    unknown = sorted(set(a.rows) - set(ROW_KEYS))
    if unknown or not a.rows:
        p.error(f"--rows: unknown {unknown}; choose from {','.join(ROW_KEYS)}")
    return a


# -- measurement ------------------------------------------------------------------------------

def clock() -> float:
    """Wall time that waits for queued GPU work, so a row is not credited with unfinished work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def cache_bytes(cache) -> int:
    """Bytes of the key/value tensors an HF cache holds (DynamicCache layers or legacy tuples)."""
    if cache is None:
        return 0
    layers = getattr(cache, "layers", None)
    pairs = ([(getattr(ly, "keys", None), getattr(ly, "values", None)) for ly in layers]
             if layers is not None else list(cache))
    return sum(t.numel() * t.element_size() for kv in pairs for t in kv
               if isinstance(t, torch.Tensor))


def weight_bytes(*models) -> int:
    """Bytes of the distinct weight storages of `models` (tied or shared tensors counted once:
    the trained draft borrows the target's embeddings)."""
    seen = {}
    for m in models:
        for p in m.parameters():
            st = p.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def engine_weight_bytes(hf_models: list, models: list, drafter=None) -> int:
    """What our rows hold in weights: the HF weights they borrow, plus the copy of every matrix
    our Model keeps pre-packed for oneDNN, plus a drafter's vocabulary head (its rows in the
    draft's weight format, and a request's extra rows)."""
    n = weight_bytes(*hf_models) + sum(m.packed_bytes()
                                       for m in {id(m): m for m in models}.values())
    if drafter is not None and getattr(drafter, "vocab", None) is not None:
        from specfork.types import SamplingParams
        drafter.begin([0])                       # a request builds the head on its first draft
        drafter.propose([0], 1, 1, SamplingParams())
        n += drafter.head.nbytes
        drafter.end()
    return n


class CacheProbe:
    """Forward hook on an HF model: counts its forwards and keeps the peak size of the K/V cache
    after each one. The cache object persists across steps, so its size after a forward is what
    stays resident (beam reorders' transient copies are not seen)."""

    def __init__(self, hf):
        hf.register_forward_hook(self._hook, with_kwargs=True)
        self.reset()

    def reset(self) -> None:
        self.calls, self.peak = 0, 0

    def _hook(self, module, args, kwargs, out):
        self.calls += 1
        cache = getattr(out, "past_key_values", None)
        if cache is None:
            cache = kwargs.get("past_key_values")
        self.peak = max(self.peak, cache_bytes(cache))


class StepSizes:
    """A generate() streamer that records how many tokens each target forward emitted (the
    first put is the prompt); HF assisted/prompt-lookup decoding puts once per verify round."""

    def __init__(self):
        self.sizes: list[int] = []
        self._prompt = True

    def put(self, value) -> None:
        if self._prompt:
            self._prompt = False
        else:
            self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


def alias(hf):
    """A second handle on the same weights with its own hooks and generation config: HF's
    assistant is then counted apart from the target even when it is the target (self-draft),
    and assistant state HF keeps in the generation config cannot reach the target's (the
    trained draft shares the target's config object)."""
    a = copy.copy(hf)
    for name in ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                 "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs"):
        object.__setattr__(a, name, OrderedDict())
    a.generation_config = copy.deepcopy(hf.generation_config)
    return a


@dataclass
class Run:
    """One row on one prompt."""
    tokens: list[int]
    wall: float
    kv: int                          # peak bytes of the target's K/V
    draft_kv: int                    # peak bytes of the draft model's K/V (0: none)
    forwards: int                    # target forwards, prefill included
    proposed: int | None = None      # draft tokens proposed / accepted (ours only)
    accepted: int | None = None
    steps: list[int] = field(default_factory=list)   # tokens emitted per verify forward
    cpu: float = 0.0                 # process CPU seconds (wall/cpu shows contention)


@dataclass
class Row:
    key: str
    strategy: str
    branches: int | str              # draft paths / beams; EAGLE rows: "tree of N" (+ paths)
    peer: bool
    weights: int                     # bytes of the weights of the models this row runs
    run: Callable[[list[int], int], Run] | None
    check: str | None                # "greedy": must equal HF greedy; "beam": HF beam search
    error: str | None = None
    runs: dict = field(default_factory=dict)       # prompt id -> Run
    reserved: int | None = None      # ours: bytes of the KV pools reserved up front


def ours(dec) -> Callable[[list[int], int], Run]:
    """A SpecDecoder row; on_tokens sees each forward's emitted tokens (the first is prefill)."""
    drafts = [d for d in dec.drafters if hasattr(d, "pool")]

    def run(ids, n):
        steps: list[int] = []
        for d in drafts:
            d.pool.reset_peak()
        t0 = clock()
        r = dec.generate(ids, max_new_tokens=n, on_tokens=lambda new: steps.append(len(new)))
        wall = clock() - t0
        s = r.stats
        spec = bool(dec.drafters)
        return Run(r.token_ids, wall, s["kv_peak_bytes"], sum(d.pool.peak_bytes for d in drafts),
                   s["target_forwards"], s["draft_tokens_proposed"] if spec else None,
                   s["draft_tokens_accepted"] if spec else None, steps[1:] if spec else [])
    return run


def reserved_bytes(dec) -> int:
    """The KV block pools a decoder (and its model drafters) allocate up front."""
    pools = [dec.pool] + [d.pool for d in dec.drafters if hasattr(d, "pool")]
    return sum(p.num_blocks * p.block_bytes for p in {id(p): p for p in pools}.values())


def beams(dec, width: int, naive: bool) -> Callable[[list[int], int], Run]:
    from specfork.search import beam_search

    def run(ids, n):
        t0 = clock()
        r = beam_search(dec.engine, ids, num_beams=width, max_new_tokens=n, naive=naive)
        wall = clock() - t0
        return Run(r.token_ids, wall, r.stats["kv_peak_bytes"], 0, r.stats["target_forwards"])
    return run


def peer(hf, probe: CacheProbe, draft_probe: CacheProbe | None = None, stream: bool = False,
         **kw) -> Callable[[list[int], int], Run]:
    """An hf.generate row: greedy (do_sample=False), explicit attention mask and pad id."""
    gc = hf.generation_config
    eos = gc.eos_token_id if isinstance(gc.eos_token_id, list) else [gc.eos_token_id]
    pad = gc.pad_token_id if gc.pad_token_id is not None else eos[0]

    def run(ids, n):
        x = torch.tensor([ids], device=hf.device)
        probe.reset()
        if draft_probe:
            draft_probe.reset()
        steps = StepSizes() if stream else None
        t0 = clock()
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                          do_sample=False, return_dict_in_generate=True, pad_token_id=pad,
                          streamer=steps, **kw)
        wall = clock() - t0
        toks = out.sequences[0, len(ids):].tolist()
        while pad not in eos and toks and toks[-1] == pad:
            toks.pop()
        return Run(toks, wall, probe.peak, draft_probe.peak if draft_probe else 0, probe.calls,
                   steps=steps.sizes if steps else [])
    return run


# -- setup ------------------------------------------------------------------------------------

SELF = "self-draft"
TRAINED = "trained draft"
SELF_NOTE = "self-draft (the target drafts for itself: proves exactness, not speed)"


def load_draft(arg: str, target: str, hf):
    """(draft HF model or the target itself, short tag, description). `auto` takes the trained
    draft when its module and weights are there; otherwise the target drafts for itself."""
    from specfork.errors import SpecforkError
    from specfork.loader import load_hf, resolve
    if arg == "auto":
        try:
            from specfork.drafters.trained_draft import load_trained_draft
            draft = load_trained_draft(hf, dtype=hf.dtype)
        except Exception as e:           # missing module, weights, or a target it was not made for
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"run_table: no trained draft ({why}); using the target as its own draft",
                  file=sys.stderr)
            return hf, SELF, SELF_NOTE
        label = TRAINED
    elif arg == "self" or os.path.realpath(resolve(arg)) == os.path.realpath(resolve(target)):
        return hf, SELF, SELF_NOTE
    else:
        draft, _ = load_hf(arg, dtype=hf.dtype, device=str(hf.device))
        label = arg
    draft = draft.to(device=hf.device, dtype=hf.dtype).eval()
    if draft.config.vocab_size != hf.config.vocab_size:
        raise SpecforkError(f"draft vocabulary {draft.config.vocab_size} != target "
                            f"{hf.config.vocab_size}: a draft must share the tokenizer")
    own = (weight_bytes(hf, draft) - weight_bytes(hf)) / hf.dtype.itemsize
    return draft, label, f"{label} ({own / 1e6:.1f}M parameters of its own)"


def load_prompt_set(a) -> list[dict]:
    from prompts import load_prompts
    names = list(SETS) if a.prompts == "both" else [a.prompts]
    sets = [[dict(p, set=name) for p in load_prompts(name, a.prompts_per_set, spread=True)]
            for name in names]
    return [p for group in zip_longest(*sets) for p in group if p]     # alternate the sets


def build_rows(a, model, tok, draft_hf, draft_tag: str, longest: int) -> list[Row]:
    from specfork.decoder import SpecDecoder
    from specfork.drafters.model_drafter import MIN_CONF, ModelDrafter
    from specfork.drafters.ngram import NgramDrafter
    from specfork.drafters.registry import trained_drafter
    from specfork.model import Model

    hf = model.hf
    self_draft = draft_hf is hf
    L = longest + a.max_new_tokens
    room = L + (a.paths + 1) * (a.draft_len + 32)
    seq = SpecDecoder(model, tok, max_kv_tokens=room)
    beam_dec = SpecDecoder(model, tok, max_kv_tokens=a.beams * (L + 32))
    # rows spec1 and multi run what `specfork generate --drafts N [--drafter trained]` runs (one
    # drafter shared; begin() resets it per request): the trained draft in the format the engine
    # picks for it (int4 where specfork's low-bit kernel runs, else fp16 on CPU), beside HF
    # assisted generation with the same trained weights in HF's format, the target's dtype; any
    # other draft (or the target drafting for itself) as a Model of the HF draft
    if draft_tag == TRAINED:
        engine_draft = trained_drafter(model)
    else:
        engine_draft = ModelDrafter(model if self_draft else Model(draft_hf), "draft",
                                    max_kv_tokens=room, max_paths=max(a.paths, 1),
                                    max_len=a.draft_len)
    spec1 = SpecDecoder(model, tok, [engine_draft], num_paths=1, draft_len=a.draft_len,
                        max_kv_tokens=room, adaptive=a.adaptive)
    dm = engine_draft.model
    a.multi_draft_dtype = (dm.weights if dm.weights != "float32"
                           else str(dm.dtype).split(".")[-1])
    a.multi_draft_own_embed = dm.embed.data_ptr() != model.embed.data_ptr()
    a.multi_draft_vocab = None if engine_draft.vocab is None else len(engine_draft.vocab)
    multi = SpecDecoder(model, tok, [NgramDrafter(), engine_draft], num_paths=a.paths,
                        draft_len=a.draft_len, max_kv_tokens=room, adaptive=a.adaptive)
    assistant = alias(draft_hf)                   # own hooks and generation config
    # the same draft at our drafting settings: draft_len tokens, per-token confidence cut
    assistant_k = alias(draft_hf)
    gk = assistant_k.generation_config
    gk.num_assistant_tokens, gk.num_assistant_tokens_schedule = a.draft_len, "constant"
    gk.assistant_confidence_threshold = MIN_CONF
    probe, draft_probe, probe_k = CacheProbe(hf), CacheProbe(assistant), CacheProbe(assistant_k)

    wt, wd = weight_bytes(hf), weight_bytes(hf, draft_hf)             # peers: HF's weights
    ot = engine_weight_bytes([hf], [model])                            # ours: + packed copies
    om = engine_weight_bytes([hf, engine_draft.model.hf], [model, engine_draft.model],
                             engine_draft)
    tag = f" [{draft_tag}]"
    W = a.beams

    def beam_row(key, name, naive):
        try:
            return Row(key, name, W, False, ot, beams(beam_dec, W, naive), "beam",
                       reserved=reserved_bytes(beam_dec))
        except ImportError as e:
            return Row(key, name, W, False, ot, None, "beam",
                       error=f"specfork.search.beam_search is not available ({e})")

    rows = [
        Row("seq", "sequential greedy (ours)", 1, False, ot, ours(seq), "greedy",
            reserved=reserved_bytes(seq)),
        Row("hf_greedy", "HF generate greedy (peer)", 1, True, wt, peer(hf, probe), "greedy"),
        beam_row("beam_naive", f"naive beam search, width {W} (cache copied per fork)", True),
        beam_row("beam_fork", f"fork search, width {W} (CoW forks)", False),
        Row("hf_beam", f"HF beam search, width {W} (peer)", W, True, wt,
            peer(hf, probe, num_beams=W, num_return_sequences=1, length_penalty=1.0,
                 early_stopping=False), "beam"),
        Row("spec1", "speculative decoding, 1 draft path (ours)" + tag, 1, False, om,
            ours(spec1), "greedy", reserved=reserved_bytes(spec1)),
        Row("hf_assisted", "HF assisted generation, same draft (peer)" + tag, 1, True, wd,
            peer(hf, probe, draft_probe, stream=True, assistant_model=assistant), "greedy"),
        Row("hf_assisted_k", f"HF assisted generation, same draft, {a.draft_len} tokens, "
            f"confidence cut {MIN_CONF:g} (peer)" + tag, 1, True, wd,
            peer(hf, probe, probe_k, stream=True, assistant_model=assistant_k), "greedy"),
        Row("hf_lookup", "HF prompt lookup decoding (peer)", 1, True, wt,
            peer(hf, probe, stream=True, prompt_lookup_num_tokens=a.lookup_tokens), "greedy"),
        Row("multi", f"multi-draft speculative decoding, {a.paths} draft paths (ours)" + tag,
            a.paths, False, om, ours(multi), "greedy", reserved=reserved_bytes(multi)),
    ]
    rows += eagle_rows(a, model, tok, room, ot)
    rows += kv_rows(a, model, tok, [NgramDrafter(), engine_draft], L, room, om)
    assert [r.key for r in rows] == ROW_KEYS
    return [r for r in rows if r.key in a.rows]


# -- the run ----------------------------------------------------------------------------------

def eagle_rows(a, model, tok, room: int, target_bytes: int) -> list[Row]:
    """EAGLE speculation (the dynamic tree at the engine's defaults) alone and with n-gram
    paths, as `specfork generate --drafts N --drafter eagle[,ngram]` runs it."""
    from specfork.decoder import SpecDecoder
    from specfork.drafters.eagle import DRAFT_TOKENS, TREE_DEPTH, TREE_TOPK
    from specfork.drafters.registry import make_drafters
    spec = "eagle" if a.eagle == "auto" else a.eagle
    shape = f"tree top-{TREE_TOPK}, depth {TREE_DEPTH}, {DRAFT_TOKENS} nodes"
    names = {"eagle": f"EAGLE speculative decoding ({shape}) (ours)",
             "eagle_ngram": f"EAGLE + n-gram, {a.paths} paths ({shape}) (ours)"}
    try:
        heads = {k: make_drafters(("ngram," if k == "eagle_ngram" else "") + spec,
                                  a.target, model, a.paths, max_kv_tokens=room)
                 for k in names}
    except Exception as e:               # no shipped head, or a checkpoint that does not fit
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Row(k, n, 1, False, target_bytes, None, "greedy", error=why)
                for k, n in names.items()]
    rows = []
    for k, ds in heads.items():
        dec = SpecDecoder(model, tok, ds, num_paths=a.paths, draft_len=a.draft_len,
                          max_kv_tokens=room, adaptive=a.adaptive)
        own = sum(d.head.own_bytes(model) for d in ds if hasattr(d, "head"))
        tree = f"tree of {DRAFT_TOKENS}"
        rows.append(Row(k, names[k] + (f" [{spec}]" if spec != "eagle" else " [shipped head]"),
                        tree if k == "eagle" else f"{a.paths} + {tree}", False,
                        target_bytes + own, ours(dec), "greedy",
                        reserved=reserved_bytes(dec)))
    return rows


def kv_rows(a, model, tok, drafters: list, L: int, room: int, weights: int) -> list[Row]:
    """Fork search and multi-draft speculation (the rows above) with the target's KV pool in
    `--kv-cache` (TurboQuant codes): the same weights, another KV format, so lossy against HF;
    speculation on it equals plain decoding on it (results/kv_quant)."""
    from specfork.decoder import SpecDecoder
    from specfork.kv_quant import calibration_ids
    from specfork.model import Model
    names = {"beam_fork_kv": f"fork search, width {a.beams} (CoW forks), {a.kv_cache} KV",
             "multi_kv": f"multi-draft speculative decoding, {a.paths} draft paths, "
                         f"{a.kv_cache} KV (ours)"}
    try:
        m = Model(model.hf, kv_cache=a.kv_cache)
        m.calibrate_kv(calibration_ids(tok))
    except Exception as e:               # a format this head size cannot take
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return [Row(k, n, 1, False, weights, None, None, error=why) for k, n in names.items()]
    beam_dec = SpecDecoder(m, tok, max_kv_tokens=a.beams * (L + 32))
    multi = SpecDecoder(m, tok, drafters, num_paths=a.paths, draft_len=a.draft_len,
                        max_kv_tokens=room, adaptive=a.adaptive)
    return [Row("beam_fork_kv", names["beam_fork_kv"], a.beams, False, weights,
                beams(beam_dec, a.beams, False), None, reserved=reserved_bytes(beam_dec)),
            Row("multi_kv", names["multi_kv"], a.paths, False, weights, ours(multi), None,
                reserved=reserved_bytes(multi))]


def run_all(rows: list[Row], prompts: list[dict], n: int, deadline: float | None) -> list[dict]:
    """Warm every row up on the shortest prompt (a row that fails is reported and dropped), then
    run all live rows on each prompt in turn, taking no new prompt that would end past
    `deadline` (perf_counter time) going by the slowest prompt so far. Returns the prompts run."""
    from tqdm import tqdm
    short = min(prompts, key=lambda p: len(p["ids"]))["ids"]
    for r in tqdm([r for r in rows if r.run], desc="warm-up", unit="row", leave=False):
        try:
            r.run(short, min(4, n))            # prefill, a decode or verify step, and back
        except Exception as e:
            r.error = f"{type(e).__name__}: {e}"
    for r in rows:
        if r.error:
            print(f"run_table: row '{r.strategy}' failed: {r.error}", file=sys.stderr)
    live = [r for r in rows if r.run and not r.error]
    bar = tqdm(total=len(prompts) * len(live), desc="rows x prompts", unit="run")
    done, slowest = [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        if deadline and done and t0 + slowest > deadline:
            print(f"\nrun_table: stopping after {len(done)} of {len(prompts)} prompts: the next "
                  f"would end past the time budget", file=sys.stderr)
            break
        for r in live:
            bar.set_postfix_str(f"{p['id']} {r.key}")
            c0 = time.process_time()
            r.runs[p["id"]] = x = r.run(p["ids"], n)
            x.cpu = time.process_time() - c0
            bar.update()
        done.append(p)
        slowest = max(slowest, time.perf_counter() - t0)
    bar.close()
    return done


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _speed(runs: list[Run]) -> dict:
    """Median tokens/s and τ over these runs (one per prompt)."""
    return {"tokens_per_s": median(len(x.tokens) / x.wall for x in runs),
            "mean_accepted": median(len(x.tokens) / x.forwards for x in runs)}


def summarize(rows: list[Row], prompts: list[dict]) -> list[dict]:
    by = {r.key: r for r in rows}
    base = by["seq"].runs if "seq" in by else {}
    refs = {"greedy": by["hf_greedy"].runs if "hf_greedy" in by else {},
            "beam": by["hf_beam"].runs if "hf_beam" in by else {}}
    out = []
    for r in rows:
        runs, ref = r.runs, refs.get(r.check, {})           # check None: no reference
        reference = ref is r.runs                # HF greedy / HF beam: what the others match
        pairs = [] if reference else [(pid, x.tokens == ref[pid].tokens)
                                      for pid, x in runs.items() if pid in ref]
        same = all(m for _, m in pairs) if pairs else None
        out.append({
            "strategy": r.strategy, "key": r.key, "peer": r.peer, "branches": r.branches,
            "kv_mem_vs_sequential": median(x.kv / base[pid].kv for pid, x in runs.items()
                                           if pid in base and base[pid].kv),
            **_speed(list(runs.values())),
            "speedup_vs_hf_greedy": None,
            "acceptance_rate": median(x.accepted / x.proposed for x in runs.values()
                                      if x.proposed),
            "kv_peak_bytes": median(x.kv for x in runs.values()),
            "draft_kv_peak_bytes": median(x.draft_kv for x in runs.values()),
            "weights_bytes": r.weights,
            "kv_reserved_bytes": r.reserved,
            "total_peak_bytes": (r.weights + median(x.kv + x.draft_kv for x in runs.values())
                                 if runs else None),
            "reference": reference,
            "matches_hf_greedy": same if r.check == "greedy" else None,
            "matches_hf_beam": same if r.check == "beam" else None,
            "mismatched_prompts": [pid for pid, m in pairs if not m],
            "prompts": len(runs),
            "per_set": {s: _speed([runs[p["id"]] for p in prompts
                                   if p["set"] == s and p["id"] in runs])
                        for s in dict.fromkeys(p["set"] for p in prompts)},
            "error": r.error,
            "per_prompt": [{"id": pid, "new_tokens": len(x.tokens), "wall_s": x.wall,
                            "cpu_s": x.cpu, "target_forwards": x.forwards,
                            "kv_peak_bytes": x.kv, "draft_kv_peak_bytes": x.draft_kv}
                           for pid, x in runs.items()],
        })
    hf = next((row["tokens_per_s"] for row in out if row["key"] == "hf_greedy"), None)
    for row in out:
        if hf and row["tokens_per_s"] is not None:
            row["speedup_vs_hf_greedy"] = row["tokens_per_s"] / hf
    return out


def check(rows: list[dict]) -> list[str]:
    """The exactness checks: every greedy row must reproduce HF greedy token for token; the
    beam rows should reproduce HF beam search (near-tied scores may legitimately differ).
    A row that failed is a warning too."""
    warn = [f"'{r['strategy']}' failed: {r['error']}" for r in rows if r["error"]]
    for r in rows:
        if r["matches_hf_greedy"] is False:
            warn.append(f"'{r['strategy']}' differs from HF greedy on {r['mismatched_prompts']}")
        if r["matches_hf_beam"] is False:
            warn.append(f"'{r['strategy']}' differs from HF beam search on "
                        f"{r['mismatched_prompts']}")
    return warn


def assistant_settings(draft_hf) -> dict:
    """The assisted-generation knobs HF will use for this assistant: its generation config's,
    or HF's defaults where it sets none (the HF row runs at HF's own settings)."""
    gc = draft_hf.generation_config
    defaults = getattr(type(gc), "_get_default_generation_params", dict)()
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule",
            "assistant_confidence_threshold")
    return {k: getattr(gc, k, None) if getattr(gc, k, None) is not None else defaults.get(k)
            for k in keys}


# -- output -----------------------------------------------------------------------------------

def _f(x, fmt):
    return "—" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    c, m = res["config"], res["machine"]
    hw = f"{m['gpu']} GPU" if m["gpu"] else f"{m['cpu']} CPU, {m['cores']} cores"
    cut = (f" ({len(c['prompt_ids'])} of {c['prompts_planned']} planned prompts: the rest would "
           f"have run past the {c['budget_min']:g}-minute budget)"
           if len(c["prompt_ids"]) < c["prompts_planned"] else "")
    hf_assist = ", ".join(f"{k} {v}" for k, v in c["hf_assistant"].items())
    own = c.get("multi_draft_own_embed", True)
    engine_fmt = (f" as the engine runs it ({c['multi_draft_dtype']}"
                  + (", its own copy of the embeddings counted in its memory" if own else
                     ", the target's embeddings shared")
                  + (f"; output layer over the target's {c['multi_draft_vocab']} most frequent "
                     "tokens plus the request's" if c.get("multi_draft_vocab") else "")
                  + "; HF assisted runs the same weights in the target's dtype)"
                  if c.get("multi_draft_dtype") not in (None, c["dtype"]) else "")
    lines = [
        f"Target `{c['target']}` ({c['dtype']}, {c['device']}) · draft: {c['draft']} · "
        f"{c['prompt_counts']} · {c['max_new_tokens']} new tokens · greedy · "
        f"medians over prompts{cut}",
        "",
        f"Ours: KV blocks of {c.get('kv_block_size', '?')} token(s); draft paths of up to "
        f"{c['draft_len']} tokens, a model-draft path stopping once the draft's probability of it "
        f"falls below {c.get('draft_min_conf', '?')}; rows {ROW_KEYS.index('spec1') + 1} and "
        f"{ROW_KEYS.index('multi') + 1} run the model draft{engine_fmt}, drafting "
        f"{'adaptively' if c.get('adaptive_drafting', True) else 'at a fixed budget'}, and row "
        f"{ROW_KEYS.index('multi') + 1} splits {c['draft_paths']} paths "
        f"between n-gram lookup and the model draft. HF assisted (row "
        f"{ROW_KEYS.index('hf_assisted') + 1}): {hf_assist}, HF's own settings for this "
        f"assistant. "
        f"HF prompt lookup: "
        f"prompt_lookup_num_tokens {c['hf_prompt_lookup_num_tokens']}.",
        "",
        "| # | strategy | branches | KV vs sequential | KV peak (MiB) | weights + KV (MiB) "
        "| tokens/s | speedup vs HF greedy | τ | acceptance | matches HF |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        i = ROW_KEYS.index(r["key"]) + 1
        if r["error"]:
            cells = [str(i), r["strategy"], str(r["branches"]), f"failed: {r['error'][:160]}"]
            lines.append("| " + " | ".join(cells + ["—"] * 7) + " |")
            continue
        ok = r["matches_hf_greedy"] if r["matches_hf_greedy"] is not None else r["matches_hf_beam"]
        which = "greedy" if r["matches_hf_greedy"] is not None else "beam"
        verdict = ("reference" if r.get("reference") else
                   "—" if ok is None else f"{'yes' if ok else 'NO'} ({which})")
        lines.append(
            f"| {i} | {r['strategy']} | {r['branches']} | {_f(r['kv_mem_vs_sequential'], '.2f')}× "
            f"| {_f(r['kv_peak_bytes'] and r['kv_peak_bytes'] / MiB, '.3g')} "
            f"| {_f(r['total_peak_bytes'] and r['total_peak_bytes'] / MiB, '.0f')} "
            f"| {_f(r['tokens_per_s'], '.1f')} | {_f(r['speedup_vs_hf_greedy'], '.2f')}× "
            f"| {_f(r['mean_accepted'], '.2f')} | {_f(r['acceptance_rate'], '.2f')} "
            f"| {verdict} |")
    sets = list(dict.fromkeys(s for r in res["rows"] for s in r["per_set"]))
    if len(sets) > 1:
        lines += ["", "Per prompt set (median tokens/s, τ):", "",
                  "| # | strategy | " + " | ".join(SETS.get(s, s) for s in sets) + " |",
                  "|---|---|" + "---|" * len(sets)]
        for r in res["rows"]:
            i = ROW_KEYS.index(r["key"]) + 1
            cells = [f"{_f(r['per_set'][s]['tokens_per_s'], '.1f')} tok/s, τ "
                     f"{_f(r['per_set'][s]['mean_accepted'], '.2f')}" if s in r["per_set"]
                     else "—" for s in sets]
            lines.append(f"| {i} | {r['strategy']} | " + " | ".join(cells) + " |")
    lines += ["", f"Machine: {hw}; torch {m['torch']} ({m['torch_threads']} thread"
                  f"{'' if m['torch_threads'] == 1 else 's'}), "
                  f"transformers {m['transformers']}, Python {m['python']}, {m['platform']}; "
                  f"1-min load average at start {_f(m['loadavg_1m_start'], '.1f')}.",
              f"Command: `{res['command']}`", f"Date: {res['date']} (run took "
              f"{res['elapsed_s'] / 60:.1f} min)", ""]
    kv = [r for r in res["rows"] if r["key"].endswith("_kv") and not r["error"]]
    if kv:
        lines += [f"Rows {', '.join(str(ROW_KEYS.index(r['key']) + 1) for r in kv)} hold the "
                  f"target's KV in {c.get('kv_cache')} (TurboQuant codes): lossy, so not "
                  "compared with HF; KV peak against a float16 sequential greedy pool: "
                  + ", ".join(f"{r['strategy'].split(',')[0]} "
                              f"{_f(r.get('kv_vs_float16_sequential'), '.2f')}×" for r in kv)
                  + ".", ""]
    ran = [r for r in res["rows"] if not r["error"] and not r.get("reference")
           and (r["matches_hf_greedy"] is not None or r["matches_hf_beam"] is not None)]
    if res["warnings"]:
        lines += ["Checks:", ""] + [f"- WARNING: {w}" for w in res["warnings"]]
    else:
        lines.append(f"Check: all {len(ran)} other rows reproduced their Hugging Face reference "
                     f"token for token on every prompt (greedy rows: HF greedy, row "
                     f"{ROW_KEYS.index('hf_greedy') + 1}; beam rows: HF beam search, row "
                     f"{ROW_KEYS.index('hf_beam') + 1}).")
    return "\n".join(lines) + "\n"


HOW = """
## How each column is measured

- **branches**: KV branches alive at once: beams for beam search, draft paths for speculation
  (EAGLE rows: a draft tree of N nodes, whose leaves are the branches, beside the n-gram paths).
- **tokens/s**: new tokens / wall time of the whole call (prefill included, prompt already
  tokenized), per prompt; the median over prompts. Every row is warmed up once before timing.
- **speedup vs HF greedy**: the row's median tokens/s ÷ HF greedy's median tokens/s.
- **KV peak**: ours: the peak of the target's block pool in use during the call
  (`kv_peak_bytes`, whole blocks of `kv_block_size` tokens, draft-path forks included; the pool
  itself is reserved up front, sized for the longest prompt, as a serving engine reserves its
  KV memory: `kv_reserved_bytes` in table.json). HF rows: a forward hook reads the bytes of
  the `past_key_values` key/value tensors after every target forward and keeps the largest
  (beam search: num_beams × length; assisted and prompt lookup: the target's cache, candidate
  tokens included before they are cropped; transient copies made while reordering beams are not
  seen).
- **KV vs sequential**: the row's KV peak ÷ row 1's KV peak on the same prompt; the median.
- **weights + KV**: one process runs every row, so its RSS cannot be split per row; this is
  computed, not measured: the bytes of the weights the row holds + the row's median KV peak +
  the draft model's KV peak (ours: the drafter's own block pool; HF assisted: the assistant's
  cache, read by the same hook on the assistant). Our weights include the second, pre-packed
  copy of every matrix that our Model keeps for oneDNN (and the trained draft's vocabulary
  head), so ours hold about twice HF's weight bytes.
- **τ**: new tokens ÷ target forwards (prefill included), per prompt; the median. Ours from the
  decoder's own count, HF's from a forward hook on the target.
- **acceptance**: draft tokens accepted ÷ draft tokens proposed (ours; HF does not report it).
- **matches HF**: every prompt's tokens equal HF greedy's (greedy rows) or HF beam search's best
  sequence (beam rows).
- **tau_distribution.png**: tokens emitted by each verify forward, all prompts pooled. Ours from
  the decoder's per-forward callback (the prefill forward, which emits one token, left out); HF's
  from a streamer, which receives one batch per verify round (HF's first round verifies its
  first draft together with the prompt). A last step cut short by the token budget counts as is.
"""


def plot(res: dict, dists: dict[str, list[int]], out: Path) -> list[str]:
    """throughput_memory.png (tokens/s; target and draft KV peaks, total with weights) and
    tau_distribution.png (how many tokens each verify forward emitted, per speculative row)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if not r["error"]]
    names = [r["strategy"].split(" [")[0] for r in rows][::-1]
    colors = ["#9aa0a6" if r["peer"] else "#1a73e8" for r in rows][::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(rows) + 1.8), sharey=True)
    ax1.barh(names, [r["tokens_per_s"] for r in rows][::-1], color=colors)
    ax1.set_xlabel("tokens/s (median over prompts)")
    kv = [r["kv_peak_bytes"] / MiB for r in rows][::-1]
    dkv = [r["draft_kv_peak_bytes"] / MiB for r in rows][::-1]
    ax2.barh(names, kv, color=colors, label="target KV")
    ax2.barh(names, dkv, left=kv, color="#fbbc04", label="draft KV")
    for y, (r, x) in enumerate(zip(rows[::-1], [a + b for a, b in zip(kv, dkv)])):
        ax2.text(x, y, f" total {r['total_peak_bytes'] / MiB:.0f} MiB", va="center", fontsize=8)
    ax2.set_xlim(0, 1.35 * max([a + b for a, b in zip(kv, dkv)], default=0) or 1)
    ax2.set_xlabel("KV peak, MiB (median over prompts); total = + weights")
    ax2.legend(loc="lower right")
    c = res["config"]
    fig.suptitle(f"{c['target']} · draft: {c['draft'].split(' (')[0]} · {c['prompt_counts']} · "
                 f"{c['max_new_tokens']} tokens (blue: ours, grey: Hugging Face)")
    fig.tight_layout()
    fig.savefig(out / "throughput_memory.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    dists = {k: v for k, v in dists.items() if v}
    top = max((max(v) for v in dists.values()), default=1)
    width = 0.8 / max(1, len(dists))
    for i, (name, sizes) in enumerate(dists.items()):
        xs = range(1, top + 1)
        frac = [sizes.count(x) / len(sizes) for x in xs]
        ax.bar([x + (i - (len(dists) - 1) / 2) * width for x in xs], frac, width,
               label=f"{name} (mean {sum(sizes) / len(sizes):.2f})")
    ax.set_xlabel("tokens emitted by one verify forward")
    ax.set_ylabel("fraction of verify forwards")
    ax.set_title("τ distribution: tokens per verify forward, all prompts pooled")
    if dists:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "tau_distribution.png", dpi=120)
    plt.close(fig)
    return ["throughput_memory.png", "tau_distribution.png"]


def write_readme(path: Path, md: str) -> None:
    """Put the table between the markers, so the README always shows what a run printed."""
    block = f"{README_BEGIN}\n{md}{README_END}"
    text = path.read_text() if path.exists() else ""
    if README_BEGIN in text and README_END in text:
        head, rest = text.split(README_BEGIN, 1)
        text = head + block + rest.split(README_END, 1)[1]
    else:
        text = text.rstrip() + ("\n\n" if text.strip() else "") + "## Throughput\n\n" + block + "\n"
    path.write_text(text)


# -- main -------------------------------------------------------------------------------------

def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    a = _args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    from provenance import command as command_line, machine
    command = command_line("run_table", argv)
    t_start = time.perf_counter()
    if a.threads:
        torch.set_num_threads(a.threads)
    host = machine()
    from specfork.errors import run_command
    return run_command("run_table", lambda: _run(a, command, t_start, host))


def _run(a, command: str, t_start: float, host: dict) -> int:
    from specfork.loader import load_hf

    dtype = getattr(torch, a.dtype) if a.dtype else None
    hf, tok = load_hf(a.target, dtype=dtype, device=a.device)
    draft_hf, draft_tag, draft_label = load_draft(a.draft, a.target, hf)
    prompts = load_prompt_set(a)
    from specfork.drafters.model_drafter import MIN_CONF
    from specfork.engine import Engine
    from specfork.model import Model
    model = Model(hf)
    enc = Engine(model, tok, max_kv_tokens=1)           # for encode(): template and checks
    for p in prompts:
        p["ids"] = enc.encode(p["text"], raw=p["kind"] == "code")   # code prompts: no template
    del enc
    rows = build_rows(a, model, tok, draft_hf, draft_tag,
                      max(len(p["ids"]) for p in prompts))
    planned = len(prompts)
    deadline = t_start + 60 * a.budget_min - 30 if a.budget_min else None   # 30 s to write
    with torch.inference_mode():
        prompts = run_all(rows, prompts, a.max_new_tokens, deadline)
    dists = {r.strategy.split(" [")[0]: [s for x in r.runs.values() for s in x.steps]
             for r in rows if r.key in ("spec1", "hf_assisted", "hf_assisted_k", "hf_lookup",
                                        "multi")}
    counts = {s: sum(p["set"] == s for p in prompts) for s in SETS}
    res = {
        "rows": summarize(rows, prompts),
        "machine": host,
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "elapsed_s": time.perf_counter() - t_start,
        "config": {"target": a.target, "draft": draft_label, "dtype": str(hf.dtype).split(".")[-1],
                   "device": str(hf.device), "max_new_tokens": a.max_new_tokens,
                   "prompt_sets": a.prompts, "prompts_per_set": a.prompts_per_set,
                   "prompt_counts": " + ".join(f"{n} {SETS[s]}" for s, n in counts.items() if n)
                   + (" prompt" if len(prompts) == 1 else " prompts")
                   + " (spread evenly over each file)",
                   "prompt_ids": [p["id"] for p in prompts], "prompts_planned": planned,
                   "budget_min": a.budget_min, "beams": a.beams,
                   "draft_paths": a.paths, "draft_len": a.draft_len,
                   "adaptive_drafting": a.adaptive, "kv_cache": a.kv_cache,
                   "draft_min_conf": MIN_CONF, "kv_block_size": model.block_size,
                   "multi_draft_dtype": getattr(a, "multi_draft_dtype", None),
                   "multi_draft_vocab": getattr(a, "multi_draft_vocab", None),
                   "multi_draft_own_embed": getattr(a, "multi_draft_own_embed", True),
                   "hf_prompt_lookup_num_tokens": a.lookup_tokens,
                   "hf_assistant": assistant_settings(draft_hf),
                   "hf_assistant_ours": {"num_assistant_tokens": a.draft_len,
                                         "num_assistant_tokens_schedule": "constant",
                                         "assistant_confidence_threshold": MIN_CONF}},
    }
    elsize = torch.empty((), dtype=hf.dtype).element_size()
    for r in res["rows"]:        # KV against sequential greedy's pool as float16 would hold it
        x = r["kv_mem_vs_sequential"]
        r["kv_vs_float16_sequential"] = None if x is None else x * elsize / 2
    res["warnings"] = check(res["rows"])
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(res)
    (out / "table.json").write_text(json.dumps(res, indent=1) + "\n")
    plots = plot(res, dists, out)
    (out / "table.md").write_text("# Throughput table\n\n" + md + HOW + "\nPlots: "
                                  + ", ".join(plots) + "\n")
    if a.readme:
        write_readme(Path(a.readme), md)
    print(md)
    for w in res["warnings"]:
        print(f"WARNING: {w}", file=sys.stderr)
    print(f"wrote {out / 'table.md'}, {out / 'table.json'}, "
          + ", ".join(str(out / p) for p in plots), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
