"""Llama-family forward (Llama 2/3/3.1, Mistral, Qwen2, SmolLM2; GQA) over the paged KV tree.

Weights are borrowed from a transformers model (no copies). One entry point, `forward`, covers
prefill, decode and tree verification: new tokens at explicit positions write their K/V into
KV-tree slots and attend as the step's `AttnMeta` says (`specfork/attention.py`: the slots read,
the masks, the attention path).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specfork.attention import AttnMeta, half_slots
from specfork.errors import SpecforkError
from specfork.kv_quant import StoredSlots, check_window, layer_codecs, resolve_kv
from specfork.kv_tree import BlockPool
from specfork.weights import HEAD_FORMAT, QuantLinear, resolve, row_blocks

SUPPORTED = ("llama", "mistral", "qwen2")


class UnsupportedModel(SpecforkError):
    pass


class Linear:
    """y = x @ w.T + b over borrowed weights. On CPU (fp32, or bf16) it may also keep `w`
    pre-packed for the few-row matmuls of decoding (1 row), beams (W rows), tree verification
    (tree-size rows) and batches of requests: float32 weights with a multiple of 32 outputs in
    specfork's panels where the CPU has AVX-512 (`kernels/panel_linear.cpp`: 1.2-1.5x the
    faster of oneDNN and F.linear from 8 to 32 rows here, results/linear_panels.json, and
    row-invariant), otherwise for oneDNN,
    whose packed matmuls run 1.6-2.8x faster than F.linear, whose sgemm re-packs the weights on
    every call (results/linear_cpu.json, from eval/bench_linear.py)."""
    __slots__ = ("w", "b", "packed", "panel", "min_rows", "exact")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None = None, pack: bool = False,
                 min_rows: int = 1):
        self.w, self.b = w, b
        self.panel = torch.ops.specfork.panel_pack(w) if pack and panel_fits(w) else None
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS)
                       if pack and self.panel is None else None)
        self.min_rows = min_rows        # fewer rows go to F.linear (`packed_from_rows`)
        self.exact = False              # row-invariant: `Model.rows_exact` (see `_blocks`)

    def _packed_for(self, rows: int, exact: bool, bulk: bool) -> bool:
        if self.panel is not None:      # any row count computes a row's bits the same way
            return exact or rows <= (MAX_PROMPT_ROWS if bulk else MAX_PANEL_ROWS)
        return self.packed is not None and self.min_rows <= rows and (
            exact or rows <= (MAX_PROMPT_ROWS if bulk else MAX_PACKED_ROWS))

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """`bulk`: rows of prompts only (no decode or tree row), which need not be computed
        as a one-row step would: one GEMM call for all, row-invariant or not."""
        exact = self.exact and not bulk
        if self._packed_for(x.shape[0], exact, bulk):
            if self.panel is not None:
                return torch.ops.specfork.panel_linear(x, self.panel, self.b, None)
            if exact:
                return row_blocks(lambda a: torch.ops.mkldnn._linear_pointwise(
                    a, self.packed, self.b, "none", [], ""), x)
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.b, "none", [], "")
        return F.linear(x, self.w, self.b)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the pre-packed copy (0 when not packed)."""
        p = self.packed if self.panel is None else self.panel
        return 0 if p is None else p.numel() * p.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes it holds: weights, bias and the pre-packed copy."""
        return self.w.nbytes + (0 if self.b is None else self.b.nbytes) + self.packed_bytes

    def add_to(self, x: torch.Tensor, a: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """x + self(a): the residual add folded into the matmul."""
        exact = self.exact and not bulk
        if self._packed_for(a.shape[0], exact, bulk):
            if self.panel is not None:
                return torch.ops.specfork.panel_linear(a, self.panel, self.b, x)
            if exact:
                return row_blocks(lambda ai, xi: torch.ops.mkldnn._linear_pointwise.binary(
                    ai, xi, self.packed, self.b, "add"), a, x)
            return torch.ops.mkldnn._linear_pointwise.binary(a, x, self.packed, self.b, "add")
        if self.b is not None:
            return x + F.linear(a, self.w, self.b)
        return torch.addmm(x, a, self.w.t())


class HeadRows:
    """Some output rows as a matmul (`Model.head_rows`), `n` logits per row of x."""
    __slots__ = ("lin", "n")

    def __init__(self, lin, n: int):
        self.lin, self.n = lin, n

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        y = self.lin(x, bulk)
        return y if y.shape[-1] == self.n else y[:, :self.n]

    @property
    def nbytes(self) -> int:
        return self.lin.nbytes            # (a QuantLinear here has no bias)


def panel_fits(w: torch.Tensor) -> bool:
    """Whether `w` can run as panels here: float32 on a CPU whose build of the compiled ops
    has the AVX-512 kernel, outputs a multiple of 32 (SPECFORK_PANELS=0: never)."""
    if (w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2
            or w.shape[0] % 32 or os.environ.get("SPECFORK_PANELS", "1") == "0"):
        return False
    from specfork.kernels import slot_attention
    return slot_attention.available() and torch.ops.specfork.panel_native()


PACK_ROWS = 8              # oneDNN's layout hint: the row count the packing is tuned for
# decode, beams, draft trees, batches of requests (one forward's matmuls run packed 1.02-1.38x
# faster than F.linear from 16 to 256 rows, Xeon, 2 threads: `python eval/bench_linear.py
# --threads 2 --rows 1,16,32,64,128,256 --json results/linear_cpu_batch.json`); prompt rows
# alone (`bulk`) beyond MAX_PROMPT_ROWS keep HF's GEMM, so a prompt's logits stay HF's within
# 1e-4. Under `exact`, any row count runs packed: oneDNN's in EXACT_ROWS-row calls, panels in one.
MAX_PACKED_ROWS = 256
MAX_PANEL_ROWS = 64        # panels beyond: F.linear (oneDNN's blocking wins from 128 rows)
MAX_PROMPT_ROWS = 32
_PACKED_FROM: dict = {}    # (shapes, dtype, threads) -> packed_from_rows' answer, per process


@torch.inference_mode()
def packed_from_rows(lins: list[Linear], reps: int = 5) -> int:
    """The fewest rows from which the packed matmul beats F.linear on this machine, timed on
    `lins` (MAX_PACKED_ROWS + 1: never). Which wins depends on the CPU: on an AMD EPYC the packed
    path is 1.6x faster even for one row, on a Sapphire Rapids Xeon F.linear's one-row GEMV is
    faster and packing pays from 4 rows on (eval/bench_linear.py), so it is measured, not assumed
    (a fraction of a second, once per shape set, dtype and thread count)."""
    key = (tuple(tuple(x.w.shape) for x in lins), lins[0].w.dtype, torch.get_num_threads())
    if key not in _PACKED_FROM:
        wins = {}
        for r in (1, 2, 4, 8):
            xs = [torch.randn(r, x.w.shape[1], dtype=x.w.dtype) for x in lins]
            t = {True: [], False: []}
            for i in range(reps + 1):                # the first round warms both paths up
                for packed in (True, False):
                    start = time.perf_counter()
                    for a, x in zip(xs, lins):
                        if packed:
                            torch.ops.mkldnn._linear_pointwise(a, x.packed, x.b, "none", [], "")
                        else:
                            F.linear(a, x.w, x.b)
                    if i:
                        t[packed].append(time.perf_counter() - start)
            wins[r] = statistics.median(t[True]) < statistics.median(t[False])
        m = MAX_PACKED_ROWS + 1
        for r in (8, 4, 2, 1):
            if not wins[r]:
                break
            m = r
        _PACKED_FROM[key] = m
    return _PACKED_FROM[key]


@dataclass
class Layer:
    """One decoder layer. q|k|v and gate|up are each one matrix (fewer, larger matmuls); the
    HF modules' own parameters are re-pointed at row slices of them, so the plain weights exist
    once (beside `Linear`'s packed copy) and the HF model keeps working."""
    ln1: torch.Tensor
    qkv: Linear                  # [(H + 2*KVH) * D, hidden]
    o: Linear
    ln2: torch.Tensor
    gate_up: Linear              # [2 * intermediate, hidden]
    down: Linear


def _fuse(mods: list, name: str) -> torch.Tensor | None:
    """Concatenate `mods[i].<name>` along dim 0 and re-point each at its slice (no second copy)."""
    parts = [getattr(m, name) for m in mods]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.data for p in parts])
    start = 0
    for p in parts:
        p.data = fused[start:start + p.shape[0]]
        start += p.shape[0]
    return fused


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """As HF: normalise in fp32, scale in the model dtype."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, w.shape, w, eps)               # one op, bit-equal to HF's in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x `[T, heads, D]`; cos, sin_signed `[T, 1, D]` from `Model.rope`. HF's rotate-half,
    x*cos + cat(-x2, x1)*sin, as x*cos + flip_halves(x)*cat(-sin1, sin2): three ops."""
    T, n, D = x.shape
    rot = x.view(T, n, 2, D // 2).flip(2).view(T, n, D)
    return torch.addcmul(x * cos, rot, sin_signed)


def fused_ops_enabled() -> bool:
    """The fused small-op switch (norms, RoPE, SiLU-mul; SPECFORK_FUSED_OPS=0: off), shared by
    the Model and the EAGLE head, which runs them under its own int4 weights."""
    return os.environ.get("SPECFORK_FUSED_OPS", "1") != "0"


def rope_dynamic(rotary) -> bool:
    """RoPE whose frequencies follow the sequence length (dynamic NTK, LongRoPE): no table."""
    kind = str(getattr(rotary, "rope_type", "default"))
    return "dynamic" in kind or kind == "longrope"


def rope_rows(rotary, ref: torch.Tensor, table: tuple | None, positions: torch.Tensor):
    """(table, cos, sin_signed `[T, 1, D]`) at `positions [T]` (T > 0) from `table`, rows of
    `rope_tables` by position, grown by doubling when a position lies past its end: HF's rotary
    module is a dozen small ops a call, and its values are elementwise in the position, so a
    table row equals the module's output for that position alone (not for `rope_dynamic`)."""
    T = positions.shape[0]
    p0 = int(positions[0])
    last = p0 if T == 1 else int(positions.max())
    n = 0 if table is None else table[0].shape[0]
    if last >= n:
        cos, sin = rope_tables(rotary, ref, torch.arange(n, max(2 * n, last + 1, 256)))
        table = (cos, sin) if table is None else (
            torch.cat((table[0], cos)), torch.cat((table[1], sin)))
    if T == 1:                                       # a decode step: views, no copy
        return table, table[0][p0:p0 + 1], table[1][p0:p0 + 1]
    return table, table[0][positions], table[1][positions]


def rope_tables(rotary, ref: torch.Tensor, positions: torch.Tensor):
    """cos, sin_signed `[T, 1, D]` from an HF rotary module itself (covers Llama 3.1 scaling
    etc.; `ref` gives dtype and device); sin_signed = cat(-sin[:D/2], sin[D/2:]) for
    `apply_rope`."""
    cos, sin = rotary(ref[:1], positions[None])
    half = cos.shape[-1] // 2
    sin = torch.cat((-sin[0, :, :half], sin[0, :, half:]), -1)
    return cos[0, :, None], sin[:, None]


# How `layer_stack.cpp` runs each matmul: the call Linear / QuantLinear would make
(LINEAR, PACKED, PACKED_BLOCKS, BF16_LINEAR, BF16_PACKED, INT8, INT4, LOWBIT4, LOWBIT8,
 LOWBIT16, PANEL) = range(11)
MATMULS = ("qkv", "o", "gate_up", "down")


def _stack_kind(lin, rows: int) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """(kind, the tensor it multiplies by, scales) of one matmul over `rows` non-prompt rows."""
    if isinstance(lin, QuantLinear):
        if lin.bits:
            return {4: LOWBIT4, 8: LOWBIT8, 16: LOWBIT16}[lin.bits], lin.w, lin.s
        if lin.fmt == "bfloat16":
            return ((BF16_LINEAR, lin.w, None) if lin.packed is None
                    else (BF16_PACKED, lin.packed, None))
        return (INT8 if lin.fmt == "int8" else INT4), lin.w, lin.s
    if lin._packed_for(rows, lin.exact, False):
        if lin.panel is not None:
            return PANEL, lin.panel, None
        return (PACKED_BLOCKS if lin.exact else PACKED), lin.packed, None
    return LINEAR, lin.w, None


class Model:
    """Plain-tensor forward of a causal LM whose K/V live in a `BlockPool`."""

    # Default KV block size: one token. Attention reads K/V slot by slot (the CPU gathers and
    # the Triton kernel's block-table loads alike), so larger blocks would buy nothing and cost
    # a partial tail block per branch plus copy-on-write copies (SGLang's page size 1).
    block_size = 1

    def __init__(self, hf, pack: bool | None = None, weights: str = "float32",
                 kv_cache: str = "auto", kv_window: int = 0):
        """`pack`: keep packed copies of the weights for few-row matmuls, specfork's panels or
        oneDNN's (`Linear`; None: on CPU in fp32, or bf16 where the CPU has bf16 GEMMs, when
        the copies take at most 4 GiB).
        `weights`: the matmuls' weight format (`specfork/weights.py`; float32: as loaded).
        `kv_cache`: the format of every pool `make_pool` makes (`specfork/kv_quant.py`; auto:
        `resolve_kv`, float16 under low-bit weights on a CPU, else the model's dtype)."""
        cfg = hf.config
        if cfg.model_type not in SUPPORTED:
            raise UnsupportedModel(f"model type '{cfg.model_type}' is not supported "
                                   f"(supported: {', '.join(SUPPORTED)})")
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise UnsupportedModel(f"activation '{cfg.hidden_act}' is not supported")
        self.hf = hf
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.vocab_size = cfg.vocab_size
        self.eps = cfg.rms_norm_eps
        self.max_positions = cfg.max_position_embeddings
        self.scale = self.head_dim ** -0.5
        body = hf.model
        self.embed = body.embed_tokens.weight
        self.norm = body.norm.weight
        self.rotary = body.rotary_emb
        self._rope_dynamic = rope_dynamic(self.rotary)
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None    # CPU: `rope`'s table
        self.dtype, self.device = self.embed.dtype, self.embed.device

        self.weights = resolve(weights, self.device, *(
            ([getattr(b.self_attn, f).weight for b in body.layers
              for f in ("q_proj", "k_proj", "v_proj", "o_proj")]
             + [getattr(b.mlp, f).weight for b in body.layers
                for f in ("gate_proj", "up_proj", "down_proj")], hf.lm_head.weight)
            if weights == "auto" else ()))
        low = self.weights != "float32"
        self.kv_cache = resolve_kv(kv_cache, low, self.dtype, self.device, self.head_dim)
        self.kv_codecs = layer_codecs(self.kv_cache, self.num_layers, self.head_dim, self.dtype,
                                      self.device)
        self.kv_window, self.kv_sink = check_window(kv_window, self.kv_cache, self.head_dim,
                                                    self.device)
        # A stored K/V format other than the model's dtype (float16 or TurboQuant codes) turns
        # last-bit differences into different stored values, and low-bit weights round every
        # matmul differently: under either, a verify tree's token must be computed bit for bit
        # as a decode step at its position would compute it, or greedy speculation drifts from
        # plain decoding at near-ties. Its attention then reads row by row
        # (specfork/attention.py), and every matmul with a decode or tree row in it (a batch of
        # requests too) gives a row the same bits in any call: specfork's low-bit kernel and
        # float32 panels by construction, torch's packed bf16 one in calls of exactly EXACT_ROWS
        # rows (`weights.row_blocks`); prompt-only forwards (`bulk`) need not.
        self.rows_exact = low or self.kv_codecs is not None
        if low:
            pack = False                           # the format's own copy replaces the packing
        if pack is None:
            pack = (self.device.type == "cpu" and torch.backends.mkldnn.is_available()
                    and (self.dtype == torch.float32 or self.dtype == torch.bfloat16
                         and torch.ops.mkldnn._is_mkldnn_bf16_supported())
                    and sum(p.nbytes for p in hf.parameters()) <= 4 << 30)
        self.pack = pack
        self.lm_head = Linear(hf.lm_head.weight, pack=pack)
        self.layers = []
        for blk in body.layers:
            a, m = blk.self_attn, blk.mlp
            qkv = [a.q_proj, a.k_proj, a.v_proj]
            self.layers.append(Layer(
                ln1=blk.input_layernorm.weight,
                qkv=Linear(_fuse(qkv, "weight"), _fuse(qkv, "bias"), pack),
                o=Linear(a.o_proj.weight, a.o_proj.bias, pack),
                ln2=blk.post_attention_layernorm.weight,
                gate_up=Linear(_fuse([m.gate_proj, m.up_proj], "weight"), pack=pack),
                down=Linear(m.down_proj.weight, pack=pack)))
        if low:
            self.lm_head = QuantLinear(self.lm_head.w, self.lm_head.b, HEAD_FORMAT[self.weights])
            for ly in self.layers:
                for f in MATMULS:
                    lin = getattr(ly, f)
                    setattr(ly, f, QuantLinear(lin.w, lin.b, self.weights))
        # Under specfork's low-bit kernels the layers' small ops run fused
        # (`kernels/layer_ops.cpp`), in the Python loop and the compiled one alike; float32 keeps
        # torch's, whose bits match HF's. SPECFORK_FUSED_OPS=0 turns it off.
        self.fused_ops = (fused_ops_enabled() and low
                          and self.head_dim % 32 == 0
                          and all(getattr(ly, f).bits for ly in self.layers for f in MATMULS))
        self._stacks: dict = {}                 # matmul kinds -> layer_stack's weight lists
        # below this many rows F.linear is faster here; 1 when not packed (it is then unused)
        self.packed_min_rows = 1
        if pack:
            ly = self.layers[0]
            one = [x for x in (ly.qkv, ly.o, ly.gate_up, ly.down, self.lm_head)
                   if x.packed is not None]                    # oneDNN's (panels need none)
            if one and not self.rows_exact:
                self.packed_min_rows = packed_from_rows(one)
            for x in self.linears():
                x.min_rows = self.packed_min_rows
                x.exact = self.rows_exact

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The layers' RMSNorm: fused under `fused_ops`, else `rms_norm` (HF's bits in fp32)."""
        if self.fused_ops:
            return torch.ops.specfork.rms_norm(x, w, self.eps)
        return rms_norm(x, w, self.eps)

    @torch.inference_mode()
    def calibrate_kv(self, ids: list[int]) -> None:
        """Centre the keys of a TurboQuant KV format on their per-head mean over one forward of
        `ids` (a text of no benchmark: `kv_calibration_ids`), taken at full precision. A no-op
        for other formats."""
        if not self.kv_codecs or not self.kv_codecs[0][0].rotated:
            return
        codecs, self.kv_codecs = self.kv_codecs, None
        try:
            pool = self.make_pool(num_blocks=len(ids))
            slots = torch.arange(len(ids), device=self.device)
            self.forward(torch.tensor(ids, device=self.device),
                         torch.arange(len(ids), device=self.device), pool,
                         AttnMeta.prefill(self, slots[:0], slots), logits_idx=slice(0, 0))
        finally:
            self.kv_codecs = codecs
        keys = pool.k[:, 1:, 0].float()               # [layers, tokens - 1, KVH, D] post-RoPE
        for (kc, _), mu in zip(codecs, keys.mean(1)):
            kc.set_center(mu)

    def _stack_slots(self, meta) -> tuple | None:
        """The slot lists (idx, offs) when every row of this forward attends through the slot
        op (decode steps, ROWS trees, batches of only those): its layer loop then runs as one
        compiled op, `kernels/layer_stack.cpp`, which makes the same ATen calls as the loop
        below (same bits) without the interpreter between them. Float pools only (float16 too: it
        rounds the new rows as the loop's FloatCodec does); a TurboQuant pool takes the loop
        below, which codes each layer's new rows. SPECFORK_LAYER_STACK=0: off."""
        groups = getattr(meta, "groups", None)
        slots = (groups[0][2] if len(groups) == 1 else None) if groups is not None else meta.slots
        coded = self.kv_codecs is not None and not all(half_slots(c) for c in self.kv_codecs[0])
        if slots is None or meta.write is None or coded or os.environ.get(
                "SPECFORK_LAYER_STACK") == "0":
            return None
        return slots

    def _stack_weights(self, rows: int) -> tuple:
        """(kinds, norms, w, s, b) for layer_stack over `rows` rows, built once per kinds."""
        plan = [_stack_kind(getattr(self.layers[0], f), rows) for f in MATMULS]
        kinds = tuple(k for k, _, _ in plan)
        if kinds not in self._stacks:
            norms, w, s, b = [], [], [], []
            for ly in self.layers:
                norms += [ly.ln1, ly.ln2]
                for f, want in zip(MATMULS, kinds):
                    lin = getattr(ly, f)
                    kind, wt, sc = _stack_kind(lin, rows)
                    if kind != want:
                        raise SpecforkError(f"layer_stack: layers differ in how {f} runs")
                    w.append(wt)
                    s.append(sc)
                    b.append(lin.b)
            self._stacks[kinds] = (list(kinds), norms, w, s, b)
        return self._stacks[kinds]

    def head_rows(self, ids: torch.Tensor) -> "HeadRows":
        """The output layer's rows `ids` as one matmul in this model's weight format (a draft's
        vocabulary head: logits over `ids` only). Under a low-bit format they are quantized from
        the HF weights as lm_head's own rows are (a multiple of 16 rows, zero rows padding)."""
        w = self.hf.lm_head.weight.detach()
        ids = ids.to(w.device)
        if self.weights == "float32":
            return HeadRows(Linear(w.index_select(0, ids), pack=self.pack,
                                   min_rows=self.packed_min_rows), len(ids))
        rows = w.index_select(0, ids).float()
        pad = -len(ids) % 16
        if pad:
            rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
        return HeadRows(QuantLinear(rows, None, HEAD_FORMAT[self.weights]), len(ids))

    def linears(self) -> list:
        """Every matmul of the forward (`Linear`, or `QuantLinear` under a low-bit format)."""
        return [self.lm_head] + [getattr(ly, f) for ly in self.layers
                                 for f in MATMULS]

    def packed_bytes(self) -> int:
        """Bytes of the pre-packed weight copies this Model keeps beside the HF weights."""
        return sum(x.packed_bytes for x in self.linears())

    def make_pool(self, num_blocks: int | None = None, max_bytes: int | None = None,
                  block_size: int | None = None) -> BlockPool:
        """A block pool in this model's KV format (`kv_cache`)."""
        block_size = block_size or self.block_size
        return BlockPool(self.num_layers, self.kv_heads, self.head_dim, block_size=block_size,
                         num_blocks=num_blocks, max_bytes=max_bytes, dtype=self.dtype,
                         device=self.device, codecs=self.kv_codecs,
                         window=self.kv_window if self.kv_codecs else 0,
                         sink=self.kv_sink if self.kv_codecs else 0)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin_signed `[T, 1, D]` at `positions`: on a CPU, rows of this model's table
        (`rope_rows`); RoPE types whose frequencies follow the sequence length, and GPUs, call
        the module."""
        if positions.device.type != "cpu" or self._rope_dynamic or positions.shape[0] == 0:
            return rope_tables(self.rotary, self.embed, positions)
        self._rope, cos, sin = rope_rows(self.rotary, self.embed, self._rope, positions)
        return cos, sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, pool: BlockPool,
                meta: AttnMeta, logits_idx: torch.Tensor | slice | None = None,
                head: Linear | None = None, capture: tuple[int, ...] | None = None):
        """Logits `[T', V]` for `tokens [T]` at `positions [T]` (`[T', K]` over the K rows of
        `head`, a vocabulary subset of lm_head, where one is given). What the new tokens read,
        write and see is `meta`, built once per step (`specfork/attention.py`).

        With `capture` it returns (logits, features `[T, len(capture) * hidden]`): the residual
        stream entering each listed layer (EAGLE-3 reads layers 2, L/2, L-3), or, for index L,
        the final norm's output (EAGLE-1), for every new token. Keeping them costs nothing: each
        layer makes a fresh residual tensor anyway."""
        T = tokens.shape[0]
        H, KVH, D = self.num_heads, self.kv_heads, self.head_dim
        nq, nqk = H * D, (H + KVH) * D
        bulk = getattr(meta, "bulk", False)
        x = self.embed[tokens]                                           # [T, hidden]
        cos, sin = self.rope(positions)
        write, src = meta.write, meta.write_src
        kept = {}
        shadow = None                    # a KV window: float16 shadow rows of the new tokens
        if pool.sk is not None and write is not None:
            shadow = pool.shadow_slots(write)
            pool.fresh.clear()           # written below: a sweep may now weigh them
        slots = self._stack_slots(meta)
        if slots is not None:
            kinds, norms, w, s, b = self._stack_weights(T)
            layers = sorted({i for i in (capture or ()) if i < self.num_layers})
            x, got = torch.ops.specfork.layer_stack(
                x, norms, w, s, b, kinds, cos, sin, pool.k, pool.v, write, src, *slots,
                [H, KVH, D], self.eps, self.scale, layers, self.fused_ops)
            kept = dict(zip(layers, got))
        for i, ly in enumerate(self.layers if slots is None else ()):
            if capture is not None and i in capture:
                kept[i] = x
            qkv = ly.qkv(self.rms_norm(x, ly.ln1), bulk)                # [T, (H+2KVH)*D]
            if self.fused_ops:
                torch.ops.specfork.rope_(qkv, cos, sin, H + KVH, D)
                q, k = qkv[:, :nq].view(T, H, D), qkv[:, nq:nqk].view(T, KVH, D)
            else:
                qk = apply_rope(qkv[:, :nqk].view(T, H + KVH, D), cos, sin)
                q, k = qk[:, :H], qk[:, H:]
            v = qkv[:, nqk:].view(T, KVH, D)
            kf, vf = pool.layer_slots(i)                                # [slots, KVH, D]
            if pool.codecs is not None:          # stored, then read back: as every later read
                kc, vc = pool.codecs[i]
                if shadow is not None:           # centred and rotated as the codes, in float16
                    sk, sv = pool.layer_shadows(i)
                    for rows, c, new in ((sk, kc, k), (sv, vc, v)):
                        h = (c.prepare(new) @ c.RT).half()
                        rows.index_copy_(0, shadow, h if src is None else h.index_select(0, src))
                if kc.rotated:
                    (k, kr), (v, vr) = kc.encode_decode_pair(vc, k, v)
                else:
                    (k, kr), (v, vr) = kc.encode_decode(k), vc.encode_decode(v)
            if write is not None:
                kf.index_copy_(0, write, k if src is None else k.index_select(0, src))
                vf.index_copy_(0, write, v if src is None else v.index_select(0, src))
            if pool.codecs is None:
                a = meta.attend(q, k, v, kf, vf, self.scale)
            else:                                # TurboQuant: rotated query, rotated values
                if kc.rotated:
                    q = kc.rotate_query(q)
                ks = StoredSlots(kf, kc)
                if pool.sk is not None:
                    ks.window = (*pool.layer_shadows(i), pool.shadow_of, pool.block_size,
                                 pool.window, pool.sink)
                a = meta.attend(q, kr, vr, ks, StoredSlots(vf, vc), self.scale)
                if vc.rotated:
                    a = vc.unrotate(a)
            x = ly.o.add_to(x, a.reshape(T, nq), bulk)
            gu = ly.gate_up(self.rms_norm(x, ly.ln2), bulk)
            if self.fused_ops:
                x = ly.down.add_to(x, torch.ops.specfork.silu_mul(gu), bulk)
            else:
                g, u = gu.chunk(2, dim=-1)
                x = ly.down.add_to(x, F.silu(g) * u, bulk)
        if capture is not None:
            if self.num_layers in capture:               # EAGLE-1: every row's final norm
                kept[self.num_layers] = self.rms_norm(x, self.norm)
            feats = torch.cat([kept[i] for i in capture], dim=-1)
        if shadow is not None and shadow.numel() > pool.window:
            pool.sweep_shadows()         # a prompt chunk: keep only what windows read next
        if logits_idx is not None:
            x = x[logits_idx]
        logits = (self.lm_head if head is None else head)(self.rms_norm(x, self.norm))
        return logits if capture is None else (logits, feats)
