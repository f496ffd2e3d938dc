"""EAGLE drafters: a one-layer head that reads the target's own features and grows a draft tree.

A standalone draft has to rebuild what the target already knows; an EAGLE head starts from the
target's hidden states, so one layer drafts as well as a much deeper model. Draft position t
takes the pair (feature h_t, token x_{t+1}) and predicts x_{t+2}; deeper draft steps feed the
head's own output back as h.

  EAGLE-3   h_0 = fc(cat(target residual entering layers 2, L/2, L-3))      (3H -> H)
            attention input cat(input_layernorm(embed(x)), hidden_norm(h))   (2H wide q/k/v)
            residual from h; post-attention norm + SwiGLU; logits = lm_head(norm(out)) over a
            draft vocabulary (target id = draft id + d2t[draft id])
  EAGLE-1   input fc(cat(embed(x), feature)) (2H -> H) where feature is the target's final-norm
            output; one decoder layer without input norm; logits = target lm_head(out)

The head keeps its own KV tree: its committed branch holds only pairs built from real target
features (those of accepted tokens, handed over by `observe`); each step's draft tree lives in a
CoW fork of it that is freed whole after verification, so nothing drafted from the head's own
guesses is ever kept. The tree is EAGLE-2's dynamic one: expand the top-k children of the best k
frontier nodes per depth by cumulative draft log-probability, then keep the best N nodes
overall (ancestor-closed, since a child never scores above its parent). Proposals are
deterministic (q = None, one-hot), which keeps sampled verification exact whatever the tree is.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specfork.attention import AttnMeta
from specfork.engine import DEFAULT_KV_TOKENS
from specfork.errors import SpecforkError
from specfork.kv_tree import BlockPool, KVTree, blocks_for
from specfork.model import (Linear, Model, apply_rope, fused_ops_enabled, rms_norm,
                            rope_dynamic, rope_rows, rope_tables)
from specfork.types import DraftPath, SamplingParams
from specfork.weights import GROUP, LANES, QuantLinear, native

EAGLE3, EAGLE1 = "eagle3", "eagle1"
# Tree shape defaults (--tree-topk, --tree-depth, --draft-tokens), tuned for the shipped head
# on this CPU with eval/tune_drafting.py on hand-written prompts that are in no reported set
# (results/tune_eagle*.json): on a CPU a verify token costs a fair share of a decode step, so a
# small tree wins. On a GPU, where a 60-token verify costs about one decode step, EAGLE-2's own
# setting (top-10, depth 6, 60 nodes) is the place to start.
TREE_TOPK, TREE_DEPTH, DRAFT_TOKENS = 4, 3, 8
MAX_TREE_TOPK, MAX_TREE_DEPTH, MAX_DRAFT_TOKENS = 32, 16, 256
SHIPPED = Path(__file__).resolve().parent / "weights" / "eagle"


class EagleCheckpointError(SpecforkError):
    """A checkpoint that does not fit the target or the layout it claims."""


def tree_shape(topk: int | None = None, depth: int | None = None,
               tokens: int | None = None) -> tuple[int, int, int]:
    """(top-k, depth, nodes) of the draft tree, the tuned defaults where None."""
    return (TREE_TOPK if topk is None else topk, TREE_DEPTH if depth is None else depth,
            DRAFT_TOKENS if tokens is None else tokens)


def check_tree(topk: int, depth: int, tokens: int) -> None:
    for name, v, hi in (("tree_topk", topk, MAX_TREE_TOPK), ("tree_depth", depth, MAX_TREE_DEPTH),
                        ("draft_tokens", tokens, MAX_DRAFT_TOKENS)):
        if not isinstance(v, int) or not 1 <= v <= hi:
            raise SpecforkError(f"{name} must be in [1, {hi}], got {v}")


def default_capture(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's three target layers (low, middle, high), as its authors and SGLang pick them."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass
class EagleHead:
    """The head's weights as plain tensors (`Linear` packs them like the target's)."""
    arch: str
    capture: tuple[int, ...]          # target layers whose features it reads (L: final norm)
    hidden: int
    num_heads: int
    kv_heads: int
    head_dim: int
    eps: float
    embed: torch.Tensor               # [V, H], the target's unless the checkpoint has its own
    fc: Linear                        # eagle3: [H, 3H]; eagle1: [H, 2H] (+ bias)
    qkv: Linear                       # [(heads + 2 kv_heads) * D, 2H (eagle3) or H]
    o: Linear
    ln_post: torch.Tensor
    gate_up: Linear
    down: Linear
    lm_head: Linear                   # eagle3: [Vd, H] own; eagle1: the target's
    #                                   (Linear or, on a CPU with specfork's low-bit kernel,
    #                                   QuantLinear, as every matmul of the head)
    rotary: object
    ln_in: torch.Tensor | None = None         # eagle3 only
    hidden_norm: torch.Tensor | None = None   # eagle3 only
    norm: torch.Tensor | None = None          # eagle3 only
    vocab_ids: torch.Tensor | None = None     # [Vd] target id of each draft row (None: same)
    fused: bool = False               # the target's fused small ops (low-bit CPU) serve it too
    _rope: tuple | None = None        # CPU: cos, sin_signed rows by position (`rope`)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def own_bytes(self, target: Model | None = None) -> int:
        """Bytes of the weights the head adds to its target (packed copies included; the
        target's embeddings and lm_head, when borrowed, are not counted)."""
        shared = set() if target is None else {target.embed.data_ptr(),
                                               target.lm_head.w.data_ptr()}
        n = 0
        for lin in (self.fc, self.qkv, self.o, self.gate_up, self.down, self.lm_head):
            if lin.w.data_ptr() not in shared:
                n += lin.nbytes + (lin.b.nbytes if isinstance(lin, QuantLinear)
                                   and lin.b is not None else 0)     # its nbytes: codes, scales
        for t in (self.embed, self.ln_in, self.hidden_norm, self.ln_post, self.norm):
            if t is not None and t.data_ptr() not in shared:
                n += t.nbytes
        return n

    def make_pool(self, num_blocks: int) -> BlockPool:
        return BlockPool(1, self.kv_heads, self.head_dim, block_size=1, num_blocks=num_blocks,
                         dtype=self.dtype, device=self.device)

    def lift(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features `[T, F]` -> the head's h `[T, H]` for a first draft step."""
        return self.fc(feats) if self.arch == EAGLE3 else feats

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, h: torch.Tensor, positions: torch.Tensor,
             pool: BlockPool, meta: AttnMeta, logits_idx=None):
        """Pairs (h `[T, H]`, tokens `[T]`) at `positions` -> (the head's output h `[T, H]`,
        draft logits `[T', Vd]`); K/V go where `meta` says."""
        T = tokens.shape[0]
        H, KVH, D = self.num_heads, self.kv_heads, self.head_dim
        e = self.embed[tokens]
        if self.arch == EAGLE3:
            inp = torch.cat((self._norm(e, self.ln_in), self._norm(h, self.hidden_norm)), dim=-1)
            resid = h
        else:
            inp = resid = self.fc(torch.cat((e, h), dim=-1))
        qkv = self.qkv(inp)
        cos, sin = self.rope(positions)
        qk = apply_rope(qkv[:, :(H + KVH) * D].view(T, H + KVH, D), cos, sin)
        q, k = qk[:, :H], qk[:, H:]
        v = qkv[:, (H + KVH) * D:].view(T, KVH, D)
        kf, vf = pool.layer_slots(0)
        kf.index_copy_(0, meta.write, k)
        vf.index_copy_(0, meta.write, v)
        a = meta.attend(q, k, v, kf, vf, self.head_dim ** -0.5)
        x = self.o.add_to(resid, a.reshape(T, H * D))
        gu = self.gate_up(self._norm(x, self.ln_post))
        if self.fused:
            x = self.down.add_to(x, torch.ops.specfork.silu_mul(gu))
        else:
            g, u = gu.chunk(2, dim=-1)
            x = self.down.add_to(x, F.silu(g) * u)
        y = x if logits_idx is None else x[logits_idx]
        return x, self.lm_head(self._norm(y, self.norm) if self.arch == EAGLE3 else y)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.specfork.rms_norm(x, w, self.eps)
        return rms_norm(x, w, self.eps)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed `[T, 1, D]` at `positions`, as `Model.rope` gives the target's: on a
        CPU, rows of the head's own table (`rope_rows`; the module is a dozen small ops a call,
        several calls per draft tree)."""
        if positions.device.type != "cpu" or rope_dynamic(self.rotary) or positions.numel() == 0:
            return rope_tables(self.rotary, self.embed, positions)
        self._rope, cos, sin = rope_rows(self.rotary, self.embed, self._rope, positions)
        return cos, sin


# -- checkpoints -------------------------------------------------------------------------------

def _read_state(path: Path) -> tuple[dict, dict]:
    """(config, state dict) of a checkpoint directory: config.json plus model.safetensors or a
    plain `.bin` state dict (read with weights_only)."""
    if not path.is_dir():
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' has no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise EagleCheckpointError(f"{cfg_file}: not JSON ({e.msg})") from None
    sts = sorted(path.glob("*.safetensors"))
    bins = sorted(path.glob("pytorch_model*.bin")) or sorted(path.glob("*.bin"))
    if not sts and not bins:
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' has no .safetensors or .bin file")
    state = {}
    try:
        if sts:
            from safetensors.torch import load_file
            for f in sts:
                state.update(load_file(str(f)))
        else:
            for f in bins:
                state.update(torch.load(f, map_location="cpu", weights_only=True))
    except Exception as e:                       # a truncated or foreign file
        raise EagleCheckpointError(f"cannot read EAGLE weights in '{path}': "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}")
    return cfg, state


def _cfg_int(cfg: dict, key: str, path: Path, default=None) -> int:
    v = default if cfg.get(key) is None else cfg[key]          # null reads as absent
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise EagleCheckpointError(f"{path}/config.json: '{key}' must be a positive integer, "
                                   f"got {v!r}")
    return v


def load_eagle(path: str | Path, target: Model, arch: str) -> EagleHead:
    """An EAGLE-3 (`arch="eagle3"`) or EAGLE-1 (`"eagle1"`) head in the layout its authors
    publish, checked against `target`; every key must be consumed and fit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    path = Path(path)
    cfg, state = _read_state(path)
    Ht = target.embed.shape[1]
    H = _cfg_int(cfg, "hidden_size", path)
    heads = _cfg_int(cfg, "num_attention_heads", path)
    kvh = _cfg_int(cfg, "num_key_value_heads", path, heads)
    inter = _cfg_int(cfg, "intermediate_size", path)
    V = _cfg_int(cfg, "vocab_size", path)
    D = cfg.get("head_dim") or H // heads
    if H != Ht:
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' has hidden_size {H}, the target "
                                   f"{Ht}")
    if V != target.vocab_size:
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' has vocab_size {V}, the target "
                                   f"{target.vocab_size}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}': num_hidden_layers must be 1, got "
                                   f"{cfg.get('num_hidden_layers')}")
    L = target.num_layers
    left = dict(state)

    def take(key: str, shape: tuple, optional: bool = False):
        if key not in left:
            if optional:
                return None
            raise EagleCheckpointError(f"EAGLE checkpoint '{path}' lacks '{key}'")
        t = left.pop(key)
        if tuple(t.shape) != shape:
            raise EagleCheckpointError(f"EAGLE checkpoint '{path}': '{key}' has shape "
                                       f"{tuple(t.shape)}, the target needs {shape}")
        return t

    dev, dt, pack = target.device, target.dtype, target.pack
    mr = target.packed_min_rows                 # F.linear below this many rows

    def w(t):
        return None if t is None else t.to(dev, dt)

    # On a CPU where specfork's low-bit kernel runs, the head's matmuls take int4 weights (its
    # own output layer int8, as the int4 format's lm_head): a draft only proposes, so their
    # rounding moves acceptance, never the output, and a head step reads a sixth of the bytes
    low = dev.type == "cpu" and dt == torch.float32 and native()

    def lin(t, b=None, fmt: str = "int4"):
        t = w(t)
        if low and t.shape[1] % GROUP == 0 and t.shape[0] % LANES == 0:
            return QuantLinear(t, w(b), fmt)
        return Linear(t, w(b), pack=pack, min_rows=mr)

    q_in = 2 * H if arch == EAGLE3 else H
    if arch == EAGLE3:
        layer = "midlayer." if any(k.startswith("midlayer.") for k in left) else "layers.0."
        # the residual entering each listed layer (EAGLE's and vLLM's reading of the ids)
        capture = tuple(cfg.get("eagle_aux_hidden_state_layer_ids")
                        or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                        or default_capture(L))
        if len(capture) != 3 or not all(isinstance(i, int) and 0 <= i < L for i in capture):
            raise EagleCheckpointError(f"EAGLE checkpoint '{path}': aux layers {list(capture)} "
                                       f"are not three layers of the target's {L}")
        Vd = _cfg_int(cfg, "draft_vocab_size", path, V)
        fc_w, fc_b = take("fc.weight", (H, 3 * H)), None
    elif arch == EAGLE1:
        layer, capture, Vd = "layers.0.", (L,), V
        fc_w = take("fc.weight", (H, 2 * H))
        fc_b = take("fc.bias", (H,), optional=True)
    else:
        raise SpecforkError(f"unknown EAGLE architecture '{arch}'")
    p = layer
    qw = take(p + "self_attn.q_proj.weight", (heads * D, q_in))
    kw = take(p + "self_attn.k_proj.weight", (kvh * D, q_in))
    vw = take(p + "self_attn.v_proj.weight", (kvh * D, q_in))
    ow = take(p + "self_attn.o_proj.weight", (H, heads * D))
    gw = take(p + "mlp.gate_proj.weight", (inter, H))
    uw = take(p + "mlp.up_proj.weight", (inter, H))
    dw = take(p + "mlp.down_proj.weight", (H, inter))
    ln_post = take(p + "post_attention_layernorm.weight", (H,))
    embed = take("embed_tokens.weight", (V, H), optional=True)
    extra = {}
    if arch == EAGLE3:
        extra = dict(ln_in=w(take(p + "input_layernorm.weight", (H,))),
                     hidden_norm=w(take(p + "hidden_norm.weight", (H,))),
                     norm=w(take("norm.weight", (H,))))
        lm = lin(take("lm_head.weight", (Vd, H)), fmt="int8")
        full = Vd == V                           # a full-vocabulary head may omit the maps
        d2t = take("d2t", (Vd,), optional=full)
        t2d = take("t2d", (V,), optional=full)
        d2t = torch.zeros(Vd, dtype=torch.long) if d2t is None else d2t.long()
        t2d = torch.ones(V, dtype=torch.bool) if t2d is None else t2d.bool()
        ids = torch.arange(Vd) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= V or ids.unique().numel() != Vd \
                or int(t2d.sum()) != Vd or not bool(t2d[ids].all()):
            raise EagleCheckpointError(f"EAGLE checkpoint '{path}': d2t and t2d do not describe "
                                       f"one draft vocabulary of {Vd} target ids")
        extra["vocab_ids"] = ids.to(dev)
    else:
        lm = target.lm_head
    if left:
        raise EagleCheckpointError(f"EAGLE checkpoint '{path}' has unexpected keys: "
                                   f"{', '.join(sorted(left)[:5])}")
    rcfg = LlamaConfig(hidden_size=H, num_attention_heads=heads, num_key_value_heads=kvh,
                       head_dim=D, max_position_embeddings=cfg.get("max_position_embeddings",
                                                                   target.max_positions),
                       rope_theta=cfg.get("rope_theta", 10000.0),
                       rope_scaling=cfg.get("rope_scaling"))
    rotary = LlamaRotaryEmbedding(config=rcfg).to(dev)
    return EagleHead(arch=arch, capture=capture, hidden=H, num_heads=heads, kv_heads=kvh,
                     head_dim=D, eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     embed=target.embed if embed is None else w(embed),
                     fc=lin(fc_w, fc_b), qkv=lin(torch.cat([qw, kw, vw])), o=lin(ow),
                     ln_post=w(ln_post), gate_up=lin(torch.cat([gw, uw])), down=lin(dw),
                     lm_head=lm, rotary=rotary,
                     fused=low and fused_ops_enabled(),
                     **extra)


def load_shipped(target: Model, weights_dir: str | Path = SHIPPED) -> EagleHead:
    """The EAGLE-3 head trained for the embedded SmolLM2-135M-Instruct (eval/train_eagle.py)."""
    from specfork.drafters.trained_draft import DraftTargetMismatch, fingerprint
    wd = Path(weights_dir)
    info_file = wd / "train_info.json"
    if not info_file.is_file():
        raise EagleCheckpointError(f"the shipped EAGLE head is missing ({info_file}); rebuild it "
                                   "with `python eval/train_eagle.py all`")
    info = json.loads(info_file.read_text())
    if not torch.allclose(torch.tensor(fingerprint(target.embed)),
                          torch.tensor(info["embed_check"]), rtol=1e-2, atol=1e-3):
        raise DraftTargetMismatch(f"the EAGLE head in {wd} was trained for {info['target']}; "
                                  "the target given is another model")
    return load_eagle(wd, target, EAGLE3)


# -- the drafter -------------------------------------------------------------------------------

class EagleDrafter:
    """Tree drafter over an `EagleHead`: `features` names the target layers it reads;
    `tree_tokens` is its node budget (it does not share the path budget of path drafters)."""

    def __init__(self, head: EagleHead, name: str = "eagle", topk: int = TREE_TOPK,
                 depth: int = TREE_DEPTH, tokens: int = DRAFT_TOKENS,
                 max_kv_tokens: int = DEFAULT_KV_TOKENS):
        check_tree(topk, depth, tokens)
        self.head, self.name = head, name
        self.features = head.capture
        self.topk, self.depth, self.tree_tokens = topk, depth, tokens
        self.max_kv_tokens = max_kv_tokens
        # committed pairs + one scratch fork holding every expanded node of a step's tree
        self.pool = head.make_pool(blocks_for(max_kv_tokens, 1, 1, depth * topk))
        self.kv = KVTree(self.pool)
        self.C = self.S = None
        self.pending: list[torch.Tensor] = []    # target features not yet in C, in order
        self.known = 0                           # positions with a feature (in C or pending)

    def spawn(self) -> "EagleDrafter":
        """A drafter for another concurrent request: the same head, a KV tree of its own."""
        return EagleDrafter(self.head, self.name, self.topk, self.depth, self.tree_tokens,
                            self.max_kv_tokens)

    def begin(self, prompt_ids: list[int]) -> None:
        self.end()
        self.C = self.kv.new_branch()

    def end(self) -> None:
        self._drop_scratch()
        if self.C is not None:
            self.kv.release(self.C)
            self.C = None
        self.pending, self.known = [], 0

    def observe(self, context: list[int], features: torch.Tensor | None = None) -> None:
        """`features [k, F]`: the target's, at positions len(context)-1-k .. len(context)-2
        (the tokens whose successor is now known)."""
        self._drop_scratch()
        if features is None or self.C is None:
            return
        start = len(context) - 1 - features.shape[0]
        if start != self.known:                  # a gap: this request cannot be drafted on
            self.known = -1
            return
        self.pending.append(features)
        self.known += features.shape[0]

    @torch.inference_mode()
    def propose(self, context: list[int], num_paths: int, max_len: int,
                sp: SamplingParams) -> list[DraftPath]:
        """The step's draft tree as root-to-leaf paths, best leaf first; [] when the target's
        features for the context are not all known."""
        hd, kv = self.head, self.kv
        self._drop_scratch()
        if self.C is None or self.known != len(context) - 1 or not self.pending:
            return []
        dev = hd.device
        n0 = self.C.length
        feats = torch.cat(self.pending).to(dev, hd.dtype)
        self.pending = []
        m = feats.shape[0]
        toks = torch.tensor(context[n0 + 1:n0 + 1 + m], device=dev)
        prefix = kv.slots(self.C)
        slots = kv.append(self.C, m)
        h, logits = hd.step(toks, hd.lift(feats), torch.arange(n0, n0 + m, device=dev), self.pool,
                            AttnMeta.prefill(hd, prefix, slots), logits_idx=slice(m - 1, m))
        n = self.C.length                          # = len(context) - 1: the root's position
        # nodes: token (target id), parent (-1: root), score (cumulative log q), depth
        tok, parent, score, depth = [], [], [], []
        h_out: dict[int, torch.Tensor] = {-1: h[-1]}

        def add_children(rows: list[int], lg: torch.Tensor) -> list[int]:
            lp = lg.float().log_softmax(-1)
            k = min(self.topk, lp.shape[-1])
            v, idx = lp.topk(k, dim=-1)
            if hd.vocab_ids is not None:
                idx = hd.vocab_ids[idx]
            v, idx = v.cpu().tolist(), idx.cpu().tolist()
            new = []
            for r, u in enumerate(rows):
                base = 0.0 if u < 0 else score[u]
                d = 1 if u < 0 else depth[u] + 1
                for j in range(k):
                    new.append(len(tok))
                    tok.append(idx[r][j])
                    parent.append(u)
                    score.append(base + v[r][j])
                    depth.append(d)
            return new

        frontier = add_children([-1], logits)
        self.S = kv.fork(self.C)
        col: dict[int, int] = {}                   # expanded node -> its column in S's slots
        for _ in range(self.depth - 1):
            frontier = sorted(frontier, key=lambda u: -score[u])[:self.topk]
            pre = kv.slots(self.S)
            write = kv.append(self.S, len(frontier))
            mask = torch.zeros(len(frontier), pre.numel(), dtype=torch.bool)
            mask[:, :n] = True
            for r, u in enumerate(frontier):
                a = parent[u]
                while a >= 0:
                    mask[r, col[a]] = True
                    a = parent[a]
            meta = AttnMeta.branches(hd, pre, write, mask)
            hin = torch.stack([h_out[parent[u]] for u in frontier])
            pos = torch.tensor([n + depth[u] - 1 for u in frontier], device=dev)
            hx, lg = hd.step(torch.tensor([tok[u] for u in frontier], device=dev), hin, pos,
                             self.pool, meta)
            for r, u in enumerate(frontier):
                col[u] = pre.numel() + r
                h_out[u] = hx[r]
            frontier = add_children(frontier, lg)
        # the best N nodes; a child never outscores its parent, ties go to the shallower node,
        # so the set is closed under ancestors
        keep = sorted(range(len(tok)), key=lambda u: (-score[u], depth[u], u))[:self.tree_tokens]
        kept = set(keep)
        inner = {parent[u] for u in keep}
        paths = []
        for u in keep:                             # best first
            if u in inner:
                continue
            chain = []
            a = u
            while a >= 0:
                assert a in kept
                chain.append(tok[a])
                a = parent[a]
            paths.append(DraftPath(chain[::-1], None, self.name, {"score": score[u]}))
        return paths

    def _drop_scratch(self) -> None:
        if self.S is not None:
            self.kv.release(self.S)
            self.S = None
