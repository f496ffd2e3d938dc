"""Triton tree attention (cascade): the paged prefix read once per (kv head, block of query rows),
the tree under the ancestor mask, merged by log-sum-exp. Entry point `tree_attention_triton`,
same arguments as `tree_attention.tree_attention`; runs on CPU tensors under TRITON_INTERPRET=1.

Query rows: for kv head `kvh`, row r = t*G + g is query head kvh*G + g of tree token t, so the G
query heads sharing a K/V page are one matrix and every page is loaded once for all of them.

Two launches:
  1. `_prefix_kernel`, grid (KVH, row blocks, splits): flash attention over one chunk of the
     prefix (no mask: every tree token sees all of it), K/V read from the pages in place.
     Writes the normalised partial `[S, KVH, R, D]` fp32 and its base-2 lse `[S, KVH, R]`.
     Splitting the prefix (flash-decoding) keeps the GPU busy when T*G is small.
  2. `_tree_merge_kernel`, grid (KVH, row blocks): the tree tokens under the mask (T <= 128),
     then folds in the S prefix partials by lse and writes `[T, H, D]` in q's dtype.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _rows(kvh, rb, rows, s_t, s_h, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's query rows, their validity, and their offsets into a `[T, H, D]` tensor:
    row r = t*G + g is query head kvh*G + g of tree token t."""
    offs_m = rb * BLOCK_M + tl.arange(0, BLOCK_M)
    return offs_m, offs_m < rows, (offs_m // G) * s_t + (kvh * G + offs_m % G) * s_h


@triton.jit
def _load_q(Q, q_off, row_ok, offs_d, UPCAST: tl.constexpr):
    q = tl.load(Q + q_off[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    if UPCAST:                                                     # see tree_attention_triton
        q = q.to(tl.float32)
    return q


@triton.jit
def _softmax_step(m_i, l_i, acc, s, v, DOT_PREC: tl.constexpr):
    """Online softmax over one key block: base-2 scores `s [M, N]` (-inf: not seen), `v [N, D]`.
    A row that has seen nothing yet still has m = -inf; its exponents are taken against 0
    then, giving 0 rather than NaN (a tree row may see no key of a tree key block)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc


@triton.jit
def _load_codes(ROWS, row_off, n_ok, offs_d, LAY, TAB, HEAD_DIM: tl.constexpr,
                PLANES: tl.constexpr):
    """TurboQuant rows `[BLOCK_N, nbytes]` uint8 at `row_off` -> `[BLOCK_N, D]` fp32, the
    rotated-space vectors `scale * centroid`. `LAY [PLANES, 5, D]` int32 gives, per plane and
    coordinate, the byte, shift, mask and bit position of its code bits and the coordinate's
    offset into the centroid table `TAB` (`TurboCodec.kernel_layout`)."""
    idx = tl.zeros([offs_d.shape[0]], tl.int32)[None, :] + tl.zeros([row_off.shape[0]],
                                                                   tl.int32)[:, None]
    for j in tl.static_range(PLANES):
        bi = tl.load(LAY + (j * 5 + 0) * HEAD_DIM + offs_d)
        sh = tl.load(LAY + (j * 5 + 1) * HEAD_DIM + offs_d)
        mk = tl.load(LAY + (j * 5 + 2) * HEAD_DIM + offs_d)
        lo = tl.load(LAY + (j * 5 + 3) * HEAD_DIM + offs_d)
        b = tl.load(ROWS + row_off[:, None] + bi[None, :], mask=n_ok[:, None], other=0)
        idx += ((b.to(tl.int32) >> sh[None, :]) & mk[None, :]) << lo[None, :]
    toff = tl.load(LAY + 4 * HEAD_DIM + offs_d)
    c = tl.load(TAB + idx + toff[None, :])
    s0 = tl.load(ROWS + row_off, mask=n_ok, other=0).to(tl.int32)
    s1 = tl.load(ROWS + row_off + 1, mask=n_ok, other=0).to(tl.int32)
    scale = (s0 | (s1 << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return c * scale[:, None]


@triton.jit
def _prefix_kernel(Q, K, V, BT, O_part, LSE_part,
                   prefix_len, rows, chunk,
                   sq_t, sq_h,                  # q [T, H, D]
                   sk_b, sk_s, sk_h,            # k cache [num_blocks, PAGE, KVH, D or nbytes]
                   sv_b, sv_s, sv_h,
                   so_s, so_h, so_r,            # O_part [S, KVH, R, D]
                   sl_s, sl_h,                  # LSE_part [S, KVH, R]
                   qk_scale,                    # scale * log2(e)
                   KLAY, KTAB, VLAY, VTAB,      # CODES: layouts and centroid tables of K, V
                   G: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr,
                   UPCAST: tl.constexpr, CODES: tl.constexpr, KPLANES: tl.constexpr,
                   VPLANES: tl.constexpr):
    kvh = tl.program_id(0)
    rb = tl.program_id(1)
    split = tl.program_id(2)
    offs_m, row_ok, q_off = _rows(kvh, rb, rows, sq_t, sq_h, G, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_q(Q, q_off, row_ok, offs_d, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    start = split * chunk
    end = tl.minimum(start + chunk, prefix_len)                    # chunk > 0 keys, by the host
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)                        # logical prefix positions
        n_ok = offs_n < end
        blk = tl.load(BT + offs_n // PAGE, mask=n_ok, other=0).to(tl.int64)
        slot = offs_n % PAGE
        if CODES:                       # TurboQuant pages: decoded here, never in memory
            k = _load_codes(K, blk * sk_b + slot * sk_s + kvh * sk_h, n_ok, offs_d, KLAY,
                            KTAB, HEAD_DIM, KPLANES).to(q.dtype)
        else:
            k = tl.load(K + (blk * sk_b + slot * sk_s + kvh * sk_h)[:, None] + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0).to(q.dtype)     # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if CODES:
            v = _load_codes(V, blk * sv_b + slot * sv_s + kvh * sv_h, n_ok, offs_d, VLAY,
                            VTAB, HEAD_DIM, VPLANES).to(q.dtype)
        else:
            v = tl.load(V + (blk * sv_b + slot * sv_s + kvh * sv_h)[:, None] + offs_d[None, :],
                        mask=n_ok[:, None], other=0.0).to(q.dtype)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, DOT_PREC)

    o_ptr = O_part + split * so_s + kvh * so_h + offs_m[:, None] * so_r + offs_d[None, :]
    tl.store(o_ptr, acc / l_i[:, None], mask=row_ok[:, None])
    tl.store(LSE_part + split * sl_s + kvh * sl_h + offs_m, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _tree_merge_kernel(Q, KT, VT, MASK, O_part, LSE_part, Out,
                       T, rows, num_splits,
                       sq_t, sq_h,              # q [T, H, D]
                       skt_t, skt_h,            # k_tree [T, KVH, D]
                       svt_t, svt_h,
                       sm_t,                    # MASK [T, T] uint8
                       so_s, so_h, so_r,        # O_part [S, KVH, R, D]
                       sl_s, sl_h,              # LSE_part [S, KVH, R]
                       sout_t, sout_h,          # Out [T, H, D]
                       qk_scale,
                       G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_T: tl.constexpr, HAS_MASK: tl.constexpr, DOT_PREC: tl.constexpr,
                       UPCAST: tl.constexpr):
    kvh = tl.program_id(0)
    rb = tl.program_id(1)
    offs_m, row_ok, q_off = _rows(kvh, rb, rows, sq_t, sq_h, G, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = _load_q(Q, q_off, row_ok, offs_d, UPCAST)
    t_q = offs_m // G                                              # tree token of each row

    # Tree part: tree keys under the ancestor mask.
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for j0 in range(0, T, BLOCK_T):
        offs_j = j0 + tl.arange(0, BLOCK_T)
        j_ok = offs_j < T
        k = tl.load(KT + (offs_j * skt_t + kvh * skt_h)[:, None] + offs_d[None, :],
                    mask=j_ok[:, None], other=0.0).to(q.dtype)     # [BLOCK_T, D]
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale
        seen = row_ok[:, None] & j_ok[None, :]
        if HAS_MASK:
            anc = tl.load(MASK + t_q[:, None] * sm_t + offs_j[None, :], mask=seen, other=0)
            seen = seen & (anc != 0)
        s = tl.where(seen, s, float("-inf"))
        v = tl.load(VT + (offs_j * svt_t + kvh * svt_h)[:, None] + offs_d[None, :],
                    mask=j_ok[:, None], other=0.0).to(q.dtype)
        m_i, l_i, acc = _softmax_step(m_i, l_i, acc, s, v, DOT_PREC)

    # Prefix partials: each is normalised with base-2 lse, i.e. weight 2^lse relative to m_i.
    for sp in range(0, num_splits):
        lse_s = tl.load(LSE_part + sp * sl_s + kvh * sl_h + offs_m, mask=row_ok,
                        other=float("-inf"))
        o_s = tl.load(O_part + sp * so_s + kvh * so_h + offs_m[:, None] * so_r + offs_d[None, :],
                      mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, lse_s)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        beta = tl.exp2(lse_s - m_ref)
        acc = acc * alpha[:, None] + o_s * beta[:, None]
        l_i = l_i * alpha + beta
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]           # l_i == 0 only on padded rows
    _, _, out_off = _rows(kvh, rb, rows, sout_t, sout_h, G, BLOCK_M)
    tl.store(Out + out_off[:, None] + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _prefix_splits(prefix_len: int, programs: int, block_n: int, sms: int,
                   num_splits: int | None) -> tuple[int, int]:
    """(splits, keys per split). Enough splits for ~2 waves of programs, each split at least
    4 key blocks so the partial write and merge stay small next to the work."""
    if prefix_len == 0:
        return 0, 0
    n_blocks = triton.cdiv(prefix_len, block_n)
    if num_splits is None:
        num_splits = min(triton.cdiv(2 * sms, programs), max(1, n_blocks // 4))
    chunk = triton.cdiv(n_blocks, max(1, min(num_splits, n_blocks))) * block_n
    return triton.cdiv(prefix_len, chunk), chunk


def tree_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_table: torch.Tensor, prefix_len: int, k_tree: torch.Tensor,
                          v_tree: torch.Tensor, tree_mask: torch.Tensor | None,
                          scale: float | None = None, num_splits: int | None = None,
                          codes: tuple | None = None) -> torch.Tensor:
    """Paged tree attention -> `[T, H, D]` in q's dtype. `num_splits` forces the prefix split
    count (tests); default from the SM count. fp32 inputs use IEEE fp32 dots (no TF32).
    `codes`: the caches hold TurboQuant rows (uint8, `[.., nbytes]`), given as
    (key layout, key table, value layout, value table) from `TurboCodec.kernel_layout`; q is then in the
    keys' rotated space and the output in the values' (the caller rotates)."""
    T, H, D = q.shape
    page, kvh = k_cache.shape[1], k_cache.shape[2]
    G = H // kvh
    assert H == kvh * G and k_tree.shape == (T, kvh, D) and D in (16, 32, 64, 128, 256), \
        f"tree_attention_triton: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}, k_tree {tuple(k_tree.shape)}"
    q, k_tree, v_tree = q.contiguous(), k_tree.contiguous(), v_tree.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache head_dim must be contiguous"
    scale = D ** -0.5 if scale is None else scale
    qk_scale = scale * _LOG2E
    rows = T * G
    # Each row block re-reads the whole prefix, so big 16-bit trees (T*G >= 256) take 128 rows.
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    if rows >= 256 and q.dtype != torch.float32:
        block_m = 128
    block_n = 32 if q.dtype == torch.float32 else 64               # fp32 tiles are 2x the smem
    # The interpreter computes bf16 dots on the raw bit patterns (triton-lang/triton#11584), so
    # off-GPU bf16 tiles are upcast to fp32 right after loading; on GPU they stay bf16.
    upcast = q.dtype == torch.bfloat16 and not q.is_cuda
    dot_prec = "ieee" if q.dtype == torch.float32 or upcast else "tf32"   # ignored for 16-bit
    warps = 4 if block_m * D <= 64 * 64 else 8
    row_blocks = triton.cdiv(rows, block_m)

    splits, chunk = _prefix_splits(prefix_len, kvh * row_blocks, block_n, _sm_count(q.device),
                                   num_splits)
    o_part = torch.empty(max(splits, 1), kvh, rows, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(max(splits, 1), kvh, rows, dtype=torch.float32, device=q.device)
    klay, ktab, vlay, vtab = codes if codes is not None else (q, q, q, q)  # q: unused ptrs
    if splits:
        _prefix_kernel[(kvh, row_blocks, splits)](
            q, k_cache, v_cache, block_table, o_part, lse_part,
            prefix_len, rows, chunk,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            o_part.stride(0), o_part.stride(1), o_part.stride(2),
            lse_part.stride(0), lse_part.stride(1),
            qk_scale, klay, ktab, vlay, vtab,
            G=G, HEAD_DIM=D, PAGE=page, BLOCK_M=block_m, BLOCK_N=block_n,
            DOT_PREC=dot_prec, UPCAST=upcast, CODES=codes is not None,
            KPLANES=klay.shape[0] if codes is not None else 0,
            VPLANES=vlay.shape[0] if codes is not None else 0, num_warps=warps, num_stages=2)

    has_mask = tree_mask is not None and T > 1
    mask = tree_mask.contiguous().view(torch.uint8) if has_mask else q   # q: unused placeholder ptr
    out = torch.empty_like(q)
    _tree_merge_kernel[(kvh, row_blocks)](
        q, k_tree, v_tree, mask, o_part, lse_part, out,
        T, rows, splits,
        q.stride(0), q.stride(1),
        k_tree.stride(0), k_tree.stride(1),
        v_tree.stride(0), v_tree.stride(1),
        mask.stride(0) if has_mask else 0,
        o_part.stride(0), o_part.stride(1), o_part.stride(2),
        lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        qk_scale, G=G, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_T=32, HAS_MASK=has_mask,
        DOT_PREC=dot_prec, UPCAST=upcast, num_warps=warps, num_stages=1)
    return out
