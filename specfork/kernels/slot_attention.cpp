// Attention of query rows over K/V read straight from KV-tree slots (CPU; float32 queries,
// float32 or float16 pools, the latter widened exactly as they are read).
//
// Row r of `q [R, H, D]` attends over the slots idx[offs[r] : offs[r+1]] of one layer's pool
// `k, v [S, KVH, D]`, in that order (or, with offs [R, 4], over two stretches of idx: rows then
// share slots, as a prompt chunk's rows or a tree's rows over one prefix do, and share one
// transposed copy of those keys). One call covers a decode step, every row of a verify
// tree (each over its prefix and its own ancestors) and a whole batch of requests: no gather
// copies, no padding, and a row's result depends only on its own query and slot list, never on
// which other rows share the call, so a request computes the same bits batched or alone and a
// tree row the same bits as the decode step at its position. Lists longer than one chunk
// (kChunk keys) are scored and summed a chunk at a time, the chunks joined in order, so one
// long row spreads over every thread and a prompt chunk's rows read each chunk of their list
// together.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include "slot_attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "vec_math.h"

// 16 stored K/V values as float32: float32 pools as they are, float16 pools widened (exact).
static inline __m512 ld16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 ld16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}

// The sums of 16 vectors' lanes, each in _mm512_reduce_add_ps's order (lanes i + 8, then
// i + 4, i + 2, then the last pair; GCC's avx512fintrin.h), so a score has the same bits as
// one reduced alone: lane t of the result is a[t]'s sum. 45 shuffles and adds instead of 16
// reductions of 8 dependent steps each.
static inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int m = 0; m < 8; ++m)            // lanes i + 8: key 2m in lanes 0-7, key 2m+1 in 8-15
    b[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int p = 0; p < 4; ++p)            // lanes i + 4: 128-bit chunk t holds key 4p + t
    c[p] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * p], b[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int q = 0; q < 2; ++q)            // lanes i + 2: chunk t holds keys 8q + t, 8q + 4 + t
    d[q] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * q], c[2 * q + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[2 * q], c[2 * q + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // lane 4c + t of e holds key 4t + c
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), e);
}

// s[g * ss + j] = scale * q_g . k_j for the G query heads sharing one kv head; D a multiple of
// 16. Keys go 16 at a time (their products summed together by reduce16), the rest one by one;
// either way a score gets the same bits.
template <class T>
static void scores(const float* q, int G, int64_t qstride, const T* k, int64_t kstride,
                   const int64_t* ix, int64_t n, int D, float scale, float* s, int64_t ss) {
  const __m512 sc = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const T* kr[16];
    for (int t = 0; t < 16; ++t) kr[t] = k + ix[j + t] * kstride;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * qstride;
      __m512 acc[16];
      const __m512 q0 = _mm512_loadu_ps(qg);
      for (int t = 0; t < 16; ++t) acc[t] = _mm512_mul_ps(q0, ld16(kr[t]));
      for (int d = 16; d < D; d += 16) {
        const __m512 qd = _mm512_loadu_ps(qg + d);
        for (int t = 0; t < 16; ++t)
          acc[t] = _mm512_fmadd_ps(qd, ld16(kr[t] + d), acc[t]);
      }
      _mm512_storeu_ps(s + g * ss + j, _mm512_mul_ps(reduce16(acc), sc));
    }
  }
  for (; j < n; ++j) {
    const T* kr = k + ix[j] * kstride;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * qstride;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), ld16(kr));
      for (int d = 16; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), ld16(kr + d), acc);
      s[g * ss + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// r[l] <- lane l of every r[t]: out[l][t] = in[t][l] (16 x 16 floats).
static inline void transpose16(__m512* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {          // per 128-bit chunk: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g)            // u[4g + e], chunk m: rows 4g..4g+3, element 4m + e
    for (int e = 0; e < 4; ++e) {
      const __m512d x = _mm512_castps_pd(t[4 * g + (e >> 1)]);
      const __m512d y = _mm512_castps_pd(t[4 * g + 2 + (e >> 1)]);
      u[4 * g + e] = _mm512_castpd_ps((e & 1) ? _mm512_unpackhi_pd(x, y)
                                              : _mm512_unpacklo_pd(x, y));
    }
  for (int e = 0; e < 4; ++e) {          // r[4m + e]: chunk m of u[e], u[4+e], u[8+e], u[12+e]
    const __m512 xl = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 xh = _mm512_shuffle_f32x4(u[e], u[4 + e], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 yl = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 yh = _mm512_shuffle_f32x4(u[8 + e], u[12 + e], _MM_SHUFFLE(3, 1, 3, 1));
    r[e] = _mm512_shuffle_f32x4(xl, yl, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + e] = _mm512_shuffle_f32x4(xl, yl, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + e] = _mm512_shuffle_f32x4(xh, yh, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + e] = _mm512_shuffle_f32x4(xh, yh, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

// Keys 16b..16b+15 of the list ix[0..n) as float32, one 16-lane vector per dimension:
// kt[b][d][t] = k_{16b+t}[d] (keys past n: zero).
template <class T>
static void transpose_block(const T* k, int64_t kstride, const int64_t* ix, int64_t n, int64_t b,
                            int D, float* kt) {
  for (int c = 0; c < D; c += 16) {
    __m512 r[16];
    for (int t = 0; t < 16; ++t)
      r[t] = 16 * b + t < n ? ld16(k + ix[16 * b + t] * kstride + c) : _mm512_setzero_ps();
    transpose16(r);
    for (int l = 0; l < 16; ++l) _mm512_storeu_ps(kt + (16 * b * D) + (c + l) * 16, r[l]);
  }
}

// The scores of the first `nb` 16-key blocks of transposed keys: the same products, lane sums
// and reduction tree as reduce16 (lane l of key t: q[l] k_t[l], then q[16c + l] k_t[16c + l]
// fused on in order of c; then lanes l and l + 8 added, l + 4, l + 2, l + 1), so the same bits,
// with no shuffles: the keys sit in the lanes.
static void scores_t(const float* q, int G, int64_t qstride, const float* kt, int64_t nb,
                     int D, float scale, float* s, int64_t ss) {
  const __m512 sc = _mm512_set1_ps(scale);
  for (int64_t b = 0; b < nb; ++b) {
    const float* kb = kt + b * 16 * D;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * qstride;
      __m512 a[16];
      for (int l = 0; l < 16; ++l)
        a[l] = _mm512_mul_ps(_mm512_set1_ps(qg[l]), _mm512_loadu_ps(kb + l * 16));
      for (int c = 16; c < D; c += 16)
        for (int l = 0; l < 16; ++l)
          a[l] = _mm512_fmadd_ps(_mm512_set1_ps(qg[c + l]), _mm512_loadu_ps(kb + (c + l) * 16),
                                 a[l]);
      for (int l = 0; l < 8; ++l) a[l] = _mm512_add_ps(a[l + 8], a[l]);
      for (int l = 0; l < 4; ++l) a[l] = _mm512_add_ps(a[l + 4], a[l]);
      for (int l = 0; l < 2; ++l) a[l] = _mm512_add_ps(a[l], a[l + 2]);
      _mm512_storeu_ps(s + g * ss + 16 * b, _mm512_mul_ps(_mm512_add_ps(a[0], a[1]), sc));
    }
  }
}

// acc[g][c] += p[g * ps + j] v_j[16c..16c+16) for GB heads at once over the slots ix1[0..n1),
// then ix2[0..n2): NV * GB accumulators held in registers (a runtime-sized array of them was
// spilled, each key's FMA then waiting on a store and a reload), each in the order of j.
template <int NV, int GB, class T>
static void weighted_block(const float* p, int64_t ps, const T* v, int64_t vstride,
                           const int64_t* ix1, int64_t n1, const int64_t* ix2, int64_t n2,
                           __m512* out) {
  __m512 acc[GB][NV];
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n1 + n2; ++j) {
    const T* vr = v + (j < n1 ? ix1[j] : ix2[j - n1]) * vstride;
    __m512 vv[NV];
    for (int c = 0; c < NV; ++c) vv[c] = ld16(vr + 16 * c);
    for (int g = 0; g < GB; ++g) {
      const __m512 w = _mm512_set1_ps(p[g * ps + j]);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int c = 0; c < NV; ++c) out[g * NV + c] = acc[g][c];
}

// out[g] = sum_j p[g * ps + j] v_j / z[g] over the slots ix1[0..n1), then ix2[0..n2), in that
// order; D a multiple of 16 and at most 256.
template <int NV, class T>
static void weighted_heads(const float* p, int64_t ps, const float* z, int G, const T* v,
                           int64_t vstride, const int64_t* ix1, int64_t n1, const int64_t* ix2,
                           int64_t n2, float* out, int64_t ostride) {
  constexpr int GB = NV <= 4 ? 3 : NV <= 8 ? 2 : 1;       // at most 16 accumulators
  for (int g0 = 0; g0 < G; g0 += GB) {
    __m512 acc[GB * NV];
    const int gb = std::min(GB, G - g0);
    const float* pg = p + g0 * ps;
    if (gb == GB)
      weighted_block<NV, GB>(pg, ps, v, vstride, ix1, n1, ix2, n2, acc);
    else if (gb == 2)
      weighted_block<NV, 2 < GB ? 2 : 1>(pg, ps, v, vstride, ix1, n1, ix2, n2, acc);
    else
      weighted_block<NV, 1>(pg, ps, v, vstride, ix1, n1, ix2, n2, acc);
    for (int g = 0; g < gb; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / z[g0 + g]);
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(out + (g0 + g) * ostride + 16 * c, _mm512_mul_ps(acc[g * NV + c], inv));
    }
  }
}

template <class T>
static void weighted_values(const float* p, int64_t ps, const float* z, int G, const T* v,
                            int64_t vstride, const int64_t* ix1, int64_t n1, const int64_t* ix2,
                            int64_t n2, int D, float* out, int64_t ostride) {
  switch (D / 16) {
#define SPECFORK_NV(n) \
  case n: return weighted_heads<n>(p, ps, z, G, v, vstride, ix1, n1, ix2, n2, out, ostride);
    SPECFORK_NV(1) SPECFORK_NV(2) SPECFORK_NV(3) SPECFORK_NV(4) SPECFORK_NV(5) SPECFORK_NV(6)
    SPECFORK_NV(7) SPECFORK_NV(8) SPECFORK_NV(9) SPECFORK_NV(10) SPECFORK_NV(11) SPECFORK_NV(12)
    SPECFORK_NV(13) SPECFORK_NV(14) SPECFORK_NV(15) SPECFORK_NV(16)
#undef SPECFORK_NV
  }
}
#endif

// The same three steps without vector instructions (other CPUs, other head sizes).
template <class T>
static void scores_ref(const float* q, int G, int64_t qstride, const T* k, int64_t kstride,
                       const int64_t* ix, int64_t n, int D, float scale, float* s) {
  for (int64_t j = 0; j < n; ++j)
    for (int g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int d = 0; d < D; ++d)
        acc += q[g * qstride + d] * static_cast<float>(k[ix[j] * kstride + d]);
      s[g * n + j] = acc * scale;
    }
}

static float softmax_ref(float* s, int64_t n) {
  float m = -INFINITY, sum = 0.f;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, s[j]);
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
  return sum;
}

template <class T>
static void weighted_ref(const float* p, const float* z, int G, const T* v,
                         int64_t vstride, const int64_t* ix, int64_t n, int D, float* out,
                         int64_t ostride) {
  for (int g = 0; g < G; ++g) {
    for (int d = 0; d < D; ++d) out[g * ostride + d] = 0.f;
    for (int64_t j = 0; j < n; ++j)
      for (int d = 0; d < D; ++d)
        out[g * ostride + d] += p[g * n + j] * static_cast<float>(v[ix[j] * vstride + d]);
    for (int d = 0; d < D; ++d) out[g * ostride + d] /= z[g];
  }
}

std::vector<RowSlots> row_slots(const at::Tensor& offs, int64_t R, int64_t numel) {
  TORCH_CHECK((offs.dim() == 1 && offs.numel() == R + 1) ||
                  (offs.dim() == 2 && offs.size(0) == R && offs.size(1) == 4),
              "offs: [R+1] or [R, 4]");
  const int64_t* op = offs.data_ptr<int64_t>();
  std::vector<RowSlots> rows((size_t)R);
  for (int64_t r = 0; r < R; ++r) {
    RowSlots& x = rows[r];
    x = offs.dim() == 1 ? RowSlots{op[r], op[r + 1], 0, 0}
                        : RowSlots{op[4 * r], op[4 * r + 1], op[4 * r + 2], op[4 * r + 3]};
    TORCH_CHECK(x.a >= 0 && x.a <= x.b && x.b <= numel && x.c >= 0 && x.c <= x.d &&
                    x.d <= numel && x.size() > 0,
                "each row reads at least one slot, within idx");
  }
  return rows;
}

// Rows that read one list (the same first stretch start, as a prompt chunk's causal rows or a
// tree's rows over their prefix) score it through one transposed copy of its keys per kv head:
// built once, read by every row and query head, with no reduction shuffles. The bits are those
// of the row-by-row path (scores_t), so a row computes the same whichever rows share its call.
struct Shared {
  int64_t a, n, kt;                       // list idx[a : a + n), its copy at kt (floats)
};

#if defined(__AVX512F__)
// Keys per softmax chunk. A row's list is scored and summed in chunks of kChunk keys from its
// start, each chunk with its own max and sum, and the chunks then joined in order (the split of
// flash-decoding): one long row (a decode step over thousands of tokens) keeps every thread
// busy, rows that share a transposed copy (a prompt chunk's, kSharedRows) read each chunk of it
// while it sits in cache, and a row's bits still depend only on its own list, never on the
// call. A list
// of at most kChunk keys is one chunk: one softmax over the whole row.
constexpr int64_t kChunk = 512;
constexpr int64_t kRowBlock = 8;         // rows of one shared list scored together per chunk
// Rows sharing a list take its transposed copy from this many on (a prompt chunk's rows):
// building the copy cost more than it saved for a verify tree of up to 8 rows, which read the
// pool's own rows, cached after the first (scratch runs of `python eval/bench_slot_attention.py`
// with either threshold: 2 rows over 300 keys 2.9x one row with the copy, 1.4x without; 8 rows
// over 3000 keys 4.3x and 3.4x).
constexpr int64_t kSharedRows = 9;

// One unit of work: rows [r0, r1) (one row, or rows sharing one list), kv head h, chunk c.
struct ChunkItem {
  int64_t r0, r1, h, c, work;
};

// Scratch that lives across calls (a call per layer per step): large buffers allocated anew
// each call were page-faulted in each call.
static std::vector<float>& scratch(int which, size_t n) {
  static thread_local std::vector<float> buf[2];
  if (buf[which].size() < n) buf[which].resize(n);
  return buf[which];
}

template <class T>
static void attend_chunks(const float* qp, const T* kp, const T* vp, const int64_t* ip,
                          const std::vector<RowSlots>& rows, float* outp, int64_t H, int64_t D,
                          int64_t KVH, double scale) {
  const int G = (int)(H / KVH);
  const int64_t kstride = KVH * D, R = (int64_t)rows.size(), ss = kChunk + 16;
  // runs of >= kSharedRows consecutive rows with one first-stretch start and a full key block
  // each share one transposed copy of that stretch's keys
  std::vector<int64_t> group((size_t)R, -1);
  std::vector<Shared> shared;
  int64_t kt_floats = 0, blocks = 0;
  for (int64_t r = 0; r < R;) {
    int64_t e = r, n = 0;
    while (e < R && rows[e].a == rows[r].a && rows[e].b - rows[e].a >= 16) {
      n = std::max(n, rows[e].b - rows[e].a);
      ++e;
    }
    if (e - r >= kSharedRows) {
      for (int64_t i = r; i < e; ++i) group[i] = (int64_t)shared.size();
      shared.push_back({rows[r].a, n, kt_floats});
      kt_floats += (n + 15) / 16 * 16 * D * KVH;
      blocks += (n + 15) / 16;
      r = e;
    } else {
      r = std::max(e, r + 1);
    }
  }
  float* kt = scratch(0, (size_t)kt_floats).data();
  if (!shared.empty()) {                  // (list, kv head, block) items, all the same size
    std::vector<std::pair<int64_t, int64_t>> first;   // (list, its first block)
    for (size_t i = 0, b = 0; i < shared.size(); b += (shared[i].n + 15) / 16, ++i)
      first.push_back({(int64_t)i, (int64_t)b});
    at::parallel_for(0, blocks * KVH, 16, [&](int64_t x0, int64_t x1) {
      for (int64_t x = x0; x < x1; ++x) {
        const int64_t h = x / blocks, gb = x % blocks;
        auto it = std::upper_bound(first.begin(), first.end(), gb,
                                   [](int64_t v, const std::pair<int64_t, int64_t>& f) {
                                     return v < f.second;
                                   }) - 1;
        const Shared& sh = shared[it->first];
        const int64_t nbl = (sh.n + 15) / 16;
        transpose_block(kp + h * D, kstride, ip + sh.a, sh.n, gb - it->second, (int)D,
                        kt + sh.kt + h * nbl * 16 * D);
      }
    });
  }
  // rows over more than one chunk keep each chunk's (max, sum, unnormalised output) to join
  std::vector<int64_t> pbase((size_t)R, -1);
  int64_t parts = 0;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = rows[r].size();
    if (n > kChunk) {
      pbase[r] = parts;
      parts += (n + kChunk - 1) / kChunk;
    }
  }
  float* pacc = scratch(1, (size_t)(parts * KVH * G * (D + 2))).data();
  float* pmax = pacc + parts * KVH * G * D;
  float* psum = pmax + parts * KVH * G;
  std::vector<ChunkItem> items;
  for (int64_t r0 = 0; r0 < R;) {
    int64_t r1 = r0 + 1;
    if (group[r0] >= 0)
      while (r1 < R && r1 - r0 < kRowBlock && group[r1] == group[r0]) ++r1;
    int64_t n = 0;
    for (int64_t r = r0; r < r1; ++r) n = std::max(n, rows[r].size());
    for (int64_t c = 0; c * kChunk < n; ++c) {
      int64_t work = 0;
      for (int64_t r = r0; r < r1; ++r)
        work += std::max<int64_t>(0, std::min(kChunk, rows[r].size() - c * kChunk));
      for (int64_t h = 0; h < KVH; ++h) items.push_back({r0, r1, h, c, work});
    }
    r0 = r1;
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const ChunkItem& x, const ChunkItem& y) { return x.work > y.work; });
  float one[64];                          // a chunk's sums stay unnormalised until the join
  std::fill(one, one + 64, 1.f);
  std::atomic<int64_t> next{0};
  const int64_t nt = std::max<int64_t>(
      1, std::min<int64_t>(at::get_num_threads(), (int64_t)items.size()));
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    std::vector<float> sbuf((size_t)(G * ss));
    float* s = sbuf.data();
    for (int64_t i; (i = next.fetch_add(1)) < (int64_t)items.size();) {
      const ChunkItem& it = items[i];
      const int64_t h = it.h, lo = it.c * kChunk;
      const T* kh = kp + h * D;
      for (int64_t r = it.r0; r < it.r1; ++r) {
        const RowSlots& x = rows[r];
        const int64_t n1 = x.b - x.a, n = x.size();
        if (lo >= n) continue;
        const int64_t hi = std::min(lo + kChunk, n), m = hi - lo;
        const int64_t m1 = std::max<int64_t>(0, std::min(hi, n1) - lo);  // first stretch
        const int64_t m2 = m - m1;                                         // second stretch
        const int64_t* ix1 = ip + x.a + lo;
        const int64_t* ix2 = ip + x.c + std::max<int64_t>(0, lo - n1);
        const float* qr = qp + (r * H + h * G) * D;
        if (m1 && group[r] >= 0) {
          const Shared& sh = shared[group[r]];
          const int64_t nbl = (sh.n + 15) / 16;
          scores_t(qr, G, D, kt + sh.kt + (h * nbl + lo / 16) * 16 * D, (m1 + 15) / 16, (int)D,
                   (float)scale, s, ss);
        } else if (m1) {
          scores(qr, G, D, kh, kstride, ix1, m1, (int)D, (float)scale, s, ss);
        }
        if (m2) scores(qr, G, D, kh, kstride, ix2, m2, (int)D, (float)scale, s + m1, ss);
        float z[64], mx[64];
        for (int g = 0; g < G; ++g) z[g] = softmax_unnormed(s + g * ss, m, mx + g);
        if (n <= kChunk) {
          weighted_values(s, ss, z, G, vp + h * D, kstride, ix1, m1, ix2, m2, (int)D,
                          outp + (r * H + h * G) * D, D);
        } else {
          const int64_t at = (pbase[r] + it.c) * KVH + h;
          weighted_values(s, ss, one, G, vp + h * D, kstride, ix1, m1, ix2, m2, (int)D,
                          pacc + at * G * D, D);
          std::copy(mx, mx + G, pmax + at * G);
          std::copy(z, z + G, psum + at * G);
        }
      }
    }
  });
  if (parts == 0) return;
  // join the chunks of long rows, in chunk order: weights e^(max_c - max), one division
  at::parallel_for(0, R * KVH, 1, [&](int64_t x0, int64_t x1) {
    for (int64_t x = x0; x < x1; ++x) {
      const int64_t r = x / KVH, h = x % KVH;
      if (pbase[r] < 0) continue;
      const int64_t nc = (rows[r].size() + kChunk - 1) / kChunk;
      for (int g = 0; g < G; ++g) {
        auto at = [&](int64_t c) { return (pbase[r] + c) * KVH + h; };
        float mall = -INFINITY;
        for (int64_t c = 0; c < nc; ++c) mall = std::max(mall, pmax[at(c) * G + g]);
        float zall = 0.f;
        float* o = outp + (r * H + h * G + g) * D;
        for (int64_t c = 0; c < nc; ++c) {
          const float w = std::exp(pmax[at(c) * G + g] - mall);
          zall += w * psum[at(c) * G + g];
          const float* a = pacc + (at(c) * G + g) * D;
          const __m512 wv = _mm512_set1_ps(w);
          for (int64_t d = 0; d < D; d += 16) {
            const __m512 prev = c ? _mm512_loadu_ps(o + d) : _mm512_setzero_ps();
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(wv, _mm512_loadu_ps(a + d), prev));
          }
        }
        const __m512 inv = _mm512_set1_ps(1.0f / zall);
        for (int64_t d = 0; d < D; d += 16)
          _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), inv));
      }
    }
  });
}
#endif

// The row/head loop over pools of element type T (float32, or float16 widened as read).
template <class T>
static void attend_rows(const float* qp, const T* kp, const T* vp, const int64_t* ip,
                        const std::vector<RowSlots>& rows, float* outp, int64_t H, int64_t D,
                        int64_t KVH, double scale) {
  const int G = (int)(H / KVH);
  const int64_t kstride = KVH * D;
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0 && D <= 256;
#else
  const bool vec = false;
#endif
  if (!vec) {
    each_row_head(KVH, ip, rows, [&](int64_t r, int64_t h, const int64_t* ix, int64_t n,
                                     std::vector<float>& s) {
      const float* qr = qp + (r * H + h * G) * D;
      float* orow = outp + (r * H + h * G) * D;
      s.resize((size_t)(G * n));
      float z[64];
      scores_ref(qr, G, D, kp + h * D, kstride, ix, n, (int)D, (float)scale, s.data());
      for (int g = 0; g < G; ++g) z[g] = softmax_ref(s.data() + g * n, n);
      weighted_ref(s.data(), z, G, vp + h * D, kstride, ix, n, (int)D, orow, D);
    });
    return;
  }
#if defined(__AVX512F__)
  attend_chunks(qp, kp, vp, ip, rows, outp, H, D, KVH, scale);
#endif
}

at::Tensor slot_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v, at::Tensor idx,
                          at::Tensor offs, double scale) {
  // profilers see it under its own name when layer_stack.cpp calls it directly
  RECORD_FUNCTION("specfork::slot_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(), "q [R,H,D], k/v [S,KVH,D]");
  const bool half = k.scalar_type() == at::kHalf;
  TORCH_CHECK(q.scalar_type() == at::kFloat && (half || k.scalar_type() == at::kFloat) &&
              v.scalar_type() == k.scalar_type(), "float32 queries, float32 or float16 pools");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "contiguous pools");
  TORCH_CHECK(idx.scalar_type() == at::kLong && offs.scalar_type() == at::kLong, "int64 slots");
  q = q.contiguous();
  idx = idx.contiguous();
  offs = offs.contiguous();
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && H % KVH == 0, "shapes");
  TORCH_CHECK(H / KVH <= 64, "at most 64 query heads per kv head");
  const auto rows = row_slots(offs, R, idx.numel());
  auto out = at::empty_like(q);
  const int64_t* ip = idx.data_ptr<int64_t>();
  if (half)
    attend_rows(q.data_ptr<float>(), k.data_ptr<at::Half>(), v.data_ptr<at::Half>(), ip, rows,
                out.data_ptr<float>(), H, D, KVH, scale);
  else
    attend_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), ip, rows,
                out.data_ptr<float>(), H, D, KVH, scale);
  return out;
}

// The widest head size the vector path takes (0: this build has no vector path).
int64_t vector_head_dim() {
#if defined(__AVX512F__)
  return 256;
#else
  return 0;
#endif
}

// Registered as torch.ops.specfork.*: dispatched (and profiled) as any other op.
TORCH_LIBRARY(specfork, m) {
  m.def("slot_attention(Tensor q, Tensor k, Tensor v, Tensor idx, Tensor offs, float scale) "
        "-> Tensor");
  m.def("vector_head_dim", &vector_head_dim);
}

TORCH_LIBRARY_IMPL(specfork, CPU, m) { m.impl("slot_attention", &slot_attention); }
