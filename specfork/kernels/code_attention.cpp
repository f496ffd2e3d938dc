// Attention of query rows over TurboQuant-coded K/V read straight from KV-tree slots (CPU).
//
// The same contract as slot_attention.cpp (row r attends over slots idx[offs[r]:offs[r+1]], or two
// stretches of idx; its result depends only on its own query and slot list), but the pool holds
// uint8 rows `[S, KVH, nbytes]`: a fp16 scale, then the codes in bit planes
// (specfork/kv_quant.py). Each slot's row is decoded into a D-float buffer as it is read, never
// into a gathered copy of the prefix: the torch path decoded every prefix slot of every layer in
// each decode step, two dozen small ops per layer that cost more than the attention itself.
//
// A row decodes a unit at a time (`TurboCodec.cpu_program`): a unit is u consecutive codes of
// one bit width, its bits gathered from up to three planes into one index of a table holding
// those u centroids (`_unit_lut`). Scores take the scale after the dot product,
// scale * (q . c); values are summed as (p * scale) * c.
//
// A window (`kv_window`, kv_tree.py's shadows): a row's list is its path from position 0 to
// itself, so its j-th slot is at position j; the last `window` slots and the first `sink` are
// read from their float16 shadow rows (centred and rotated as the codes are, so both kinds of
// score share one space) instead of their codes. The rule depends only on positions, so a tree
// node reads what a decode step at its position reads.
#include <ATen/ATen.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "slot_attention.h"
#include "vec_math.h"

constexpr int kProg = 16;       // int32 per unit: coord, u, table base, fields, 3 x (byte,
                                // shift, mask, position)

// One stored row -> its unit centroids `out [D]`; returns the row's fp16 scale.
static inline float decode_row(const uint8_t* row, const int32_t* prog, int64_t units,
                               const float* lut, float* out) {
  uint16_t bits;
  std::memcpy(&bits, row, 2);
  for (int64_t k = 0; k < units; ++k) {
    const int32_t* p = prog + k * kProg;
    int32_t index = 0;
    for (int f = 0; f < p[3]; ++f) {
      const int32_t* fl = p + 4 + 4 * f;
      index |= ((row[fl[0]] >> fl[1]) & fl[2]) << fl[3];
    }
    const float* src = lut + p[2] + (int64_t)index * p[1];
    float* dst = out + p[0];
    for (int c = 0; c < p[1]; ++c) dst[c] = src[c];
  }
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

static inline float dot(const float* a, const float* b, int D) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b));
  for (int d = 16; d < D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  return _mm512_reduce_add_ps(acc);
}

at::Tensor code_attention(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                          at::Tensor idx, at::Tensor offs, double scale, at::Tensor kprog,
                          at::Tensor klut, at::Tensor vprog, at::Tensor vlut,
                          const c10::optional<at::Tensor>& kwin,
                          const c10::optional<at::Tensor>& vwin,
                          const c10::optional<at::Tensor>& shadow, int64_t block,
                          int64_t window, int64_t sink) {
  RECORD_FUNCTION("specfork::code_attention", std::vector<c10::IValue>());
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && k.size(0) == v.size(0) &&
              k.size(1) == v.size(1), "q [R,H,D], k/v [S,KVH,nbytes]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kByte &&
              v.scalar_type() == at::kByte, "float32 queries, uint8 rows");
  TORCH_CHECK(k.is_contiguous() && v.is_contiguous(), "contiguous pools");
  TORCH_CHECK(idx.scalar_type() == at::kLong && offs.scalar_type() == at::kLong, "int64 slots");
  TORCH_CHECK(kprog.scalar_type() == at::kInt && vprog.scalar_type() == at::kInt &&
              kprog.size(1) == kProg && vprog.size(1) == kProg, "unit programs [U, 16] int32");
  TORCH_CHECK(klut.scalar_type() == at::kFloat && vlut.scalar_type() == at::kFloat, "float luts");
  q = q.contiguous();
  idx = idx.contiguous();
  offs = offs.contiguous();
  kprog = kprog.contiguous();
  vprog = vprog.contiguous();
  klut = klut.contiguous();
  vlut = vlut.contiguous();
  const int64_t R = q.size(0), H = q.size(1), D = q.size(2), KVH = k.size(1);
  TORCH_CHECK(D % 16 == 0 && D <= 256 && H % KVH == 0, "shapes");
  const auto rows = row_slots(offs, R, idx.numel());
  const int G = (int)(H / KVH);
  TORCH_CHECK(G <= 64, "at most 64 query heads per kv head");
  const int64_t KB = k.size(2), VB = v.size(2), ku = kprog.size(0), vu = vprog.size(0);
  auto out = at::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const uint8_t *kp = k.data_ptr<uint8_t>(), *vp = v.data_ptr<uint8_t>();
  const int32_t *kpr = kprog.data_ptr<int32_t>(), *vpr = vprog.data_ptr<int32_t>();
  const float *kl = klut.data_ptr<float>(), *vl = vlut.data_ptr<float>();
  float* outp = out.data_ptr<float>();
  const int nv = (int)D / 16;
  const int64_t* ip = idx.data_ptr<int64_t>();
  const bool win = window > 0 || sink > 0;
  const at::Half *kw = nullptr, *vw = nullptr;
  const int32_t* shp = nullptr;
  int64_t nshadow = 0;
  if (win) {
    TORCH_CHECK(kwin.has_value() && vwin.has_value() && shadow.has_value() && block > 0,
                "a window needs the shadow rows, the shadow table and the block size");
    TORCH_CHECK(kwin->scalar_type() == at::kHalf && vwin->scalar_type() == at::kHalf &&
                kwin->is_contiguous() && vwin->is_contiguous() && kwin->dim() == 3 &&
                kwin->size(1) == KVH && kwin->size(2) == D && vwin->sizes() == kwin->sizes(),
                "shadow rows [slots, KVH, D] float16");
    TORCH_CHECK(shadow->scalar_type() == at::kInt && shadow->is_contiguous(),
                "shadow table int32");
    kw = kwin->data_ptr<at::Half>();
    vw = vwin->data_ptr<at::Half>();
    shp = shadow->data_ptr<int32_t>();
    nshadow = shadow->numel();
  }
  const int64_t wrows = win ? kwin->size(0) : 0;
  // row j of n: float16 shadow row (>= 0) or -1 (codes)
  auto shadow_row = [&](const int64_t* ix, int64_t j, int64_t n) -> int64_t {
    if (!win || (j < n - window && j >= sink)) return -1;
    const int64_t b = ix[j] / block;
    TORCH_CHECK(b < nshadow && shp[b] >= 0, "KV window: slot ", ix[j],
                " has no float16 shadow row");
    const int64_t at = (int64_t)shp[b] * block + ix[j] % block;
    TORCH_CHECK(at < wrows, "KV window: shadow row out of range");
    return at;
  };
  auto load_half = [&](const at::Half* src, float* dst) {
    for (int64_t c = 0; c < D; c += 16)
      _mm512_storeu_ps(dst + c, _mm512_cvtph_ps(_mm256_loadu_si256(
                                    reinterpret_cast<const __m256i*>(src + c))));
  };
  each_row_head(KVH, ip, rows, [&](int64_t r, int64_t h, const int64_t* ix, int64_t n,
                                   std::vector<float>& s) {
    const float* qr = qp + (r * H + h * G) * D;
    float* orow = outp + (r * H + h * G) * D;
    alignas(64) float buf[256];
    std::vector<__m512> acc((size_t)(G * nv), _mm512_setzero_ps());   // weighted value sums
    s.resize((size_t)(G * n));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t w = shadow_row(ix, j, n);
      float norm = 1.0f;
      if (w >= 0) load_half(kw + (w * KVH + h) * D, buf);
      else norm = decode_row(kp + (ix[j] * KVH + h) * KB, kpr, ku, kl, buf);
      for (int g = 0; g < G; ++g)
        s[g * n + j] = norm * dot(qr + g * D, buf, (int)D) * (float)scale;
    }
    float z[64];
    for (int g = 0; g < G; ++g) z[g] = softmax_unnormed(s.data() + g * n, n);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t w = shadow_row(ix, j, n);
      float norm = 1.0f;
      if (w >= 0) load_half(vw + (w * KVH + h) * D, buf);
      else norm = decode_row(vp + (ix[j] * KVH + h) * VB, vpr, vu, vl, buf);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(s[g * n + j] * norm);
        for (int c = 0; c < nv; ++c)
          acc[g * nv + c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(buf + 16 * c), acc[g * nv + c]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / z[g]);
      for (int c = 0; c < nv; ++c)
        _mm512_storeu_ps(orow + g * D + 16 * c, _mm512_mul_ps(acc[g * nv + c], inv));
    }
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(specfork, m) {
  m.def("code_attention(Tensor q, Tensor k, Tensor v, Tensor idx, Tensor offs, float scale, "
        "Tensor kprog, Tensor klut, Tensor vprog, Tensor vlut, Tensor? kwin=None, "
        "Tensor? vwin=None, Tensor? shadow=None, int block=0, int window=0, int sink=0) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(specfork, CPU, m) { m.impl("code_attention", &code_attention); }
#endif
