"""Weight formats for the target's matmuls: float32 (as loaded), bfloat16, int8 and int4.

Weight-only: activations, norms, attention and the KV cache stay in the model's dtype (fp32 on
a CPU). A decode step reads the weights once, so bytes per weight is what sets its time:

- bfloat16: 2 bytes; without specfork's kernel, the oneDNN-packed product (AMX where the CPU
  has it).
- int8: 1 byte + a scale per group of 32 inputs: GGUF's Q8_0 blocks (w = q * d).
- int4: 0.5 byte + a scale and offset per group of 32 inputs: GGUF's Q4_1 blocks (w = q * d + m).

Two kernels. Where the CPU has AVX-512 with VNNI, specfork's own (`kernels/lowbit_linear.cpp`):
weights in panels of 16 outputs holding d and m float16, as GGUF stores them, so weights that
came from Q8_0 / Q4_1 blocks are found again exactly (the embedded target's Q4_1 layers and its
Q8_0 output layer: under int4 it multiplies by the file's own weights); activations quantized per
row to 8 bits per group of 32 as llama.cpp does (`quantize_activations`; the embedded target's
perplexity under int4 against float32 is in results/cpu_engines.md), which lets integer dot products (vpdpbusd) replace dequantizing every weight; residual
add and bias fused; bf16 weights too (float32 activations; decode and tree rows). Elsewhere
torch's (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`): bf16 activations, int8 per
output channel (s = absmax / 127), and for int4 w = (q - 8) * s + z with s = d and z = m + 8 d
rounded to bf16.

Scales (and offsets) are rounded to their stored precision before the weights are quantized
against them, so the kernel dequantizes exactly the values the rounding chose.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from specfork.errors import SpecforkError

FORMATS = ("auto", "float32", "bfloat16", "int8", "int4")
GROUP = 32                     # int4: inputs per scale/offset group (GGUF Q4_0/Q4_1 blocks)
LANES = 16                     # outputs per panel of specfork's int4/int8 kernel
# The output layer under each format: int4 keeps it at int8, as llama.cpp's 4-bit files do
# (the embedded GGUF stores its tied embeddings/output as Q8_0 beside Q4_1 layers): one
# vocabulary-wide matmul decides every token, and 4 bits there cost most of the agreement.
HEAD_FORMAT = {"bfloat16": "bfloat16", "int8": "int8", "int4": "int8"}


EXACT_ROWS = 8      # rows per call where a row's product must not depend on the row count


def native() -> bool:
    """Whether specfork's low-bit kernels run here (built with AVX-512 and VNNI; SPECFORK_LOWBIT=0:
    off)."""
    if not _NATIVE:
        ok = False
        if os.environ.get("SPECFORK_LOWBIT", "1") != "0":
            from specfork.kernels import slot_attention
            ops = slot_attention._load()
            ok = ops is not None and bool(ops.lowbit_native())
        _NATIVE.append(ok)
    return _NATIVE[0]


_NATIVE: list[bool] = []


def row_blocks(fn, x: torch.Tensor, res: torch.Tensor | None = None) -> torch.Tensor:
    """`fn` over x's rows (and `res`'s, a second operand row-aligned with x) in calls of
    exactly EXACT_ROWS rows, the last padded with zeros: a oneDNN kernel gives a row the same
    bits wherever it sits in such a call, but not across calls of other sizes (bf16 on an AMD
    EPYC: the 1536-input product from 21 rows on), so a verify tree's row then equals the
    decode step's one-row product bit for bit."""
    T, B = x.shape[0], EXACT_ROWS
    pad = -T % B
    if pad:
        x = torch.cat((x, x.new_zeros(pad, x.shape[1])))
        res = None if res is None else torch.cat((res, res.new_zeros(pad, res.shape[1])))
    outs = [fn(x[i:i + B]) if res is None else fn(x[i:i + B], res[i:i + B])
            for i in range(0, T + pad, B)]
    return (outs[0] if len(outs) == 1 else torch.cat(outs))[:T]


class QuantLinear:
    """y = x @ w.T + b with `w` held in a low-bit format; x and y in the caller's dtype."""
    __slots__ = ("fmt", "w", "s", "b", "packed", "out_features", "bits")

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, fmt: str,
                 absmax: torch.Tensor | None = None):
        """`absmax` (int8 on torch's kernel): per output channel, the whole row's when `w` holds
        some of its columns (a tensor-parallel shard), so every rank quantizes on the one
        model's grid (our kernel's blocks of 32 lie whole within a shard of a multiple of 32)."""
        if w.device.type != "cpu":
            raise SpecforkError(f"--weights {fmt}: only on a CPU for now (use --dtype on GPU)")
        self.fmt, self.b, self.out_features = fmt, b, w.shape[0]
        self.s = self.packed = None
        self.bits = 0                      # 4, 8 or 16: specfork's kernel runs this matmul
        w = w.detach().float()
        if (fmt in ("int8", "int4") and w.shape[1] % GROUP == 0 and w.shape[0] % LANES == 0
                and native()):
            self.bits = 8 if fmt == "int8" else 4
            if fmt == "int8":          # blocks of 32 within a row: a shard's blocks are its own
                self.w, self.s = pack_q8(*quantize_q8(w))
            else:
                self.w, self.s = pack_q4(*quantize_q4(w))
            return
        if fmt == "bfloat16":
            self.w = w.bfloat16()
            if w.shape[1] % GROUP == 0 and native():
                self.bits, self.s = 16, torch.empty(0)     # our kernel: every row
            elif torch.ops.mkldnn._is_mkldnn_bf16_supported():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.w, 8)
        elif fmt == "int8":
            self.w, self.s = quantize_int8(w, absmax)
        elif fmt == "int4":
            if w.shape[1] % GROUP or w.shape[0] % 16:
                raise SpecforkError(f"--weights int4: a {w.shape[0]}x{w.shape[1]} matrix does "
                                    f"not fit the kernel (rows a multiple of 16, inputs of "
                                    f"{GROUP})")
            q, self.s = quantize_int4(w)
            self.w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        else:
            raise SpecforkError(f"unknown weight format {fmt!r}")

    def __call__(self, x: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """Our kernel (`bits`) and torch's int8/int4 ones give a row the same bits in any call;
        the packed bf16 one only within calls of one size, so where it serves rows other than
        prompt rows (`bulk`: no AVX-512 here) they go through it in EXACT_ROWS-row calls. Our
        kernel takes prompt rows too (bf16 as well), so a prompt's rows get the bits a decode
        step would, however the prompt is chunked or cached."""
        if self._ours():
            return torch.ops.specfork.lowbit_linear(x, self.w, self.s, self.bits, self.b, None)
        xb = x.to(torch.bfloat16)           # torch's kernels take bf16 rows
        if self.fmt == "bfloat16":
            if self.packed is None:
                y = F.linear(xb, self.w)
            else:
                def mm(a):
                    return torch.ops.mkldnn._linear_pointwise(a, self.packed, None, "none", [],
                                                              "")
                y = mm(xb) if bulk else row_blocks(mm, xb)
        elif self.fmt == "int8":
            y = torch.ops.aten._weight_int8pack_mm(xb, self.w, self.s)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.w, GROUP, self.s)
        y = y.to(x.dtype)
        return y if self.b is None else y.add_(self.b)

    def add_to(self, x: torch.Tensor, a: torch.Tensor, bulk: bool = False) -> torch.Tensor:
        """x + self(a) (the residual add)."""
        if self._ours():
            return torch.ops.specfork.lowbit_linear(a, self.w, self.s, self.bits, self.b, x)
        return self(a, bulk).add_(x)

    def _ours(self) -> bool:
        """Whether specfork's kernel multiplies these rows (all of them where it runs)."""
        return bool(self.bits)

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: the weights in their format (packed) and their scales."""
        t = [self.packed if self.packed is not None else self.w, self.s]
        return sum(x.numel() * x.element_size() for x in t if x is not None)

    packed_bytes = 0              # no second copy beside the format's own


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (q int8 `[N, K]`, s bf16 `[N]`), w ~ q * s per output channel."""
    amax = w.abs().amax(dim=1) if absmax is None else absmax.float()
    s = (amax / 127).clamp_min(1e-12).bfloat16()
    q = torch.round(w / s.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, s


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (q int32 in 0..15 `[N, K]`, scale_and_zero bf16 `[K / group, N, 2]`),
    w ~ (q - 8) * s + z per group of `group` inputs: s = (max - min) / 15 and z = min + 8 s,
    the group's range mapped onto 16 levels (GGUF's Q4_1)."""
    N, K = w.shape
    g = w.view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    s = ((hi - lo) / 15).clamp_min(1e-8).bfloat16().float()
    z = (lo + 8 * s).bfloat16().float()
    q = torch.round((g - z[..., None]) / s[..., None] + 8).clamp_(0, 15)
    sz = torch.stack((s, z), dim=-1).transpose(0, 1).contiguous().bfloat16()  # [K/g, N, 2]
    return q.view(N, K).to(torch.int32), sz


def quantize_q4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (q uint8 in 0..15 `[N, K]`, sz float16 `[N, K / group, 2]`), w ~ q * d + m
    per group: d = (max - min) / 15 and m = min (GGUF's Q4_1)."""
    N, K = w.shape
    g = w.view(N, K // group, group)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    d = ((hi - lo) / 15).clamp_min(1e-7).half().float()
    m = lo.half().float()
    q = torch.round((g - m[..., None]) / d[..., None]).clamp_(0, 15)
    return q.view(N, K).to(torch.uint8), torch.stack((d, m), dim=-1).half().contiguous()


def quantize_q8(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (q int8 `[N, K]`, d float16 `[N, K / group]`), w ~ q * d per group:
    d = absmax / 127 (GGUF's Q8_0)."""
    N, K = w.shape
    g = w.view(N, K // group, group)
    d = (g.abs().amax(dim=-1) / 127).clamp_min(1e-7).half()
    q = torch.round(g / d.float()[..., None]).clamp_(-127, 127)
    return q.view(N, K).to(torch.int8), d.contiguous()


def pack_q4(q: torch.Tensor, sz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_1 codes `[N, K]` (0..15) and (d, m) `[N, K / 32, 2]` -> the panels
    `lowbit_linear.cpp` reads, in tensors of the same shapes as before packing (N a multiple of
    16): codes `[N, K / 2]` bytes ordered [N / 16, K / 32, chunk c 0..3, output j 0..15, b 0..3],
    byte (c, j, b) holding output j's input 4c + b of the group in its low nibble and 16 + 4c + b
    in its high one; scales `[N, K / 32, 2]` ordered [N / 16, K / 32, (d, m), j]."""
    N, K = q.shape
    P, G = N // LANES, K // GROUP
    c = q.view(P, LANES, G, 2, 4, 4).to(torch.uint8)         # [p, j, g, half, c, b]
    b = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)  # [p, g, c, j, b]
    return (b.reshape(N, K // 2).contiguous(),
            sz.view(P, LANES, G, 2).permute(0, 2, 3, 1).reshape(N, G, 2).contiguous())


def unpack_q4(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q4`'s inverse."""
    N, G = s.shape[0], s.shape[1]
    P = N // LANES
    b = w.view(P, G, 4, LANES, 4)                             # [p, g, c, j, b]
    c = torch.stack((b & 15, b >> 4), dim=2)                  # [p, g, half, c, j, b]
    return (c.permute(0, 4, 1, 2, 3, 5).reshape(N, G * GROUP).contiguous(),
            s.view(P, G, 2, LANES).permute(0, 3, 1, 2).reshape(N, G, 2).contiguous())


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 codes `[N, K]` (int8) and d `[N, K / 32]` -> `lowbit_linear.cpp`'s panels in tensors
    of the same shapes: q's bytes (uint8 storage) ordered [N / 16, K / 32, chunk c 0..7, j,
    b 0..3] (output j's input 4c + b of the group), d ordered [N / 16, K / 32, j]."""
    N, K = q.shape
    P, G = N // LANES, K // GROUP
    u = q.contiguous().view(torch.uint8).view(P, LANES, G, 8, 4)
    return (u.permute(0, 2, 3, 1, 4).reshape(N, K).contiguous(),
            d.view(P, LANES, G).permute(0, 2, 1).reshape(N, G).contiguous())


def unpack_q8(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_q8`'s inverse."""
    N, G = s.shape
    P = N // LANES
    u = w.view(P, G, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(N, G * GROUP).contiguous()
    return u.view(torch.int8), s.view(P, G, LANES).permute(0, 2, 1).reshape(N, G).contiguous()


def dequantize_q4(q: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    """Q4_1 codes `[N, K]` and (d, m) `[N, K / 32, 2]` -> the fp32 weights our kernel uses
    (q * d + m rounded once, as the kernel's fma does)."""
    d, m = sz[..., :1].double(), sz[..., 1:].double()
    return (q.double().view(q.shape[0], -1, GROUP) * d + m).float().flatten(1)


def dequantize_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 codes `[N, K]` and d `[N, K / 32]` -> the fp32 weights our kernel uses."""
    return (q.float().view(q.shape[0], -1, GROUP) * d.float()[..., None]).flatten(1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """Rows `[T, K]` -> the float32 values specfork's int4/int8 kernel multiplies the weights by:
    per group of 32, codes round(x * (127 / max|x|)) times max|x| / 127 (llama.cpp's Q8
    activations; tests and error reports)."""
    g = x.float().view(x.shape[0], -1, GROUP)
    amax = g.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    q = torch.round(g * inv).clamp_(-127, 127)
    return (q.double() * (amax / 127).double()).view_as(x)


def dequantize(lin: QuantLinear) -> torch.Tensor:
    """The fp32 weights `[N, K]` the kernel multiplies by (tests, error reports)."""
    if lin.fmt == "bfloat16":
        return lin.w.float()
    if lin.bits == 8:
        return dequantize_q8(*unpack_q8(lin.w, lin.s))
    if lin.fmt == "int8":
        return lin.w.float() * lin.s.float()[:, None]
    if lin.bits == 4:
        return dequantize_q4(*unpack_q4(lin.w, lin.s))
    raise SpecforkError("int4 weights are kept packed; dequantize before packing")


def check_weights(fmt: str, device: str | torch.device | None) -> None:
    """One-line errors before any weights load."""
    if fmt not in FORMATS:
        raise SpecforkError(f"--weights: unknown format {fmt!r} (choose from "
                            f"{', '.join(FORMATS)})")
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if fmt not in ("auto", "float32") and dev.type != "cpu":
        raise SpecforkError(f"--weights {fmt}: low-bit weights run on a CPU for now; on a GPU "
                            f"use --dtype")


def resolve(fmt: str, device: torch.device, matmuls=None, head=None) -> str:
    """`auto` -> the format this machine runs fastest within the exactness contract: int4 where
    specfork's kernel runs and every matmul weight of `matmuls` lies exactly on a Q4_1 grid
    and `head` on a Q8_0 one (a model read from a GGUF of those blocks, as the embedded target:
    int4 then multiplies by the very weights float32 holds, with 8-bit activations as llama.cpp
    does on that file, and reads a sixth of the bytes), float32 otherwise (and on a GPU, and for
    weights given as `None`)."""
    check_weights(fmt, device)
    if fmt != "auto":
        return fmt
    if (torch.device(device).type == "cpu" and matmuls is not None and head is not None
            and native() and holds(head, "int8") and all(holds(w, "int4") for w in matmuls)):
        return "int4"
    return "float32"


def holds(w: torch.Tensor, fmt: str) -> bool:
    """Whether `fmt`'s blocks (our kernel's: int4 = Q4_1, int8 = Q8_0) hold `w [N, K]` exactly,
    as `dequantize` gives them back."""
    if w.dim() != 2 or w.shape[1] % GROUP or w.dtype != torch.float32:
        return False
    for r in range(0, w.shape[0], 4096):        # in slices: the vocabulary head is 28M values
        x = w[r:r + 4096].detach()
        back = (dequantize_q4(*quantize_q4(x)) if fmt == "int4"
                else dequantize_q8(*quantize_q8(x)))
        if not torch.equal(back, x):
            return False
    return True
