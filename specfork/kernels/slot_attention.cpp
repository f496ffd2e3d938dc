// Attention of query rows over K/V read straight from KV-tree slots (CPU; float32 queries,
// float32 or float16 pools, the latter widened exactly as they are read).
//
// Row r of `q [R, H, D]` attends over the slots idx[offs[r] : offs[r+1]] of one layer's pool
// `k, v [S, KVH, D]`, in that order. One call covers a decode step, every row of a verify
// tree (each over its prefix and its own ancestors) and a whole batch of requests: no gather
// copies, no padding, and a row's result depends only on its own query and slot list, never on
// which other rows share the call, so a request computes the same bits batched or alone and a
// tree row the same bits as the decode step at its position.
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

// s[j] = scale * q . k_j for the G query heads sharing one kv head; D a multiple of 16. Keys
// go 16 at a time (their products summed together by reduce16), the rest one by one; either
// way a score gets the same bits.
template <class T>
static void scores(const float* q, int G, int64_t qstride, const T* k, int64_t kstride,
                   const int64_t* ix, int64_t n, int D, float scale, float* s) {
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
      _mm512_storeu_ps(s + g * n + j, _mm512_mul_ps(reduce16(acc), sc));
    }
  }
  for (; j < n; ++j) {
    const T* kr = k + ix[j] * kstride;
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * qstride;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), ld16(kr));
      for (int d = 16; d < D; d += 16)
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), ld16(kr + d), acc);
      s[g * n + j] = _mm512_reduce_add_ps(acc) * scale;
    }
  }
}

// out[g] = sum_j p[g][j] v_j / z[g], D a multiple of 16 and at most 256.
template <class T>
static void weighted_values(const float* p, const float* z, int G, const T* v,
                            int64_t vstride, const int64_t* ix, int64_t n, int D, float* out,
                            int64_t ostride) {
  for (int g = 0; g < G; ++g) {
    __m512 acc[16];
    const int nv = D / 16;
    for (int c = 0; c < nv; ++c) acc[c] = _mm512_setzero_ps();
    const float* pg = p + g * n;
    for (int64_t j = 0; j < n; ++j) {
      const T* vr = v + ix[j] * vstride;
      const __m512 w = _mm512_set1_ps(pg[j]);
      for (int c = 0; c < nv; ++c)
        acc[c] = _mm512_fmadd_ps(w, ld16(vr + 16 * c), acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / z[g]);
    for (int c = 0; c < nv; ++c)
      _mm512_storeu_ps(out + g * ostride + 16 * c, _mm512_mul_ps(acc[c], inv));
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

// The row/head loop over pools of element type T (float32, or float16 widened as read).
template <class T>
static void attend_rows(const float* qp, const T* kp, const T* vp, const at::Tensor& idx,
                        const int64_t* op, float* outp, int64_t R, int64_t H, int64_t D,
                        int64_t KVH, double scale) {
  const int G = (int)(H / KVH);
  const int64_t kstride = KVH * D;
#if defined(__AVX512F__)
  const bool vec = D % 16 == 0 && D <= 256;
#else
  const bool vec = false;
#endif
  each_row_head(R, KVH, idx, op, [&](int64_t r, int64_t h, const int64_t* ix, int64_t n,
                                     std::vector<float>& s) {
    const float* qr = qp + (r * H + h * G) * D;
    float* orow = outp + (r * H + h * G) * D;
    const T* kh = kp + h * D;
    const T* vh = vp + h * D;
    s.resize((size_t)(G * n));
    float z[64];
    if (vec) {
#if defined(__AVX512F__)
      scores(qr, G, D, kh, kstride, ix, n, (int)D, (float)scale, s.data());
      for (int g = 0; g < G; ++g) z[g] = softmax_unnormed(s.data() + g * n, n);
      weighted_values(s.data(), z, G, vh, kstride, ix, n, (int)D, orow, D);
#endif
    } else {
      scores_ref(qr, G, D, kh, kstride, ix, n, (int)D, (float)scale, s.data());
      for (int g = 0; g < G; ++g) z[g] = softmax_ref(s.data() + g * n, n);
      weighted_ref(s.data(), z, G, vh, kstride, ix, n, (int)D, orow, D);
    }
  });
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
  TORCH_CHECK(k.size(2) == D && H % KVH == 0 && offs.numel() == R + 1, "shapes");
  TORCH_CHECK(H / KVH <= 64, "at most 64 query heads per kv head");
  auto out = at::empty_like(q);
  const int64_t* op = offs.data_ptr<int64_t>();
  if (half)
    attend_rows(q.data_ptr<float>(), k.data_ptr<at::Half>(), v.data_ptr<at::Half>(), idx, op,
                out.data_ptr<float>(), R, H, D, KVH, scale);
  else
    attend_rows(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), idx, op,
                out.data_ptr<float>(), R, H, D, KVH, scale);
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
