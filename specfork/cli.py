"""`specfork generate ...`: stream a completion, or print one JSON object with --json.
`specfork score ...`: per-token negative log-likelihoods and perplexity of a text.
`specfork serve ...`: an OpenAI-compatible server on one engine (`specfork/server.py`)."""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import sys


class _Parser(argparse.ArgumentParser):
    """Bad flags get one line and exit 2, like every other bad input."""

    def error(self, message):
        self.exit(2, f"specfork: error: {message} (see --help)\n")


def _args(argv):
    p = _Parser(prog="specfork", description="Speculative decoding on a KV tree.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate a completion")
    g.add_argument("--target", default="smollm2-135m",
                   help="alias, local directory or HF id in the local cache (default: the "
                        "embedded SmolLM2-135M-Instruct)")
    _draft_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="file holding the prompt ('-' for stdin)")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--beams", type=int, default=0, help="beam search width (CoW fork search)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    g.add_argument("--weights", default="auto", help="the target's weight format: auto, "
                   "float32, bfloat16, int8 (Q8_0 blocks) or int4 (Q4_1 blocks), weight-only "
                   "(CPU; auto: int4 where the weights lie on Q4_1 grids, as the embedded "
                   "target's GGUF, and the CPU has AVX-512; else float32)")
    g.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    _kv_arg(g)
    _tp_arg(g)
    g.add_argument("--raw", action="store_true", help="no chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    s = sub.add_parser("score", help="per-token NLL and perplexity of a text (no chat template)")
    s.add_argument("--target", default="smollm2-135m", help="as for generate")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the text")
    src.add_argument("--prompt-file", help="file holding the text ('-' for stdin)")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    s.add_argument("--weights", default="auto", help="as for generate")
    s.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    _kv_arg(s)
    _tp_arg(s)
    s.add_argument("--json", action="store_true",
                   help="print one JSON object: tokens, nll (tokens 1..), ppl")
    v = sub.add_parser("serve", help="an OpenAI-compatible server (continuous batching)")
    v.add_argument("--target", default="smollm2-135m", help="as for generate")
    _draft_args(v)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default "
                   "127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", default=None,
                   help="the model id clients name (default: --target)")
    v.add_argument("--max-batch", type=int, default=32,
                   help="requests decoded together in one forward (default 32)")
    v.add_argument("--prefill-tokens", type=int, default=256,
                   help="prompt tokens prefilled per step while other requests decode "
                        "(default 256)")
    v.add_argument("--max-kv-tokens", type=int, default=32768,
                   help="KV pool size in tokens, shared by all requests (default 32768)")
    v.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="do not keep finished requests' KV for prompts that start the same")
    v.add_argument("--max-waiting", type=int, default=256,
                   help="queued requests beyond which new ones get HTTP 429 (default 256)")
    v.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    v.add_argument("--weights", default="auto", help="as for generate")
    v.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda if available)")
    _kv_arg(v)
    _tp_arg(v)
    v.add_argument("--replicas", type=int, default=1, metavar="R",
                   help="R engines behind this endpoint on Ray Serve (pip install "
                        "'specfork[replicas]'); requests are spread over them")
    v.add_argument("--ray-address", default=None,
                   help="with --replicas: join this Ray cluster (from `ray start --head`) "
                        "instead of starting a local one")
    return p.parse_args(argv)


def _draft_args(g) -> None:
    g.add_argument("--drafts", type=int, default=0, help="draft paths per step (0: no drafting)")
    g.add_argument("--drafter", default=None,
                   help="drafter mix, comma separated: ngram, trained, eagle (the shipped "
                        "EAGLE-3 head), model:ID_OR_PATH, eagle3:PATH, eagle:PATH (published "
                        "EAGLE-3 / EAGLE-1 checkpoints) (default: the target's default mix)")
    g.add_argument("--draft-len", type=int, default=None,
                   help="most tokens per draft path (default 4)")
    g.add_argument("--min-conf", type=float, default=None,
                   help="a model-draft path stops once the draft's probability of it falls "
                        "below this (default 0.3; 0 drafts every path to --draft-len)")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help="output rows the trained draft keeps: the target's N most frequent "
                        "tokens plus the prompt's (default 8192; 0: the whole vocabulary)")
    g.add_argument("--tree-topk", type=int, default=None,
                   help="EAGLE tree: children per expanded node and nodes expanded per depth "
                        "(default 4)")
    g.add_argument("--tree-depth", type=int, default=None, help="EAGLE tree depth (default 3)")
    g.add_argument("--draft-tokens", type=int, default=None,
                   help="EAGLE tree: nodes kept for verification (default 8)")
    g.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="every drafter drafts its full budget every step (default: adaptive "
                        "drafting picks drafters and depth from measured cost and acceptance, "
                        "down to plain decoding)")


def _tp_arg(g) -> None:
    g.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="shard the target over N processes (at most its KV heads; CPU ranks "
                        "on one host share memory, GPUs use NCCL; under torchrun: its process "
                        "count)")


def _kv_arg(g) -> None:
    g.add_argument("--kv-cache", default="auto",
                   help="KV cache format: auto (float16 under low-bit weights on a CPU, else the "
                        "model's dtype), float32, bfloat16, float16, "
                        "or TurboQuant codes turbo4, turbo3.5, turbo3, turbo2.5 (bits per "
                        "stored value, norms included)")
    g.add_argument("--kv-window", type=int, default=0, metavar="N",
                   help="with a turbo format: each token reads its last N keys and values, and "
                        "the first token's, at float16 (shadows of the newest blocks) instead "
                        "of through their codes (CPU)")


def score(a) -> int:
    import torch

    from specfork.decoder import SpecDecoder
    from specfork.engine import check_prompt
    from specfork.kv_quant import check_window_flags, parse_kv_format
    from specfork.loader import check_device
    from specfork.weights import check_weights
    check_device(a.device)
    check_weights(a.weights, a.device)
    parse_kv_format(a.kv_cache)
    check_window_flags(a.kv_window, a.kv_cache, _tensor_parallel(a))
    text = _prompt(a)
    check_prompt(text)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    dec = SpecDecoder.from_pretrained(target=a.target, dtype=dtype, device=a.device,
                                      weights=a.weights, kv_cache=a.kv_cache,
                                      kv_window=a.kv_window, tensor_parallel=_tensor_parallel(a))
    res = dec.score(text)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{len(res['tokens'])} tokens, mean NLL {sum(res['nll']) / len(res['nll']):.4f}, "
              f"perplexity {res['ppl']:.4f}")
    return 0


def _prompt(a) -> str:
    if a.prompt is not None:
        return a.prompt
    if a.prompt_file == "-":
        return sys.stdin.read()
    with open(a.prompt_file, encoding="utf-8") as f:
        return f.read()


def _tensor_parallel(a) -> int:
    from specfork.errors import SpecforkError
    if a.tensor_parallel < 1:
        raise SpecforkError(f"--tensor-parallel must be >= 1, got {a.tensor_parallel}")
    return a.tensor_parallel


def _drafting_flags(a) -> dict:
    return {"--drafter": a.drafter, "--draft-len": a.draft_len, "--min-conf": a.min_conf,
            "--draft-vocab": a.draft_vocab, "--tree-topk": a.tree_topk,
            "--tree-depth": a.tree_depth, "--draft-tokens": a.draft_tokens,
            "--no-adaptive": None if a.adaptive else True}


def _checked_loader(a, drafting: dict, **kw):
    """Check the drafting, device, weight and KV flags (before any weights load); returns
    the call that loads the SpecDecoder they describe (`kw`: more from_pretrained args)."""
    import torch

    from specfork.decoder import SpecDecoder
    from specfork.drafters import eagle
    from specfork.drafters.registry import DRAFT_LEN, check_drafting
    from specfork.errors import SpecforkError
    from specfork.kv_quant import check_window_flags, parse_kv_format
    from specfork.loader import check_device
    from specfork.weights import check_weights
    given = [k for k, v in drafting.items() if v is not None]
    if a.drafts == 0 and given:
        raise SpecforkError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} "
                            "only with --drafts N (N >= 1)")
    draft_len = DRAFT_LEN if a.draft_len is None else a.draft_len
    tree = eagle.tree_shape(a.tree_topk, a.tree_depth, a.draft_tokens)
    check_drafting(a.drafts, draft_len, a.drafter, a.target, a.min_conf, a.draft_vocab, tree)
    check_device(a.device)
    check_weights(a.weights, a.device)
    parse_kv_format(a.kv_cache)
    tp = _tensor_parallel(a)
    check_window_flags(a.kv_window, a.kv_cache, tp)
    dtype = getattr(torch, a.dtype) if a.dtype else None
    return functools.partial(                    # picklable: Ray replicas load with it too
        SpecDecoder.from_pretrained, target=a.target, drafts=a.drafts, drafter=a.drafter,
        draft_len=draft_len, dtype=dtype, device=a.device, min_conf=a.min_conf,
        draft_vocab=a.draft_vocab, tree_topk=tree[0], tree_depth=tree[1], draft_tokens=tree[2],
        adaptive=a.adaptive, weights=a.weights, kv_cache=a.kv_cache, kv_window=a.kv_window,
        tensor_parallel=tp, **kw)


def generate(a) -> int:
    from specfork.engine import check_prompt
    from specfork.errors import SpecforkError
    from specfork.sampling import check_sampling
    drafting = _drafting_flags(a)
    sampling = {"--temperature": a.temperature or None, "--top-p": a.top_p, "--top-k": a.top_k,
                "--seed": a.seed}
    # Which flags go together is the CLI's own rule; every value is checked by the library,
    # here before the weights load.
    if a.beams < 0:
        raise SpecforkError(f"--beams must be >= 0, got {a.beams}")
    if a.beams:
        given = [k for k, v in {**sampling, "--drafts": a.drafts or None, **drafting}.items()
                 if v is not None]
        if given:
            raise SpecforkError(f"--beams is greedy beam search: drop {', '.join(given)}")
    load = _checked_loader(a, drafting)
    check_sampling(a.max_new_tokens, a.temperature, a.top_p, a.top_k, a.seed)
    prompt = _prompt(a)
    check_prompt(prompt)
    dec = load()
    tok = dec.tokenizer
    if a.beams:
        from specfork.search import beam_search
        res = beam_search(dec.engine, prompt, num_beams=a.beams, max_new_tokens=a.max_new_tokens,
                          raw=a.raw)
    else:
        shown = {"ids": [], "text": ""}

        def stream(new):
            shown["ids"] += new
            text = tok.decode(shown["ids"], skip_special_tokens=True)
            if not text.endswith("\ufffd"):            # wait for a whole UTF-8 character
                sys.stdout.write(text[len(shown["text"]):])
                sys.stdout.flush()
                shown["text"] = text

        res = dec.generate(prompt, max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                           top_p=a.top_p, top_k=a.top_k, seed=a.seed, raw=a.raw,
                           on_tokens=None if a.json else stream)
    if a.json:
        print(json.dumps({"text": res.text, "token_ids": res.token_ids,
                          "prompt_token_ids": res.prompt_token_ids, "stats": res.stats}))
    elif a.beams:
        print(res.text)
    else:                       # what the stream held back (a character cut at the end)
        sys.stdout.write(res.text[len(shown["text"]):] + "\n")
        s = res.stats
        print(f"[{s['new_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"{s['target_forwards']} target forwards, tau {s['mean_accepted']:.2f}"
              + (f", speculation off {s['adaptive']['off_steps']} steps" if "adaptive" in s
                 else "") + "]", file=sys.stderr)
    return 0


def serve(a) -> int:
    import importlib.util

    from specfork.errors import SpecforkError, check_positive
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecforkError(f"serve needs {' and '.join(missing)}: pip install 'specfork[serve]'")
    check_positive(max_batch=a.max_batch, prefill_tokens=a.prefill_tokens,
                   max_kv_tokens=a.max_kv_tokens, max_waiting=a.max_waiting)
    if not 0 < a.port < 65536:
        raise SpecforkError(f"--port must be in 1..65535, got {a.port}")
    if a.replicas < 1:
        raise SpecforkError(f"--replicas must be >= 1, got {a.replicas}")
    if a.ray_address and a.replicas == 1:
        raise SpecforkError("--ray-address applies only with --replicas R (R >= 2)")
    if a.replicas > 1 and a.tensor_parallel > 1:
        raise SpecforkError("--replicas with --tensor-parallel is not supported yet: use one")
    load = _checked_loader(a, _drafting_flags(a), max_kv_tokens=a.max_kv_tokens)
    serving = {"max_batch": a.max_batch, "prefill_tokens": a.prefill_tokens,
               "prefix_cache": a.prefix_cache}
    name = a.served_model_name or a.target
    if a.replicas > 1:
        if importlib.util.find_spec("ray") is None:
            raise SpecforkError("--replicas needs Ray Serve: pip install 'specfork[replicas]'")
        from specfork.replicas import serve_replicas
        import torch
        gpu = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
        serve_replicas(load, serving, name, a.host, a.port, a.max_waiting, a.replicas,
                       a.ray_address, gpu)
        return 0
    dec = load()
    dec.serving(**serving)
    from specfork.server import serve as run_server
    print(f"specfork: serving '{name}' on http://{a.host}:{a.port}/v1", file=sys.stderr,
          flush=True)
    if a.tensor_parallel > 1:        # a rank that dies between requests stops the server
        dec.model.on_rank_exit = lambda: os.kill(os.getpid(), signal.SIGTERM)
    run_server(dec, name, a.host, a.port, a.max_waiting)
    if getattr(dec.model, "failed", None):
        from specfork.parallel import RankFailed
        raise RankFailed(dec.model.failed)
    return 0


def main(argv=None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")          # never reach for a hub at run time
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    a = _args(argv)
    from specfork.errors import run_command
    cmds = {"score": score, "generate": generate, "serve": serve}
    return run_command("specfork", lambda: cmds[a.cmd](a))


if __name__ == "__main__":
    sys.exit(main())
