"""Train the EAGLE-3 head of the embedded SmolLM2-135M-Instruct on the target's own answers.

    python eval/train_eagle.py gen      # the target answers non-benchmark prompts; the features
                                        # of layers 2, 15, 27 are recorded in the same pass
    python eval/train_eagle.py train    # training-time test -> specfork/drafters/weights/eagle/
    python eval/train_eagle.py all      # both in turn

The shipped head (weights/eagle/train_info.json holds the exact command and what it measured):

    python eval/train_eagle.py all --threads 2 --gen-minutes 25 --train-minutes 55 \
        --train-dtype bfloat16 --epochs 12

(That run fitted a step count to its first steps' pace; the schedule now follows the clock.)

Prompts: with `--self-prompts`, first the target writes user requests itself (Magpie: sampled
from the chat template cut just before the user's text; see `self_prompts`), then the rest are
train_draft.py's (templated chat, standard-library code stubs, docstring passages); MT-bench and
HumanEval are excluded throughout. The target answers them with HF `generate` (`--dtype`: in
bfloat16 it runs faster on an AMX CPU, at the price of bf16 rounding in the answers and
features the head learns from; the head then runs beside a float32 or int4 target) and a hook
keeps the residual stream entering layers 2, 15 and 27 at every position, the same tensors
`Model.forward(capture=...)` hands the engine's drafter (equal to 1e-5 in float32,
tests/test_eagle.py). Recording them in the generation pass saves a second prefill, which on
this 2-core CPU runs no faster than batched generation.

Training follows EAGLE-3: the head sees (fc(target features at t), token t+1) and predicts token
t+2; then, for `--unroll` steps, it is fed its own output h with the next token, attending to the
real-feature keys up to t plus its own earlier steps at t (the draft tree's attention at
inference). Each step's loss is the cross-entropy against the target's distribution at that
position (its top-k, renormalised over the draft vocabulary), weighted 0.8^step, on the answer's
positions. The softmax runs over the batch's label tokens plus `--negatives` random draft rows
(the lm_head is most of a step); held-out agreement uses the whole draft vocabulary. The draft
vocabulary is the `--draft-vocab` tokens the target predicts most often in the data (d2t/t2d in
the checkpoint); lm_head starts as the target's rows for it and stays frozen, as do the
embeddings (the target's, not shipped). Everything is seeded; `--resume` continues a cut run
from its last checkpoint and `--resume-gen` a cut generation.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from specfork.errors import SpecforkError, check_positive, run_command

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_draft  # noqa: E402  (its prompts and generation are this script's stage 1)
from train_draft import batches  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "specfork" / "drafters" / "weights" / "eagle"
DATA = Path(os.environ.get("SPECFORK_EAGLE_DATA", "/tmp/specfork_eagle_gen.pt"))
TOPK = 32


# -- the head --------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x):
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Attn(nn.Module):
    def __init__(self, H, heads, kvh, D):
        super().__init__()
        self.q_proj = nn.Linear(2 * H, heads * D, bias=False)
        self.k_proj = nn.Linear(2 * H, kvh * D, bias=False)
        self.v_proj = nn.Linear(2 * H, kvh * D, bias=False)
        self.o_proj = nn.Linear(heads * D, H, bias=False)


class MLP(nn.Module):
    def __init__(self, H, inter):
        super().__init__()
        self.gate_proj = nn.Linear(H, inter, bias=False)
        self.up_proj = nn.Linear(H, inter, bias=False)
        self.down_proj = nn.Linear(inter, H, bias=False)


class Layer(nn.Module):
    def __init__(self, H, heads, kvh, D, inter, eps):
        super().__init__()
        self.self_attn = Attn(H, heads, kvh, D)
        self.mlp = MLP(H, inter)
        self.input_layernorm = RMSNorm(H, eps)
        self.hidden_norm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)


class Head(nn.Module):
    """EAGLE-3's head; parameter names are the published checkpoint keys."""

    def __init__(self, cfg: dict):
        super().__init__()
        H, heads, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.H, self.heads, self.kvh, self.D = H, heads, kvh, H // heads
        eps = cfg["rms_norm_eps"]
        self.fc = nn.Linear(3 * H, H, bias=False)
        self.midlayer = Layer(H, heads, kvh, self.D, cfg["intermediate_size"], eps)
        self.norm = RMSNorm(H, eps)
        self.lm_head = nn.Linear(H, cfg["draft_vocab_size"], bias=False)

    def unroll(self, feats, toks, embed, cos, sin, steps: int):
        """feats `[B, S, 3H]`, toks `[B, S + steps]` (toks[:, t + 1 + j] is step j's input at
        t) -> one `[B, S, H]` normed output per step (lm_head's input)."""
        B, S, _ = feats.shape
        ly, a = self.midlayer, self.midlayer.self_attn
        heads, kvh, D = self.heads, self.kvh, self.D
        G = heads // kvh
        h = self.fc(feats)
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        K0 = V0 = None
        own_k, own_v, out = [], [], []
        for j in range(steps):
            e = embed[toks[:, 1 + j:1 + j + S]]
            inp = torch.cat((ly.input_layernorm(e), ly.hidden_norm(h)), dim=-1)
            q = a.q_proj(inp).view(B, S, heads, D).transpose(1, 2)
            k = a.k_proj(inp).view(B, S, kvh, D).transpose(1, 2)
            v = a.v_proj(inp).view(B, S, kvh, D).transpose(1, 2)
            c, s = cos[j:j + S], sin[j:j + S]                    # position t + j
            q, k = rope(q, c, s), rope(k, c, s)
            k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            if j == 0:
                K0, V0 = k, v
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                own_k.append(k)
                own_v.append(v)
                sc = (q @ K0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
                dg = torch.stack([(q * kk).sum(-1) for kk in own_k], -1)      # [B, h, S, j]
                w = (torch.cat((sc, dg), -1) * D ** -0.5).softmax(-1)
                att = w[..., :S] @ V0 + (w[..., S:, None] * torch.stack(own_v, -2)).sum(-2)
            x = h + a.o_proj(att.transpose(1, 2).reshape(B, S, heads * D))
            y = ly.post_attention_layernorm(x)
            x = x + ly.mlp.down_proj(F.silu(ly.mlp.gate_proj(y)) * ly.mlp.up_proj(y))
            out.append(self.norm(x))
            h = x
        return out


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rot * sin


def make_batch(rows, steps: int, t2d_index: torch.Tensor):
    """Padded tensors of one micro-batch: feats [B,S,3H], toks [B,S+steps+1], the target's
    distribution per position as draft ids and probabilities [B,S+steps+1,k] (renormalised
    over the draft vocabulary), and valid [B,S+steps+1] (that position has a label: the
    answer's, start-1 .. n-2)."""
    S = max(len(r["ids"]) for r in rows)
    B, F3 = len(rows), rows[0]["feats"].shape[1]
    feats = torch.zeros(B, S, F3)
    toks = torch.zeros(B, S + steps + 1, dtype=torch.long)
    tid = torch.zeros(B, S + steps + 1, TOPK, dtype=torch.long)
    tp = torch.zeros(B, S + steps + 1, TOPK)
    for b, r in enumerate(rows):
        n, s0 = len(r["ids"]), r["start"]
        feats[b, :n - 1] = r["feats"].float()
        toks[b, :n] = r["ids"].long()
        d = t2d_index[r["topi"].long()]
        tid[b, s0 - 1:n - 1] = d.clamp(min=0)
        tp[b, s0 - 1:n - 1] = r["topv"].float().softmax(-1) * (d >= 0)
    mass = tp.sum(-1, keepdim=True)
    valid = mass[..., 0] > 0.05                   # most of the target's mass is in the vocab
    return feats, toks, tid, tp / mass.clamp(min=1e-9), valid


def head_loss(head, batch, embed, cos, sin, steps: int, negatives: int = 0,
              gen: torch.Generator | None = None):
    """(weighted loss, per step (loss, argmax hits, labelled positions)). With `negatives`,
    the softmax covers the labels' draft rows plus that many random ones (hits are then
    within that subset)."""
    feats, toks, tid, tp, valid = batch
    S = feats.shape[1]
    outs = head.unroll(feats, toks, embed, cos, sin, steps)
    W = head.lm_head.weight
    if negatives:
        neg = torch.randint(0, W.shape[0], (negatives,), generator=gen)
        cand = torch.cat([tid[valid].flatten(), neg]).unique()               # sorted
        W = W[cand]
    total, stats = 0.0, []
    for j, y in enumerate(outs):
        sl = slice(1 + j, 1 + j + S)                # the target's distribution at t + 1 + j
        m = valid[:, sl]
        ids = tid[:, sl][m]
        if negatives:
            ids = torch.searchsorted(cand, ids)
        lg = F.linear(y[m], W)
        logq = lg.log_softmax(-1)
        loss = -(tp[:, sl][m] * logq.gather(1, ids)).sum(-1).mean()
        total = total + 0.8 ** j * loss
        hit = (lg.argmax(-1) == ids[:, 0]).sum()
        stats.append((loss.item(), hit.item(), int(m.sum())))
    return total, stats


def lr_factor(step: int, total: int, time_used: float, warmup: int) -> float:
    """Linear warmup, then a cosine decay over whichever runs out first, the steps or the time
    budget (`time_used`: its share spent). A host that slows down mid-run, as a shared 2-core
    machine does, still ends inside the budget with the rate decayed; a step count fitted to
    the pace of steps 6-20 overran a 54-minute budget by 7 minutes."""
    progress = min(1.0, max(step / total, time_used))
    return min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * progress))


def train(args) -> None:
    from safetensors.torch import save_file

    from specfork.drafters.trained_draft import fingerprint
    from specfork.loader import load_hf
    from provenance import command
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    blob = torch.load(args.data)
    rows, capture = blob["rows"], blob["capture"]
    hf, _ = load_hf("smollm2-135m", dtype=torch.float32, device="cpu")
    tc = hf.config
    embed = hf.model.embed_tokens.weight.detach()
    V = embed.shape[0]
    # the draft vocabulary: the tokens the target predicts most often in the data
    counts = torch.bincount(torch.cat([r["topi"][:, 0].long() for r in rows]), minlength=V)
    vocab = counts.argsort(descending=True)[:args.draft_vocab].sort().values
    coverage = float(counts[vocab].sum() / counts.sum())
    t2d_index = torch.full((V,), -1, dtype=torch.long)
    t2d_index[vocab] = torch.arange(len(vocab))
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": tc.hidden_size, "intermediate_size": args.intermediate,
           "num_attention_heads": tc.num_attention_heads,
           "num_key_value_heads": tc.num_key_value_heads, "num_hidden_layers": 1,
           "vocab_size": V, "draft_vocab_size": len(vocab), "rms_norm_eps": tc.rms_norm_eps,
           "max_position_embeddings": tc.max_position_embeddings,
           "rope_theta": float(getattr(tc, "rope_theta", None)
                               or (getattr(tc, "rope_parameters", None) or {})["rope_theta"]),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": capture}}
    head = Head(cfg)
    with torch.no_grad():
        head.lm_head.weight.copy_(hf.lm_head.weight[vocab])
        head.norm.weight.copy_(hf.model.norm.weight)
    head.lm_head.weight.requires_grad_(False)
    cos, sin = hf.model.rotary_emb(embed[:1], torch.arange(1024)[None])
    cos, sin = cos[0].detach(), sin[0].detach()

    rng.shuffle(rows)
    n_val = max(1, int(len(rows) * args.val_frac))
    val, tr = rows[:n_val], rows[n_val:]
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    per_epoch = len(batches(tr, args.batch_tokens, random.Random(0)))
    total = args.steps or int(args.epochs * per_epoch)
    ck = args.out / "train_state.pt"
    step, done, log = 0, 0.0, []
    if args.resume and ck.is_file():
        st = torch.load(ck, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step, total, done, log = st["step"], st["total"], st["seconds"], st["log"]
        rng.setstate(st["rng"])
        print(f"train: resuming at step {step}/{total}", file=sys.stderr)
    budget = args.train_minutes * 60
    warmup = min(50, max(1, total // 20))
    print(f"train: cosine schedule over {total} steps ({total / per_epoch:.2f} epochs) or "
          f"{args.train_minutes} minutes, whichever ends first", file=sys.stderr)
    t0 = time.perf_counter()
    epoch_batches = []
    neg_gen = torch.Generator().manual_seed(args.seed)
    last = step >= total or done >= budget
    while not last:
        el = done + time.perf_counter() - t0
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, total, el / budget, warmup)
        if not epoch_batches:
            epoch_batches = batches(tr, args.batch_tokens, rng)
        mb = epoch_batches.pop()
        with torch.autocast("cpu", torch.bfloat16, enabled=args.train_dtype == "bfloat16"):
            loss, stats = head_loss(head, make_batch(mb, args.unroll, t2d_index), embed, cos,
                                    sin, args.unroll, args.negatives, neg_gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        el = done + time.perf_counter() - t0
        last = step >= total or el >= budget
        if step % 25 == 0 or last:
            acc = [round(h / max(1, n), 3) for _, h, n in stats]
            print(f"train: step {step}/{total} loss {float(loss.detach()):.3f} acc/step {acc} "
                  f"{el:.0f} s", file=sys.stderr, flush=True)
        if step % 200 == 0 or last:
            v = evaluate(head, val, t2d_index, embed, cos, sin, args)
            log.append({"step": step, "seconds": round(el), "held_out": v})
            print(f"train: held-out {v}", file=sys.stderr, flush=True)
            args.out.mkdir(parents=True, exist_ok=True)
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step,
                        "total": total, "seconds": el, "log": log, "rng": rng.getstate()}, ck)
    # ship: fp16 weights in the published EAGLE-3 layout, config, what it took and measured
    state = {k: v.detach().half().contiguous() for k, v in head.state_dict().items()}
    state["d2t"] = (vocab - torch.arange(len(vocab))).contiguous()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[vocab] = True
    state["t2d"] = t2d
    args.out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    kinds = {}
    for r in rows:
        kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    info = {"target": "smollm2-135m", "seed": args.seed, "capture": capture,
            "data": {"sequences": len(rows), "held_out": n_val,
                     "tokens": int(sum(len(r["ids"]) for r in rows)),
                     "answer_tokens": int(sum(len(r["ids"]) - r["start"] for r in rows)),
                     "kinds": kinds, "generation_seconds": round(blob.get("seconds", 0)),
                     "self_prompt_seconds": (blob.get("self_prompts") or {}).get("seconds", 0)},
            "draft_vocab": {"size": len(vocab), "coverage_of_target_argmax": round(coverage, 4)},
            "train": {"steps": step, "epochs": round(step / per_epoch, 2), "lr": args.lr,
                      "unroll": args.unroll, "negatives": args.negatives,
                      "batch_tokens": args.batch_tokens,
                      "seconds": round(done + time.perf_counter() - t0),
                      "threads": torch.get_num_threads()},
            "held_out": log,
            "command": command("train_eagle", sys.argv[1:]),
            "embed_check": fingerprint(embed)}
    (args.out / "train_info.json").write_text(json.dumps(info, indent=2) + "\n")
    ck.unlink(missing_ok=True)
    print(json.dumps(info["held_out"][-1]), file=sys.stderr)


@torch.no_grad()
def evaluate(head, rows, t2d_index, embed, cos, sin, args) -> dict:
    """Held-out loss and argmax agreement with the target per unrolled step (answers and
    prompts alike)."""
    tot = [[0.0, 0.0, 0] for _ in range(args.unroll)]
    for mb in batches(rows, args.batch_tokens, random.Random(0)):
        _, stats = head_loss(head, make_batch(mb, args.unroll, t2d_index), embed, cos, sin,
                             args.unroll)
        for j, (lo, h, n) in enumerate(stats):
            tot[j][0] += lo * n
            tot[j][1] += h
            tot[j][2] += n
    return {"loss": [round(lo / max(1, n), 4) for lo, _, n in tot],
            "agreement": [round(h / max(1, n), 4) for _, h, n in tot]}


def self_prompts(args) -> list[str]:
    """Requests the target writes itself (Magpie, Xu et al. 2024): given the chat template only
    up to the user's turn, an instruction-tuned model samples a user's request. Far more varied
    than templates, and in the target's own SFT distribution (SmolLM2's chat data is largely of
    this kind); no benchmark is read. Seeded per batch; kept only when the turn ends within
    `--self-max` tokens (a batch runs until its last row ends); exact duplicates and any text
    equal to an MT-bench or HumanEval prompt are dropped. Saved beside `--data`, so
    `--resume-gen` reuses the same list."""
    path = args.data.with_suffix(".prompts.json")
    if args.resume_gen and path.is_file():
        return json.loads(path.read_text())["prompts"]
    from specfork.loader import load_hf
    hf, tok = load_hf("smollm2-135m", dtype=getattr(torch, args.dtype), device="cpu")
    marker = "\x00"
    text = tok.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    head = tok(text[:text.index(marker)], add_special_tokens=False,
               return_tensors="pt")["input_ids"]                       # [1, P]
    end, evals = tok.eos_token_id, train_draft.eval_texts()
    out, seen, t0, b = [], set(), time.perf_counter(), 0
    while len(out) < args.self_prompts and time.perf_counter() - t0 < args.self_minutes * 60:
        torch.manual_seed(args.seed * 1_000_003 + b)
        ids = head.repeat(args.batch, 1)
        with torch.inference_mode():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                              max_new_tokens=args.self_max, temperature=1.0, min_p=0.05,
                              top_k=0, pad_token_id=end)     # min_p: no vocabulary sort
        for row in seq[:, head.shape[1]:].tolist():
            if end in row:
                t = tok.decode(row[:row.index(end)], skip_special_tokens=True).strip()
                if len(t) >= 12 and t not in seen and t not in evals:
                    seen.add(t)
                    out.append(t)
        b += 1
        print(f"self-prompts: {len(out)} after {b} batches, {time.perf_counter() - t0:.0f} s",
              file=sys.stderr, flush=True)
    out = out[:args.self_prompts]
    path.write_text(json.dumps({"prompts": out, "batches": b,
                                "seconds": round(time.perf_counter() - t0)}))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("stage", choices=["gen", "train", "all"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", type=Path, default=DATA, help="gen output, train input")
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--threads", type=int, default=2)
    g = p.add_argument_group("gen (train_draft.py's generation)")
    g.add_argument("--prompts", type=int, default=8000)
    g.add_argument("--seqs", type=int, default=8000)
    g.add_argument("--gen-minutes", dest="gen_minutes", type=float, default=math.inf)
    g.add_argument("--resume-gen", dest="resume_gen", action="store_true")
    g.add_argument("--batch", type=int, default=128)
    g.add_argument("--max-new", dest="max_new", type=int, default=128)
    g.add_argument("--max-prompt", dest="max_prompt", type=int, default=320)
    g.add_argument("--sampled-frac", dest="sampled_frac", type=float, default=0.25)
    g.add_argument("--temperature", type=float, default=0.8)
    g.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                   help="the target's compute dtype while it answers (bfloat16: faster on a "
                   "CPU with AMX; answers and features then carry bf16 rounding)")
    g.add_argument("--self-prompts", dest="self_prompts", type=int, default=0,
                   help="at most this many of --prompts are requests the target writes itself")
    g.add_argument("--self-minutes", dest="self_minutes", type=float, default=math.inf,
                   help="time budget for writing them (on top of --gen-minutes)")
    g.add_argument("--self-max", dest="self_max", type=int, default=64,
                   help="longest self-written request, in tokens")
    t = p.add_argument_group("train")
    t.add_argument("--draft-vocab", dest="draft_vocab", type=int, default=8192)
    t.add_argument("--intermediate", type=int, default=1536)
    t.add_argument("--unroll", type=int, default=4, help="training-time-test steps")
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--steps", type=int, default=0, help="schedule length (overrides --epochs "
                   "and the --train-minutes fit)")
    t.add_argument("--train-minutes", dest="train_minutes", type=float, default=math.inf)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--train-dtype", dest="train_dtype", choices=["bfloat16", "float32"],
                   default="float32", help="bfloat16: autocast (fp32 master weights); worth it "
                   "where the CPU has bf16 matrix units (AMX)")
    t.add_argument("--negatives", type=int, default=1024, help="random draft rows in the "
                   "training softmax beside the labels' (0: the whole draft vocabulary)")
    t.add_argument("--batch-tokens", dest="batch_tokens", type=int, default=4096)
    t.add_argument("--val-frac", dest="val_frac", type=float, default=0.03)
    t.add_argument("--resume", action="store_true", help="continue from --out/train_state.pt")
    args = p.parse_args(argv)
    check_positive(threads=args.threads, prompts=args.prompts, seqs=args.seqs, batch=args.batch,
                   max_new=args.max_new, max_prompt=args.max_prompt, draft_vocab=args.draft_vocab,
                   intermediate=args.intermediate, unroll=args.unroll, epochs=args.epochs,
                   lr=args.lr, batch_tokens=args.batch_tokens, val_frac=args.val_frac,
                   gen_minutes=args.gen_minutes, train_minutes=args.train_minutes,
                   self_minutes=args.self_minutes, self_max=args.self_max)
    if not 0 <= args.self_prompts <= args.prompts:
        raise SpecforkError("--self-prompts must be between 0 and --prompts")
    if args.steps < 0 or args.negatives < 0:
        raise SpecforkError("--steps and --negatives must be >= 0")
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.stage in ("gen", "all"):
        from specfork.drafters.eagle import default_capture
        extra = self_prompts(args) if args.self_prompts else []
        gen = argparse.Namespace(**{**vars(args), "resume": args.resume_gen},
                                 extra_prompts=extra,
                                 minutes=args.gen_minutes, topk=TOPK, code_share=0.30,
                                 text_share=0.10, constraints=0.5,
                                 capture=list(default_capture(30)))
        train_draft.generate_data(gen)
        blob = torch.load(args.data)
        blob["capture"] = gen.capture
        if extra:
            blob["self_prompts"] = json.loads(args.data.with_suffix(".prompts.json").read_text())
        torch.save(blob, args.data)
    if args.stage in ("train", "all"):
        train(args)


if __name__ == "__main__":
    sys.exit(run_command("train_eagle", main))
