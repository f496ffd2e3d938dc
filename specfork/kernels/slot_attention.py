"""Attention over KV-tree slots on a CPU, as a compiled op (`slot_attention.cpp`).

A decode step's attention is a few hundred thousand multiply-adds per layer, and the torch
path spends more than that on op dispatch: a gather of the keys and values, two bmm's and a
softmax per request per layer (a 16-request batch: 480 calls per step). This op reads each row's
K/V straight from its slots, every row of every request in one call, with no gather copies and
no padding, and gives each row the same bits whatever else is in the call.

It is compiled once per machine at first use (about 30 s) with the CPU's own vector
instructions into ~/.cache/specfork/ops (SPECFORK_CACHE moves it), named by a hash of its
source, flags and torch version; later processes load that file and take no lock, so a process
killed mid-build leaves nothing that blocks the next. Where no compiler is found, or with
SPECFORK_SLOT_ATTENTION=0, `available()` is False and the engine keeps its torch paths.
"""
from __future__ import annotations

import hashlib
import os
import platform
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import torch

SRC = Path(__file__).with_suffix(".cpp")
# one library: the slot op, its reading and writing of TurboQuant codes (code_attention.cpp,
# code_encode.cpp), the low-bit and float32 panel matmuls (lowbit_linear.cpp, panel_linear.cpp),
# the fused small ops (layer_ops.cpp), the decoder-layer loop that calls them (layer_stack.cpp)
# and their headers
SOURCES = [SRC] + [SRC.with_name(f) for f in ("code_attention.cpp", "code_encode.cpp",
                                               "lowbit_linear.cpp", "panel_linear.cpp",
                                               "layer_ops.cpp", "layer_stack.cpp")]
HEADERS = [SRC.with_suffix(".h")] + [SRC.with_name(f) for f in ("lowbit_linear.h", "panel_linear.h",
                                                                  "layer_ops.h", "vec_math.h")]
# -fopenmp: at::parallel_for splits work over torch's threads only where OpenMP is compiled in;
# -ffp-contract=off: only the FMAs the code asks for, so a row's bits cannot depend on how the
# compiler inlined the call it came through (tile shapes, Python or layer loop)
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
_LOCK = threading.Lock()
_OPS: list = []                     # [torch.ops.specfork or None] once tried


def _built_path() -> Path:
    key = hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(FLAGS + [
        torch.__version__, platform.machine(), sys.version.split()[0]]).encode()).hexdigest()
    from specfork.loader import cache_root
    return cache_root() / "ops" / f"slot_attention-{key[:16]}.so"


def _build(dest: Path) -> None:
    """Compile into a private directory (loading it into this process), then move the library
    into the cache in one rename: concurrent builders each finish, the last rename wins."""
    from torch.utils.cpp_extension import load
    print("specfork: compiling the CPU ops (slot attention, low-bit matmuls, layer loop) once "
          "(about 30-60 s)...",
          file=sys.stderr, flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        load(f"specfork_slot_attention_{dest.stem[-16:]}", [str(p) for p in SOURCES],
             extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], extra_include_paths=[str(SRC.parent)],
             build_directory=tmp, is_python_module=False, verbose=False)
        built = next(Path(tmp).glob("*.so"))
        part = dest.with_suffix(f".{os.getpid()}.part")
        shutil.copyfile(built, part)
        os.replace(part, dest)


def _load():
    with _LOCK:
        if not _OPS:
            ops = None
            if os.environ.get("SPECFORK_SLOT_ATTENTION", "1") != "0":
                try:
                    path = _built_path()
                    if path.is_file():
                        torch.ops.load_library(str(path))
                    else:
                        _build(path)
                    ops = torch.ops.specfork
                except Exception as e:           # no compiler, no ninja: the torch paths
                    line = str(e).strip().splitlines()[0] if str(e).strip() else ""
                    print(f"specfork: CPU slot-attention op unavailable ({type(e).__name__}: "
                          f"{line}); using torch ops", file=sys.stderr)
            _OPS.append(ops)
    return _OPS[0]


def available(head_dim: int | None = None) -> bool:
    """Whether the op is built here (and, for `head_dim`, runs it with vector instructions:
    its scalar fallback is slower than the torch paths, so the engine only takes the fast one)."""
    ops = _load()
    if ops is None or head_dim is None:
        return ops is not None
    return head_dim % 16 == 0 and head_dim <= ops.vector_head_dim()


def slot_attention(q: torch.Tensor, k_slots: torch.Tensor, v_slots: torch.Tensor,
                   idx: torch.Tensor, offs: torch.Tensor, scale: float) -> torch.Tensor:
    """q `[R, H, D]`; row r attends over slots `idx[offs[r]:offs[r+1]]` of `k_slots, v_slots
    [S, KVH, D]` (float32 or float16, contiguous) in that order -> `[R, H, D]`; `offs [R, 4]`
    gives each row two stretches instead, `idx[a:b]` then `idx[c:d]` (`row_slots`). Loads the
    op first where this process has not (a tensor-parallel rank runs what rank 0's step
    chose)."""
    ops = _OPS[0] if _OPS else _load()
    return ops.slot_attention(q, k_slots, v_slots, idx, offs, scale)


def code_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
                   idx: torch.Tensor, offs: torch.Tensor, scale: float, kprog: torch.Tensor,
                   klut: torch.Tensor, vprog: torch.Tensor, vlut: torch.Tensor,
                   window: tuple | None = None) -> torch.Tensor:
    """`slot_attention` over TurboQuant rows `[S, KVH, nbytes]` uint8, each decoded as it is
    read with its codec's `cpu_program` (program, centroid units). `window`: (float16 shadow
    K rows, V rows `[slots, KVH, D]`, shadow table `[blocks]` int32, block size, window, sink):
    a row's last `window` slots and first `sink` are read from their shadow rows."""
    ops = _OPS[0] if _OPS else _load()
    if window is None:
        return ops.code_attention(q, k_rows, v_rows, idx, offs, scale, kprog, klut, vprog, vlut)
    return ops.code_attention(q, k_rows, v_rows, idx, offs, scale, kprog, klut, vprog, vlut,
                              *window)


def row_slots(idx: torch.Tensor, offs: torch.Tensor) -> list:
    """Each row's slot list, from either form of `offs`."""
    if offs.dim() == 1:
        return [idx[offs[r]:offs[r + 1]] for r in range(offs.numel() - 1)]
    return [torch.cat((idx[a:b], idx[c:d])) for a, b, c, d in offs.tolist()]


def slot_attention_ref(q, k_slots, v_slots, idx, offs, scale) -> torch.Tensor:
    """The same in torch ops, row by row (tests)."""
    out = []
    G = q.shape[1] // k_slots.shape[1]
    for r, ix in enumerate(row_slots(idx, offs)):
        k = k_slots[ix].repeat_interleave(G, dim=1)                      # [n, H, D]
        v = v_slots[ix].repeat_interleave(G, dim=1)
        s = torch.einsum("hd,nhd->hn", q[r], k) * scale
        out.append(torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v))
    return torch.stack(out)
