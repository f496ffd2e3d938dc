"""One attention-metadata object per forward, in the spirit of nano-vllm's `Context`: which
KV-tree slots the new tokens read and write, what each of them may see, and which attention
path runs. A named constructor builds it once per step (`prefill`, `tree`, `branches`) and moves
every index and mask to the device there, in one copy, so the layer loop only indexes tensors
already in place and `Model.forward` stays the model.

Paths (`pick_path` chooses):
  decode   one token after a linear cache: one gather of prefix + its own slot, two bmm's
  causal   prefill over an empty prefix on GPU: fused `is_causal` SDPA, no T x T scores
  paged    GPU trees (and prefill over a prefix): the Triton cascade reads the pool in place
  masked   tokens that each see their own prefix subset, or a short prefix on CPU: two bmm's
           under one additive mask
  cascade  CPU otherwise: the prefix dense, the tree under its mask, merged by log-sum-exp

On a CPU, decode and cascade read the leading run of consecutive prefix slots (a prompt's: the
pool hands large allocations out in order) as a view of the pool and gather only the rest: a
per-layer gather of a 3K-token prefix cost more than the attention that reads it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.errors import SpecforkError
from specfork.kernels import slot_attention as slot_op
from specfork.kernels.dense_attention import causal_attention, decode_attention, masked_attention
from specfork.kernels.tree_attention import (_flash_cpu, tree_attention, tree_attention_torch,
                                             tree_bias_of)

DECODE, CAUSAL, PAGED, MASKED, CASCADE = "decode", "causal", "paged", "masked", "cascade"
# Under low-bit weights (model.rows_exact) every matmul rounds its input (int8/int4 quantize the
# rows to 8 bits, where a last-bit change can move a code), and under TurboQuant KV a last-bit
# difference in a key can pick another code: either turns last-bit differences between
# attention paths into flipped tokens. There a verify tree attends row by row exactly as a
# decode step at that position would (the same keys in the same order through the same op),
# decode steps gather their keys in one piece, and, where the slot op runs, so do a prompt's
# rows: a prompt then leaves the same K/V and logits however it is cut into chunks or found in
# the prefix cache (a causal SDPA over the whole prompt and a one-row step after a cached
# prefix gave logits 0.8 apart under int4's 8-bit activations, and other greedy outputs).
ROWS = "rows"

# A tree this small over a prefix this short (and not passing its own prefix_mask) attends with
# two plain bmm's under one additive mask built per forward instead of the cascade's two flash
# calls, whose fixed cost dominates there. results/tree_attention_cpu.json (one SmolLM2 layer, one
# thread; `python eval/bench_tree_attention.py --threads 1 --json results/tree_attention_cpu.json`):
# for trees of 2-32 tokens the bmm's are 1.05-1.6x faster up to 384 prefix tokens and the cascade
# wins from 512-1024 on; a 64-token tree takes the cascade at 0.5-0.6x their time from 256 on.
SHORT_PREFIX, SHORT_TREE = 384, 32
RUN_MIN = 64               # a run of consecutive prefix slots this long is read in place (CPU)


def pick_path(T: int, L: int, *, gpu: bool, causal: bool, per_query: bool,
              plain_write: bool) -> str:
    """The attention path for T new tokens over L prefix slots. `per_query`: each token reads
    its own subset of the prefix (only the masked bmm's take that); `causal`: the new tokens
    are a causal chain (prefill); `plain_write`: new row i goes to write slot i, so one token
    can read prefix + its own slot in one gather."""
    if per_query:
        return MASKED
    if causal and L == 0 and (gpu or T > 1):      # CPU too: 3300 tokens in 4.05 s, cascade 5.71
        return CAUSAL                              # (results/prefill_cpu.json)
    if T == 1 and plain_write:
        return DECODE
    if gpu:
        return PAGED
    if 0 < L <= SHORT_PREFIX and 1 < T <= SHORT_TREE:
        return MASKED
    return CASCADE


@dataclass
class AttnMeta:
    """Everything a forward's attention needs, on the model's device. `read` are the prefix
    slots `[L]` (decode: `[L+1]`, the new token's own slot last); the new K/V row
    `write_src[j]` (None: row j) goes to slot `write[j]`, so a tree node that lies on several
    draft forks is written once per fork; `table` is `read` as int32, the block table of the
    pool viewed as one-token pages (the Triton kernel's, whatever the pool's block size)."""
    path: str
    prefix_len: int
    read: torch.Tensor
    write: torch.Tensor | None = None
    write_src: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None     # [T, T] bool (not on decode, causal)
    bias: torch.Tensor | None = None          # additive 0/-inf: cascade [T, T], masked [T*G, L+T]
    table: torch.Tensor | None = None         # [L] int32 (paged)
    rows: list | None = None                  # ROWS: per tree row, its ancestors (and itself)
    run: tuple[int, int] | None = None        # CPU decode/cascade: (first slot, length) of the
    #                                           prefix's leading run, read as a view; `read`
    #                                           then holds only the slots after it
    bulk: bool = False                        # prompt rows only (a causal chain of > 1 token)
    slots: tuple | None = None                # CPU decode / ROWS through the slot op: (idx,
    #                                           offs), offs [R+1] (row r reads idx[offs[r] :
    #                                           offs[r+1]]) or [R, 4] (a, b, c, d: idx[a:b],
    #                                           then idx[c:d]; rows share one list)

    @classmethod
    def prefill(cls, model, prefix: torch.Tensor, write: torch.Tensor) -> "AttnMeta":
        """`write.numel()` new tokens, a causal chain after the prefix slots `prefix [L]`
        (one token: a decode step)."""
        return cls._build(model, write.numel(), prefix, write, causal=True)

    @classmethod
    def tree(cls, model, prefix: torch.Tensor, tree_mask: torch.Tensor,
             write: torch.Tensor | None = None,
             write_src: torch.Tensor | None = None) -> "AttnMeta":
        """A draft tree over `prefix [L]`: token i sees the prefix and token j where
        `tree_mask [T, T]` is True (its ancestors and itself). `write` None: score the tree
        without storing its K/V."""
        return cls._build(model, tree_mask.shape[0], prefix, write, write_src,
                          tree_mask=tree_mask)

    @classmethod
    def branches(cls, model, prefix: torch.Tensor, write: torch.Tensor,
                 prefix_mask: torch.Tensor, tree_mask: torch.Tensor | None = None) -> "AttnMeta":
        """New tokens of several branches over the union of their prefixes `prefix [L]`:
        token i sees prefix slot l where `prefix_mask [T, L]` is True, and new token j where
        `tree_mask [T, T]` is (None: only itself)."""
        T = prefix_mask.shape[0]
        if tree_mask is None:
            tree_mask = torch.eye(T, dtype=torch.bool, device=prefix_mask.device)
        return cls._build(model, T, prefix, write, tree_mask=tree_mask, prefix_mask=prefix_mask)

    @classmethod
    def lists(cls, model, prefixes: list[torch.Tensor], write: torch.Tensor) -> "AttnMeta":
        """One new token per branch (beams): row r reads its branch's prefix `prefixes[r]`,
        then its own slot `write[r]`, through the slot op (`uses_slot_op(model)`), so each row
        computes as a lone decode step of its branch would, and the forward can run as the
        compiled layer loop. The slots every branch starts with (the prompt, the beams' common
        start) are listed once and read together."""
        pre = [p.cpu().long() for p in prefixes]
        m = min(p.numel() for p in pre)
        head = pre[0][:m]
        for p in pre[1:]:
            differ = torch.nonzero(p[:m] != head)
            if differ.numel():
                m = int(differ[0])
                head = head[:m]
        w = write.cpu().long()
        tails = [torch.cat((p[m:], w[r:r + 1])) for r, p in enumerate(pre)]
        offs = _head_rows(m, torch.tensor([t.numel() for t in tails]))
        return cls(ROWS, m, *_to_device(model.device, head, write),
                   slots=(torch.cat([head] + tails), offs))

    @classmethod
    def _build(cls, model, T: int, prefix: torch.Tensor, write: torch.Tensor | None,
               write_src: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
               prefix_mask: torch.Tensor | None = None, causal: bool = False) -> "AttnMeta":
        dev, L = model.device, prefix.numel()
        path = pick_path(T, L, gpu=dev.type == "cuda", causal=causal,
                         per_query=prefix_mask is not None,
                         plain_write=write is not None and write_src is None)
        exact = getattr(model, "rows_exact", False) and dev.type == "cpu"
        if exact and prefix_mask is None and (not causal or (
                T > 1 and write is not None and write_src is None and uses_slot_op(model))):
            path = ROWS                    # prompt rows too: see ROWS
        if path in (DECODE, ROWS) and uses_slot_op(model):
            if path == DECODE:             # the prefix, then its own slot: one list for both
                read = torch.cat((prefix, write)).long()
                return cls(path, L, read, write, slots=(read, torch.tensor([0, L + 1])))
            slots = (_causal_rows(prefix, write) if causal
                     else _tree_rows(prefix, tree_mask, write, write_src))
            if slots is not None:
                return cls(path, L, *_to_device(dev, prefix, write, write_src),
                           tree_mask=tree_mask, bulk=causal and T > 1, slots=slots)
        run = None
        if dev.type == "cpu" and path in (DECODE, CASCADE) and L >= RUN_MIN and not exact and (
                path == DECODE or _flash_cpu is not None):
            r = leading_run(prefix)
            if r >= RUN_MIN:
                run, prefix = (int(prefix[0]), r), prefix[r:]
        read = torch.cat((prefix, write)) if path == DECODE else prefix
        read, write, write_src = _to_device(dev, read, write, write_src)
        meta = cls(path, L, read, write, write_src, run=run, bulk=causal and T > 1)
        if path in (DECODE, CAUSAL):
            return meta
        if path == ROWS:                   # row i's keys: the prefix, then its tree ancestors
            meta.tree_mask = tree_mask
            meta.rows = [torch.nonzero(r).flatten().to(dev) for r in tree_mask.cpu()]
            return meta
        if tree_mask is None:              # prefill; a tree's mask is never None
            tree_mask = causal_mask(T, dev)
        tree_mask = meta.tree_mask = tree_mask.to(dev)
        if path == PAGED:
            meta.table = read.to(torch.int32)
        elif path == CASCADE:
            meta.bias = tree_bias_of(tree_mask, model.dtype)
            if run is not None and read.numel():    # the gathered rest: seen by every token
                tb = meta.bias if meta.bias is not None else torch.zeros(
                    T, T, dtype=model.dtype, device=dev)
                meta.bias = torch.cat((torch.zeros(T, read.numel(), dtype=model.dtype,
                                                   device=dev), tb), dim=1)
        else:                              # MASKED; without a prefix mask: all of a short prefix
            if prefix_mask is None:
                prefix_mask = torch.ones(T, L, dtype=torch.bool, device=dev)
            see = torch.cat([prefix_mask.to(dev), tree_mask], dim=1)     # [T, L+T]
            bias = torch.full(see.shape, float("-inf"), dtype=model.dtype, device=dev)
            meta.bias = bias.masked_fill_(see, 0.0).repeat_interleave(
                model.num_heads // model.kv_heads, dim=0)               # row t*G+g: token t
        return meta

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots: torch.Tensor,
               v_slots: torch.Tensor, scale: float) -> torch.Tensor:
        """One layer: q `[T, H, D]`, the new k/v `[T, KVH, D]` (already written), the layer's
        pool as slot arrays `[slots, KVH, D]` (or `StoredSlots` that decode what is read)
        -> `[T, H, D]`."""
        if self.slots is not None:
            return slot_attend(q, k_slots, v_slots, self.slots, scale)
        if getattr(k_slots, "window", None) is not None:
            raise SpecforkError("--kv-window: this attention (several branches over a shared "
                                "prefix, or a tree written to no slots) reads no window yet")
        if self.run is not None:                  # CPU decode / cascade over a long prefix
            a, r = self.run
            kr, vr = k_slots[a:a + r], v_slots[a:a + r]                  # views, no copy
            kx, vx = k_slots.index_select(0, self.read), v_slots.index_select(0, self.read)
            if self.path == DECODE:
                return decode_attention(q, kr, vr, scale, kx, vx)
            if self.read.numel():
                k, v = torch.cat((kx, k)), torch.cat((vx, v))
            return tree_attention_torch(q, kr, vr, k, v, self.tree_mask, scale,
                                        tree_bias=self.bias)
        if self.path == DECODE:
            return decode_attention(q, k_slots.index_select(0, self.read),
                                    v_slots.index_select(0, self.read), scale)
        if self.path == ROWS:
            kp, vp = k_slots.index_select(0, self.read), v_slots.index_select(0, self.read)
            return torch.cat([decode_attention(q[i:i + 1], torch.cat((kp, k.index_select(0, a))),
                                               torch.cat((vp, v.index_select(0, a))), scale)
                              for i, a in enumerate(self.rows)])
        if self.path == CAUSAL:
            return causal_attention(q, k, v, scale)
        if self.path == PAGED and not isinstance(k_slots, torch.Tensor):
            kl, vl = _kernel_layout(k_slots.codec, q), _kernel_layout(v_slots.codec, q)
            if kl is not None and vl is not None:     # TurboQuant: the kernel decodes pages
                pages = (-1, 1) + tuple(k_slots.raw.shape[1:])
                return tree_attention(q, k_slots.raw.view(pages),
                                      v_slots.raw.view((-1, 1) + tuple(v_slots.raw.shape[1:])),
                                      self.table, self.prefix_len, k, v, self.tree_mask,
                                      scale, codes=kl + vl)
            # other stored formats: the prefix decoded in one gather, then the same kernel
            # over it as one-token pages in order
            kp, vp = k_slots.index_select(0, self.read), v_slots.index_select(0, self.read)
            pages = (-1, 1) + tuple(kp.shape[1:])
            table = torch.arange(kp.shape[0], dtype=torch.int32, device=kp.device)
            return tree_attention(q, kp.view(pages), vp.view(pages), table, self.prefix_len,
                                  k, v, self.tree_mask, scale)
        if self.path == PAGED:
            pages = (-1, 1) + tuple(k_slots.shape[1:])                # one-token pages
            return tree_attention(q, k_slots.view(pages), v_slots.view(pages), self.table,
                                  self.prefix_len, k, v, self.tree_mask, scale)
        kp, vp = k_slots.index_select(0, self.read), v_slots.index_select(0, self.read)
        if self.path == MASKED:
            return masked_attention(q, kp, vp, k, v, self.bias, scale)
        return tree_attention_torch(q, kp, vp, k, v, self.tree_mask, scale, tree_bias=self.bias)


class BatchMeta:
    """Several requests in one forward: each request's rows (a prefill chunk, a decode step or
    a verify tree over its own prefix) attend under their own `AttnMeta`; the rows are
    concatenated request after request, so the matmuls run once over all of them while
    attention stays block-diagonal (no request sees another's slots, and each keeps the path
    it would take alone, so its rows compute as they would in a forward of its own)."""

    def __init__(self, metas: list[AttnMeta], sizes: list[int]):
        self.metas, self.sizes = metas, sizes                 # sizes[i]: request i's rows
        self.path = "batch"
        self.bulk = all(m.bulk for m in metas)
        writes, srcs, start = [], [], 0
        for m, n in zip(metas, sizes):
            if m.write is not None:
                writes.append(m.write)
                src = m.write_src if m.write_src is not None else torch.arange(
                    m.write.numel(), device=m.write.device)
                srcs.append(src + start)
            start += n
        self.write = torch.cat(writes) if writes else None
        plain = all(m.write is not None and m.write_src is None and m.write.numel() == n
                    for m, n in zip(metas, sizes))
        self.write_src = None if plain or self.write is None else torch.cat(srcs)
        # consecutive requests that go through the slot op share one call per layer (all of
        # them in an all-decode batch); the others attend one by one on their own paths
        self.groups, start = [], 0
        for m, n in zip(metas, sizes):
            last = self.groups[-1] if self.groups else None
            if m.slots is not None and last is not None and last[2] is not None:
                last[1] += n
                last[2].append(m.slots)
            else:
                self.groups.append([start, n, [m.slots] if m.slots is not None else None, m])
            start += n
        for g in self.groups:
            if g[2] is not None:
                g[2] = _merge_slots(g[2])

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_slots, v_slots,
               scale: float) -> torch.Tensor:
        outs = []
        for a, n, slots, m in self.groups:
            if slots is not None:
                outs.append(slot_attend(q[a:a + n], k_slots, v_slots, slots, scale))
            else:
                outs.append(m.attend(q[a:a + n], k[a:a + n], v[a:a + n], k_slots, v_slots,
                                     scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _merge_slots(parts: list) -> tuple:
    """Several (idx, offs) slot lists as one, rows in order."""
    if len(parts) == 1:
        return parts[0]
    base = torch.tensor([0] + [i.numel() for i, _ in parts[:-1]]).cumsum(0)
    idx = torch.cat([i for i, _ in parts])
    if all(o.dim() == 1 for _, o in parts):
        return idx, torch.cat([parts[0][1][:1]] + [o[1:] + b for (_, o), b in zip(parts, base)])
    return idx, torch.cat([_ranges(o) + b for (_, o), b in zip(parts, base)])


def _ranges(offs: torch.Tensor) -> torch.Tensor:
    """Slot offsets in the [R, 4] form (a, b, c, d)."""
    if offs.dim() == 2:
        return offs
    z = torch.zeros_like(offs[1:])
    return torch.stack((offs[:-1], offs[1:], z, z), dim=1)


def uses_slot_op(model) -> bool:
    """Decode steps and ROWS trees go through the compiled slot op (`kernels/slot_attention`):
    float32 K/V in plain slots, or TurboQuant codes (`kernels/code_attention`), on a CPU whose
    vector path covers the head size. Not under tensor parallelism for now (a precaution while
    a Ctrl-C test of the ranks fails in full suite runs, on an AMD EPYC and a Xeon alike;
    turning the op off there did not cure it)."""
    codecs = getattr(model, "kv_codecs", None)
    return (model.device.type == "cpu" and model.dtype == torch.float32
            and (codecs is None or all(half_slots(c) or getattr(c, "cpu_program",
                                                                lambda: None)() is not None
                                       for c in codecs[0]))
            and getattr(model, "world", 1) == 1
            and slot_op.available(model.head_dim))


def half_slots(codec) -> bool:
    """A float16 KV format (`FloatCodec`): the slot op reads its rows as stored, widening
    each to float32 exactly (float32 queries and arithmetic, as over a float32 pool)."""
    return getattr(codec, "store_dtype", None) == torch.float16


def slot_attend(q: torch.Tensor, k_slots, v_slots, slots: tuple, scale: float) -> torch.Tensor:
    """The slot op over a layer's pool: float slots, float16 ones it widens as it reads, or
    `StoredSlots` of TurboQuant rows that the op decodes as it reads them."""
    if isinstance(k_slots, torch.Tensor):
        return slot_op.slot_attention(q, k_slots, v_slots, *slots, scale)
    if half_slots(k_slots.codec):
        return slot_op.slot_attention(q, k_slots.raw, v_slots.raw, *slots, scale)
    return slot_op.code_attention(q, k_slots.raw, v_slots.raw, *slots, scale,
                                  *k_slots.codec.cpu_program(), *v_slots.codec.cpu_program(),
                                  window=k_slots.window)


def _tree_rows(prefix: torch.Tensor, tree_mask: torch.Tensor, write: torch.Tensor | None,
               write_src: torch.Tensor | None) -> tuple | None:
    """The slots each tree row reads, as (idx, offs [T, 4]): the prefix (one list every row
    shares), then the slots its ancestors and itself are written to (a node written to several
    forks: its first). None without writes."""
    if write is None:
        return None
    T = tree_mask.shape[0]
    if write_src is None:
        node_slot = write
    else:
        first: dict = {}
        for j, t in enumerate(write_src.tolist()):
            first.setdefault(t, j)
        if len(first) < T:
            return None
        node_slot = write.cpu()[torch.tensor([first[t] for t in range(T)])]
    node_slot, pre = node_slot.cpu().long(), prefix.cpu().long()
    mask = tree_mask.cpu()
    cols = torch.arange(T).expand(T, T)[mask]                     # row by row, in order
    return torch.cat((pre, node_slot[cols])), _head_rows(pre.numel(), mask.sum(1))


def _head_rows(L: int, n: torch.Tensor) -> torch.Tensor:
    """offs [R, 4] of rows that all read one head idx[0:L], then each its own n[r] slots,
    the rows' own slots laid after the head in row order."""
    ends = L + n.cumsum(0)
    return torch.stack((torch.zeros_like(n), torch.full_like(n, L), ends - n, ends), dim=1)


def _causal_rows(prefix: torch.Tensor, write: torch.Tensor) -> tuple:
    """Prompt rows as (idx, offs [T, 4]): row i reads what a decode step at its position reads,
    the prefix, then the chain's rows 0..i, all stretches of one list."""
    pre, w = prefix.cpu().long(), write.cpu().long()
    L, T = pre.numel(), w.numel()
    ends = torch.arange(L + 1, L + T + 1)
    z = torch.zeros_like(ends)
    return torch.cat((pre, w)), torch.stack((z, ends, z, z), dim=1)


def _kernel_layout(codec, q: torch.Tensor):
    """The layout the Triton kernel decodes `codec`'s rows with, where it runs (CUDA)."""
    layout = getattr(codec, "kernel_layout", None)
    return layout() if layout is not None and q.is_cuda else None


def _to_device(dev: torch.device, *ts: torch.Tensor | None) -> tuple:
    """Int index tensors to `dev` in one host-to-device copy (None stays None)."""
    if dev.type == "cpu" or any(t is not None and t.device.type != "cpu" for t in ts):
        return tuple(None if t is None else t.to(dev) for t in ts)
    live = [t for t in ts if t is not None]
    flat = torch.cat([t.long() for t in live]).to(dev).split([t.numel() for t in live])
    it = iter(flat)
    return tuple(None if t is None else next(it) for t in ts)


def leading_run(slots: torch.Tensor) -> int:
    """How many of `slots` (CPU) from the first are consecutive ids: slots[0], slots[0] + 1, ..."""
    if slots.numel() < 2:
        return slots.numel()
    brk = torch.nonzero(slots[1:] - slots[:-1] != 1)
    return int(brk[0]) + 1 if brk.numel() else slots.numel()


def causal_mask(T: int, device=None) -> torch.Tensor:
    """`[T, T]` bool, row i sees tokens 0..i."""
    return torch.ones(T, T, dtype=torch.bool, device=device).tril()
