"""KV cache formats: float (float32/bfloat16/float16) and TurboQuant codes (Zandieh et al. 2025).

TurboQuant stores a K/V vector x `[D]` as a scale (fp16) and the codes of u = R x / |x|, R a
fixed random rotation (a randomized Hadamard transform when D is a power of two, seeded per
layer). Rotated, every coordinate of a unit vector has the same known density,
f(t) ~ (1 - t^2)^((D-3)/2) on [-1, 1] (about N(0, 1/D)), so one precomputed Lloyd-Max codebook
per bit width is optimal for all of them and no per-block scales are needed.

Three refinements, all free in bytes:
- The stored scale is not |x| but |x| / (u . c), c the decoded unit vector: a Lloyd-Max decode
  is shorter than the vector it codes (its error is orthogonal to the centroid, not to x), so
  |x| * c shrinks every inner product by about the distortion; this scale makes the decode's
  component along x exact (as RaBitQ's estimator does).
- Keys may be centred on a per-head mean `center` (`Model.calibrate_kv`): every score of one
  query then moves by the same q . center, which softmax ignores, so the mean is never added
  back. Much of the embedded target's key energy is such a constant direction per head,
  energy the codes would otherwise spend their error on.
- Keys get half a bit more than the rate and values half a bit less (`split_rate`): a key's
  error moves scores through softmax's exponential; a value's is only averaged.
Each lowered the embedded target's perplexity on held-out text; what the shipped formats give
is in results/kv_quant.md (eval/bench_kv_quant.py).

A rate is bits per stored coordinate with everything counted (norms, residual norms, sign
bits): turbo3.5 at D=64 is 256 + 192 bits = 32 + 24 bytes per key and value, 4.57x fewer than
float16. After the 16 norm bits a vector's code bits are split over the rotated coordinates as
b and b+1 bits, the b+1 ones first (at D=64, a turbo3.5 value: 48 coordinates at 3 bits and
16 at 2).

Attention never rotates keys back: q.k = (R q).(R k), so a layer rotates the query once and
scores against norm * centroid directly; values are summed in the rotated space and the output
rotated back once (`rotate_query`, `unrotate`). `decode` returns that rotated-space vector.

The "prod" variant (TurboQuant-prod, for keys) spends D bits on the signs of S r, r the
residual of the codes and S a Gaussian matrix (QJL), and 16 on |r|; adding
|r| sqrt(pi/2) / D * S^T sign(S r) makes every inner product with the key unbiased.
"""
from __future__ import annotations

import math
import re
from functools import lru_cache

import torch

from specfork.errors import SpecforkError

FLOAT_FORMATS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TURBO_RATES = (4.0, 3.5, 3.0, 2.5)
KV_FORMATS = ("auto",) + tuple(FLOAT_FORMATS) + tuple(
    f"turbo{r:g}" for r in TURBO_RATES)
NORM_BITS = 16
KEY_EXTRA_BITS = 0.5           # turbo{r}: keys at r + 0.5 bits, values at r - 0.5


def _code_ops() -> bool:
    """Whether the compiled CPU ops (kernels/slot_attention.py's library, with
    code_encode.cpp) are built here; without a compiler the torch paths code the rows."""
    from specfork.kernels import slot_attention as slot_op
    return slot_op.available()


# -- codebooks --------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def lloyd_max(d: int, bits: int, grid: int = 1 << 16, iters: int = 300) -> tuple[torch.Tensor,
                                                                                  float]:
    """Centroids `[2**bits]` (ascending, float32) minimising E(t - c(t))^2 for one coordinate of
    a uniform unit vector in d dimensions, and that minimum (per coordinate). Computed on a
    dense grid in float64; the density is symmetric, so are the centroids."""
    if d < 3:
        raise ValueError("lloyd_max needs d >= 3")
    t = torch.linspace(-1, 1, grid + 1, dtype=torch.float64)[1:-1]
    w = (1 - t * t).pow((d - 3) / 2)
    w = w / w.sum()
    cdf = w.cumsum(0)
    n = 1 << bits
    c = t[torch.searchsorted(cdf, (torch.arange(n, dtype=torch.float64) + 0.5) / n)]
    cw, ctw = torch.cat((w.new_zeros(1), cdf)), torch.cat((w.new_zeros(1), (w * t).cumsum(0)))
    for _ in range(iters):
        edges = torch.searchsorted(t, (c[1:] + c[:-1]) / 2)
        idx = torch.cat((edges.new_zeros(1), edges, edges.new_tensor([t.numel()])))
        mass = cw[idx[1:]] - cw[idx[:-1]]
        new = (ctw[idx[1:]] - ctw[idx[:-1]]) / mass.clamp_min(1e-300)
        if torch.allclose(new, c, rtol=0, atol=1e-12):
            c = new
            break
        c = new
    c = (c - c.flip(0)) / 2                                         # exact symmetry
    q = c[torch.bucketize(t, (c[1:] + c[:-1]) / 2)]
    return c.float(), float((w * (t - q) ** 2).sum())


# -- rotations --------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def rotation(d: int, seed: int) -> torch.Tensor:
    """A fixed random orthogonal `[d, d]` (float32; rotate rows with x @ R.T): H diag(s) / sqrt(d)
    with random signs s when d is a power of two (randomized Hadamard), else the Q of a seeded
    Gaussian matrix."""
    g = torch.Generator().manual_seed(seed)
    if d & (d - 1) == 0:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)))
        s = torch.randint(0, 2, (d,), generator=g).double() * 2 - 1
        perm = torch.randperm(d, generator=g)
        return (h[perm] * s / math.sqrt(d)).float()
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).float()


# -- bit packing ------------------------------------------------------------------------------

def _planes(bits: int) -> list[int]:
    """A b-bit code as planes of 4, 2 and 1 bits (low bits first): each plane packs whole codes
    into bytes with one shift per code, so unpacking is a few vector ops per plane."""
    out = []
    for w in (4, 2, 1):
        while bits >= w:
            out.append(w)
            bits -= w
    return out


@lru_cache(maxsize=None)
def _shifts(w: int, device) -> torch.Tensor:
    return torch.arange(0, 8, w, dtype=torch.uint8, device=device)


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes `[..., n]` (0 <= c < 2**bits, n a multiple of 8) -> uint8 `[..., n * bits / 8]`."""
    n = codes.shape[-1]
    if n % 8:
        raise ValueError("pack_bits: the code count must be a multiple of 8")
    c = codes.to(torch.uint8)
    out, lo = [], 0
    for w in _planes(bits):
        per = 8 // w
        p = ((c >> lo) & ((1 << w) - 1)).view(*c.shape[:-1], n // per, per)
        out.append((p << _shifts(w, c.device)).sum(-1, dtype=torch.uint8))
        lo += w
    return torch.cat(out, -1)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 `[..., n * bits / 8]` -> uint8 codes `[..., n]`."""
    out, at, lo = None, 0, 0
    for w in _planes(bits):
        m = n * w // 8
        p = ((packed[..., at:at + m, None] >> _shifts(w, packed.device))
             & ((1 << w) - 1)).flatten(-2)
        out = p if out is None else out | (p << lo)
        at, lo = at + m, lo + w
    return out


# -- codecs -----------------------------------------------------------------------------------

class FloatCodec:
    """A float KV format other than the model's dtype: stored cast, read cast back."""
    rotated = False

    def __init__(self, head_dim: int, dtype: torch.dtype, model_dtype: torch.dtype):
        self.row, self.store_dtype, self.dtype = (head_dim,), dtype, model_dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.store_dtype)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.to(self.dtype)

    def encode_decode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.encode(x)
        return rows, self.decode(rows)


def _unit_lut(bits: int, table: torch.Tensor):
    """Decoding b-bit codes stored in bit planes (`pack_bits`) a unit at a time: u = 8 / w0
    consecutive codes (w0 the widest plane) take one field of u * w bits from each plane w;
    their concatenated bits (at most 16) index a table `[2**(u*b), u]` of the centroids
    themselves. One gather per unit replaces a shift, mask and lookup per code and plane.
    Returns (lut, [(plane width, field offset in the index, byte shifts or None)])."""
    planes = _planes(bits)
    u = 8 // planes[0]
    fields, off, lo = [], 0, 0
    idx = torch.arange(1 << (u * bits))
    codes = torch.zeros(idx.numel(), u, dtype=torch.long)
    for w in planes:
        f = (idx >> off) & ((1 << (u * w)) - 1)
        for c in range(u):
            codes[:, c] |= ((f >> (c * w)) & ((1 << w) - 1)) << lo
        per = 8 // (u * w)                   # fields per byte of this plane
        shifts = None if per == 1 else torch.arange(0, 8, u * w, dtype=torch.uint8,
                                                    device=table.device)
        fields.append((w, off, shifts))
        off, lo = off + u * w, lo + w
    return table[codes.to(table.device)], fields


class TurboCodec:
    """TurboQuant codes for one layer's keys or values: `encode` `[N, KVH, D]` float ->
    `[N, KVH, nbytes]` uint8 (norm, codes and, for prod, |r| and the QJL signs, all inside);
    `decode` -> `[N, KVH, D]` in the rotated space, as `rotate_query` / `unrotate` expect."""
    rotated = True
    store_dtype = torch.uint8

    def __init__(self, head_dim: int, rate: float, seed: int, prod: bool = False,
                 dtype: torch.dtype = torch.float32, device="cpu"):
        D = head_dim
        self.center = None                                    # [KVH, D] keys: set_center
        self._program = self._op = None                       # caches: cpu_program, _op_args
        self._rt2 = self._rt2_of = self._layout = None        # caches: _pair_rt, kernel_layout
        total = round(rate * D)
        code_bits = total - NORM_BITS - (NORM_BITS + D if prod else 0)
        b = code_bits // D
        hi = (code_bits - b * D) // 8 * 8                   # coordinates at b + 1 bits
        if D % 8 or D < 16 or b < 1 or b + (hi > 0) > 8 or rate * D != total:
            raise SpecforkError(f"KV format turbo{rate:g}{'-prod' if prod else ''} does not "
                                f"fit head_dim {D}")
        self.D, self.rate, self.prod, self.dtype = D, rate, prod, dtype
        self.groups = [(0, hi, b + 1), (hi, D - hi, b)] if hi else [(0, D, b)]
        self.groups = [g for g in self.groups if g[1]]
        tables, offs = [], []
        for start, n, bits in self.groups:
            offs.append(torch.full((n,), sum(t.numel() for t in tables), dtype=torch.long))
            tables.append(lloyd_max(D, bits)[0])
        self.table = torch.cat(tables).to(device, dtype)             # [sum 2**bits]
        self.offset = torch.cat(offs).to(device)                     # [D] into table
        self.edges = [((t[1:] + t[:-1]) / 2).to(device) for t in tables]
        self.R = rotation(D, seed).to(device)                        # [D, D]
        self.RT = self.R.t().contiguous()
        self.R_, self.RT_ = self.R.to(dtype), self.RT.to(dtype)
        if prod:
            g = torch.Generator().manual_seed(seed + (1 << 20))
            self.S = torch.randn(D, D, generator=g).to(device)           # [D, D]
            self.qjl = (self.S * (math.sqrt(math.pi / 2) / D)).to(dtype)
        self.code_bytes = sum(n * bits for _, n, bits in self.groups) // 8
        self.luts = [_unit_lut(bits, t.to(device, dtype)) for (_, _, bits), t in
                     zip(self.groups, tables)]
        self.nbytes = 2 + self.code_bytes + (2 + D // 8 if prod else 0)
        self.row = (self.nbytes,)

    @property
    def bits_per_coordinate(self) -> float:
        return self.nbytes * 8 / self.D

    def _codes(self, y: torch.Tensor) -> torch.Tensor:
        """Nearest-centroid indices (into each group's own codebook) of rotated unit rows."""
        parts = [torch.bucketize(y[..., s:s + n].contiguous(), e)
                 for (s, n, _), e in zip(self.groups, self.edges)]
        return torch.cat(parts, -1)

    def set_center(self, center: torch.Tensor | None) -> None:
        """Keys only: code x - center `[KVH, D]` (see the module docstring); None: x itself."""
        self.center = None if center is None else center.to(self.R.device, torch.float32)

    def prepare(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., KVH, D]` -> the float vectors the codes stand for: keys centred."""
        xf = x.float()
        return xf if self.center is None else xf - self.center

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """`[..., KVH, D]` -> `[..., KVH, nbytes]` uint8."""
        if self._op_encodes(x):
            return self.encode_decode(x)[0]
        return self._encode(x)[0]

    def _encode(self, x: torch.Tensor):
        shape = x.shape[:-1]
        xf = self.prepare(x).reshape(-1, self.D)
        norm = xf.norm(dim=-1, keepdim=True)
        y = (xf / norm.clamp_min(1e-30)) @ self.RT                  # rotated unit rows [N, D]
        rows, c, scale = self._code_rows(y, norm)
        return rows.view(*shape, self.nbytes), c, scale

    def _op_encodes(self, x: torch.Tensor) -> bool:
        """Whether the compiled encoder (`kernels/code_encode.cpp`) codes x: on a CPU, for
        float32 models, where the ops are built; prod (QJL) stays in torch."""
        return (not self.prod and x.device.type == "cpu" and self.dtype == torch.float32
                and _code_ops())

    def _op_args(self) -> tuple:
        """The encoder's constant inputs: rotation, codebooks, their edges, per coordinate
        (table offset, edges offset, edge count), the bit-plane layout and the row size."""
        if self._op is None:
            lay, table = self.kernel_layout()
            offs, at = [], 0
            for (_, n, _), e in zip(self.groups, self.edges):
                offs += [(at, e.numel())] * n
                at += e.numel()
            cinfo = torch.tensor([self.offset.tolist(), [o for o, _ in offs],
                                  [c for _, c in offs]], dtype=torch.int32)
            self._op = (self.RT.float().contiguous(), table,
                        torch.cat(self.edges).float().cpu(), cinfo, lay.cpu(), self.nbytes)
        return self._op

    def encode_decode_pair(self, vc: "TurboCodec", k: torch.Tensor, v: torch.Tensor):
        """`encode_decode` of a layer's keys (self) and values (`vc`, the same rate or not) in
        one pass over both: a decode step's K and V are a few rows each, where the number of
        ops, not their size, sets the time (the compiled encoder: one call each). Returns
        ((k rows, k decoded), (v rows, v decoded))."""
        if self.prod or vc.prod or self._op_encodes(k):
            return self.encode_decode(k), vc.encode_decode(v)
        shape = k.shape[:-1]
        xf = torch.stack((self.prepare(k).reshape(-1, self.D),
                          vc.prepare(v).reshape(-1, self.D)))                # [2, N, D]
        norm = xf.norm(dim=-1, keepdim=True)
        y = torch.bmm(xf / norm.clamp_min(1e-30), self._pair_rt(vc))
        if self.groups == vc.groups:
            rows, c, scale = self._code_rows(y.flatten(0, 1), norm.flatten(0, 1))
            dec = (c.to(self.dtype) * scale.half().to(self.dtype)).view(2, *shape, self.D)
            rows = rows.view(2, *shape, self.nbytes)
            return (rows[0], dec[0]), (rows[1], dec[1])
        out = []
        for codec, yi, ni in ((self, y[0], norm[0]), (vc, y[1], norm[1])):
            rows, c, scale = codec._code_rows(yi, ni)
            out.append((rows.view(*shape, codec.nbytes),
                        (c.to(codec.dtype) * scale.half().to(codec.dtype)).view(*shape, self.D)))
        return out[0], out[1]

    def _pair_rt(self, vc: "TurboCodec") -> torch.Tensor:
        if self._rt2_of is not vc:
            self._rt2, self._rt2_of = torch.stack((self.RT, vc.RT)), vc
        return self._rt2

    def _code_rows(self, y: torch.Tensor, norm: torch.Tensor):
        """Rotated unit rows `[N, D]` and their norms `[N, 1]` -> (stored rows `[N, nbytes]`,
        decoded unit rows, stored scale)."""
        idx = self._codes(y)
        c = self.table.float()[idx + self.offset]                    # decoded unit rows
        scale = None
        if self.prod:                       # |x|, codes, |r|, sign(S r): unbiased q . x
            r = y - c
            parts = [norm.half().view(torch.uint8)]
            parts += [pack_bits(idx[:, s:s + n], bits) for s, n, bits in self.groups]
            parts += [r.norm(dim=-1, keepdim=True).half().view(torch.uint8),
                      pack_bits(r @ self.S.t() >= 0, 1)]
        else:                               # |x| / (u . c): exact along x
            scale = norm / (y * c).sum(-1, keepdim=True).clamp_min(1e-6)
            parts = [scale.half().view(torch.uint8)]
            parts += [pack_bits(idx[:, s:s + n], bits) for s, n, bits in self.groups]
        return torch.cat(parts, -1), c, scale

    def encode_decode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode(x)` and `decode` of it, the decode taken from the encoder's own codes (the
        same values, without unpacking what was just packed)."""
        if self._op_encodes(x):
            rows, dec = torch.ops.specfork.code_encode(
                self.prepare(x).reshape(-1, self.D), *self._op_args())
            return rows.view(*x.shape[:-1], self.nbytes), dec.view(*x.shape[:-1], self.D)
        rows, c, scale = self._encode(x)
        if self.prod:
            return rows, self.decode(rows)
        return rows, (c.to(self.dtype) * scale.half().to(self.dtype)).view(
            *x.shape[:-1], self.D)

    def decode(self, rows: torch.Tensor) -> torch.Tensor:
        """`[..., KVH, nbytes]` -> `[..., KVH, D]` in the rotated space (centred keys)."""
        shape = rows.shape[:-1]
        r = rows.reshape(-1, self.nbytes)
        norm = r[:, :2].contiguous().view(torch.float16).to(self.dtype)     # [N, 1]
        at, ys = 2, []
        for (_, n, bits), (lut, fields) in zip(self.groups, self.luts):
            index = None                     # each unit's bits from every plane, one number
            for w, off, shifts in fields:
                m = n * w // 8
                b = r[:, at:at + m]
                f = b if shifts is None else ((b[..., None] >> shifts)
                                              & ((1 << (8 // shifts.numel())) - 1)).flatten(-2)
                f = f.long() if off == 0 else f.long() << off
                index = f if index is None else index | f
                at += m
            ys.append(lut[index].flatten(-2))                         # [N, n] centroids
        y = torch.cat(ys, -1) if len(ys) > 1 else ys[0]                # [N, D]
        if self.prod:
            rn = r[:, at:at + 2].contiguous().view(torch.float16).to(self.dtype)
            s = unpack_bits(r[:, at + 2:], 1, self.D).to(self.dtype) * 2 - 1
            y = y + rn * (s @ self.qjl)
        return (y * norm).view(*shape, self.D)

    def kernel_layout(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(layout `[planes, 5, D]` int32, centroid table) for the Triton kernel to decode
        these rows itself (`_load_codes`): per plane and coordinate, the byte of the row
        holding its bits, their shift and mask, where they go in the code, and the
        coordinate's offset into the table. None for prod (its QJL term needs a matmul)."""
        if self.prod:
            return None
        if self._layout is None:
            P = max(len(_planes(b)) for _, _, b in self.groups)
            lay = torch.zeros(P, 5, self.D, dtype=torch.int32)
            at = 2
            for start, n, bits in self.groups:
                lo = 0
                for j, w in enumerate(_planes(bits)):
                    c = torch.arange(n)
                    lay[j, 0, start:start + n] = at + c * w // 8
                    lay[j, 1, start:start + n] = c * w % 8
                    lay[j, 2, start:start + n] = (1 << w) - 1
                    lay[j, 3, start:start + n] = lo
                    at, lo = at + n * w // 8, lo + w
            lay[:, 4] = self.offset.to(torch.int32).cpu()
            self._layout = (lay.to(self.table.device), self.table.float().contiguous())
        return self._layout

    def cpu_program(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(program `[units, 16]` int32, centroid units float32) for the CPU op to decode these
        rows a unit at a time (`kernels/code_attention.cpp`), as `decode` does with `luts`: per
        unit its first coordinate, u (codes per unit), where its table starts, how many plane
        fields make its index and, per field, (byte, shift, mask, position in the index).
        None for prod (its QJL term needs a matmul)."""
        if self.prod:
            return None
        if self._program is None:
            prog, tabs, base, at = [], [], 0, 2
            for (start, n, bits), (lut, fields) in zip(self.groups, self.luts):
                u = lut.shape[1]
                units = [[start + k * u, u, base, len(fields)] + [0] * 12 for k in range(n // u)]
                for j, (w, off, _) in enumerate(fields):
                    fb = u * w                                # field bits per unit
                    for k, row in enumerate(units):
                        row[4 + 4 * j:8 + 4 * j] = [at + k * fb // 8, k * fb % 8,
                                                    (1 << fb) - 1, off]
                    at += n * w // 8
                prog += units
                tabs.append(lut.float().flatten().cpu())
                base += lut.numel()
            self._program = (torch.tensor(prog, dtype=torch.int32), torch.cat(tabs))
        return self._program

    def rotate_query(self, q: torch.Tensor) -> torch.Tensor:
        """q `[T, H, D]` into the keys' rotated space."""
        return q @ self.RT_

    def unrotate(self, o: torch.Tensor) -> torch.Tensor:
        """An attention output `[T, H, D]` over rotated values, back to the model's space."""
        return o @ self.R_


def parse_kv_format(name: str) -> tuple[str, float | None, bool]:
    """'float16' -> ('float', None, False); 'turbo3.5' -> ('turbo', 3.5, False);
    'turbo3.5-prod' -> ('turbo', 3.5, True) (keys TurboQuant-prod). Unknown: a one-line error."""
    if name == "auto" or name in FLOAT_FORMATS:
        return "float", None, False
    m = re.fullmatch(r"turbo(\d+(?:\.5)?)(-prod)?", name)
    if m and float(m.group(1)) in TURBO_RATES:
        return "turbo", float(m.group(1)), bool(m.group(2))
    raise SpecforkError(f"unknown KV cache format '{name}' (choose from "
                        f"{', '.join(KV_FORMATS)}; turbo formats also as '<name>-prod')")


def split_rate(rate: float) -> tuple[float, float]:
    """A turbo format's (key, value) bits per coordinate: the same bytes as `rate` for both,
    moved half a bit from values to keys. Scores amplify key errors through softmax's
    exponential, values only average theirs; on the embedded target this split lowers the
    perplexity gap at every rate (results/kv_quant.md)."""
    return rate + KEY_EXTRA_BITS, rate - KEY_EXTRA_BITS


def resolve_kv(name: str, low_bit: bool, model_dtype: torch.dtype, device, head_dim: int) -> str:
    """`auto` -> float16 under low-bit weights (int4, int8, bfloat16: every format but float32)
    where the CPU slot op reads float16 pools, as llama.cpp's default K/V type: a decode step
    then reads half the K/V bytes (results/kv_quant_f16_epyc: perplexity 1.000x float32 K/V at
    1K and 8K tokens, the same speed at one request), and low-bit weights already give up
    bitwise agreement with the float32 model. Otherwise, and for every other name, the model's
    dtype / the name itself."""
    if name != "auto" or not low_bit or model_dtype != torch.float32 or (
            torch.device(device).type != "cpu"):
        return name
    from specfork.kernels import slot_attention as slot_op
    return "float16" if slot_op.available(head_dim) else name


def layer_codecs(name: str, num_layers: int, head_dim: int, model_dtype: torch.dtype,
                 device="cpu", seed: int = 0) -> list | None:
    """Per layer (key codec, value codec) for a KV format, or None when the pool stores the
    model's own dtype. Keys and values of each layer have their own rotation seeds."""
    kind, rate, prod = parse_kv_format(name)
    if kind == "float":
        dt = model_dtype if name == "auto" else FLOAT_FORMATS[name]
        if dt == model_dtype:
            return None
        c = FloatCodec(head_dim, dt, model_dtype)
        return [(c, c)] * num_layers
    kr, vr = split_rate(rate)
    try:
        return [(TurboCodec(head_dim, kr, seed + 2 * i, prod, model_dtype, device),
                 TurboCodec(head_dim, vr, seed + 2 * i + 1, False, model_dtype, device))
                for i in range(num_layers)]
    except SpecforkError:
        raise SpecforkError(f"KV format {name} does not fit head_dim {head_dim}") from None


WINDOW_SINK = 1      # with a KV window, the first token (the attention sink) is read in float16


def check_window_flags(window, kv_cache: str, ranks: int = 1) -> None:
    """A one-line error for a KV window the flags alone rule out (before weights load)."""
    if window == 0:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise SpecforkError(f"--kv-window must be a token count >= 0, not {window!r}")
    if parse_kv_format(kv_cache)[0] != "turbo" or kv_cache.endswith("-prod"):
        raise SpecforkError("--kv-window needs a TurboQuant KV format (--kv-cache turbo4, "
                            "turbo3.5, turbo3 or turbo2.5)")
    if ranks != 1:
        raise SpecforkError("--kv-window does not run under --tensor-parallel yet")


def check_window(window: int, kv_cache: str, head_dim: int, device) -> tuple[int, int]:
    """(window, sink) of a KV window of `window` tokens over the (resolved) format `kv_cache`,
    or a one-line error where it cannot run: a window reads float16 shadows beside TurboQuant
    codes (`BlockPool`), through the CPU slot op (kernels/code_attention.cpp), the one
    attention path that reads them so far."""
    check_window_flags(window, kv_cache)
    if window == 0:
        return 0, 0
    from specfork.kernels import slot_attention as slot_op
    if torch.device(device).type != "cpu" or not slot_op.available(head_dim):
        raise SpecforkError("--kv-window reads through the CPU slot op, which is not built "
                            "for this device (the GPU kernel does not read windows yet)")
    return window, WINDOW_SINK


class StoredSlots:
    """One layer's stored K or V slots `[slots, KVH, *row]` read through their codec: what the
    attention paths index or slice comes back decoded `[n, KVH, D]`, so every read of a
    compressed pool sees exactly the stored form. `window` (keys of a pool with a KV window):
    the slot op's shadow arguments (`kernels/slot_attention.code_attention`)."""
    __slots__ = ("raw", "codec", "window")

    def __init__(self, raw: torch.Tensor, codec):
        self.raw, self.codec, self.window = raw, codec, None

    def index_select(self, dim: int, idx: torch.Tensor) -> torch.Tensor:
        return self.codec.decode(self.raw.index_select(dim, idx))

    def __getitem__(self, s) -> torch.Tensor:
        return self.codec.decode(self.raw[s])


def calibration_ids(tokenizer, max_tokens: int = 1024) -> list[int]:
    """Token ids of the text `Model.calibrate_kv` centres keys on: a few paragraphs written for
    this (prose, a recipe, code, a dialogue, arithmetic; no benchmark question)."""
    from importlib.resources import files
    text = files("specfork").joinpath("kv_calibration.txt").read_text(encoding="utf-8")
    return list(tokenizer(text)["input_ids"])[:max_tokens]
